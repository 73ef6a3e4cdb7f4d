"""specdec against Hugging Face transformers on the same pair and prompts.

transformers (torch CPU, same thread count as XLA here) runs greedy AR and
assisted generation (`assistant_model=` the draft); specdec runs AR and tree
speculation. All at batch 1, greedy, 128 new tokens; every output is checked
against transformers' greedy AR. Both sides run in one dtype (`--dtype`, default
float32, where the two compute the same numbers and greedy outputs must match;
in bfloat16 transformers also keeps activations in bfloat16 and specdec keeps
them in float32, so a near-tie may resolve differently).

    python benchmarks/bench_hf.py [--num-prompts 8] [--dtype float32] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os

from common import DEMO, Timer, heldout_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--tree-nodes", type=int, default=16)
    ap.add_argument("--depth", type=int, default=8)  # the tree bench_spec.py measures best
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="both libraries; default 1 = plain greedy")  # fmt: skip
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

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
        outs = []
        # repetition_penalty always given: transformers would take the folder's
        # generation_config.json value otherwise (the demo pair ships 1.2).
        kw = dict(do_sample=False, max_new_tokens=args.max_tokens, pad_token_id=tok.eos_token_id,
                  repetition_penalty=args.repetition_penalty)  # fmt: skip
        if assistant is not None:
            kw["assistant_model"] = assistant
        with torch.no_grad():
            target.generate(ids[0], **kw)  # warm-up
            with Timer() as t:
                for x in ids:
                    outs.append(target.generate(x, **kw)[0, x.shape[1] :].tolist())
        return outs, t.seconds

    def ours(spec):
        llm = LLM(args.target, max_num_seqs=1, max_model_len=1024, speculative_config=spec,
                  dtype=args.dtype)  # fmt: skip
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                repetition_penalty=args.repetition_penalty)  # fmt: skip

        def once():
            return [
                llm.generate([{"prompt_token_ids": x[0].tolist()}], params, use_tqdm=False)[0]
                for x in ids
            ]

        once()  # untimed: compiles every prefill / K/V-length bucket the timed pass meets
        with Timer() as t:
            outs = once()
        return [o.outputs[0].token_ids for o in outs], t.seconds

    tree = {"method": "draft_model", "model": args.draft, "num_speculative_tokens":
            args.tree_nodes, "max_depth": args.depth, "topk": args.topk}  # fmt: skip
    runs = {
        "hf_ar": hf(),
        "hf_assisted": hf(draft),
        "specdec_ar": ours(None),
        "specdec_tree": ours(tree),
    }
    reference = runs["hf_ar"][0]
    results = {}
    print(f"{len(prompts)} held-out prompts, batch 1, greedy, {args.max_tokens} new tokens, "
          f"{threads} threads, {args.dtype}")  # fmt: skip
    for name, (outs, sec) in runs.items():
        n = sum(len(o) for o in outs)
        same = sum(o == r for o, r in zip(outs, reference, strict=True))
        results[name] = {"tokens": n, "seconds": sec, "tokens_per_s": n / sec,
                         "outputs_equal_hf_ar": f"{same}/{len(outs)}"}  # fmt: skip
        print(f"{name:14s} {n / sec:8.1f} tok/s   equal to HF greedy AR: {same}/{len(outs)}")
    r = results
    results["ratio_specdec_ar_over_hf_ar"] = (
        r["specdec_ar"]["tokens_per_s"] / r["hf_ar"]["tokens_per_s"]
    )
    results["ratio_specdec_tree_over_hf_assisted"] = (
        r["specdec_tree"]["tokens_per_s"] / r["hf_assisted"]["tokens_per_s"]
    )
    print(f"specdec AR / HF AR:             {results['ratio_specdec_ar_over_hf_ar']:.2f}x")
    print(f"specdec tree / HF assisted:     {results['ratio_specdec_tree_over_hf_assisted']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
