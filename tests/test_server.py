"""`specdec serve` end to end: Ray Serve on loopback, the official `openai` client.

One server for the module (`python -m specdec.cli serve`, 2 replicas, tree
speculation with a draft, in its own process group and its own Ray, with its own
auth token), checked against `LLM.generate` in this process: completions, chat and
streaming; 32 concurrent clients; bad requests; metrics; a replica killed mid-request.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")  # explicit, before Ray is imported

import json  # noqa: E402
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from fixtures import free_port, stop_group, tiny_pair

from specdec import LLM, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPEC = ["--num-speculative-tokens", "6", "--max-depth", "3", "--topk", "2"]
MAX_LEN, SEQS = 128, 8


def get(url: str, timeout: float = 5):
    """(status, body) of a GET; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_ready(base: str, proc, timeout: float = 300, streak: int = 16) -> None:
    """Until `streak` health checks in a row answer 200: with 2 replicas, one still
    loading (503) would show within 16 checks but for a 2^-16 chance."""
    deadline, ok = time.monotonic() + timeout, 0
    while ok < streak:
        if proc.poll() is not None:
            raise RuntimeError(f"specdec serve exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError("specdec serve did not become ready")
        try:
            ok = ok + 1 if get(f"{base}/health")[0] == 200 else 0
        except OSError:
            ok = 0
        time.sleep(0.25 if ok else 1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tiny_pair(tmp_path_factory.mktemp("served"))
    (root / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=secrets.token_hex(16))  # fmt: skip
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", str(model), "--draft",
         str(model), *SPEC, "--port", str(port), "--num-replicas", "2", "--max-num-seqs",
         str(SEQS), "--max-model-len", str(MAX_LEN), "--served-model-name", "tiny"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: stopped below by that group's id
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        yield base
    except Exception:
        print(log.read_text()[-5000:])
        raise
    finally:
        stop_group(proc, signal.SIGINT)


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model):
    """The same model in this process, plain decoding: what greedy responses must equal."""
    return LLM(str(model), max_model_len=MAX_LEN, max_num_seqs=SEQS)


PROMPTS = ["def fib(n):", "class Point:", "for i in range(", "import os\n", "x = [", "print("]


def test_completions_chat_and_streaming_equal_llm_generate(client, reference):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].text for o in reference.generate(PROMPTS, greedy, use_tqdm=False)]
    extra = {"ignore_eos": True}
    for prompt, text in zip(PROMPTS, want, strict=True):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body=extra)  # fmt: skip
        assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
        assert r.usage.completion_tokens == 12
        s = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      stream=True, extra_body=extra)  # fmt: skip
        assert "".join(c.choices[0].text for c in s) == text
    messages = [{"role": "user", "content": "say hello"}]
    want_chat = reference.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                       temperature=0, extra_body=extra)  # fmt: skip
    assert r.choices[0].message.content == want_chat and r.choices[0].message.role == "assistant"
    s = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                       temperature=0, stream=True, extra_body=extra,
                                       stream_options={"include_usage": True})  # fmt: skip
    chunks = list(s)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage.completion_tokens == 12
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_32_concurrent_clients_4_requests_each(client, reference):
    rng_prompts = [f"{PROMPTS[i % len(PROMPTS)]}{i}" for i in range(32 * 4)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].text for o in reference.generate(rng_prompts, greedy, use_tqdm=False)]

    def worker(c: int) -> list[str]:
        texts = []
        for j in range(4):
            prompt = rng_prompts[4 * c + j]
            kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0,
                      extra_body={"ignore_eos": True})  # fmt: skip
            if (c + j) % 2:
                texts.append(
                    "".join(x.choices[0].text for x in client.completions.create(stream=True, **kw))
                )
            else:
                texts.append(client.completions.create(**kw).choices[0].text)
        return texts

    with ThreadPoolExecutor(32) as pool:
        got = [t for texts in pool.map(worker, range(32)) for t in texts]
    assert len(got) == len(want)
    bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
    assert not bad, f"requests {bad} differ from LLM.generate"


def _post(server: str, path: str, data: bytes):
    req = urllib.request.Request(f"{server}{path}", data=data,
                                 headers={"content-type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"model": "gpt-4", "prompt": "x"}, "does not exist"),
        ({"model": "tiny", "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "tiny", "prompt": [5] * (MAX_LEN + 10)}, "max_model_len"),
        (b"{'not': json", "not valid JSON"),
    ],
)
def test_bad_request_gets_400_and_the_server_goes_on(server, body, words):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = _post(server, "/v1/completions", data)
    assert status == 400 and words in answer["error"]["message"], answer
    assert answer["error"]["type"] == "invalid_request_error"
    good = {"model": "tiny", "prompt": "def f(", "max_tokens": 3}
    assert _post(server, "/v1/completions", json.dumps(good).encode())[0] == 200


def test_metrics_carry_the_speculative_counters(server, client):
    client.completions.create(model="tiny", prompt="def fib(n):", max_tokens=8, temperature=0)
    seen = ""
    for _ in range(10):  # each scrape reaches one replica: look at both
        seen += get(f"{server}/metrics")[1]
    for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "e2e_request_latency_seconds_bucket",
                 "request_success_total"):  # fmt: skip
        assert f"specdec:{name}{{" in seen, name
    assert (
        'specdec:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'
        in seen
    )


def _scrape(server: str, name: str, times: int = 12) -> list[float]:
    """`name`'s value in each of `times` scrapes (each reaches one replica)."""
    values = []
    for _ in range(times):
        for line in get(f"{server}/metrics")[1].splitlines():
            if line.startswith(f"specdec:{name}{{"):
                values.append(float(line.rsplit(" ", 1)[1]))
    return values


def test_a_client_that_disconnects_frees_its_slot(server):
    body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 110, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    before = sum(set(_scrape(server, "request_aborted_total")))
    req = urllib.request.Request(f"{server}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=60) as r:
        r.readline()  # running; then the client goes away
    deadline = time.monotonic() + 30
    while sum(set(_scrape(server, "request_aborted_total"))) <= before:
        assert time.monotonic() < deadline, "the disconnected request was never aborted"
        time.sleep(0.5)
    assert max(_scrape(server, "num_requests_running")) == 0


def test_replica_killed_mid_request_fails_that_request_not_the_next(server, client):
    import openai

    stream = client.completions.with_raw_response.create(
        model="tiny", prompt="def fib(n):", max_tokens=100, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    pid = int(stream.headers["x-specdec-replica-pid"])
    chunks = stream.parse()
    next(iter(chunks))  # the request is running on that replica
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises((openai.APIError, Exception)) as info:  # noqa: B017 - any error, not a hang
        for _ in chunks:
            pass
        raise AssertionError("the stream ended normally although its replica was killed")
    assert not isinstance(info.value, AssertionError), info.value
    print(f"killed replica {pid}: the client got {type(info.value).__name__}: {info.value}")
    assert time.monotonic() - started < 60
    r = client.completions.create(model="tiny", prompt="class A:", max_tokens=4, temperature=0)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1
