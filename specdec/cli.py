"""`specdec` command line: generate (the main job), batch, serve, aot.

specdec generate "def fib(n):"           # bundled demo pair, tree speculation, streamed
specdec generate --method none "x = "    # plain autoregressive decoding
specdec batch --input prompts.jsonl --output out.jsonl
specdec serve --port 8000                # OpenAI-compatible server on Ray Serve
specdec aot --config qwen3-8b --topology tpu7x:2x2x1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from specdec import batch
from specdec.flags import (
    add_model_arguments,
    add_sampling_arguments,
    build_llm,
    llm_kwargs,
    sampling_from_args,
)


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    from specdec.api import enable_compilation_cache  # jax only once a command needs it

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
        "kernel": llm.kernel,
        "tree": None
        if llm.tree is None
        else {"num_nodes": llm.tree.num_nodes, "max_depth": llm.tree.max_depth},
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


def cmd_batch(args) -> int:
    """`specdec batch`: exit status 0 once every input row has an output row.

    Bad rows are results too (error rows, counted in the summary line), so they
    do not fail the run; a run that cannot go on stops with exit status 1 (bad
    arguments: 2), keeping the rows written so far.
    """
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    defaults = sampling_from_args(args)
    kwargs = llm_kwargs(args)
    progress = not args.no_progress
    if args.ray:
        from specdec.cluster.batch import RayBatch, generate_file_ray  # Ray only when asked

        ray_batch = RayBatch(args.num_engines, args.ray_batch_size, args.ray_address)
        result = generate_file_ray(kwargs, args.input, args.output, defaults, ray_batch, progress)
    else:
        from specdec.api import LLM

        llm = LLM(**kwargs)
        result = batch.generate_file(llm, args.input, args.output, defaults, progress=progress)
    s = result.summary
    print(
        f"specdec batch: wrote {result.rows} rows ({result.errors} errors), skipped "
        f"{result.skipped} already done; {s['output_tokens']} tokens in {s['seconds']:.1f} s"
        + (f", acceptance length {s['acceptance_length']:.2f}" if s["acceptance_length"] else ""),
        file=sys.stderr,
    )
    return 0


def cmd_serve(args) -> int:
    """`specdec serve`: the OpenAI-compatible server (`specdec/server.py`)."""
    kwargs = llm_kwargs(args)
    if args.distributed_executor_backend is not None:
        kwargs["distributed_executor_backend"] = args.distributed_executor_backend
    from specdec.checkpoint import load_config

    load_config(kwargs["model"])  # a bad config.json is one error line, before Ray starts
    try:
        from specdec import server
    except ImportError as e:
        raise ValueError(
            f"specdec serve needs Ray Serve and FastAPI ({e.name} is not installed): "
            "pip install 'specdec[serve]'."
        ) from None
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return server.run(args, kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from one prompt, streamed")
    gen.add_argument("prompt")
    add_model_arguments(gen, max_num_seqs=1)  # one prompt: a cache for one sequence will do
    add_sampling_arguments(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON result instead")
    gen.set_defaults(func=cmd_generate)

    bp = sub.add_parser("batch", help="offline generation over a JSONL file")
    batch.add_arguments(bp)
    bp.set_defaults(func=cmd_batch)

    sp = sub.add_parser("serve", help="OpenAI-compatible HTTP server on Ray Serve")
    add_model_arguments(sp)
    g = sp.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--num-replicas", type=int, default=1, help="engine replicas (default 1)")
    g.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs per replica")
    g.add_argument("--address", default=None,
                   help="Ray cluster to join (default: start a local one)")  # fmt: skip
    g.add_argument("--distributed-executor-backend", choices=("ray",), default=None,
                   help="ray: each replica runs its draft and target as Ray actors on "
                        "their own groups (LLM's distributed_executor_backend)")  # fmt: skip
    g.add_argument("--served-model-name", default=None,
                   help="the `model` requests name (default: the model folder's name)")  # fmt: skip
    sp.set_defaults(func=cmd_serve)

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
    from specdec.checkpoint import load_config
    from specdec.kernels import aot

    def config_from(path: str):
        """A model folder or its config.json (kernels/ never reads checkpoint files)."""
        if not Path(path).exists():
            raise ValueError(
                f"--config {path!r} is not a preset ({', '.join(aot.PRESETS)}), nor an "
                "existing model folder or config.json."
            )
        return load_config(path)

    return aot.main(rest, load_config=config_from)


if __name__ == "__main__":
    sys.exit(main())
