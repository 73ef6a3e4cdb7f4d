"""`ray job submit` entrypoint: batch generation with the draft and target as Ray actors.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m specdec.cluster.job --model /models/target --draft /models/draft \\
        --input prompts.jsonl --output results/ --temperature 0 --max-tokens 128

Inside the job, `ray.init()` joins the cluster that runs it. The job reserves
the draft and target groups (`--draft-resources`, `--target-resources`,
default one CPU each; `{"TPU": 4}` on TPU hosts), generates every row of
`--input` (same row format as `specdec batch`) into `DIR/results.jsonl`
(resumable: a re-submitted job skips finished ids) and writes
`DIR/summary.json`: rows, errors, tokens/s, acceptance length, overlap hit
rate, recovery times and the target's placement.

Exit code 0 on success; 1 on failure, after one log line that says why
(`specdec.cluster.job: error: Model folder '/nope' does not exist.`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("specdec.cluster.job")


def _resources(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    from specdec.flags import add_model_arguments, add_sampling_arguments

    p = argparse.ArgumentParser(prog="python -m specdec.cluster.job", description=__doc__)
    p.add_argument("--input", required=True, type=Path, help="prompts JSONL")
    p.add_argument("--output", required=True, type=Path, help="output folder")
    add_model_arguments(p)
    add_sampling_arguments(p)
    g = p.add_argument_group("cluster")
    g.add_argument("--target-resources", type=_resources, default={"CPU": 1},
                   help='one target host\'s bundle, e.g. \'{"TPU": 4}\'')  # fmt: skip
    g.add_argument("--draft-resources", type=_resources, default={"CPU": 1},
                   help="one draft host's bundle")  # fmt: skip
    g.add_argument("--target-devices", type=int, default=None,
                   help="devices to shard the target over (CPU: virtual XLA devices)")  # fmt: skip
    g.add_argument("--draft-devices", type=int, default=None)
    g.add_argument("--max-restarts", type=int, default=3, help="per actor")
    g.add_argument("--no-overlap", action="store_true", help="draft only after each verify")
    g.add_argument("--no-progress", action="store_true")
    return p


def cluster_config(args):
    from specdec.cluster.config import ClusterConfig, GroupConfig, virtual_cpu_devices

    def group(resources: dict, devices: int | None) -> GroupConfig:
        env = {k: os.environ[k] for k in ("JAX_PLATFORMS",) if k in os.environ}
        if devices and devices > 1 and os.environ.get("JAX_PLATFORMS") == "cpu":
            env.update(virtual_cpu_devices(devices))
        return GroupConfig(
            resources, num_devices=devices, env_vars=env, max_restarts=args.max_restarts
        )

    return ClusterConfig(
        target=group(args.target_resources, args.target_devices),
        draft=group(args.draft_resources, args.draft_devices),
        overlap=not args.no_overlap,
    )


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    args = parser().parse_args(argv)
    llm = None
    try:
        from specdec import batch
        from specdec.flags import llm_kwargs, sampling_from_args

        kwargs = llm_kwargs(args)  # checks the model folder before any Ray work
        if not args.input.is_file():
            raise ValueError(f"Input file {str(args.input)!r} does not exist.")
        defaults = sampling_from_args(args)
        args.output.mkdir(parents=True, exist_ok=True)

        import ray

        if not ray.is_initialized():
            ray.init()
        from specdec.api import LLM

        llm = LLM(kwargs.pop("model"), cluster=cluster_config(args), **kwargs)
        result = batch.generate_file(
            llm, args.input, args.output / "results.jsonl", defaults, progress=not args.no_progress
        )
        summary = {
            "rows_written": result.rows,
            "error_rows": result.errors,
            "skipped": result.skipped,
            **result.summary,
            **(llm.cluster_stats() or {}),
        }
        (args.output / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        logger.info("done: %s", json.dumps({k: summary[k] for k in list(summary)[:7]}))
        return 0
    except Exception as e:  # noqa: BLE001 - a job reports any failure as one line + exit 1
        logger.error("error: %s", e)
        logger.debug("traceback", exc_info=True)
        return 1
    finally:
        if llm is not None:
            llm.shutdown()


if __name__ == "__main__":
    sys.exit(main())
