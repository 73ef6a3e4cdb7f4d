"""Routed experts vs every expert on every token: one MoE target's decode and verify steps.

A random mixture-of-experts target (Qwen3-MoE layout; by default 32 experts, top-2,
4 layers) after a prompt of `--context` tokens, on the XLA path:

* a decode step (one row, no tree) and
* a verify step of a 16-node tree (17 rows: the root and its nodes),

each timed with the routed experts (`transformer.routed_experts`, the default) and
with the dense form they replaced (`Layout.dense_experts`), alternating per round in
one process; medians, and the dense / routed ratio. Both forms must emit the same
tokens for the same inputs (checked) and their logits agree to float32 rounding.

    python benchmarks/bench_moe.py [--experts 32] [--top-k 2] [--rounds 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import describe_machine, machine

from specdec.draft.base import DraftBatch
from specdec.kernels import transformer
from specdec.kernels.config import Architecture, ModelConfig
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling
from specdec.workers import TargetWorker

# A 16-node tree: two children per node down to depth 4 (1 + 2 + 4 + 8 = 15), one more.
PARENTS = (-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-ffn", type=int, default=512, help="each expert's MLP width")
    ap.add_argument("--context", type=int, default=200, help="cached tokens before the step")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    cfg = ModelConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
        num_layers=args.layers, num_heads=8, num_kv_heads=4, head_dim=64,
        architecture=Architecture.QWEN3_MOE, qk_norm=True, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_ffn, norm_topk_prob=True,
    )  # fmt: skip
    params = transformer.init_params(cfg, jax.random.key(0), jnp.dtype(args.dtype))
    worker = TargetWorker(cfg, params, num_slots=1, max_model_len=args.context + 64,
                          max_tree_nodes=len(PARENTS))  # fmt: skip
    worker.widths = None  # verify every node: the step timed is the 16-node one
    rng = np.random.default_rng(0)
    sampling = SamplingBatch.make_dummy(1)
    worker.prefill([0], [list(rng.integers(1, cfg.vocab_size, args.context))], sampling)
    roots, active = np.ones(1, np.int32), np.ones(1, bool)
    steps = {
        "decode": DraftBatch.empty(1, 0),
        "verify16": DraftBatch(
            tokens=rng.integers(1, cfg.vocab_size, (1, len(PARENTS))).astype(np.int32),
            parents=np.asarray([PARENTS], np.int32), draft_probs=None,
            child_sampling=ChildSampling.DETERMINISTIC_TOPK,
        ),
    }  # fmt: skip
    routed = worker.runner.layout
    layouts = {"routed": routed, "dense": dataclasses.replace(routed, dense_experts=True)}

    def run(step: str, form: str):
        worker.runner.layout = layouts[form]
        out = worker.verify(roots, steps[step], active, sampling)
        worker.runner.cache_lens[:] = args.context  # the next step sees the same cache
        return out

    times = {(s, f): [] for s in steps for f in layouts}
    emitted = {}
    for key in times:  # compile, and the outputs to compare
        emitted[key] = run(*key)[0]
        run(*key)
    for r in range(args.rounds):
        for key in times if r % 2 == 0 else reversed(list(times)):
            t = time.perf_counter()
            jax.block_until_ready(run(*key))
            times[key].append(time.perf_counter() - t)

    results = {"machine": machine(), "config": dataclasses.asdict(cfg) | {"architecture": str(
        cfg.architecture)}, "dtype": args.dtype, "context": args.context, "steps": {}}  # fmt: skip
    print(describe_machine())
    print(f"random MoE target: {args.experts} experts, top-{args.top_k}, {args.layers} layers, "
          f"hidden {args.hidden}, expert MLP {args.moe_ffn}, {args.dtype}, "
          f"{args.context} cached tokens; medians of {args.rounds} rounds")  # fmt: skip
    ok = True
    for s in steps:
        same = bool(np.array_equal(emitted[(s, "routed")], emitted[(s, "dense")]))
        ok &= same
        ms = {f: 1e3 * statistics.median(times[(s, f)]) for f in layouts}
        ratio = ms["dense"] / ms["routed"]
        results["steps"][s] = {"routed_ms": ms["routed"], "dense_ms": ms["dense"],
                               "dense_over_routed": ratio, "same_output": same}  # fmt: skip
        print(f"{s:9s}: routed {ms['routed']:7.2f} ms, dense {ms['dense']:7.2f} ms, "
              f"routed {ratio:.2f}x faster, same output: {same}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if not ok:
        raise SystemExit("the routed and dense forms emitted different tokens")


if __name__ == "__main__":
    main()
