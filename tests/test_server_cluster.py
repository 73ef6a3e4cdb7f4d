"""`specdec serve --address` joins a running Ray cluster (a `ray start --head` of its
own, with its own auth token), and with `--distributed-executor-backend ray` each
replica runs its draft and target as Ray actors on their own groups: greedy answers
still equal `LLM.generate`.
"""

import os

os.environ.setdefault("RAY_AUTH_MODE", "token")  # explicit, before Ray is imported

import secrets  # noqa: E402
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fixtures import free_port, stop_group, tiny_pair
from test_server import SPEC, wait_ready

from specdec import LLM, SamplingParams

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def env():
    ray_bin = Path(sys.executable).with_name("ray")
    if not ray_bin.exists():
        pytest.skip("the ray CLI is not installed next to this python")
    return dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
                JAX_PLATFORMS="cpu", PATH=f"{ray_bin.parent}:{os.environ['PATH']}")  # fmt: skip


@pytest.fixture(scope="module")
def head(env):
    """A head node; yields its GCS address. Four logical CPUs: the replica (0 CPUs) and
    its draft and target actors (1 each) fit on this 2-core machine."""
    port = free_port()
    temp = tempfile.mkdtemp(prefix="rays", dir="/tmp")  # short: Ray's socket paths must fit
    proc = subprocess.Popen(
        ["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=4",
         "--include-dashboard=false", f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_group(proc, signal.SIGTERM, timeout=10)


def test_serve_joins_the_cluster_with_remote_workers(head, env, tmp_path):
    import openai

    model = tiny_pair(tmp_path / "model")
    port = free_port()
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--model", str(model), "--draft",
         str(model), *SPEC, "--port", str(port), "--address", head,
         "--distributed-executor-backend", "ray", "--replica-cpus", "0", "--max-num-seqs",
         "4", "--max-model-len", "96", "--served-model-name", "tiny"],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, streak=3)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=120)  # fmt: skip
        prompts = ["def fib(n):", "class Point:"]
        greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        want = LLM(str(model), max_model_len=96, max_num_seqs=4).generate(
            prompts, greedy, use_tqdm=False)  # fmt: skip
        for prompt, w in zip(prompts, want, strict=True):
            kw = dict(max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
            r = client.completions.create(model="tiny", prompt=prompt, **kw)
            assert r.choices[0].text == w.outputs[0].text
    except Exception:
        print(log.read_text()[-5000:])
        raise
    finally:
        stop_group(proc, signal.SIGINT)
