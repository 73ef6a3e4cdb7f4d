"""Speculative decoding vs plain autoregressive decoding on held-out prompts.

Greedy, 128 new tokens, batch 1 and batch 8; plain AR, chain speculation
(topk=1), tree speculation and n-gram speculation, all measured in one run:
tokens/s, acceptance length and rate, speedup over AR at the same batch size.

    python benchmarks/bench_spec.py [--num-prompts 8] [--json results.json]
"""

from __future__ import annotations

import argparse
import json

from common import DEMO, Timer, heldout_prompts

from specdec import LLM, SamplingParams


def methods(draft: str, depth: int, tree_nodes: int, topk: int) -> dict[str, dict | None]:
    return {
        "ar": None,
        "chain": {"method": "draft_model", "model": draft, "num_speculative_tokens": depth,
                  "max_depth": depth, "topk": 1},
        "tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": tree_nodes,
                 "max_depth": depth, "topk": topk},
        "ngram": {"method": "ngram", "num_speculative_tokens": 8, "max_depth": 4, "topk": 2},
    }  # fmt: skip


def run(target, spec, prompts, batch, max_tokens, max_model_len):
    llm = LLM(target, max_num_seqs=batch, max_model_len=max_model_len, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    # One untimed pass over every prompt compiles every shape the timed pass meets
    # (prefill buckets per prompt length, K/V-length buckets of the decode steps):
    # the timed pass measures decoding, not XLA compiling.
    llm.generate(prompts, params, use_tqdm=False)
    before = llm.get_metrics()
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_metrics()
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    return {
        "tokens": n_tokens,
        "seconds": t.seconds,
        "tokens_per_s": n_tokens / t.seconds,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--methods", nargs="+", default=["ar", "chain", "tree", "ngram"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    prompts = heldout_prompts(args.num_prompts)
    specs = methods(args.draft, args.depth, args.tree_nodes, args.topk)
    results = {}
    for batch in args.batch_sizes:
        for name in args.methods:
            r = run(args.target, specs[name], prompts, batch, args.max_tokens, 1024)
            results[(name, batch)] = r
    print(f"{len(prompts)} held-out prompts, greedy, {args.max_tokens} new tokens")
    header = ("method", "batch", "tok/s", "speedup", "acc.len", "acc.rate")
    print(f"{header[0]:8s} " + " ".join(f"{h:>8s}" for h in header[1:]))
    rows = []
    for (name, batch), r in results.items():
        ar = results.get(("ar", batch))
        speedup = r["tokens_per_s"] / ar["tokens_per_s"] if ar else None
        same = ar is None or r["outputs"] == ar["outputs"]
        al, rate = r["acceptance_length"], r["acceptance_rate"]
        print(
            f"{name:8s} {batch:5d} {r['tokens_per_s']:8.1f} "
            f"{(f'{speedup:.2f}x' if speedup else '-'):>8s} "
            f"{(f'{al:.2f}' if al else '-'):>8s} {(f'{rate:.2f}' if rate else '-'):>8s}"
            + ("" if same else "  OUTPUT DIFFERS FROM AR")
        )
        rows.append({"method": name, "batch": batch, "speedup_vs_ar": speedup,
                     "same_output_as_ar": same,
                     **{k: v for k, v in r.items() if k != "outputs"}})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
