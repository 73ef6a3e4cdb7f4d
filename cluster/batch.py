"""Batch offline generation on Ray Data: rows spread over an actor pool of engines.

    specdec batch --input prompts.jsonl --output out.jsonl --ray --num-engines 4

The file is parsed and resumed exactly as the local path does (specdec/batch.py,
whose docstring describes rows, error rows and resume); here Ray Data spreads the
good rows over `num_engines` engines (`from_items -> map_batches ->
iter_batches`) and the driver appends the rows as batches come back. The file is
parsed on the driver first (not `read_json`), because one Arrow schema for all
rows would reject exactly the malformed rows that must be reported, and resume
needs each row's line number.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from specdec.batch import BatchResult, Row, run_file, stream
from specdec.params import SamplingParams


class _EngineActor:
    """One engine in a Ray Data actor pool: generates a batch of rows, returns JSON rows."""

    def __init__(self, llm_kwargs: dict):
        from specdec.api import LLM

        self.llm = LLM(**llm_kwargs)

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        rows = []
        for line, rid, prompt, messages, params in zip(
            batch["line"],
            batch["id"],
            batch["prompt"],
            batch["messages"],
            batch["params"],
            strict=True,
        ):
            rows.append(
                Row(
                    line=int(line),
                    id=json.loads(rid),
                    prompt=None if prompt == "" else str(prompt),
                    messages=json.loads(messages) if messages else None,
                    params=SamplingParams(**json.loads(params)),
                )
            )
        out = [json.dumps([row, tokens]) for row, tokens in stream(self.llm, rows)]
        return {"result": np.array(out, dtype=object)}


@dataclasses.dataclass(frozen=True)
class RayBatch:
    """How the rows spread over Ray Data."""

    num_engines: int = 1  # engines (actors) in the pool, one `LLM` each
    batch_size: int = 16  # rows handed to an engine at a time
    address: str | None = None  # the cluster to join; None = Ray's default

    def __post_init__(self):
        for name in ("num_engines", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")


def generate_file_ray(
    llm_kwargs: dict, input_path: Path, output_path: Path, defaults: SamplingParams,
    ray_batch: RayBatch = RayBatch(), progress: bool = True,
) -> BatchResult:  # fmt: skip
    """The Ray Data path: rows over an actor pool of `ray_batch.num_engines` engines."""
    import ray

    env = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ}
    runtime_env = {"env_vars": env} if env else None

    def results(good: list[Row]):
        if not good:
            return
        if not ray.is_initialized():
            ray.init(address=ray_batch.address, runtime_env=runtime_env)
        items = [
            {
                "line": r.line,
                "id": json.dumps(r.id),
                "prompt": r.prompt or "",
                "messages": json.dumps(r.messages) if r.messages is not None else "",
                "params": json.dumps(dataclasses.asdict(r.params)),
            }
            for r in good
        ]
        ds = ray.data.from_items(items).map_batches(
            _EngineActor,
            fn_constructor_kwargs={"llm_kwargs": llm_kwargs},
            batch_size=ray_batch.batch_size,
            runtime_env=runtime_env,
            **_pool(ray.data, ray_batch.num_engines),
        )
        for batch in ds.iter_batches(batch_size=None):
            for blob in batch["result"]:
                yield tuple(json.loads(blob))

    return run_file(input_path, output_path, defaults, results, progress)


def _pool(data, n: int) -> dict:
    """An actor pool of n engines, in whichever form this Ray Data takes it."""
    if hasattr(data, "ActorPoolStrategy"):
        return {"compute": data.ActorPoolStrategy(size=n)}
    return {"concurrency": n}
