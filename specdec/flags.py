"""Command-line flags shared by `specdec generate`, `specdec batch` and the Ray job
(cluster/job.py): the model and sampling argument groups and what they build.

Without `--draft`, the bundled demo target drafts with the bundled draft and any
other `--model` drafts by n-gram prompt lookup (no draft model needed), saying so
in one line on stderr; `--method none` is plain decoding.
"""

from __future__ import annotations

import argparse
import sys
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


def add_model_arguments(
    p: argparse.ArgumentParser, max_num_seqs: int = 256, compile_at_start: bool = False
) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=str(DEMO_DIR / "target"), help="target model folder")
    g.add_argument("--draft", default=None,
                   help="draft model folder (default: bundled draft), or with --method "
                        "dflash a DFlash drafter folder")  # fmt: skip
    g.add_argument(
        "--method", choices=("draft_model", "dflash", "ngram", "none"), default=None,
        help="drafter; none = plain autoregressive decoding (default: draft_model with "
             "--draft or the bundled pair, else ngram)",
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
    g.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=1,
        help="split the target over this many local devices (default 1)",
    )  # fmt: skip
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument(
        "--max-num-seqs", type=_positive_int, default=max_num_seqs,
        help=f"sequences decoded together at most (default {max_num_seqs})",
    )  # fmt: skip
    g.add_argument(
        "--kv-cache-memory", type=_positive_int, default=None, metavar="BYTES",
        help="bytes of paged KV cache, target and draft together (default: 10%% of the "
             "available RAM on CPU, 80%% of free device memory on an accelerator)",
    )  # fmt: skip
    g.add_argument(
        "--compile-at-start", action=argparse.BooleanOptionalAction, default=compile_at_start,
        help="compile every program a request up to --max-model-len can run before the "
             "first one, kept in $SPECDEC_CACHE/xla for later starts "
             f"(default {'on' if compile_at_start else 'off'})",
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


def method_from_args(args) -> str:
    """The drafter: `--method` if given; else draft_model when there is a draft (given,
    or the bundled one for the bundled target), else ngram, said on stderr."""
    if args.method is None:
        if args.draft is not None or Path(args.model) == DEMO_DIR / "target":
            args.method = "draft_model"
        else:
            print("specdec: no --draft given: drafting with n-gram prompt lookup "
                  "(--method ngram); --method none decodes without speculation",
                  file=sys.stderr)  # fmt: skip
            args.method = "ngram"
    return args.method


def speculative_from_args(args) -> dict | None:
    method = method_from_args(args)
    if args.draft is not None and method not in ("draft_model", "dflash"):
        raise ValueError(
            f"--draft is a draft model for --method draft_model or dflash; --method {method} "
            "takes none (leave --draft out, or pick --method draft_model)."
        )
    if method == "none":
        return None
    n = args.num_speculative_tokens
    n = n if n == "auto" else int(n)
    spec = {"method": method, "num_speculative_tokens": n, "max_depth": args.max_depth,
            "topk": args.topk}  # fmt: skip
    if method in ("draft_model", "dflash"):
        bundled = DEMO_DIR / ("draft" if method == "draft_model" else "dflash")
        default_draft = bundled if Path(args.model) == DEMO_DIR / "target" else None
        draft = args.draft or (default_draft if default_draft and default_draft.exists() else None)
        if draft is None:
            raise ValueError(f"--method {method} with this --model needs --draft PATH.")
        spec["model"] = str(draft)
    return spec


def llm_kwargs(args) -> dict:
    """LLM(...) keyword arguments from the model flags (ValueError on a missing folder)."""
    if not Path(args.model).exists():
        raise ValueError(
            f"Model folder {args.model!r} does not exist"
            + (" (the bundled demo pair is missing from this install)." if DEMO_DIR.name in
               args.model else ".")
        )  # fmt: skip
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory": args.kv_cache_memory,
        "speculative_config": speculative_from_args(args),
        "kernel": args.kernel,
        "compile_at_start": args.compile_at_start,
        "tensor_parallel_size": args.tensor_parallel_size,
    }


def build_llm(args):
    from specdec.api import LLM

    return LLM(**llm_kwargs(args))
