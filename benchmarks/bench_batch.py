"""What a step costs with the paged KV cache: lone requests, batches, cache bytes.

All on the bundled pair and held-out prompts, greedy, measured in one run:

1. **One request at a time** on a default `LLM(model)` (256 slots) against
   `LLM(model, max_num_seqs=1)`, plain decoding and tree speculation
   (`num_speculative_tokens="auto"`): tok/s and the ratio (paired per round,
   median over rounds). A step runs over the live rows only, so the two should
   match.
2. **Batches**: B prompts submitted together to a default `LLM(model)`, total
   tok/s for B = 8, 32, 64 (plain and tree), the batch-8 over batch-1 ratio
   for plain decoding, and transformers' batched greedy (left-padded, same
   dtype, same prompts) at batch 8 beside tree speculation at batch 8.
3. **Cache bytes**: 64 concurrent requests of about 300 tokens on a default
   `LLM(model)` (plain); at every step with all 64 running, the bytes of the
   blocks the caches hold over the bytes their tokens need (the largest ratio).

    python benchmarks/bench_batch.py [--num-prompts 8] [--max-tokens 96]
        [--batches 8 32 64] [--rounds 3] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
from pathlib import Path

from common import DEMO, Timer, describe_machine, machine

from specdec import LLM, SamplingParams


def prompts_from_heldout(n: int, lines: int = 30) -> list[str]:
    """n prompts: windows of `lines` lines of the held-out standard-library files, the
    first window of every file, then the next, ... (never trained on)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / rel for rel in (DEMO / "heldout_files.txt").read_text().split()]
    texts = [f.read_text(errors="replace").splitlines(keepends=True) for f in files if f.is_file()]
    out, w = [], 0
    while len(out) < n:
        got = False
        for t in texts:
            chunk = "".join(t[w * lines : (w + 1) * lines])
            if chunk.strip():
                out.append(chunk)
                got = True
                if len(out) == n:
                    break
        if not got:
            raise SystemExit(f"the held-out files give only {len(out)} prompts of {lines} lines")
        w += 1
    return out


def tokens_per_s(llm, prompts, params, one_at_a_time: bool) -> tuple[float, list]:
    with Timer() as t:
        if one_at_a_time:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
    ids = [o.outputs[0].token_ids for o in outs]
    return sum(map(len, ids)) / t.seconds, ids


def lone_requests(args, spec, params, prompts) -> dict:
    engines = {}
    for method, s in (("plain", None), ("tree", spec)):
        engines[(method, "default")] = LLM(args.target, speculative_config=s)
        engines[(method, "max_num_seqs=1")] = LLM(args.target, max_num_seqs=1, speculative_config=s)
    for llm in engines.values():  # compiles every shape the timed passes meet
        tokens_per_s(llm, prompts, params, True)
    rates = {k: [] for k in engines}
    outputs = {}
    keys = list(engines)
    for r in range(args.rounds):
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            tps, outputs[k] = tokens_per_s(engines[k], prompts, params, True)
            rates[k].append(tps)
            print(f"  round {r + 1}/{args.rounds} one at a time {k[0]:5s} {k[1]:15s} "
                  f"{tps:7.1f} tok/s", flush=True)  # fmt: skip
    out = {}
    for method in ("plain", "tree"):
        d, one = rates[(method, "default")], rates[(method, "max_num_seqs=1")]
        out[method] = {
            "default_tokens_per_s": statistics.median(d),
            "max_num_seqs_1_tokens_per_s": statistics.median(one),
            "ratio": statistics.median(a / b for a, b in zip(d, one, strict=True)),
            "same_output": outputs[(method, "default")] == outputs[(method, "max_num_seqs=1")],
        }
    return out


def hf_batched(args, dtype: str, prompts, batch: int) -> float:
    import os

    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    tok = transformers.AutoTokenizer.from_pretrained(args.target)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = transformers.AutoModelForCausalLM.from_pretrained(
        args.target, dtype=getattr(torch, dtype)
    )
    model.eval()
    enc = tok(prompts[:batch], return_tensors="pt", padding=True)
    kw = dict(do_sample=False, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
              pad_token_id=tok.pad_token_id, repetition_penalty=1.0)  # fmt: skip
    with torch.no_grad():
        model.generate(**enc, **kw)  # warm-up
        rates = []
        for _ in range(args.rounds):
            with Timer() as t:
                out = model.generate(**enc, **kw)
            rates.append(batch * (out.shape[1] - enc.input_ids.shape[1]) / t.seconds)
    return statistics.median(rates)


def batches(args, spec, params, prompts) -> dict:
    out = {}
    for method, s in (("plain", None), ("tree", spec)):
        llm = LLM(args.target, speculative_config=s)
        for b in args.batches:
            tokens_per_s(llm, prompts[:b], params, False)  # compiles this batch's shapes
            rates = [tokens_per_s(llm, prompts[:b], params, False)[0] for _ in range(args.rounds)]
            out[f"{method}_batch{b}"] = statistics.median(rates)
            print(f"  {method:5s} batch {b:3d}: {out[f'{method}_batch{b}']:7.1f} tok/s", flush=True)
        out["dtype"] = llm.dtype
        del llm
    return out


def cache_bytes(args, params) -> dict:
    """The largest ratio, over steps with every request running, of the bytes of the
    blocks held to the bytes of the tokens held."""
    llm = LLM(args.target)
    eng = llm.engine
    runner = eng.target.runner
    prompts = prompts_from_heldout(64, lines=args.cache_prompt_lines)
    ids = [llm.tokenizer.encode(p) for p in prompts]
    for i, x in enumerate(ids):
        eng.add_request(f"m{i}", None, x, params)
    worst, seen = 0.0, 0
    while eng.has_unfinished_requests():
        eng.step()
        running = eng.running
        if len(running) == len(ids):
            held = runner.blocks.bytes_held(runner.token_bytes)
            need = sum(int(runner.cache_lens[s.slot]) for s in running) * runner.token_bytes
            worst = max(worst, held / need)
            seen += 1
    lengths = [len(x) for x in ids]
    return {"requests": len(ids), "prompt_tokens_min": min(lengths),
            "prompt_tokens_max": max(lengths), "steps_all_running": seen,
            "allocated_over_needed_max": worst, "block_size": runner.blocks.block_size,
            "pool_blocks": runner.blocks.num_blocks}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--num-prompts", type=int, default=8, help="lone-request prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cache-prompt-lines", type=int, default=30)
    ap.add_argument("--skip", nargs="*", default=[], choices=["lone", "batch", "hf", "cache"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    spec = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": "auto"}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            repetition_penalty=1.0)  # fmt: skip
    prompts = prompts_from_heldout(max([args.num_prompts, *args.batches]))
    results = {"machine": machine(), "max_tokens": args.max_tokens}
    if "lone" not in args.skip:
        results["one_at_a_time"] = lone_requests(args, spec, params, prompts[: args.num_prompts])
    if "batch" not in args.skip:
        results["batches"] = batches(args, spec, params, prompts)
        if "hf" not in args.skip:
            results["batches"]["hf_batch8"] = hf_batched(args, results["batches"]["dtype"],
                                                         prompts, 8)  # fmt: skip
    if "cache" not in args.skip:
        results["cache"] = cache_bytes(args, SamplingParams(temperature=0, max_tokens=16,
                                                            ignore_eos=True))  # fmt: skip

    print(describe_machine())
    print(f"bundled pair, greedy, {args.max_tokens} new tokens, {args.rounds} rounds (medians)")
    if "one_at_a_time" in results:
        for m, r in results["one_at_a_time"].items():
            print(f"one at a time, {m:5s}: default LLM {r['default_tokens_per_s']:7.1f} tok/s, "
                  f"max_num_seqs=1 {r['max_num_seqs_1_tokens_per_s']:7.1f} tok/s, ratio "
                  f"{r['ratio']:.3f}, same output: {r['same_output']}")  # fmt: skip
    if "batches" in results:
        b = results["batches"]
        one = results.get("one_at_a_time", {})
        for m in ("plain", "tree"):
            cells = ", ".join(f"batch {n} {b[f'{m}_batch{n}']:.1f}" for n in args.batches)
            print(f"{m:5s} tok/s in all: {cells}")
        if "plain" in one and "plain_batch8" in b:
            ratio = b["plain_batch8"] / one["plain"]["default_tokens_per_s"]
            results["plain_batch8_over_batch1"] = ratio
            print(f"plain batch 8 / batch 1: {ratio:.2f}x")
        if "hf_batch8" in b and "tree_batch8" in b:
            ratio = b["tree_batch8"] / b["hf_batch8"]
            results["tree_batch8_over_hf_batch8"] = ratio
            print(f"transformers batched greedy, batch 8: {b['hf_batch8']:.1f} tok/s; tree batch 8 "
                  f"/ transformers: {ratio:.2f}x ({b['dtype']})")  # fmt: skip
    if "cache" in results:
        c = results["cache"]
        print(f"{c['requests']} concurrent requests of {c['prompt_tokens_min']}-"
              f"{c['prompt_tokens_max']} prompt tokens: cache bytes held / bytes their tokens "
              f"need <= {c['allocated_over_needed_max']:.3f} over {c['steps_all_running']} steps "
              f"(blocks of {c['block_size']})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
