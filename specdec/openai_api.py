"""The OpenAI HTTP protocol as specdec speaks it, without the server: request bodies
parsed into prompts and `SamplingParams`, results rendered as OpenAI's JSON objects
and streamed chunks, errors as OpenAI error objects. `server.py` serves it.

    parse_completion({"model": "m", "prompt": "def f(", "max_tokens": 8}, ctx)
      -> ParsedRequest(prompts=["def f("], params=SamplingParams(max_tokens=8, ...))

Sampling fields are vLLM's (`temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, `max_tokens`, `stop`, `seed`, `stop_token_ids`, `ignore_eos`,
`skip_special_tokens`); fields left out take the model's generation_config.json
defaults, as `LLM.generate` does. A field whose meaning specdec does not implement
(logprobs, presence / frequency penalties, n > 1, ...) is refused, never ignored.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from specdec.outputs import RequestOutput
from specdec.params import SamplingParams

# Request fields passed to SamplingParams under the same name.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                    "ignore_eos", "skip_special_tokens", "stop_token_ids")  # fmt: skip
# Fields specdec does not implement, and the value that means "off" for each.
_UNSUPPORTED = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
    "use_beam_search": (None, False),
}


class APIError(Exception):
    """A request the server answers with an OpenAI error object and `status`."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


_ERROR_TYPES = {400: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "api_error"),
                      "param": param, "code": status}}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a request is checked against: the served name and the model's limits."""

    name: str  # the `model` a request must name
    max_model_len: int
    defaults: Mapping[str, Any]  # SamplingParams fields from generation_config.json
    render_chat: Callable[[list, Mapping[str, Any]], list[int]] | None  # messages -> ids


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    kind: Literal["completion", "chat"]
    prompts: list  # each a str or {"prompt_token_ids": [...]} (LLM's prompt types)
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage


def _check_common(body: Any, ctx: ServedModel) -> dict:
    if not isinstance(body, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
    model = body.get("model")
    if model != ctx.name:
        raise APIError(400, f"The model {model!r} does not exist; this server serves "
                            f"{ctx.name!r}.", "model")  # fmt: skip
    n = body.get("n", 1)
    if n != 1:
        raise APIError(400, f"n must be 1 (one choice per prompt), got {n!r}.", "n")
    for name, off in _UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise APIError(400, f"{name}={body[name]!r} is not supported by specdec.", name)
    if not isinstance(body.get("stream", False), bool):
        raise APIError(400, f"stream must be true or false, got {body['stream']!r}.", "stream")
    return body


def _sampling(body: dict, ctx: ServedModel, max_tokens: int | None) -> SamplingParams:
    fields = dict(ctx.defaults)
    fields.update({k: body[k] for k in _SAMPLING_FIELDS if body.get(k) is not None})
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list):
            raise APIError(400, f"stop must be a string or a list of strings, got {stop!r}.",
                           "stop")  # fmt: skip
        fields["stop"] = stop or None
    if max_tokens is not None:
        fields["max_tokens"] = max_tokens
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise APIError(400, f"{name} must be a positive integer, got {value!r}.", name)
            return value
    return None


def parse_completion(body: Any, ctx: ServedModel) -> ParsedRequest:
    """/v1/completions: `prompt` is a string, a list of token ids, or a list of either
    (one choice per prompt). `max_tokens` defaults to 16, as OpenAI's does."""
    body = _check_common(body, ctx)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p)
                                                     for p in prompt):  # fmt: skip
        prompts = list(prompt)
    else:
        raise APIError(400, "prompt must be a non-empty string, a list of token ids, or a "
                            f"list of those; got {_short(prompt)}.", "prompt")  # fmt: skip
    prompts = [{"prompt_token_ids": p} if _is_ids(p) else p for p in prompts]
    params = _sampling(body, ctx, _max_tokens(body, "max_tokens") or 16)
    return ParsedRequest("completion", prompts, params, body.get("stream", False),
                         _include_usage(body))  # fmt: skip


def parse_chat(body: Any, ctx: ServedModel) -> ParsedRequest:
    """/v1/chat/completions: `messages` rendered with the model's chat template.
    `max_tokens` (or `max_completion_tokens`) defaults to what fits in max_model_len."""
    body = _check_common(body, ctx)
    messages = body.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise APIError(400, "messages must be a non-empty list of objects with a 'role', got "
                            f"{_short(messages)}.", "messages")  # fmt: skip
    if ctx.render_chat is None:
        raise APIError(400, "This model has no chat template (and no tokenizer to apply one); "
                            "use /v1/completions.")  # fmt: skip
    try:
        ids = ctx.render_chat(messages, body.get("chat_template_kwargs") or {})
    except ValueError as e:
        raise APIError(400, f"The chat template could not render these messages: {e}",
                       "messages") from None  # fmt: skip
    limit = _max_tokens(body, "max_completion_tokens", "max_tokens")
    params = _sampling(body, ctx, limit or max(1, ctx.max_model_len - len(ids)))
    return ParsedRequest("chat", [{"prompt_token_ids": ids}], params, body.get("stream", False),
                         _include_usage(body))  # fmt: skip


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options") or {}
    return bool(isinstance(options, dict) and options.get("include_usage"))


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in x)  # fmt: skip


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- responses


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def usage(outputs: Sequence[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def finish_reason(out: RequestOutput) -> str | None:
    return out.outputs[0].finish_reason if out.finished else None


def response(req: ParsedRequest, rid: str, model: str, outputs: Sequence[RequestOutput]) -> dict:
    """The whole (non-streamed) response for the finished `outputs`, one per prompt."""
    created = int(time.time())
    if req.kind == "completion":
        choices = [{"index": i, "text": o.outputs[0].text, "logprobs": None,
                    "finish_reason": finish_reason(o), "stop_reason": o.outputs[0].stop_reason}
                   for i, o in enumerate(outputs)]  # fmt: skip
        obj = "text_completion"
    else:
        o = outputs[0]
        choices = [{"index": 0, "message": {"role": "assistant", "content": o.outputs[0].text},
                    "logprobs": None, "finish_reason": finish_reason(o),
                    "stop_reason": o.outputs[0].stop_reason}]  # fmt: skip
        obj = "chat.completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": choices,
            "usage": usage(outputs)}  # fmt: skip


def chunk(req: ParsedRequest, rid: str, model: str, index: int, text: str | None,
          reason: str | None, role: bool = False) -> dict:  # fmt: skip
    """One streamed chunk: `text` new for choice `index` (chat: the first chunk carries
    the assistant role), `reason` set on the choice's last chunk."""
    if req.kind == "completion":
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": ""} if role else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        obj = "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [choice]}  # fmt: skip


def usage_chunk(req: ParsedRequest, rid: str, model: str, outputs) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "choices": [], "usage": usage(outputs)}  # fmt: skip


class TextStream:
    """The text of one streamed choice, released as it can no longer change: text that
    could still be the start of a stop string is held back (as `LLM.generate_stream`),
    and the deltas concatenate to the final text."""

    def __init__(self, params: SamplingParams):
        self.hold = max((len(s) for s in params.stop or ()), default=1) - 1
        self.sent = 0

    def delta(self, out: RequestOutput) -> str:
        text = out.outputs[0].text
        end = len(text) if out.finished else max(self.sent, len(text) - self.hold)
        new, self.sent = text[self.sent : end], end
        return new


__all__ = [
    "APIError", "ParsedRequest", "ServedModel", "TextStream", "chunk", "error_body",
    "finish_reason", "new_id", "parse_chat", "parse_completion", "response", "usage",
    "usage_chunk",
]  # fmt: skip
