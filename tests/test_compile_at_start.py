"""`LLM(compile_at_start=True)`: every program a request can run is compiled before
the first one, so requests of any prompt length, output length and sampling
parameters then run without a single compile."""

import logging

import jax
import numpy as np
import pytest
from fixtures import tiny_pair
from hf_models import write_dflash
from jax import monitoring

from specdec import LLM, SamplingParams

MAX_LEN = 160


class Compiles(logging.Handler):
    """Counts XLA compilations: programs jax compiled because the persistent cache
    (on under compile_at_start) did not hold them. A program loaded from it is not
    a compile (`LLMEngine.compile_shapes` drops compiled programs from memory)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.on = False
        self._last = ""

    def emit(self, record):  # jax logs each program's name under `jax_log_compiles`
        msg = record.getMessage()
        if msg.startswith("Finished XLA compilation of"):
            self._last = msg.split(" in ")[0].removeprefix("Finished XLA compilation of ")
            if self._misses:
                self.names.append(self._last)
                self._misses = 0

    _misses = 0

    def event(self, name, **kw):
        if self.on and name == "/jax/compilation_cache/cache_misses":
            self._misses += 1


_HANDLER = Compiles()
monitoring.register_event_listener(_HANDLER.event)  # listeners cannot be removed: one, reused


@pytest.fixture
def compiles():
    handler, log = _HANDLER, logging.getLogger("jax")
    handler.names.clear()
    handler.on = True
    log.addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        yield handler
    finally:
        handler.on = False
        jax.config.update("jax_log_compiles", False)
        log.removeHandler(handler)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("warm"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "dflash", "ngram", "none"])
def test_no_compile_after_start_up(pair, method, compiles, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # a fresh persistent cache
    jax.clear_caches()  # programs an earlier test left in memory would never reach it
    spec = None if method == "none" else {"method": method, "num_speculative_tokens": 6,
                                           "max_depth": 3, "topk": 2}  # fmt: skip
    if method == "draft_model":
        spec["model"] = str(pair)
    if method == "dflash":  # a random drafter reading both of the target's layers
        write_dflash(tmp_path / "dflash", vocab=320, layers=1, target_layer_ids=(0, 1),
                     num_target_layers=2)  # fmt: skip
        spec["model"] = str(tmp_path / "dflash")
    llm = LLM(pair, max_model_len=MAX_LEN, max_num_seqs=4, speculative_config=spec,
              compile_at_start=True)  # fmt: skip
    assert compiles.names, "start-up compiled nothing"
    compiles.names.clear()
    rng = np.random.default_rng(0)
    lengths = [1, 7, 16, 17, 40, 64, 65, 100, 130, MAX_LEN - 2]
    prompts = [{"prompt_token_ids": rng.integers(1, 300, n).tolist()} for n in lengths]
    params = [
        SamplingParams(temperature=0, max_tokens=MAX_LEN, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=40, ignore_eos=True),
    ]
    outs = llm.generate(prompts, [params[i % 3] for i in range(len(prompts))], use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    assert compiles.names == [], compiles.names


def test_compile_shapes_covers_every_prompt_chunk(pair):
    """The prompt lengths run at start-up hit every chunk program once."""
    from specdec.kernels.runner import chunk_len

    llm = LLM(pair, max_model_len=MAX_LEN, max_num_seqs=2)
    runner = llm.engine.target.runner
    lengths = runner.prefill_shapes(MAX_LEN - 1)
    chunks = {chunk_len(n, runner.prefill_chunk) for n in range(1, MAX_LEN)}
    assert {chunk_len(n, runner.prefill_chunk) for n in lengths} == chunks
    assert len(lengths) == len(chunks)  # prefill_chunk (512) > MAX_LEN: one chunk each
