"""The OpenAI protocol (`specdec.openai_api`) and one replica's app (`specdec.server`)
without Ray: request parsing and its errors, rendering, streamed text release, 503
while loading, and the endpoints over FastAPI's test client."""

import json
import threading
import time

import pytest
from fixtures import tiny_pair

from specdec import LLM, SamplingParams
from specdec.openai_api import (
    APIError,
    ServedModel,
    TextStream,
    parse_chat,
    parse_completion,
)
from specdec.outputs import CompletionOutput, RequestOutput

CTX = ServedModel("m", max_model_len=64, defaults={"temperature": 0.5},
                  render_chat=lambda messages, kw: [5] * (3 * len(messages)))  # fmt: skip


def test_completion_fields_map_to_sampling_params():
    req = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 7, "top_k": 3,
                            "stop": "\n", "seed": 4, "ignore_eos": True}, CTX)  # fmt: skip
    assert req.kind == "completion" and req.prompts == ["hi"] and not req.stream
    p = req.params
    assert (p.max_tokens, p.top_k, p.stop, p.seed, p.ignore_eos) == (7, 3, ("\n",), 4, True)
    assert p.temperature == 0.5  # left out: the model's generation_config default
    assert parse_completion({"model": "m", "prompt": "hi"}, CTX).params.max_tokens == 16


def test_prompt_forms():
    ids = parse_completion({"model": "m", "prompt": [4, 5, 6]}, CTX).prompts
    assert ids == [{"prompt_token_ids": [4, 5, 6]}]
    many = parse_completion({"model": "m", "prompt": ["a", [7, 8]]}, CTX).prompts
    assert many == ["a", {"prompt_token_ids": [7, 8]}]


def test_chat_renders_and_fills_max_tokens():
    msgs = [{"role": "user", "content": "hi"}]
    req = parse_chat({"model": "m", "messages": msgs, "stream": True,
                      "stream_options": {"include_usage": True}}, CTX)  # fmt: skip
    assert req.prompts == [{"prompt_token_ids": [5, 5, 5]}] and req.stream and req.include_usage
    assert req.params.max_tokens == 64 - 3  # what fits in max_model_len
    capped = parse_chat({"model": "m", "messages": msgs, "max_completion_tokens": 5}, CTX)
    assert capped.params.max_tokens == 5


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "x", "prompt": "a"}, "model", "does not exist"),
        ({"model": "m", "prompt": "a", "temperature": -1}, None, "temperature"),
        ({"model": "m", "prompt": "a", "top_p": 2}, None, "top_p"),
        ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens", "positive"),
        ({"model": "m", "prompt": "a", "n": 2}, "n", "n must be 1"),
        ({"model": "m", "prompt": "a", "logprobs": 3}, "logprobs", "not supported"),
        ({"model": "m", "prompt": "a", "presence_penalty": 0.5}, "presence_penalty", "not"),
        ({"model": "m", "prompt": 3}, "prompt", "prompt must be"),
        ({"model": "m", "prompt": "a", "stop": 5}, "stop", "stop must be"),
        ([1, 2], None, "JSON object"),
    ],
)
def test_bad_requests_are_400_with_the_reason(body, param, words):
    with pytest.raises(APIError) as info:
        parse_completion(body, CTX)
    e = info.value
    assert e.status == 400 and words in e.message and e.param == param
    err = e.body()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400


def test_chat_without_template_or_messages():
    no_template = ServedModel("m", 64, {}, None)
    with pytest.raises(APIError, match="no chat template"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}]}, no_template)
    with pytest.raises(APIError, match="messages must be"):
        parse_chat({"model": "m", "messages": []}, CTX)


def _out(text: str, finished: bool) -> RequestOutput:
    reason = "stop" if finished else None
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [2], reason)], finished)


def test_text_stream_holds_back_a_possible_stop_string():
    stream = TextStream(SamplingParams(stop=["END"]))
    deltas = [stream.delta(_out(t, False)) for t in ("ab", "abcE", "abcEN")]
    deltas.append(stream.delta(_out("abcEN", True)))  # the stop string never came: all out
    assert deltas == ["", "ab", "c", "EN"] and "".join(deltas) == "abcEN"


# ----------------------------------------------------------------------------- the app


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("srv"))


def _client(service):
    from fastapi.testclient import TestClient

    from specdec.server import build_app

    return TestClient(build_app(lambda: service))


@pytest.mark.slow
def test_503_while_loading_then_served(model, monkeypatch):
    """A replica answers 503 (an OpenAI error object) until its LLM is loaded."""
    from specdec import api, server

    gate = threading.Event()

    class SlowLLM(api.LLM):
        def __init__(self, *a, **kw):
            gate.wait(60)
            super().__init__(*a, **kw)

    monkeypatch.setattr(api, "LLM", SlowLLM)
    service = server.OpenAIService({"model": str(model), "max_model_len": 64,
                                    "max_num_seqs": 2}, "tiny")  # fmt: skip
    client = _client(service)
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    assert client.get("/health").status_code == 503
    gate.set()
    deadline = time.monotonic() + 120
    while client.get("/health").status_code != 200:
        assert time.monotonic() < deadline, "the replica never became ready"
        time.sleep(0.2)
    body = {"model": "tiny", "prompt": "def f(", "max_tokens": 4, "temperature": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    want = LLM(str(model), max_model_len=64, max_num_seqs=2).generate(
        ["def f("], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    assert r.json()["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    # Malformed JSON and a prompt past max_model_len: 400, and the next request is served.
    bad = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    long = client.post("/v1/completions", json={**body, "prompt": [5] * 80})
    assert long.status_code == 400 and "max_model_len" in long.json()["error"]["message"]
    assert client.post("/v1/completions", json=body).json() ["choices"][0]["text"] == (
        want.outputs[0].text)  # fmt: skip
    metrics = client.get("/metrics").text
    assert 'endpoint="/v1/completions",status="400"} 2' in metrics
    assert 'specdec:request_success_total{model_name="tiny",finished_reason="length"} 2' in metrics
    stream = client.post("/v1/completions", json={**body, "stream": True})
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == want.outputs[0].text
