"""A speculative step in-process costs three jitted dispatches: grow, verify, commit.

Counts calls of the module-level jitted functions the engine reaches (the draft's
K/V commit runs inside the next `_grow`, so it adds none).
"""

import collections
import functools

import numpy as np
import pytest
from fixtures import tiny_pair

from specdec import LLM, SamplingParams, workers
from specdec.draft import model as draft_model
from specdec.kernels import transformer


@pytest.mark.slow
def test_three_dispatches_per_step(tmp_path, monkeypatch):
    target = tiny_pair(tmp_path / "t")
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 8,
            "max_depth": 4, "topk": 2}  # fmt: skip
    llm = LLM(target, max_model_len=96, max_num_seqs=4, speculative_config=spec)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in (3, 9, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)  # compile

    calls = collections.Counter()

    def wrap(name, fn):
        @functools.wraps(fn)
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    def counted(module, name):
        monkeypatch.setattr(module, name, wrap(name, getattr(module, name)))

    counted(draft_model, "_grow")
    for library, fn in workers.VERIFY_STEPS.items():  # one jitted copy per dot library
        monkeypatch.setitem(workers.VERIFY_STEPS, library, wrap("verify_step", fn))
    counted(workers, "commit_path")
    counted(transformer, "commit_kv")
    counted(transformer, "write_kv")  # the draft's K/V write-back, if it ran on its own
    # Admission (prefill) is not a step: start every request, then count only steps.
    for i, p in enumerate(prompts):
        llm.engine.add_request(f"d{i}", None, p["prompt_token_ids"], params)
    llm.engine.step()  # admits and runs the first step
    calls.clear()
    steps = 0
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        steps += 1
    assert steps > 2
    assert calls["verify_step"] == calls["_grow"] == calls["commit_path"] == steps
    # The draft's commit (writing back its side K/V) rode along in `_grow`.
    assert calls["commit_kv"] == calls["write_kv"] == 0
