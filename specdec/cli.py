"""`specdec` command line: generate (the main job), batch, aot.

specdec generate "def fib(n):"           # bundled demo pair, tree speculation, streamed
specdec generate --method none "x = "    # plain autoregressive decoding
specdec batch --input prompts.jsonl --output out.jsonl
specdec aot --config qwen3-8b --topology tpu7x:2x2x1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

DEMO_DIR = Path(__file__).parent / "assets" / "demo"


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    # None = the model's generation_config.json value, else the built-in default.
    g.add_argument(
        "--temperature", type=float, default=None,
        help="0 = greedy (default, unless the model's generation_config.json sets one)",
    )  # fmt: skip
    g.add_argument("--top-p", type=float, default=None, help="default 1 (off)")
    g.add_argument("--top-k", type=int, default=None, help="default 0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="default 0 (off)")
    g.add_argument(
        "--repetition-penalty", type=float, default=None,
        help="> 1 discourages tokens already in the text (default 1 = off)",
    )  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def add_model_arguments(p: argparse.ArgumentParser, max_num_seqs: int = 8) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=str(DEMO_DIR / "target"), help="target model folder")
    g.add_argument("--draft", default=None, help="draft model folder (default: bundled draft)")
    g.add_argument(
        "--method", choices=("draft_model", "ngram", "none"), default="draft_model",
        help="drafter; none = plain autoregressive decoding",
    )  # fmt: skip
    g.add_argument(
        "--num-speculative-tokens", default="auto",
        help="tree nodes per step, or 'auto' (default)",
    )  # fmt: skip
    g.add_argument("--max-depth", type=_positive_int, default=6)
    g.add_argument("--topk", type=_positive_int, default=4, help="children per expanded node")
    g.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="weight dtype; auto = bfloat16 off CPU; on CPU float32, or bfloat16 for a "
             "bfloat16 checkpoint where this CPU runs it faster (timed once)",
    )  # fmt: skip
    g.add_argument(
        "--kernel", choices=("auto", "megakernel", "xla"), default="auto",
        help="target verify step; auto = Pallas megakernel on TPU, XLA elsewhere",
    )  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--max-num-seqs", type=_positive_int, default=max_num_seqs,
        help=f"sequences decoded together (default {max_num_seqs})",
    )  # fmt: skip


# The CLI decodes greedily unless told otherwise (SamplingParams' own default is 1).
CLI_SAMPLING_DEFAULTS = {"temperature": 0.0}


def sampling_from_args(args):
    """Flags given, else the model's generation_config.json, else CLI_SAMPLING_DEFAULTS."""
    from specdec.params import (
        GENERATION_CONFIG_ALWAYS,
        GENERATION_CONFIG_SAMPLING,
        SamplingParams,
        generation_defaults,
    )

    fields = {**CLI_SAMPLING_DEFAULTS, **generation_defaults(args.model)}
    for name in GENERATION_CONFIG_SAMPLING + GENERATION_CONFIG_ALWAYS:  # each has a flag
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return SamplingParams(
        **fields, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
        ignore_eos=args.ignore_eos,
    )  # fmt: skip


def speculative_from_args(args) -> dict | None:
    if args.draft is not None and args.method != "draft_model":
        raise ValueError(
            f"--draft is a draft model for --method draft_model; --method {args.method} "
            "takes none (leave --draft out, or pick --method draft_model)."
        )
    if args.method == "none":
        return None
    n = args.num_speculative_tokens
    n = n if n == "auto" else int(n)
    spec = {"method": args.method, "num_speculative_tokens": n, "max_depth": args.max_depth,
            "topk": args.topk}  # fmt: skip
    if args.method == "draft_model":
        default_draft = DEMO_DIR / "draft" if Path(args.model) == DEMO_DIR / "target" else None
        draft = args.draft or default_draft
        if draft is None:
            raise ValueError("--method draft_model with a custom --model needs --draft PATH.")
        spec["model"] = str(draft)
    return spec


def build_llm(args):
    from specdec.api import LLM

    if not Path(args.model).exists():
        raise ValueError(
            f"Model folder {args.model!r} does not exist"
            + (" (the bundled demo pair is missing from this install)." if DEMO_DIR.name in
               args.model else ".")
        )  # fmt: skip
    return LLM(
        args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, speculative_config=speculative_from_args(args),
        kernel=args.kernel,
    )  # fmt: skip


def enable_compilation_cache() -> None:
    """Reuse XLA compilations across runs (first run compiles, later ones start fast)."""
    import jax

    cache = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec")) / "xla"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache))
        # Every program, however quick to compile: the quick ones add up (a warm
        # `specdec generate` reached its first token after 3.8 s, 5.5 s caching only
        # programs that took 0.5 s or more).
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    except OSError:
        pass  # read-only home: just compile every time


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    enable_compilation_cache()
    params = sampling_from_args(args)
    llm = build_llm(args)
    prompt = args.prompt
    out = None
    first = None
    if not args.json:
        sys.stdout.write(prompt)
        sys.stdout.flush()
    t_gen = time.perf_counter()
    for delta, out in llm.generate_stream(prompt, params):
        if first is None and out.outputs[0].token_ids:
            first = time.perf_counter()
        if delta and not args.json:
            sys.stdout.write(delta)
            sys.stdout.flush()
    t_end = time.perf_counter()
    c = out.outputs[0]
    spec = out.metrics.spec
    n = len(c.token_ids)
    total_s = t_end - t_gen
    # Decode speed from the first token on: the time before it is start-up and compiling.
    decode_s = t_end - first if first is not None else 0.0
    result = {
        "prompt": prompt,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "num_tokens": n,
        "tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
        "tokens_per_s_with_startup": n / total_s if total_s > 0 else None,
        "startup_to_first_token_s": (first or t_end) - t0,
        "acceptance_length": spec.acceptance_length if spec.num_drafts else None,
        "acceptance_rate": spec.acceptance_rate if spec.num_drafts else None,
        "method": args.method,
        "tree": _tree_shape(llm),
    }
    if args.json:
        print(json.dumps(result))
        return 0
    tps = result["tokens_per_s"]
    summary = f"[{n} tokens" + (f", {tps:.1f} tokens/s after the first" if tps else "")
    if spec.num_drafts:
        summary += (
            f", acceptance length {spec.acceptance_length:.2f}, "
            f"acceptance rate {spec.acceptance_rate:.2f}"
        )
    if result["tree"]:
        summary += f", tree {result['tree']['num_nodes']} nodes"
    summary += f", first token after {result['startup_to_first_token_s']:.1f} s]"
    print("\n" + summary)
    return 0


def _tree_shape(llm) -> dict | None:
    drafter = llm.engine.drafter
    if drafter is None:
        return None
    return {"num_nodes": drafter.max_nodes, "max_depth": getattr(drafter, "max_depth", None)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt, streamed")
    gen.add_argument("prompt")
    add_model_arguments(gen, max_num_seqs=1)  # one prompt: idle slots would cost compute
    add_sampling_arguments(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON result instead")
    gen.set_defaults(func=cmd_generate)

    try:
        from specdec import batch

        bp = sub.add_parser("batch", help="offline generation over a JSONL file")
        batch.add_arguments(bp)
        bp.set_defaults(func=batch.run)
    except ImportError:
        pass

    # Listed here for `specdec -h`; its own parser (kernels/aot.py) reads its flags.
    sub.add_parser("aot", help="compile the verify step for a TPU topology", add_help=False)

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["aot"]:
        return _aot(argv[1:])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # generation stopped (the engine's error); output so far is kept
        print(f"specdec {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _aot(rest: list[str]) -> int:
    # Compiling for a TPU needs no TPU: JAX stays on the CPU (no libtpu start-up noise,
    # no /tmp/libtpu_lockfile), and several AOT processes may load libtpu at once.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from specdec.kernels import aot

    return aot.main(rest)


if __name__ == "__main__":
    sys.exit(main())
