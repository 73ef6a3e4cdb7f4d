"""`ray job submit` against a local head: a good job SUCCEEDS, a missing model FAILS with 1.

Starts its own head (`ray start --head --block` on 127.0.0.1, in its own
process group, stopped by signalling that group: never `ray stop`, which would
stop every Ray process on the machine). The auth mode is set explicitly for
both the head and the CLI.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")  # explicit, before Ray is imported

import json  # noqa: E402
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from fixtures import free_port, stop_group, tiny_pair

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = "http://127.0.0.1:8265"


@pytest.fixture(scope="module")
def env():
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip("the ray CLI is not installed next to this python")
    return dict(os.environ, RAY_AUTH_MODE=os.environ.get("RAY_AUTH_MODE", "token"),
                JAX_PLATFORMS="cpu", PATH=f"{ray_bin.parent}:{os.environ['PATH']}")  # fmt: skip


@pytest.fixture(scope="module")
def head(env):
    temp = tempfile.mkdtemp(prefix="rayh", dir="/tmp")  # short: Ray's socket paths must fit
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={free_port()}",
         "--dashboard-host=127.0.0.1", "--dashboard-port=8265",
         "--include-dashboard=true", "--num-cpus=2", f"--temp-dir={temp}",
         "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: stopped below by that group's id
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{DASHBOARD}/api/version", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # answering, if only to refuse an unauthenticated probe
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ray head did not start:\n{proc.stdout.read()}") from None
                time.sleep(1)
        yield
    finally:
        stop_group(proc, signal.SIGTERM, timeout=5)


def submit(env, job_args: list[str]):
    """Submits with the CLI and waits; returns (JobInfo, logs)."""
    sid = f"specdec-{uuid.uuid4().hex[:8]}"
    runtime = json.dumps({"env_vars": {"JAX_PLATFORMS": "cpu"}})
    subprocess.run(
        ["ray", "job", "submit", "--address", DASHBOARD, "--submission-id", sid,
         "--working-dir", ".", "--runtime-env-json", runtime, "--",
         "python", "-m", "specdec.cluster.job", *job_args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(DASHBOARD)
    info = client.get_job_info(sid)
    return info, client.get_job_logs(sid)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("job")
    model = tiny_pair(root / "model")
    texts = ["def fib(n):", "class Point:", "for i in", "hello", "x = ", "print("]
    rows = [{"id": f"q{i}", "prompt": p} for i, p in enumerate(texts)]
    rows.append({"id": "q6", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model, prompts, rows


def test_job_submit_succeeds(head, env, work):
    root, model, prompts, rows = work
    out = root / "out"
    info, logs = submit(env, [
        "--model", str(model), "--draft", str(model), "--num-speculative-tokens", "6",
        "--max-depth", "3", "--topk", "2", "--input", str(prompts), "--output", str(out),
        "--max-tokens", "8", "--ignore-eos", "--target-devices", "2", "--no-progress",
    ])  # fmt: skip
    assert info.status == "SUCCEEDED", f"{info.message}\n{logs[-3000:]}"
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in results) == sorted(r["id"] for r in rows)
    for r in results:
        if r["id"] == "q6":  # the fixture tokenizer has no chat template: a per-row error
            assert "error" in r
            continue
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == 8
        assert isinstance(r["text"], str) and r["metrics"]["num_output_tokens"] == 8
    summary = json.loads((out / "summary.json").read_text())
    assert summary["target"]["devices"] == ["cpu:0", "cpu:1"]
    assert summary["overlap"]["hits"] > 0  # draft == target: the guesses hit


def test_job_with_missing_model_fails(head, env, work):
    root, _, prompts, _ = work
    info, logs = submit(env, ["--model", str(root / "nope"), "--input", str(prompts),
                                "--output", str(root / "out2")])  # fmt: skip
    assert info.status == "FAILED", info.message
    assert info.driver_exit_code == 1 and "exit code 1" in info.message
    assert f"error: Model folder '{root / 'nope'}' does not exist." in logs
