"""One `LLM`, many threads: requests of concurrent callers join one running batch and
every caller gets exactly what a sequential run gives it."""

import dataclasses
import threading
from pathlib import Path

import pytest
from fixtures import tiny_pair

from specdec import LLM, SamplingParams

DEMO = Path(__file__).resolve().parent.parent / "specdec" / "assets" / "demo"
CODE = ["def fib(n):", "class Point:", "import os\n", "for i in range(", "def main():",
        "    return self.", "if __name__ ==", "with open(", "try:\n    ", "from typing import",
        "def __init__(self", "x = [", "@property\ndef", "raise ValueError(", "while True:",
        "# parse the", "async def fetch(", "lambda x:", "print(f\"", "assert len("]  # fmt: skip


def run_threads(llm: LLM, batches: list, params: list) -> list:
    """`llm.generate(batches[i], params[i])` on one thread each, started together."""
    results: list = [None] * len(batches)
    errors: list = []
    start = threading.Barrier(len(batches))

    def work(i):
        try:
            start.wait()
            results[i] = llm.generate(batches[i], params[i], use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert all(r is not None for r in results)
    return results


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.slow
def test_four_threads_of_five_prompts_equal_the_sequential_run():
    """Bundled pair (float32: a bfloat16 near-tie may round differently in another
    batch), its greedy defaults with the repetition penalty, and seeded sampling."""
    spec = {"method": "draft_model", "model": str(DEMO / "draft")}
    llm = LLM(DEMO / "target", dtype="float32", speculative_config=spec)
    greedy = dataclasses.replace(llm.get_default_sampling_params(), temperature=0, max_tokens=12)
    assert greedy.repetition_penalty == 1.2
    batches = [[p + " " * (i % 3) for p in CODE[5 * i :][:5]] for i in range(4)]
    for sampled in (False, True):
        params = [
            [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=100 * i + j)
             for j in range(5)] if sampled else greedy
            for i in range(4)
        ]  # fmt: skip
        sequential = [
            token_ids(llm.generate(b, p, use_tqdm=False))
            for b, p in zip(batches, params, strict=True)
        ]
        concurrent = [token_ids(r) for r in run_threads(llm, batches, params)]
        assert concurrent == sequential, f"sampled={sampled}"
        assert not llm.has_unfinished_requests()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("conc"))


@pytest.mark.slow
def test_threads_streams_and_the_request_api_share_one_engine(pair):
    spec = {"method": "draft_model", "model": str(pair), "num_speculative_tokens": 4}
    llm = LLM(pair, max_model_len=64, max_num_seqs=4, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 9, 3 * i + 1]} for i in range(6)]
    want = token_ids(llm.generate(prompts, params, use_tqdm=False))
    streamed: list = []

    def stream():
        for _, out in llm.generate_stream(prompts[0], params):
            streamed.append(out)

    rid = llm.add_request(prompts[1], params, request_id="api")
    with pytest.raises(ValueError, match="request_id 'api' is already running"):
        llm.add_request(prompts[1], params, request_id="api")
    t = threading.Thread(target=stream)
    t.start()
    got = run_threads(llm, [prompts[2:4], prompts[4:]], [params, params])
    t.join(timeout=300)
    outs = {}
    while llm.has_unfinished_requests() or not outs:
        for out in llm.step():
            outs[out.request_id] = out
    assert outs[rid].finished and outs[rid].outputs[0].token_ids == want[1]
    assert streamed[-1].finished and streamed[-1].outputs[0].token_ids == want[0]
    assert token_ids(got[0]) + token_ids(got[1]) == want[2:]
    assert llm.step() == []  # a finished request is reported once
