"""The paged KV cache: the paged forward equals the slot cache's, the block
bookkeeping, the budget, and the engine's admission and preemption (requests wait
or are recomputed, never lose output), plus steps over the live rows only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import noisy_copy, tiny_pair
from mock_engine import MockDrafter, MockTarget, next_token

from specdec import LLM, SamplingParams
from specdec.engine import LLMEngine
from specdec.kernels import blocks
from specdec.kernels import transformer as T
from specdec.kernels.config import ModelConfig
from specdec.kernels.runner import live_rows, row_bucket

CFG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)  # fmt: skip


SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "block_size", [4, pytest.param(8, marks=SLOW), pytest.param(32, marks=SLOW)]
)
def test_paged_forward_equals_the_slot_cache(block_size):
    """Prefill, decode and a tree block over rows in shuffled slot order, with a
    padding row, on a shuffled block table: logits equal the contiguous cache's."""
    params = T.init_params(CFG, jax.random.key(0))
    s_count, max_len = 3, 64
    nb = max_len // block_size
    contiguous = T.KVCache.create(CFG, s_count, max_len)
    paged = T.PagedKVCache.create(CFG, s_count, max_len, block_size=block_size,
                                  num_blocks=1 + s_count * nb)  # fmt: skip
    rng = np.random.default_rng(block_size)
    table = rng.permutation(np.arange(1, 1 + s_count * nb)).reshape(s_count, nb)
    paged = T.PagedKVCache(
        paged.k.at[:].set(jnp.nan), paged.v.at[:].set(jnp.nan), jnp.asarray(table, jnp.int32)
    )  # NaN wherever nothing was written
    slots = jnp.asarray([2, -1, 0], jnp.int32)
    lens = np.zeros(3, np.int32)
    for n in (13, 1, 6, 1):
        toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (3, n)), jnp.int32)
        cl = jnp.asarray(lens)
        pos = cl[:, None] + jnp.arange(n)[None]
        mask = T.causal_block_mask(jnp.full((3,), n, jnp.int32), n)
        want, contiguous = T.forward_block(params, contiguous, toks, pos, mask, slots, cl, cfg=CFG)
        got, paged = T.forward_block(params, paged, toks, pos, mask, slots, cl, cfg=CFG, kv_len=32)
        live = np.asarray(slots) >= 0
        np.testing.assert_allclose(np.asarray(got)[live], np.asarray(want)[live], atol=1e-5)
        lens += n


def test_allocator_takes_and_returns_blocks():
    a = blocks.BlockAllocator(num_blocks=6, block_size=4, num_slots=2, max_blocks=8)
    assert a.num_free == 5  # block 0 is the null block
    a.ensure(0, 9)  # 3 blocks
    assert a.held[0] == 3 and 0 not in a.table[0, :3] and a.num_free == 2
    v = a.version
    a.ensure(0, 12)  # still 3 blocks: nothing changes
    assert a.version == v
    with pytest.raises(blocks.CacheFull, match="needs 3 more KV blocks, 2 are free"):
        a.ensure(1, 12)
    a.free(0)
    assert a.num_free == 5 and (a.table[0] == 0).all() and a.held[0] == 0
    a.ensure(1, 20)
    assert sorted(a.table[1, :5]) == [1, 2, 3, 4, 5]


def test_budget_buys_blocks_and_refuses_less_than_one_sequence():
    tb = 1024  # bytes per token
    assert blocks.num_blocks_for(None, tb, num_slots=4, max_len=100) == 4 * 7 + 1
    assert blocks.num_blocks_for(64 * 16 * tb, tb, num_slots=256, max_len=100) == 64
    assert blocks.num_blocks_for(10**12, tb, num_slots=2, max_len=100) == 2 * 7 + 1  # capped
    with pytest.raises(ValueError, match="one sequence of max_model_len needs 8"):
        blocks.num_blocks_for(5 * 16 * tb, tb, num_slots=2, max_len=100)


def test_live_rows_pad_to_a_power_of_two():
    active = np.zeros(256, bool)
    active[[3, 5, 9]] = True
    assert live_rows(active, 256).tolist() == [3, 5, 9, -1]
    assert live_rows(np.zeros(8, bool), 8).tolist() == [-1]
    assert [row_bucket(n, 6) for n in (1, 2, 3, 5, 6)] == [1, 2, 4, 6, 6]


# ----------------------------------------------------------------------------- engine (mock)


def mock_engine(blocks_, slots=8, drafter=True, block_size=4, max_len=64):
    target = MockTarget(100, slots, capacity=(block_size, blocks_, max_len))
    draft = MockDrafter(100, slots, 3, 3) if drafter else None
    return LLMEngine(target, None, max_num_seqs=slots, max_model_len=max_len, drafter=draft,
                     vocab_size=100)  # fmt: skip


def rule(last, n):
    out = []
    for _ in range(n):
        last = next_token(last, 100)
        out.append(last)
    return out


@pytest.mark.parametrize("drafter", [True, False], ids=["spec", "plain"])
def test_requests_wait_for_blocks_and_preempted_ones_resume_exactly(drafter):
    """A pool too small for every request at once: requests wait in order, the latest
    admitted are preempted as the others grow, and every output is the rule's."""
    eng = mock_engine(blocks_=14, drafter=drafter)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[i + 1] * (5 + i) for i in range(6)]
    seqs = [eng.add_request(str(i), None, p, params) for i, p in enumerate(prompts)]
    most_running = 0
    decode = eng._decode

    def checked(active):  # every step fits the pool when it runs
        assert eng.kv_blocks_used() <= eng.num_blocks
        return decode(active)

    eng._decode = checked
    while eng.has_unfinished_requests():
        eng.step()
        most_running = max(most_running, len(eng.running))
    for seq, p in zip(seqs, prompts, strict=True):
        assert seq.output_ids == rule(p[-1], 20)
        assert seq.finish_reason == "length"
    assert 1 < most_running < 6
    assert eng.num_preemptions > 0
    # A preempted request's prompt was prefilled again with its output but the last token.
    resumed = [s for s in seqs if s.num_preemptions]
    assert resumed


def test_first_come_first_served():
    """The head of the queue is never overtaken by a smaller request behind it."""
    eng = mock_engine(blocks_=10, drafter=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    big = eng.add_request("big", None, [1] * 30, params)  # 8 blocks of 4 with its growth
    eng.add_request("huge", None, [2] * 30, params)
    small = eng.add_request("small", None, [3], params)
    eng.step()
    assert [s.request_id for s in eng.running] == ["big"]
    assert small.slot == -1 and big.slot >= 0


# ----------------------------------------------------------------------------- engine (model)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("paged")
    target = tiny_pair(root / "t")
    return target, noisy_copy(target, root / "d", noise=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "draft_model"])
def test_a_tight_budget_gives_the_same_tokens(pair, method):
    """Greedy outputs with a cache that holds about two requests (so others wait and
    some are preempted) equal those of a cache that holds them all."""
    target, draft = pair
    spec = (
        None
        if method == "none"
        else {
            "method": "draft_model",
            "model": str(draft),
            "num_speculative_tokens": 4,
            "max_depth": 3,
            "topk": 2,
        }
    )
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 300, int(n)).tolist()}
               for n in rng.integers(5, 40, 7)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = LLM(target, max_model_len=96, max_num_seqs=8, speculative_config=spec)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    per_token = roomy.engine.target.runner.token_bytes
    if spec is not None:
        per_token += roomy.engine.drafter.runner.token_bytes
    tight = LLM(
        target,
        max_model_len=96,
        max_num_seqs=8,
        speculative_config=spec,
        kv_cache_memory=per_token * 16 * 16,
    )  # 16 blocks: about two requests at a time
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert tight.engine.num_blocks == 15
    assert tight.engine.num_preemptions > 0


def test_one_request_steps_over_one_row(pair, monkeypatch):
    """A default-size LLM (256 slots) runs a lone request's steps over one row, and its
    cache holds just that request's blocks."""
    from specdec import workers

    target, _ = pair
    llm = LLM(target, max_model_len=96)
    assert llm.max_num_seqs == 256
    rows = []
    real = workers.VERIFY_BACKENDS["xla"]
    monkeypatch.setitem(workers.VERIFY_BACKENDS, "xla",
                        lambda r, roots, tree, slots, *a: rows.append(len(slots)) or
                        real(r, roots, tree, slots, *a))  # fmt: skip
    llm.engine.target._verify = workers.VERIFY_BACKENDS["xla"]
    seen = []
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    llm.engine.add_request("a", None, list(range(3, 33)), params)
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        seen.append(int(llm.engine.target.runner.blocks.held.sum()))
    assert set(rows) == {1}
    bs = llm.engine.block_size
    assert max(seen) <= -(-(30 + 20 + 2) // bs)  # prompt + output + one step's growth
    assert llm.engine.target.runner.blocks.num_free == llm.engine.num_blocks
