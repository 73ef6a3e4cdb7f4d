"""Speculative decoding vs plain autoregressive decoding on held-out prompts.

Greedy, 128 new tokens, batch 1 and batch 8; plain AR, chain speculation
(topk=1), an 8-node tree, a 16-node tree, the tree `num_speculative_tokens="auto"`
sizes for this machine (what `specdec generate` runs), n-gram speculation and the
DFlash block drafter at the 8- and 16-node budgets (with `--dflash`'s folder; the
bundled one by default), with each drafter's time per step (propose + commit),
in float32 and bfloat16 weights, all measured in one run: tokens/s end to end (prefill
included) and in decode alone (after each request's first token), acceptance
length and rate, and speedups over AR at the same batch size, both over AR in
the same dtype and over the faster of the two AR runs (the honest baseline: on
XLA CPU a one-row bfloat16 product is no faster than a float32 one, slower on
a CPU without bfloat16 instructions, while many-row ones are faster, so
bfloat16 helps speculation, not AR). The first line printed names the CPU.

Every engine of one batch size is built and compiled first; then `--rounds`
rounds each run every engine once over all prompts, in an order that rotates
per round. A speedup is taken within each round (paired: both engines ran
seconds apart on the same machine state) and the median over rounds is
reported, so the minutes-long swings of a shared machine do not land on one
method only. tokens/s are medians over rounds too.

    python benchmarks/bench_spec.py [--num-prompts 8] [--rounds 3]
        [--dtypes float32 bfloat16] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
from common import DEMO, Timer, describe_machine, heldout_prompts, machine

from specdec import LLM, SamplingParams


def methods(draft: str, args) -> dict[str, dict | None]:
    model = {"method": "draft_model", "model": draft}
    block = {"method": "dflash", "model": args.dflash}
    return {
        "ar": None,
        "chain": {**model, "num_speculative_tokens": args.chain_depth,
                  "max_depth": args.chain_depth, "topk": 1},
        "tree": {**model, "num_speculative_tokens": args.tree_nodes, "max_depth": args.depth,
                 "topk": args.topk},
        "tree16": {**model, "num_speculative_tokens": 16, "max_depth": args.depth16,
                   "topk": args.topk16},
        "auto": {**model, "num_speculative_tokens": "auto"},  # what `specdec generate` uses
        "ngram": {"method": "ngram", "num_speculative_tokens": 8, "max_depth": 4, "topk": 2},
        # The DFlash block drafter at the model drafter's node budgets ("tree", "tree16").
        "dflash": {**block, "num_speculative_tokens": args.tree_nodes,
                   "max_depth": args.dflash_depth, "topk": args.topk},
        "dflash16": {**block, "num_speculative_tokens": 16, "max_depth": args.dflash_depth,
                     "topk": args.topk16},
    }  # fmt: skip


COUNTERS = ("num_drafts", "num_accepted_tokens", "num_draft_tokens")


class DraftClock:
    """Time spent in a drafter's `propose` (until its tree is computed) and `commit`."""

    def __init__(self, drafter):
        self.seconds, self.steps = 0.0, 0
        propose, commit = drafter.propose, drafter.commit

        def timed_propose(*a, **k):
            t0 = time.perf_counter()
            tree = propose(*a, **k)
            jax.block_until_ready((tree.tokens, tree.parents))
            self.seconds += time.perf_counter() - t0
            self.steps += 1
            return tree

        def timed_commit(*a, **k):
            t0 = time.perf_counter()
            commit(*a, **k)
            self.seconds += time.perf_counter() - t0

        drafter.propose, drafter.commit = timed_propose, timed_commit


def decode_seconds(outs) -> float:
    """Wall time during which some request was decoding: the union of the intervals
    from each request's first token to its finish. At batch 1 that leaves out every
    prefill; at batch > 1 a prefill that overlaps other requests' decoding counts."""
    spans = sorted((o.metrics.first_token_time, o.metrics.finished_time) for o in outs)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


def run_once(llm, prompts, params) -> dict:
    """One timed pass of `llm` over every prompt."""
    before = llm.get_metrics()
    clock = getattr(llm, "draft_clock", None)
    drafted = (clock.seconds, clock.steps) if clock else (0.0, 0)
    with Timer() as t:
        outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_metrics()
    steps = clock.steps - drafted[1] if clock else 0
    n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "tokens": n_tokens,
        "seconds": t.seconds,
        "tokens_per_s": n_tokens / t.seconds,
        "decode_tokens_per_s": (n_tokens - len(outs)) / decode_seconds(outs),
        **{k: after[k] - before[k] for k in COUNTERS},
        "draft_ms_per_step": 1e3 * (clock.seconds - drafted[0]) / steps if steps else None,
        "outputs": [o.outputs[0].token_ids for o in outs],
    }


def measure(engines: dict, prompts, params, rounds: int) -> dict[tuple, list[dict]]:
    """Warm-up pass per engine (compiles every shape the timed passes meet: prefill
    buckets per prompt length, K/V-length buckets), then `rounds` rotated rounds."""
    keys = list(engines)
    for k in keys:
        run_once(engines[k], prompts, params)
    runs = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            runs[k].append(run_once(engines[k], prompts, params))
            print(f"  round {r + 1}/{rounds} {k[0]:7s} batch {k[1]} {k[2]:9s} "
                  f"{runs[k][-1]['tokens_per_s']:7.1f} tok/s", flush=True)  # fmt: skip
    return runs


def summarise(runs: dict[tuple, list[dict]]) -> dict[tuple, dict]:
    """Medians over rounds; speedups paired within each round."""
    med = statistics.median
    out = {}
    for (name, batch, dtype), rs in runs.items():
        ar = runs.get(("ar", batch, dtype))
        ars = [v for (m, b, _), v in runs.items() if m == "ar" and b == batch]
        res = {key: med(r[key] for r in rs) for key in ("tokens_per_s", "decode_tokens_per_s")}
        for key, label in (("tokens_per_s", "speedup"), ("decode_tokens_per_s", "decode_speedup")):
            res[f"{label}_vs_ar"] = (
                med(r[key] / a[key] for r, a in zip(rs, ar, strict=True)) if ar else None
            )
            res[f"{label}_vs_best_ar"] = (
                med(r[key] / max(a[i][key] for a in ars) for i, r in enumerate(rs))
                if ars else None
            )  # fmt: skip
        drafts = sum(r["num_drafts"] for r in rs)
        accepted = sum(r["num_accepted_tokens"] for r in rs)
        drafted = sum(r["num_draft_tokens"] for r in rs)
        res["acceptance_length"] = 1 + accepted / drafts if drafts else None
        res["acceptance_rate"] = accepted / drafted if drafted else None
        res["draft_ms_per_step"] = (
            med(r["draft_ms_per_step"] for r in rs) if rs[0]["draft_ms_per_step"] else None
        )
        res["tokens"] = rs[0]["tokens"]
        res["rounds_tokens_per_s"] = [r["tokens_per_s"] for r in rs]
        res["same_output_as_ar"] = ar is None or all(
            r["outputs"] == a["outputs"] for r, a in zip(rs, ar, strict=True)
        )
        out[(name, batch, dtype)] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine")
    # "tree": deeper than "auto" (which takes the 5-node tree on 2 AVX2 cores). The
    # draft's cost grows with depth (about 0.35 ms a level here) and a float32 Eigen
    # verify steps up at 7 rows (docs: README, Performance).
    ap.add_argument("--tree-nodes", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6, help="tree depth")
    ap.add_argument("--topk", type=int, default=2, help="children per expanded tree node")
    ap.add_argument("--depth16", type=int, default=8, help="depth of the 16-node tree")
    ap.add_argument("--topk16", type=int, default=2, help="width of the 16-node tree")
    ap.add_argument("--chain-depth", type=int, default=4, help="chain length (topk 1)")
    ap.add_argument("--dflash", default=str(DEMO / "dflash"), help="DFlash drafter folder")
    ap.add_argument("--dflash-depth", type=int, default=7,
                    help="DFlash tree depth (at most its block size - 1)")  # fmt: skip
    names = ["ar", "chain", "tree", "tree16", "auto", "ngram", "dflash", "dflash16"]
    ap.add_argument("--methods", nargs="+", default=None, choices=names,
                    help="default: all (the dflash ones when --dflash exists)")  # fmt: skip
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
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    if args.methods is None:
        args.methods = [m for m in names if Path(args.dflash).is_dir() or "dflash" not in m]
    prompts = heldout_prompts(args.num_prompts)
    specs = methods(args.draft, args)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                            repetition_penalty=args.repetition_penalty)  # fmt: skip
    results = {}
    for batch in args.batch_sizes:
        # One batch size at a time: its engines (and their K/V caches) are freed after.
        engines = {(name, batch, dtype): LLM(args.target, max_num_seqs=batch, max_model_len=1024,
                                             speculative_config=specs[name], dtype=dtype)
                   for dtype in args.dtypes for name in args.methods}  # fmt: skip
        for llm in engines.values():
            if llm.engine.drafter is not None:
                llm.draft_clock = DraftClock(llm.engine.drafter)
        results |= summarise(measure(engines, prompts, params, args.rounds))
        del engines
    print(describe_machine())
    print(f"{len(prompts)} held-out prompts, greedy, {args.max_tokens} new tokens, "
          f"{args.rounds} rounds; x = speedup over AR in the same dtype, best = over the "
          "faster AR dtype (medians of per-round ratios)")  # fmt: skip
    header = ("method", "batch", "dtype", "tok/s", "x", "best", "dec.tok/s", "x", "best",
              "acc.len", "acc.rate", "draft.ms")  # fmt: skip
    print(f"{header[0]:8s} " + " ".join(f"{h:>9s}" for h in header[1:]))

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-"

    rows = []
    for (name, batch, dtype), r in results.items():
        cells = (batch, dtype[:4], fmt(r["tokens_per_s"], ".1f"), fmt(r["speedup_vs_ar"], ".2f"),
                 fmt(r["speedup_vs_best_ar"], ".2f"), fmt(r["decode_tokens_per_s"], ".1f"),
                 fmt(r["decode_speedup_vs_ar"], ".2f"), fmt(r["decode_speedup_vs_best_ar"], ".2f"),
                 fmt(r["acceptance_length"], ".2f"), fmt(r["acceptance_rate"], ".2f"),
                 fmt(r["draft_ms_per_step"], ".2f"))  # fmt: skip
        print(f"{name:8s} " + " ".join(f"{c!s:>9s}" for c in cells)
              + ("" if r["same_output_as_ar"] else "  OUTPUT DIFFERS FROM AR"))  # fmt: skip
        spec = specs[name]
        rows.append({"method": name, "batch": batch, "dtype": dtype, "config": spec and
                     {k: v for k, v in spec.items() if k != "model"}, **r})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
