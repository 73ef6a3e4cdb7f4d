"""AR decode against the memory roofline, and the cost of verifying N tree nodes.

A 125M-class random Llama (float32) decodes at batch 1 through the engine's own
verify step (an empty tree = plain decoding). The floor is streamed bytes /
bandwidth: the weights a step reads (an untied embedding table, of which it
reads one row, is not counted) plus the K/V, over the bandwidth of a jitted
reduction over a >= 1 GB array (all cores), measured in the same run.
Bandwidth and decode are timed in alternating rounds (`--rounds`; per round
the reduction's fastest of 3 passes and the decode's median of `--repeats`),
and the fraction is the median of the per-round fractions: on a shared
machine the bandwidth moves (40 to 72 GB/s within minutes on one), and a floor
timed minutes away from the decode once came out above it. Then one verify
step over a tree of N nodes is timed against that decode step, N in
{1, 4, 16, 64}: the curve that sizes trees for this hardware
(`num_speculative_tokens="auto"`).

`--model` runs a checkpoint folder instead (in float32), e.g. the demo target
at a held-out prompt's context, where the step is not bound by its weights:

    python benchmarks/bench_roofline.py [--json out.json] [--small]
    python benchmarks/bench_roofline.py --model specdec/assets/demo/target \
        --context 400 --nodes 1 4 5 6 7 8 16
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import describe_machine, machine  # noqa: E402

from specdec.checkpoint import load_model  # noqa: E402
from specdec.draft.base import DraftBatch  # noqa: E402
from specdec.kernels.config import ModelConfig  # noqa: E402
from specdec.kernels.transformer import init_params  # noqa: E402
from specdec.verify.batch import SamplingBatch  # noqa: E402
from specdec.workers import TargetWorker  # noqa: E402

CONFIG_125M = ModelConfig(
    vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=12, num_heads=12,
    num_kv_heads=12, head_dim=64, max_position_embeddings=2048,
)  # fmt: skip
CONFIG_SMALL = ModelConfig(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
    num_kv_heads=4, head_dim=64, max_position_embeddings=2048,
)  # fmt: skip


def timings(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` calls of `fn()` (which must block)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def best_of(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which must block) over `repeats` runs."""
    return float(np.median(timings(fn, repeats)))


def measure_bandwidth(gib: float = 1.0, repeats: int = 3) -> float:
    """Peak bytes/s of a jitted sum over a float32 array of `gib` GiB (read once per
    call): its fastest of `repeats` passes."""
    n = int(gib * 2**30 // 4)
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(jnp.sum)
    f(x).block_until_ready()
    return n * 4 / min(timings(lambda: f(x).block_until_ready(), repeats))


def chain_tree(n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """A tree of n nodes: 4 root children, each extended by a chain (typical EAGLE shape)."""
    parents = [-1 if i < 4 else i - 4 for i in range(n)]
    return np.arange(1, n + 1, dtype=np.int32) % min(vocab, 1000), np.array(parents, np.int32)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--small", action="store_true", help="tiny model (smoke run)")
    ap.add_argument("--context", type=int, default=128, help="committed tokens before timing")
    ap.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating bandwidth / decode measurements")  # fmt: skip
    ap.add_argument(
        "--model",
        default=None,
        help="checkpoint folder to time instead of the random model (float32)",
    )
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16, 64],
                    help="tree sizes N whose verify cost is timed")  # fmt: skip
    args = ap.parse_args()
    if min(args.nodes) < 1 or args.context < 1:
        ap.error("--nodes and --context must be at least 1")
    if args.rounds < 1 or args.repeats < 1:
        ap.error("--rounds and --repeats must be at least 1")
    if args.model is not None:
        cfg, params = load_model(args.model, dtype="float32")
    else:
        cfg = CONFIG_SMALL if args.small else CONFIG_125M
        params = init_params(cfg, jax.random.key(0), jnp.float32)
    sizes = tuple(args.nodes)
    max_len = args.context + max(sizes) + 2
    if max_len > cfg.max_position_embeddings:
        ap.error(f"--context {args.context} plus {max(sizes)} nodes exceeds the model's "
                 f"{cfg.max_position_embeddings} positions")  # fmt: skip

    gib = 0.25 if args.small else 1.0
    # The bytes one step streams: every weight but an untied embedding table, of which
    # a step reads one row (a tied one is the LM head, read whole).
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        weight_bytes -= params["embed"].nbytes - params["embed"][0].nbytes
    target = TargetWorker(cfg, params, num_slots=1, max_model_len=max_len,
                          max_tree_nodes=max(sizes))  # fmt: skip
    target.widths = None  # verify every node of each timed tree (its tokens are never accepted)
    sampling = SamplingBatch.make_dummy(1)
    active = np.ones(1, bool)
    prompt = [1 + i % (cfg.vocab_size - 1) for i in range(args.context)]
    target.prefill([0], [prompt], sampling)

    def step(tree: DraftBatch):
        target.runner.cache_lens[0] = args.context  # time the same position every call
        target.verify(np.array([7], np.int32), tree, active, sampling)

    name = args.model or ("small" if args.small else "random 125M")
    results = {"model": name, "params": cfg.num_params(), "context": args.context,
               "machine": machine()}  # fmt: skip
    empty = DraftBatch.empty(1)
    step(empty)
    kv_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * args.context * cfg.head_dim * 4
    rounds = []  # (bandwidth B/s, decode s) pairs, timed seconds apart
    for _ in range(args.rounds):
        rounds.append((measure_bandwidth(gib), best_of(lambda: step(empty), args.repeats)))
    fractions = [(weight_bytes + kv_bytes) / bw / dec for bw, dec in rounds]
    fraction = float(np.median(fractions))
    bandwidth = float(np.median([bw for bw, _ in rounds]))
    decode_s = float(np.median([dec for _, dec in rounds]))
    floor_s = (weight_bytes + kv_bytes) / bandwidth
    results |= {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_range_gb_s": [min(b for b, _ in rounds) / 1e9, max(b for b, _ in rounds) / 1e9],
        "weight_bytes": weight_bytes,
        "decode_ms_per_token": decode_s * 1e3,
        "roofline_ms_per_token": floor_s * 1e3,
        "fraction_of_roofline": fraction,
        "fraction_range": [min(fractions), max(fractions)],
    }
    curve = {}
    for n in sizes:
        toks, parents = chain_tree(n, cfg.vocab_size)
        tree = DraftBatch(toks[None], parents[None], None, empty.child_sampling)
        step(tree)
        curve[n] = best_of(lambda tree=tree: step(tree), args.repeats) / decode_s
    results["verify_cost_vs_decode"] = curve

    print(describe_machine())
    print(
        f"model: {results['model']}, {cfg.num_params() / 1e6:.0f}M params, "
        f"{weight_bytes / 1e6:.0f} MB float32; context {args.context}"
    )
    lo, hi = results["bandwidth_range_gb_s"]
    print(f"measured bandwidth: {bandwidth / 1e9:.1f} GB/s (median of {args.rounds} rounds; "
          f"{lo:.1f} to {hi:.1f})")  # fmt: skip
    print(f"AR decode (batch 1): {decode_s * 1e3:.2f} ms/token")
    print(f"roofline floor:      {floor_s * 1e3:.2f} ms/token (weights + KV / bandwidth)")
    lo, hi = results["fraction_range"]
    print(f"fraction of roofline: {fraction:.0%} (median of per-round fractions; "
          f"{lo:.0%} to {hi:.0%})")  # fmt: skip
    print("verify cost of N tree nodes relative to one decode step:")
    for n, r in curve.items():
        print(f"  N={n:3d}: {r:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
