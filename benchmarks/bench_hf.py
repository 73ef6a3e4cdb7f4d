"""specdec against Hugging Face transformers on the same pair and prompts.

transformers (torch CPU, same thread count as XLA here) runs greedy AR and
assisted generation (`assistant_model=` the draft); specdec runs AR and tree
speculation. All at batch 1, greedy, 128 new tokens; every output is checked
against transformers' greedy AR. Both sides run in one dtype (`--dtype`, default
float32, where the two compute the same numbers and greedy outputs must match;
in bfloat16 transformers also keeps activations in bfloat16 and specdec keeps
them in float32, so a near-tie may resolve differently).

The four runs are interleaved: every engine is loaded and warmed first, then
`--rounds` rounds each run all four over every prompt (rotating the order);
ratios are taken within each round and the median is reported.

    python benchmarks/bench_hf.py [--num-prompts 8] [--dtype float32] [--rounds 3]
        [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from common import DEMO, Timer, describe_machine, heldout_prompts, machine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per engine")
    # "auto" (the default): the tree `specdec generate` runs, sized for this machine
    # (`num_speculative_tokens="auto"`; --depth is then the plan's).
    ap.add_argument("--tree-nodes", type=lambda v: v if v == "auto" else int(v), default="auto",
                    help="tree nodes, or 'auto' (default)")  # fmt: skip
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--topk", type=int, default=2, help="widest expansion (caps 'auto' too)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="both libraries; default 1 = plain greedy")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")

    import torch
    import transformers

    from specdec import LLM, SamplingParams

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    prompts = heldout_prompts(args.num_prompts)
    tok = transformers.AutoTokenizer.from_pretrained(args.target)
    tdtype = getattr(torch, args.dtype)
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=tdtype)
    draft = transformers.AutoModelForCausalLM.from_pretrained(args.draft, dtype=tdtype)
    target.eval()
    draft.eval()
    ids = [tok(p, return_tensors="pt").input_ids for p in prompts]

    def hf(assistant=None):
        # repetition_penalty always given: transformers would take the folder's
        # generation_config.json value otherwise (the demo pair ships 1.2).
        kw = dict(do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=tok.eos_token_id,
                  repetition_penalty=args.repetition_penalty)  # fmt: skip
        if assistant is not None:
            kw["assistant_model"] = assistant

        def once():
            with torch.no_grad():
                return [target.generate(x, **kw)[0, x.shape[1] :].tolist() for x in ids]

        return once

    shapes = {}

    def ours(spec):
        llm = LLM(args.target, max_num_seqs=1, max_model_len=1024, speculative_config=spec,
                  dtype=args.dtype)  # fmt: skip
        if spec is not None:  # the tree actually grown ("auto" resolved)
            t = llm.tree
            shapes["tree"] = {"num_nodes": t.num_nodes, "max_depth": t.max_depth, "topk": t.topk}
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                repetition_penalty=args.repetition_penalty)  # fmt: skip

        def once():
            return [
                llm.generate([{"prompt_token_ids": x[0].tolist()}], params, use_tqdm=False)[0]
                .outputs[0]
                .token_ids
                for x in ids
            ]

        return once

    tree = {"method": "draft_model", "model": args.draft, "num_speculative_tokens":
            args.tree_nodes, "max_depth": args.depth, "topk": args.topk}  # fmt: skip
    engines = {
        "hf_ar": hf(),
        "hf_assisted": hf(draft),
        "specdec_ar": ours(None),
        "specdec_tree": ours(tree),
    }
    # Untimed pass: transformers' first calls, and every XLA compile (prefill and
    # K/V-length buckets) the timed passes meet.
    outputs = {name: once() for name, once in engines.items()}
    names = list(engines)
    seconds = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names[r % 4 :] + names[: r % 4]:
            with Timer() as t:
                outs = engines[name]()
            assert outs == outputs[name], f"{name}: outputs changed between passes"
            seconds[name].append(t.seconds)
            print(f"  round {r + 1}/{args.rounds} {name:13s} {t.seconds:6.2f} s", flush=True)
    reference = outputs["hf_ar"]
    results = {}
    print(describe_machine())
    print(f"{len(prompts)} held-out prompts, batch 1, greedy, {args.max_tokens} new tokens, "
          f"{threads} threads, {args.dtype}, {args.rounds} rounds (medians)")  # fmt: skip
    for name in names:
        outs = outputs[name]
        n = sum(len(o) for o in outs)
        same = sum(o == ref for o, ref in zip(outs, reference, strict=True))
        results[name] = {"tokens": n, "seconds": statistics.median(seconds[name]),
                         "tokens_per_s": statistics.median(n / s for s in seconds[name]),
                         "outputs_equal_hf_ar": f"{same}/{len(outs)}"}  # fmt: skip
        print(f"{name:14s} {results[name]['tokens_per_s']:8.1f} tok/s   "
              f"equal to HF greedy AR: {same}/{len(outs)}")  # fmt: skip

    def paired(a, b):  # tokens/s of a over b, per round (same tokens: inverse seconds)
        ta, tb = results[a]["tokens"], results[b]["tokens"]
        return statistics.median(
            (ta / sa) / (tb / sb) for sa, sb in zip(seconds[a], seconds[b], strict=True)
        )

    results["ratio_specdec_ar_over_hf_ar"] = paired("specdec_ar", "hf_ar")
    results["ratio_specdec_tree_over_hf_assisted"] = paired("specdec_tree", "hf_assisted")
    results["ratio_specdec_tree_over_hf_ar"] = paired("specdec_tree", "hf_ar")
    results["tree"] = {**{k: v for k, v in tree.items() if k != "model"}, **shapes["tree"]}
    results["machine"] = machine()
    print(f"specdec AR / HF AR:             {results['ratio_specdec_ar_over_hf_ar']:.2f}x")
    print(f"specdec tree / HF assisted:     {results['ratio_specdec_tree_over_hf_assisted']:.2f}x")
    print(f"specdec tree / HF AR:           {results['ratio_specdec_tree_over_hf_ar']:.2f}x")
    print(f"tree: {shapes['tree']} (asked: {args.tree_nodes} nodes)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
