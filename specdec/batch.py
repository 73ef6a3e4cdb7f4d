"""Batch offline generation: a JSONL file of prompts in, a JSONL file of results out.

    specdec batch --input prompts.jsonl --output out.jsonl [model / sampling flags]
    specdec batch --input prompts.jsonl --output out.jsonl --ray --num-engines 4

Input rows (one JSON object per line)::

    {"id": "a1", "prompt": "def fib(n):"}
    {"id": 7, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7}

Optional per-row sampling fields (`ROW_SAMPLING_FIELDS`) override the command
line's. Output rows keep the id and add the generation::

    {"id": "a1", "text": "...", "token_ids": [...], "finish_reason": "length",
     "metrics": {"num_output_tokens": 16, "ttft": 0.01, "tpot": 0.002,
                 "acceptance_length": 3.2, ...}}

A bad row (not JSON, missing or duplicate id, empty prompt, bad sampling
value, a prompt too long for the model) becomes `{"id": ..., "line": n,
"error": "..."}` and the run goes on.

Resume: each output row is appended with one `write` to a file opened with
O_APPEND, then fsync'ed, so a killed run leaves whole rows (a torn last line,
if any, is cut off on the next start). Re-running skips every id already in
the output (and every input line that produced an error row), so a killed run
resumed gives every id exactly once. Resuming assumes the same input file.

Locally one engine streams the whole file (continuous batching: a finished
row is written at once and a new row takes its slot). With `--ray`, Ray Data
spreads rows over an actor pool of engines (`from_items -> map_batches ->
iter_batches`) and the driver appends the rows as batches come back; the
file is parsed on the driver first (not `read_json`), because one Arrow schema
for all rows would reject exactly the malformed rows that must be reported,
and resume needs each row's line number.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from specdec.params import SamplingParams

logger = logging.getLogger(__name__)

ROW_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "seed",
    "skip_special_tokens",
)


@dataclasses.dataclass
class Row:
    """One input line, checked; `error` set when it cannot be generated."""

    line: int  # 1-based line number in the input file
    id: Any  # str or int; None when missing
    prompt: str | None = None
    messages: list | None = None
    params: SamplingParams | None = None
    error: str | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)

    def error_row(self, error: str | None = None) -> dict:
        return {"id": self.id, "line": self.line, "error": error or self.error}


def id_key(value: Any) -> str:
    """Ids compare by their JSON text: 7 and "7" are different ids."""
    return json.dumps(value)


# ----------------------------------------------------------------------------- reading


def parse_rows(lines: Iterable[str], defaults: SamplingParams) -> list[Row]:
    """Checks every line (no model needed): id, prompt or messages, sampling fields."""
    rows, seen = [], {}
    base = dataclasses.asdict(defaults)
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        row = Row(line=n, id=None)
        rows.append(row)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            row.error = f"line {n} is not valid JSON: {e}"
            continue
        if not isinstance(obj, dict):
            row.error = f"line {n} must be a JSON object, got {type(obj).__name__}"
            continue
        rid = obj.get("id")
        if isinstance(rid, str | int) and not isinstance(rid, bool) and rid != "":
            row.id = rid
        row.error = _check_row(obj, row, seen, base)
        if row.error is None:
            seen[row.key] = n
    return rows


def _check_row(obj: dict, row: Row, seen: dict, base: dict) -> str | None:
    if row.id is None:
        return (
            f"missing id: every row needs an 'id' (a string or an integer), got {obj.get('id')!r}"
        )
    if row.key in seen:
        return f"duplicate id {row.id!r} (first on line {seen[row.key]})"
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if prompt is not None and messages is not None:
        return "give either 'prompt' or 'messages', not both"
    if messages is not None:
        ok = (
            isinstance(messages, list)
            and messages
            and all(isinstance(x, dict) and isinstance(x.get("role"), str) for x in messages)
        )
        if not ok:
            return "messages must be a non-empty list of {'role': ..., 'content': ...} objects"
        row.messages = messages
    elif isinstance(prompt, str) and prompt:
        row.prompt = prompt
    else:
        return f"empty prompt: 'prompt' must be a non-empty string, got {prompt!r}"
    fields = {k: obj[k] for k in ROW_SAMPLING_FIELDS if k in obj}
    try:
        row.params = SamplingParams(**(base | fields))
    except (ValueError, TypeError) as e:
        return f"bad sampling value: {e}"
    return None


def done_keys(output: Path) -> tuple[set[str], set[int]]:
    """Ids and error lines already in `output`; cuts off a torn last line first."""
    ids, lines = set(), set()
    if not output.exists():
        return ids, lines
    data = output.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):  # a run killed mid-write: drop the partial row
        logger.warning("%s: dropping a torn last line (%d bytes)", output, len(data) - end)
        with open(output, "r+b") as f:
            f.truncate(end)
            os.fsync(f.fileno())
    for raw in data[:end].splitlines():
        if not raw.strip():
            continue
        row = json.loads(raw)
        if "error" in row:  # by line: a duplicate id's error row must not mark the id done
            lines.add(row["line"])
        else:
            ids.add(id_key(row["id"]))
    return ids, lines


class ResultWriter:
    """Appends whole rows durably: one O_APPEND write per row, then fsync."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rows = self.errors = 0

    def write(self, row: dict) -> None:
        data = (json.dumps(row, ensure_ascii=False) + "\n").encode()
        os.write(self.fd, data)  # regular files take the whole buffer in one write
        os.fsync(self.fd)
        self.rows += 1
        self.errors += "error" in row

    def close(self) -> None:
        os.close(self.fd)


# ----------------------------------------------------------------------------- generating


def encode(llm, row: Row) -> list[int]:
    """Prompt token ids for `row` (ValueError naming the problem)."""
    tok = llm.tokenizer
    if tok is None:
        raise ValueError(f"{llm.model_path} has no tokenizer.json; text prompts need one")
    if row.params.stop and tok is None:
        raise ValueError("stop strings need a tokenizer")
    if row.messages is not None:
        ids = tok.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    else:
        ids = tok.encode(row.prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    if len(ids) + 1 > llm.max_model_len:
        raise ValueError(
            f"prompt too long: {len(ids)} prompt tokens + at least 1 output token = "
            f"{len(ids) + 1} > max_model_len = {llm.max_model_len}"
        )
    return list(ids)


def result_row(row_id: Any, seq) -> dict:
    out = seq.output().outputs[0]
    m = seq.metrics
    spec = m.spec
    metrics = m.as_dict() | {
        "acceptance_length": spec.acceptance_length if spec.num_drafts else None,
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
    }
    return {
        "id": row_id,
        "text": out.text,
        "token_ids": out.token_ids,
        "finish_reason": out.finish_reason,
        "metrics": metrics,
    }


def stream(llm, rows: Iterable[Row]) -> Iterator[tuple[dict, int]]:
    """Generates `rows` through `llm.engine`, yielding (output row, tokens) as each ends.

    Keeps at most `max_num_seqs` requests waiting, so a finished row is out
    (and durable) long before the file ends. Stops early when a worker is
    lost for good (`engine.last_error`); those rows are not yielded, so a
    resumed run retries them.
    """
    engine = llm.engine
    todo = iter(rows)
    live: dict[int, Row] = {}
    exhausted = False
    while True:
        while not exhausted and len(engine.waiting) < engine.max_num_seqs:
            row = next(todo, None)
            if row is None:
                exhausted = True
                break
            try:
                ids = encode(llm, row)
            except ValueError as e:
                yield row.error_row(str(e)), 0
                continue
            seq = engine.add_request(str(row.id), row.prompt, ids, row.params)
            live[id(seq)] = row
        if not engine.has_unfinished_requests():
            if exhausted:
                return
            continue
        for seq in engine.step():
            if seq.finished and id(seq) in live:
                row = live.pop(id(seq))
                if seq.finish_reason == "error":
                    continue
                yield result_row(row.id, seq), len(seq.output_ids)
        if engine.last_error is not None:
            raise RuntimeError(f"generation stopped: {engine.last_error}")


class Progress:
    """tqdm bar over rows with output tokens/s and the running acceptance length."""

    def __init__(self, total: int, enabled: bool):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, unit="row", disable=not enabled, desc="batch")
        self.tokens = 0
        self.start = time.perf_counter()
        self.drafts = self.accepted = 0

    def update(self, row: dict, tokens: int) -> None:
        self.tokens += tokens
        m = row.get("metrics") or {}
        self.drafts += m.get("num_drafts") or 0
        self.accepted += m.get("num_accepted_tokens") or 0
        dt = time.perf_counter() - self.start
        post = {"tok/s": f"{self.tokens / dt:.1f}" if dt > 0 else "-"}
        if self.drafts:
            post["acc_len"] = f"{1 + self.accepted / self.drafts:.2f}"
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(1)

    def summary(self) -> dict:
        dt = time.perf_counter() - self.start
        return {
            "seconds": dt,
            "output_tokens": self.tokens,
            "tokens_per_s": self.tokens / dt if dt > 0 else None,
            "acceptance_length": 1 + self.accepted / self.drafts if self.drafts else None,
        }

    def close(self) -> None:
        self.bar.close()


@dataclasses.dataclass
class BatchResult:
    rows: int  # rows written by this run
    errors: int  # of which error rows
    skipped: int  # rows already in the output (resume)
    summary: dict


def generate_file(
    llm, input_path: Path, output_path: Path, defaults: SamplingParams, *, progress: bool = True
) -> BatchResult:
    """The local path: one engine over the whole file (resumable; module docstring)."""
    rows, done_ids, done_lines = _plan(input_path, output_path, defaults)
    todo = [r for r in rows if not _done(r, done_ids, done_lines)]
    writer = ResultWriter(output_path)
    bar = Progress(len(todo), progress)
    try:
        _write_bad_rows(todo, writer, bar)
        for out, tokens in stream(llm, (r for r in todo if r.error is None)):
            writer.write(out)
            bar.update(out, tokens)
    finally:
        bar.close()
        writer.close()
    return BatchResult(writer.rows, writer.errors, len(rows) - len(todo), bar.summary())


def _write_bad_rows(todo: list[Row], writer: ResultWriter, bar: Progress) -> None:
    """Rows that failed their checks are results too: written first, in input order."""
    for r in todo:
        if r.error is not None:
            writer.write(r.error_row())
            bar.update({}, 0)


def _plan(input_path: Path, output_path: Path, defaults: SamplingParams):
    if not input_path.is_file():
        raise ValueError(f"Input file {str(input_path)!r} does not exist.")
    with open(input_path, encoding="utf-8") as f:
        rows = parse_rows(f, defaults)
    done_ids, done_lines = done_keys(output_path)
    return rows, done_ids, done_lines


def _done(row: Row, done_ids: set[str], done_lines: set[int]) -> bool:
    return row.line in done_lines or (row.error is None and row.key in done_ids)


# ----------------------------------------------------------------------------- Ray Data


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


def generate_file_ray(
    llm_kwargs: dict,
    input_path: Path,
    output_path: Path,
    defaults: SamplingParams,
    *,
    num_engines: int = 1,
    batch_size: int = 16,
    progress: bool = True,
    address: str | None = None,
) -> BatchResult:
    """The Ray Data path: rows over an actor pool of `num_engines` engines."""
    import ray

    rows, done_ids, done_lines = _plan(input_path, output_path, defaults)
    todo = [r for r in rows if not _done(r, done_ids, done_lines)]
    env = {k: os.environ[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS") if k in os.environ}
    if not ray.is_initialized():
        ray.init(address=address, runtime_env={"env_vars": env} if env else None)
    writer = ResultWriter(output_path)
    bar = Progress(len(todo), progress)
    try:
        _write_bad_rows(todo, writer, bar)
        good = [
            {
                "line": r.line,
                "id": json.dumps(r.id),
                "prompt": r.prompt or "",
                "messages": json.dumps(r.messages) if r.messages is not None else "",
                "params": json.dumps(dataclasses.asdict(r.params)),
            }
            for r in todo
            if r.error is None
        ]
        if good:
            ds = ray.data.from_items(good).map_batches(
                _EngineActor,
                fn_constructor_kwargs={"llm_kwargs": llm_kwargs},
                batch_size=batch_size,
                runtime_env={"env_vars": env} if env else None,
                **_pool(ray.data, num_engines),
            )
            for batch in ds.iter_batches(batch_size=None):
                for blob in batch["result"]:
                    out, tokens = json.loads(blob)
                    writer.write(out)
                    bar.update(out, tokens)
    finally:
        bar.close()
        writer.close()
    return BatchResult(writer.rows, writer.errors, len(rows) - len(todo), bar.summary())


def _pool(data, n: int) -> dict:
    """An actor pool of n engines, in whichever form this Ray Data takes it."""
    if hasattr(data, "ActorPoolStrategy"):
        return {"compute": data.ActorPoolStrategy(size=n)}
    return {"concurrency": n}


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`specdec batch` flags: model and sampling flags as `specdec generate`, plus I/O."""
    from specdec.cli import add_model_arguments, add_sampling_arguments

    parser.add_argument("--input", required=True, type=Path, help="prompts, one JSON per line")
    parser.add_argument("--output", required=True, type=Path, help="results JSONL (appended)")
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    g = parser.add_argument_group("batch")
    g.add_argument("--ray", action="store_true", help="run on Ray Data (actor pool of engines)")
    g.add_argument("--num-engines", type=int, default=1, help="--ray: engines in the pool")
    g.add_argument("--ray-batch-size", type=int, default=16, help="--ray: rows per batch")
    g.add_argument("--ray-address", default=None, help="--ray: cluster to join (default: auto)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def llm_kwargs(args) -> dict:
    """LLM(...) keyword arguments from the model flags (ValueError on a missing folder)."""
    from specdec.cli import speculative_from_args

    if not Path(args.model).exists():
        raise ValueError(f"Model folder {args.model!r} does not exist.")
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "speculative_config": speculative_from_args(args),
        "kernel": args.kernel,
    }


def run(args) -> int:
    """`specdec batch`: exit status 0 once every input row has an output row.

    Bad rows are results too (error rows, counted in the summary line), so they
    do not fail the run; a run that cannot go on stops with exit status 1 (bad
    arguments: 2), keeping the rows written so far.
    """
    from specdec.cli import sampling_from_args

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    defaults = sampling_from_args(args)
    kwargs = llm_kwargs(args)
    progress = not args.no_progress
    if args.ray:
        result = generate_file_ray(
            kwargs,
            args.input,
            args.output,
            defaults,
            num_engines=args.num_engines,
            batch_size=args.ray_batch_size,
            progress=progress,
            address=args.ray_address,
        )
    else:
        from specdec.api import LLM

        llm = LLM(**kwargs)
        result = generate_file(llm, args.input, args.output, defaults, progress=progress)
    s = result.summary
    print(
        f"specdec batch: wrote {result.rows} rows ({result.errors} errors), skipped "
        f"{result.skipped} already done; {s['output_tokens']} tokens in {s['seconds']:.1f} s"
        + (f", acceptance length {s['acceptance_length']:.2f}" if s["acceptance_length"] else ""),
        file=sys.stderr,
    )
    return 0
