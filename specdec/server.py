"""`specdec serve`: an OpenAI-compatible HTTP server on Ray Serve.

How a request travels:

1. Ray Serve's HTTP proxy routes it to one replica of `OpenAIDeployment` (the
   FastAPI app below is its ingress). Each replica owns one `LLM` and one
   `EngineLoop`: a thread that steps that LLM while any request runs.
2. The handler parses the body (`openai_api`), then `EngineLoop.submit` queues each
   prompt on the LLM (`LLM.add_request`, in a worker thread: it waits for the
   engine's lock while a step runs). Queued requests join the running batch at the
   engine's next step, up to `max_num_seqs`; the rest wait in its queue.
3. After every step the loop thread hands each request's new output to its
   handler's asyncio queue (`loop.call_soon_threadsafe`). A streamed request sends
   the text that can no longer change as a server-sent event per step; the others
   answer once their request has finished.
4. A client that goes away cancels its handler (Ray Serve cancels it on
   disconnect); the handler then aborts its request (`LLM.abort_request`), which
   frees the slot and KV blocks at once.

Errors are OpenAI error objects: 400 for a bad request (the server goes on), 503
while the replica is still loading its model, 500 if generation itself failed.
`/metrics` is Prometheus text: request counts and latencies, and the
speculative-decoding counters under vLLM's names with a `specdec:` prefix.

    specdec serve --model path/to/model --draft path/to/draft --port 8000
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from ray import serve

from specdec.openai_api import (
    APIError,
    ParsedRequest,
    ServedModel,
    TextStream,
    chunk,
    error_body,
    finish_reason,
    new_id,
    parse_chat,
    parse_completion,
    response,
    usage_chunk,
)
from specdec.outputs import RequestOutput

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- engine loop


class Handle:
    """One submitted request: its outputs arrive on an asyncio queue."""

    def __init__(self, engine: EngineLoop, loop: asyncio.AbstractEventLoop, rid: str):
        self.engine, self.loop, self.rid = engine, loop, rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.last: RequestOutput | None = None
        self.closed = False

    def push(self, item: RequestOutput | BaseException) -> None:  # from the loop thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """Each step's output until the finished one. A consumer that stops early
        (its client went away) must `close` the handle: an abandoned async generator
        is only finalised whenever the event loop gets to it."""
        while self.last is None or not self.last.finished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            self.last = item
            yield item

    def close(self) -> None:
        """Aborts the request unless it finished (idempotent)."""
        if (self.last is None or not self.last.finished) and not self.closed:
            self.closed = True
            self.engine.abort(self.rid)

    async def result(self) -> RequestOutput:
        try:
            async for _ in self.outputs():
                pass
        finally:
            self.close()  # cancelled (client gone) or failed: free the slot now
        return self.last


class EngineLoop:
    """Steps one `LLM` in a thread while requests run (module docstring)."""

    def __init__(self, llm):
        self.llm = llm
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.aborted = 0  # requests whose client went away before they finished
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    async def submit(self, prompt, params) -> Handle:
        """Queues one prompt; ValueError (a bad prompt) before anything is queued."""
        loop = asyncio.get_running_loop()
        handle = Handle(self, loop, uuid.uuid4().hex)
        with self._lock:
            self._handles[handle.rid] = handle
        try:
            add = functools.partial(self.llm.add_request, prompt, params, request_id=handle.rid)
            await loop.run_in_executor(None, add)
        except BaseException:
            with self._lock:
                self._handles.pop(handle.rid, None)
            raise
        self._wake.set()
        return handle

    def abort(self, rid: str) -> None:
        """Ends a request whose client left; never blocks the caller (the engine's lock
        may be held by a step)."""
        self.aborted += 1
        threading.Thread(target=self.llm.abort_request, args=(rid,), daemon=True).start()

    def _run(self) -> None:
        while True:
            self._wake.clear()  # cleared before the check: a submit after it wakes us
            if not self.llm.has_unfinished_requests():
                self._wake.wait()
                continue
            try:
                outputs = self.llm.step()
            except Exception as e:  # noqa: BLE001 - every waiting client must hear of it
                logger.exception("engine step failed")
                with self._lock:
                    handles, self._handles = list(self._handles.values()), {}
                for h in handles:
                    self.llm.abort_request(h.rid)
                    h.push(RuntimeError(f"generation failed: {e}"))
                continue
            with self._lock:
                for out in outputs:
                    handle = self._handles.get(out.request_id)
                    if handle is not None:
                        handle.push(out)
                        if out.finished:
                            del self._handles[out.request_id]

    @property
    def running(self) -> int:
        return len(self.llm.engine.running)

    @property
    def waiting(self) -> int:
        return len(self.llm.engine.waiting)


# ----------------------------------------------------------------------------- metrics

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclasses.dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    total: float = 0.0
    n: int = 0

    def observe(self, x: float) -> None:
        i = bisect.bisect_left(self.buckets, x)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += x
        self.n += 1

    def samples(self, labels: str) -> list[str]:
        """Prometheus samples, each after the metric's name: `_bucket{...} n`, ..."""
        out, running = [], 0
        for le, c in zip(self.buckets, self.counts, strict=True):
            running += c
            out.append(f'_bucket{{{labels},le="{le}"}} {running}')
        out.append(f'_bucket{{{labels},le="+Inf"}} {self.n}')
        return out + [f"_sum{{{labels}}} {self.total}", f"_count{{{labels}}} {self.n}"]


class ServerMetrics:
    """Counters one replica keeps, rendered as Prometheus text (`render`)."""

    def __init__(self):
        self.responses: dict[tuple[str, int], int] = {}  # (endpoint, HTTP status) -> count
        self.finished: dict[str, int] = {}  # finish_reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.e2e = Histogram()
        self.ttft = Histogram()

    def response(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.responses[key] = self.responses.get(key, 0) + 1

    def request(self, out: RequestOutput) -> None:
        reason = out.outputs[0].finish_reason or "none"
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += len(out.prompt_token_ids)
        self.generation_tokens += len(out.outputs[0].token_ids)
        m = out.metrics
        if m is not None and m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m is not None and m.ttft is not None:
            self.ttft.observe(m.ttft)

    def render(self, model: str, engine: EngineLoop | None) -> str:
        lab = f'model_name="{model}"'
        lines: list[str] = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP specdec:{name} {help_}", f"# TYPE specdec:{name} {kind}"])
            lines.extend(f"specdec:{name}{s}" for s in samples)

        metric("http_responses_total", "counter", "HTTP responses by endpoint and status.",
               [f'{{{lab},endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(self.responses.items())])  # fmt: skip
        metric(
            "request_success_total",
            "counter",
            "Finished requests by finish reason.",
            [f'{{{lab},finished_reason="{r}"}} {n}' for r, n in sorted(self.finished.items())],
        )
        scalars = [
            ("prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
             self.prompt_tokens),
            ("generation_tokens_total", "counter", "Generated tokens of finished requests.",
             self.generation_tokens),
        ]  # fmt: skip
        if engine is not None:
            spec = engine.llm.engine.spec_metrics
            scalars += [
                ("num_requests_running", "gauge", "Requests in the running batch.",
                 engine.running),
                ("num_requests_waiting", "gauge", "Requests queued for a slot.", engine.waiting),
                ("request_aborted_total", "counter", "Requests whose client went away.",
                 engine.aborted),
                ("spec_decode_num_drafts_total", "counter", "Speculative steps with a draft.",
                 spec.num_drafts),
                ("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.",
                 spec.num_draft_tokens),
                ("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                 spec.num_accepted_tokens),
            ]  # fmt: skip
        for name, kind, help_, value in scalars:
            metric(name, kind, help_, [f"{{{lab}}} {value}"])
        metric("e2e_request_latency_seconds", "histogram", "Arrival to finish.",
               self.e2e.samples(lab))  # fmt: skip
        metric("time_to_first_token_seconds", "histogram", "Arrival to first token.",
               self.ttft.samples(lab))  # fmt: skip
        if engine is not None:
            per_pos = engine.llm.engine.spec_metrics.accepted_per_position
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Steps whose accepted path reached each position (0 = depth 1).",
                   [f'{{{lab},position="{i}"}} {n}' for i, n in enumerate(per_pos)])  # fmt: skip
        return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- service


class OpenAIService:
    """The endpoints' logic for one replica: loads its LLM in a thread (503 until
    then), parses, generates, renders. Framework-free apart from the responses."""

    def __init__(self, llm_kwargs: Mapping[str, Any], served_model_name: str | None = None):
        self.llm_kwargs = dict(llm_kwargs)
        self.name = served_model_name or os.path.basename(
            os.path.normpath(str(llm_kwargs["model"]))
        )
        self.engine: EngineLoop | None = None
        self.ctx: ServedModel | None = None
        self.load_error: str | None = None
        self.metrics = ServerMetrics()
        threading.Thread(target=self._load, name="specdec-load", daemon=True).start()

    def _load(self) -> None:
        try:
            from specdec.api import LLM

            llm = LLM(**self.llm_kwargs)
            render = None
            if llm.tokenizer is not None:

                def render(messages, kwargs, tok=llm.tokenizer):
                    return tok.apply_chat_template(messages, add_generation_prompt=True,
                                                   tokenize=True, **dict(kwargs))  # fmt: skip

            self.ctx = ServedModel(self.name, llm.max_model_len, dict(llm.generation_defaults),
                                   render)  # fmt: skip
            self.engine = EngineLoop(llm)
            logger.info("specdec replica ready: %s", self.name)
        except Exception as e:  # noqa: BLE001 - reported by /health and every request
            logger.exception("loading the model failed")
            self.load_error = f"{type(e).__name__}: {e}"

    def check_ready(self) -> None:
        if self.load_error is not None:
            raise APIError(500, f"The model failed to load: {self.load_error}")
        if self.engine is None:
            raise APIError(503, "The model is still loading; retry shortly.")

    def models(self) -> dict:
        self.check_ready()
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": int(time.time()),
            "owned_by": "specdec", "max_model_len": self.ctx.max_model_len,
        }]}  # fmt: skip

    async def generate(self, kind: str, body: Any):
        """A parsed request's answer: a dict (whole response) or an async iterator of
        server-sent-event strings (stream)."""
        self.check_ready()
        parse = parse_completion if kind == "completion" else parse_chat
        req = parse(body, self.ctx)
        handles = []
        try:
            for prompt in req.prompts:
                handles.append(await self.engine.submit(prompt, req.params))
        except ValueError as e:  # a prompt the LLM refuses (too long, out of vocabulary)
            for h in handles:
                h.close()
            raise APIError(400, str(e), "prompt" if kind == "completion" else "messages") from None
        rid = new_id(kind)
        if req.stream:
            return self._stream(req, rid, handles)
        outs = await asyncio.gather(*(h.result() for h in handles))
        for out in outs:
            self.metrics.request(out)
        failed = [o for o in outs if o.outputs[0].finish_reason == "error"]
        if failed:
            raise APIError(500, f"Generation failed: {self.engine.llm.last_error}")
        return response(req, rid, self.name, outs)

    async def _stream(self, req: ParsedRequest, rid: str, handles: list[Handle]):
        """Server-sent events as OpenAI sends them, ending with `data: [DONE]`."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, handle: Handle):
            try:
                async for out in handle.outputs():
                    await queue.put((i, out))
            except Exception as e:  # noqa: BLE001 - reported in the stream
                await queue.put((i, e))
            finally:
                handle.close()  # cancelled with the stream (client gone): free the slot

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        texts = [TextStream(req.params) for _ in handles]
        finals: list[RequestOutput | None] = [None] * len(handles)
        try:
            if req.kind == "chat":
                yield _sse(chunk(req, rid, self.name, 0, None, None, role=True))
            while any(f is None for f in finals):
                i, out = await queue.get()
                if isinstance(out, Exception):
                    yield _sse(error_body(500, str(out)))
                    return
                delta = texts[i].delta(out)
                reason = finish_reason(out)
                if out.finished:
                    finals[i] = out
                    self.metrics.request(out)
                if reason == "error":
                    yield _sse(error_body(500, f"Generation failed: "
                                               f"{self.engine.llm.last_error}"))  # fmt: skip
                    return
                if delta or reason:
                    yield _sse(chunk(req, rid, self.name, i, delta, reason))
            if req.include_usage:
                yield _sse(usage_chunk(req, rid, self.name, finals))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()  # a client gone mid-stream: each handle aborts its request


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ----------------------------------------------------------------------------- HTTP


def build_app(get_service) -> FastAPI:
    """The FastAPI app; `get_service()` returns the replica's `OpenAIService`."""
    app = FastAPI(title="specdec", description="OpenAI-compatible speculative decoding")

    def error(endpoint: str, e: APIError):
        get_service().metrics.response(endpoint, e.status)
        return JSONResponse(e.body(), status_code=e.status)

    async def generate(kind: str, endpoint: str, request: Request):
        service = get_service()
        try:
            try:
                body = await request.json()
            except (ValueError, UnicodeDecodeError) as e:
                raise APIError(400, f"The request body is not valid JSON: {e}.") from None
            result = await service.generate(kind, body)
        except APIError as e:
            return error(endpoint, e)
        except RuntimeError as e:  # the engine failed mid-request
            return error(endpoint, APIError(500, str(e)))
        service.metrics.response(endpoint, 200)
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers=_replica_headers())  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("completion", "/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate("chat", "/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        try:
            return JSONResponse(get_service().models())
        except APIError as e:
            return error("/v1/models", e)

    @app.get("/health")
    async def health():
        try:
            get_service().check_ready()
        except APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse({}, headers=_replica_headers())

    @app.get("/metrics")
    async def metrics():
        service = get_service()
        text = service.metrics.render(service.name, service.engine)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


def _replica_headers() -> dict:
    """Which replica process answered (logs, and tests that stop one)."""
    return {"x-specdec-replica-pid": str(os.getpid())}


_SERVICE: OpenAIService | None = None  # this process's replica (set by its deployment)


def _service() -> OpenAIService:
    return _SERVICE


app = build_app(_service)


@serve.deployment(name="specdec", health_check_period_s=5)
@serve.ingress(app)
class OpenAIDeployment:
    """One replica: one `OpenAIService` (its LLM and engine loop).

    Ray ships this class to the replica by value (the module's name for it is the
    deployment wrapper), so its methods see a copy of this module's globals: the
    service goes on the imported module itself, where the routes' `_service` reads it.
    """

    def __init__(self, llm_kwargs: dict, served_model_name: str | None):
        import specdec.server

        specdec.server._SERVICE = OpenAIService(llm_kwargs, served_model_name)

    def check_health(self) -> None:
        import specdec.server

        error = specdec.server._service().load_error
        if error is not None:  # Serve replaces a replica that cannot load
            raise RuntimeError(error)


def run(args, llm_kwargs: dict) -> int:
    """`specdec serve`: starts (or joins, `--address`) Ray, deploys, serves until ^C."""
    import ray

    ray.init(address=args.address, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)  # fmt: skip
    serve.start(http_options={"host": args.host, "port": args.port})
    # Requests past max_num_seqs wait in the engine's own queue, where they join the
    # batch the moment a slot frees; Serve's default (5 in flight) would hold them back.
    ongoing = max(64, 4 * llm_kwargs["max_num_seqs"])
    deployment = OpenAIDeployment.options(
        num_replicas=args.num_replicas, max_ongoing_requests=ongoing,
        ray_actor_options={"num_cpus": args.replica_cpus},
    )  # fmt: skip
    serve.run(deployment.bind(llm_kwargs, args.served_model_name), name="specdec",
              route_prefix="/")  # fmt: skip
    url = f"http://{args.host}:{args.port}"
    print(f"specdec serve: {args.num_replicas} replica(s) of {llm_kwargs['model']} at {url}/v1 "
          f"(GET {url}/health answers 200 once the model is loaded)", flush=True)  # fmt: skip
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


__all__ = ["EngineLoop", "OpenAIDeployment", "OpenAIService", "ServerMetrics", "app", "build_app",
           "run"]  # fmt: skip
