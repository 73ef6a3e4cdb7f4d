"""Speculative decoding vs plain autoregressive decoding on held-out prompts.

Greedy, 128 new tokens, batch 1 and batch 8; plain AR, chain speculation
(topk=1), tree speculation and n-gram speculation, in float32 and bfloat16
weights, all measured in one run: tokens/s end to end (prefill included) and
in decode alone (after each request's first token), acceptance length and
rate, and speedups over AR at the same batch size, both over AR in the same
dtype and over the faster of the two AR runs (the honest baseline: on XLA
CPU a one-row bfloat16 product is no faster than a float32 one, while a
17-row one is 1.6x faster, so bfloat16 helps speculation, not AR).

    python benchmarks/bench_spec.py [--num-prompts 8] [--dtypes float32 bfloat16]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import json

from common import DEMO, Timer, heldout_prompts

from specdec import LLM, SamplingParams


def methods(draft: str, depth: int, tree_nodes: int, topk: int,
            chain_depth: int) -> dict[str, dict | None]:  # fmt: skip
    return {
        "ar": None,
        "chain": {"method": "draft_model", "model": draft, "num_speculative_tokens": chain_depth,
                  "max_depth": chain_depth, "topk": 1},
        "tree": {"method": "draft_model", "model": draft, "num_speculative_tokens": tree_nodes,
                 "max_depth": depth, "topk": topk},
        "ngram": {"method": "ngram", "num_speculative_tokens": 8, "max_depth": 4, "topk": 2},
    }  # fmt: skip


def run(target, spec, prompts, batch, max_tokens, max_model_len, dtype, penalty=1.0):
    llm = LLM(target, max_num_seqs=batch, max_model_len=max_model_len, speculative_config=spec,
              dtype=dtype)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens, repetition_penalty=penalty)
    # One untimed pass over every prompt compiles every shape the timed pass meets
    # (prefill buckets per prompt length, K/V-length buckets of the decode steps):
    # the timed pass measures decoding, not XLA compiling.
    llm.generate(prompts, params, use_tqdm=False)
    before = llm.get_metrics()
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_metrics()
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    # Decode alone: the tokens after each request's first over the wall time from the
    # first first-token to the last finish (prefill of later requests overlaps at batch > 1).
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    return {
        "tokens": n_tokens,
        "seconds": t.seconds,
        "tokens_per_s": n_tokens / t.seconds,
        "decode_tokens_per_s": (n_tokens - len(outs)) / (last - first),
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
    # Tree shape: 16 nodes, deep and narrow. Measured here in bfloat16 at batch 1
    # (tree tok/s over AR): topk 2 depth 8 1.74x, topk 4 depth 6 1.52x, 12 nodes
    # topk 2 depth 8 1.78x, 24 nodes topk 3 depth 7 1.50x, 32 nodes topk 4 1.64x.
    ap.add_argument("--depth", type=int, default=8, help="tree depth")
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2, help="children per expanded tree node")
    ap.add_argument("--chain-depth", type=int, default=6, help="chain length (topk 1)")
    ap.add_argument("--methods", nargs="+", default=["ar", "chain", "tree", "ngram"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])  # fmt: skip
    ap.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="default 1 = plain greedy (the demo pair's generate default is 1.2)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    prompts = heldout_prompts(args.num_prompts)
    specs = methods(args.draft, args.depth, args.tree_nodes, args.topk, args.chain_depth)
    results = {}
    for batch in args.batch_sizes:
        for dtype in args.dtypes:
            for name in args.methods:
                r = run(args.target, specs[name], prompts, batch, args.max_tokens, 1024, dtype,
                        args.repetition_penalty)  # fmt: skip
                results[(name, batch, dtype)] = r
    print(f"{len(prompts)} held-out prompts, greedy, {args.max_tokens} new tokens; "
          "x = speedup over AR in the same dtype, best = over the faster AR dtype")  # fmt: skip
    header = ("method", "batch", "dtype", "tok/s", "x", "best", "dec.tok/s", "x", "best",
              "acc.len", "acc.rate")  # fmt: skip
    print(f"{header[0]:8s} " + " ".join(f"{h:>9s}" for h in header[1:]))
    rows = []

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    for (name, batch, dtype), r in results.items():
        ar = results.get(("ar", batch, dtype))
        ars = [v for (m, b, _), v in results.items() if m == "ar" and b == batch]
        ratios = {}
        for key in ("tokens_per_s", "decode_tokens_per_s"):
            ratios[key] = (r[key] / ar[key] if ar else None,
                           r[key] / max(a[key] for a in ars) if ars else None)  # fmt: skip
        same = ar is None or r["outputs"] == ar["outputs"]
        al, rate = r["acceptance_length"], r["acceptance_rate"]
        (e2e, e2e_best), (dec, dec_best) = ratios["tokens_per_s"], ratios["decode_tokens_per_s"]
        cells = (batch, dtype[:4], fmt(r["tokens_per_s"], ".1f"), fmt(e2e, ".2f"),
                 fmt(e2e_best, ".2f"), fmt(r["decode_tokens_per_s"], ".1f"), fmt(dec, ".2f"),
                 fmt(dec_best, ".2f"), fmt(al, ".2f"), fmt(rate, ".2f"))  # fmt: skip
        print(f"{name:8s} " + " ".join(f"{c!s:>9s}" for c in cells)
              + ("" if same else "  OUTPUT DIFFERS FROM AR"))  # fmt: skip
        rows.append({"method": name, "batch": batch, "dtype": dtype,
                     "speedup_vs_ar": e2e, "speedup_vs_best_ar": e2e_best,
                     "decode_speedup_vs_ar": dec, "decode_speedup_vs_best_ar": dec_best,
                     "same_output_as_ar": same,
                     **{k: v for k, v in r.items() if k != "outputs"}})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
