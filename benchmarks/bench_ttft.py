"""Time to first token of a batch of prompts of different lengths, right after start-up,
with and without `LLM(compile_at_start=True)`.

Each mode runs in its own fresh process with an empty `$SPECDEC_CACHE` (so neither
finds the other's programs, in memory or on disk): it builds the engine (the
bundled pair by default, a plain `LLM(model)` otherwise), then submits 8 held-out
prompts cut to 8 different lengths at once and prints, per request, the time from
submission to its first token, and the number of XLA compilations that ran after
start-up (while requests were waiting or decoding).

    python benchmarks/bench_ttft.py [--lengths 12 40 90 150 200 280 350 480]
        [--max-tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import DEMO, describe_machine, heldout_prompts

CHILD = r"""
import json, logging, sys, time
import jax
from specdec import LLM, SamplingParams

args = json.loads(sys.argv[1])
compiles = []


class Count(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Finished XLA compilation"):
            compiles.append(time.perf_counter())


logging.getLogger("jax").addHandler(Count())
jax.config.update("jax_log_compiles", True)
t0 = time.perf_counter()
spec = {"method": "draft_model", "model": args["draft"]} if args["draft"] else None
llm = LLM(args["model"], speculative_config=spec, compile_at_start=args["warm"])
started = time.perf_counter()
compiled_at_start = len(compiles)
params = SamplingParams(temperature=0, max_tokens=args["max_tokens"], ignore_eos=True)
prompts = [{"prompt_token_ids": ids} for ids in args["prompts"]]
submitted = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
done = time.perf_counter()
print(json.dumps({
    "startup_s": started - t0,
    "compiles_at_start": compiled_at_start,
    "compiles_after_start": len(compiles) - compiled_at_start,
    "ttft_s": [o.metrics.first_token_time - submitted for o in outs],
    "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
    "generate_s": done - submitted,
    "token_ids": [o.outputs[0].token_ids for o in outs],
}))
"""


def run(mode: str, payload: dict) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, SPECDEC_CACHE=cache, JAX_PLATFORMS="cpu")
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(payload | {"warm": mode == "after"})],
            env=env, capture_output=True, text=True, timeout=3600,
        )  # fmt: skip
    if proc.returncode:
        raise SystemExit(f"{mode} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=None, help="default: the bundled draft for the demo")
    ap.add_argument("--lengths", type=int, nargs="+", default=[12, 40, 90, 150, 200, 280, 350, 480])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    draft = args.draft or (str(DEMO / "draft") if args.model == str(DEMO / "target") else None)

    from specdec.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(args.model)
    text = "\n".join(heldout_prompts(lines=200))
    ids = tok.encode(text)
    if len(ids) < max(args.lengths):
        raise SystemExit(f"held-out text has {len(ids)} tokens, fewer than {max(args.lengths)}")
    starts = range(0, len(ids) - max(args.lengths), max(1, len(ids) // 16))
    prompts = [ids[s : s + n] for s, n in zip(starts, args.lengths, strict=False)]
    payload = {"model": args.model, "draft": draft, "prompts": prompts,
               "max_tokens": args.max_tokens}  # fmt: skip
    print(describe_machine())
    results = {}
    for mode in ("before", "after"):  # compile_at_start off, then on
        t = time.perf_counter()
        results[mode] = run(mode, payload)
        results[mode]["wall_s"] = time.perf_counter() - t
    b, a = results["before"], results["after"]
    print(f"{'prompt tokens':>14} {'TTFT before (s)':>16} {'TTFT after (s)':>15}")
    for n, tb, ta in zip(b["prompt_tokens"], b["ttft_s"], a["ttft_s"], strict=True):
        print(f"{n:>14} {tb:>16.3f} {ta:>15.3f}")
    for mode, r in results.items():
        print(f"{mode}: start-up {r['startup_s']:.1f} s ({r['compiles_at_start']} compiles), "
              f"compiles after start-up {r['compiles_after_start']}, generate "
              f"{r['generate_s']:.2f} s, max TTFT {max(r['ttft_s']):.3f} s")  # fmt: skip
    print("same tokens:", b["token_ids"] == a["token_ids"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe_machine(), **results}, f, indent=1)


if __name__ == "__main__":
    main()
