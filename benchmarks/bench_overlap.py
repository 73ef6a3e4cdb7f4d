"""Distributed speculative decoding with overlap off vs on: same output, hit rate, tokens/s.

The draft and the target run as Ray actors on their own resource groups; with
overlap on, the draft grows tree t + 1 (from its guess of the verdict on tree
t) while the target verifies tree t. Both modes run on the same actors,
greedy, after a warm-up that compiles every shape.

Ray must stay on loopback, so run it in its own network namespace (as root):

    unshare -n sh -c 'ip link set lo up; exec python benchmarks/bench_overlap.py --tiny'
    unshare -n sh -c 'ip link set lo up; exec python benchmarks/bench_overlap.py \\
        --target T --draft D --num-prompts 16 --json overlap.json'

`--tiny` builds a random 2-layer target and a noisy copy of it as the draft
(about half of the guesses hit), for machines without the demo pair.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "token")  # before Ray is imported

from common import DEMO, Timer, heldout_prompts  # noqa: E402

from specdec import SamplingParams  # noqa: E402


def tiny_models(root: Path, noise: float) -> tuple[Path, Path]:
    """A random tiny Llama (no tokenizer: token-id prompts) and a noisy copy as the draft."""
    import jax
    import numpy as np

    from specdec.checkpoint import save_checkpoint
    from specdec.kernels.config import ModelConfig
    from specdec.kernels.transformer import init_params

    cfg = ModelConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    params = init_params(cfg, jax.random.key(0))
    params["embed"] = params["embed"] * 30.0  # peaky distributions, like a trained model
    rng = np.random.default_rng(1)
    noisy = jax.tree.map(
        lambda a: np.asarray(a) + noise * float(np.std(a)) * rng.standard_normal(a.shape), params
    )
    target, draft = root / "target", root / "draft"
    save_checkpoint(target, cfg, params, dtype="float32")
    save_checkpoint(
        draft, cfg, jax.tree.map(lambda a: np.asarray(a, np.float32), noisy), dtype="float32"
    )
    return target, draft


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--tiny", action="store_true", help="random tiny pair instead of the demo")
    ap.add_argument("--noise", type=float, default=0.05, help="--tiny: draft weight noise")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--tree-nodes", type=int, default=10)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--target-devices", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per mode (best kept)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import numpy as np
    import ray

    from specdec.api import LLM
    from specdec.cluster.config import ClusterConfig

    tmp = None
    if args.tiny:
        tmp = Path(tempfile.mkdtemp(prefix="bench_overlap"))
        target, draft = tiny_models(tmp, args.noise)
        rng = np.random.default_rng(0)
        prompts = [
            {"prompt_token_ids": rng.integers(0, 300, n).tolist()}
            for n in rng.integers(4, 40, args.num_prompts)
        ]
    else:
        target, draft = Path(args.target), Path(args.draft)
        if not target.exists():
            raise SystemExit(f"{target} is missing; pass --target/--draft or --tiny.")
        prompts = heldout_prompts(args.num_prompts)
    ray.init(
        num_cpus=os.cpu_count(),
        resources={"target_group": 1, "draft_group": 1},
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}},
    )
    spec = {
        "method": "draft_model",
        "model": str(draft),
        "num_speculative_tokens": args.tree_nodes,
        "max_depth": args.depth,
        "topk": args.topk,
    }
    llm = LLM(
        target,
        cluster=ClusterConfig.local_cpu(target_devices=args.target_devices),
        max_model_len=args.max_model_len,
        max_num_seqs=args.batch,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    drafter = llm.engine.drafter
    results = {}
    try:
        for overlap in (False, True):  # warm-up: every shape compiled in both modes
            drafter.overlap = overlap
            llm.generate(prompts[: args.batch], params, use_tqdm=False)
        for overlap in (False, True):
            drafter.overlap = overlap
            best = None
            for _ in range(args.repeats):
                before = drafter.overlap_stats()
                spec_before = llm.get_metrics()
                with Timer() as t:
                    outs = llm.generate(prompts, params, use_tqdm=False)
                after, spec_after = drafter.overlap_stats(), llm.get_metrics()
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
                drafts = spec_after["num_drafts"] - spec_before["num_drafts"]
                acc = spec_after["num_accepted_tokens"] - spec_before["num_accepted_tokens"]
                r = {
                    "overlap": overlap,
                    "tokens": tokens,
                    "seconds": t.seconds,
                    "tokens_per_s": tokens / t.seconds,
                    "acceptance_length": 1 + acc / drafts if drafts else None,
                    "hits": hits,
                    "misses": misses,
                    "hit_rate": hits / (hits + misses) if hits + misses else None,
                    "outputs": [o.outputs[0].token_ids for o in outs],
                }
                if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                    best = r
            results[overlap] = best
    finally:
        llm.shutdown()
        ray.shutdown()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)

    same = results[False]["outputs"] == results[True]["outputs"]
    print(
        f"{len(prompts)} prompts, greedy, {args.max_tokens} new tokens, batch {args.batch}, "
        f"target on {args.target_devices} device(s), tree {args.tree_nodes} nodes / depth "
        f"{args.depth} / top-{args.topk}"
    )
    print(
        f"{'overlap':8s} {'tok/s':>8s} {'acc.len':>8s} {'hit rate':>9s} {'hits':>6s} {'misses':>7s}"
    )
    for overlap, r in results.items():
        hr = f"{r['hit_rate']:.2f}" if r["hit_rate"] is not None else "-"
        print(
            f"{'on' if overlap else 'off':8s} {r['tokens_per_s']:8.1f} "
            f"{r['acceptance_length']:8.2f} {hr:>9s} {r['hits']:6d} {r['misses']:7d}"
        )
    speedup = results[True]["tokens_per_s"] / results[False]["tokens_per_s"]
    print(f"overlap speedup {speedup:.2f}x; outputs identical: {same}")
    if args.json:
        rows = [{k: v for k, v in r.items() if k != "outputs"} for r in results.values()]
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "identical_output": same, "speedup": speedup}, f, indent=2)
    if not same:
        raise SystemExit("overlap changed the output")


if __name__ == "__main__":
    main()
