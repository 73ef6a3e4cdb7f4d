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

A bad row (not UTF-8, not JSON, missing or duplicate id, empty prompt, bad
sampling value, a prompt too long for the model) becomes `{"id": ..., "line": n,
"error": "..."}` and the run goes on.

Resume: each output row is appended with one `write` to a file opened with
O_APPEND, then fsync'ed, so a killed run leaves whole rows (a torn last line,
if any, is cut off on the next start). Re-running skips every id already in
the output (and every input line that produced an error row), so a killed run
resumed gives every id exactly once. Resuming assumes the same input file.

Locally one engine streams the whole file (continuous batching: a finished
row is written at once and a new row takes its slot), through `LLM`'s request
API. With `--ray`, Ray Data spreads rows over an actor pool of engines
(cluster/batch.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from specdec.flags import add_model_arguments, add_sampling_arguments
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


def parse_rows(lines: Iterable[str | bytes], defaults: SamplingParams) -> list[Row]:
    """Checks every line (no model needed): UTF-8 text, JSON, id, prompt or messages,
    sampling fields. A line failing any check becomes an error row."""
    rows, seen = [], {}
    base = dataclasses.asdict(defaults)
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        row = Row(line=n, id=None)
        rows.append(row)
        if isinstance(text, bytes):
            try:
                text = text.decode("utf-8")
            except UnicodeDecodeError as e:
                row.error = f"line {n} is not UTF-8 text: byte {e.start} is {text[e.start]:#04x}"
                continue
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


def result_row(row_id: Any, out) -> dict:
    """The output row of a finished request (`RequestOutput`)."""
    c = out.outputs[0]
    m = out.metrics
    spec = m.spec
    metrics = m.as_dict() | {
        "acceptance_length": spec.acceptance_length if spec.num_drafts else None,
        "num_drafts": spec.num_drafts,
        "num_draft_tokens": spec.num_draft_tokens,
        "num_accepted_tokens": spec.num_accepted_tokens,
    }
    return {
        "id": row_id,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "metrics": metrics,
    }


def stream(llm, rows: Iterable[Row]) -> Iterator[tuple[dict, int]]:
    """Generates `rows` through `llm`'s request API, yielding (output row, tokens) as
    each ends.

    Keeps at most `max_num_seqs` requests waiting, so a finished row is out
    (and durable) long before the file ends. Stops early when a worker is
    lost for good (`llm.last_error`); those rows are not yielded, so a
    resumed run retries them.
    """
    todo = iter(rows)
    live: dict[str, Row] = {}
    exhausted = False
    while True:
        while not exhausted and llm.num_waiting_requests() < llm.max_num_seqs:
            row = next(todo, None)
            if row is None:
                exhausted = True
                break
            try:
                ids = encode(llm, row)
                prompt = {"prompt_token_ids": ids, "prompt": row.prompt}
                live[llm.add_request(prompt, row.params)] = row
            except ValueError as e:
                yield row.error_row(str(e)), 0
        if not live:
            if exhausted:
                return
            continue
        for out in llm.step():
            if out.finished and out.request_id in live:
                row = live.pop(out.request_id)
                if out.outputs[0].finish_reason == "error":
                    continue
                yield result_row(row.id, out), len(out.outputs[0].token_ids)
        if llm.last_error is not None:
            raise RuntimeError(f"generation stopped: {llm.last_error}")


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
    return run_file(input_path, output_path, defaults, lambda good: stream(llm, good), progress)


def run_file(
    input_path: Path,
    output_path: Path,
    defaults: SamplingParams,
    results: Callable[[list[Row]], Iterable[tuple[dict, int]]],
    progress: bool = True,
) -> BatchResult:
    """Reads and checks the file, skips rows already done (resume), writes the bad rows,
    then each (output row, tokens) that `results` yields for the good rows, as it comes."""
    rows, done_ids, done_lines = read_plan(input_path, output_path, defaults)
    todo = [r for r in rows if not is_done(r, done_ids, done_lines)]
    writer = ResultWriter(output_path)
    bar = Progress(len(todo), progress)
    try:
        write_bad_rows(todo, writer, bar)
        for out, tokens in results([r for r in todo if r.error is None]):
            writer.write(out)
            bar.update(out, tokens)
    finally:
        bar.close()
        writer.close()
    return BatchResult(writer.rows, writer.errors, len(rows) - len(todo), bar.summary())


def write_bad_rows(todo: list[Row], writer: ResultWriter, bar: Progress) -> None:
    """Rows that failed their checks are results too: written first, in input order."""
    for r in todo:
        if r.error is not None:
            writer.write(r.error_row())
            bar.update({}, 0)


def read_plan(input_path: Path, output_path: Path, defaults: SamplingParams):
    if not input_path.is_file():
        raise ValueError(f"Input file {str(input_path)!r} does not exist.")
    # Read as bytes and decoded line by line: one line that is not UTF-8 is an error
    # row, not the end of the run.
    rows = parse_rows(input_path.read_bytes().splitlines(), defaults)
    done_ids, done_lines = done_keys(output_path)
    return rows, done_ids, done_lines


def is_done(row: Row, done_ids: set[str], done_lines: set[int]) -> bool:
    return row.line in done_lines or (row.error is None and row.key in done_ids)


# ----------------------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`specdec batch` flags: model and sampling flags as `specdec generate`, plus I/O."""
    parser.add_argument("--input", required=True, type=Path, help="prompts, one JSON per line")
    parser.add_argument("--output", required=True, type=Path, help="results JSONL (appended)")
    # Compiles on first use: with up to 256 rows a step, the whole grid of shapes
    # (`LLMEngine.compile_shapes`) costs far more start-up than the shapes a file meets.
    add_model_arguments(parser)
    add_sampling_arguments(parser)
    g = parser.add_argument_group("batch")
    g.add_argument("--ray", action="store_true", help="run on Ray Data (actor pool of engines)")
    g.add_argument("--num-engines", type=int, default=1, help="--ray: engines in the pool")
    g.add_argument("--ray-batch-size", type=int, default=16, help="--ray: rows per batch")
    g.add_argument("--ray-address", default=None, help="--ray: cluster to join (default: auto)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
