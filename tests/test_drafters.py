"""Drafters on their own: tree shapes, n-gram lookup by hand, vocabulary checks, sizing."""

import json

import numpy as np
import pytest
from fixtures import noisy_copy, tiny_config, tiny_pair, write_model, write_tokenizer

from specdec import LLM, SamplingParams
from specdec.draft.base import DraftBatch
from specdec.draft.ngram import NgramDrafter
from specdec.sizing import CANDIDATES, plan_tree
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling
from specdec.workers import WidthChooser, narrowest, truncate, verify_widths


def test_ngram_continuations_by_hand():
    # history a b c x y a b c z w a b c (a=1 b=2 c=3 x=4 y=5 z=6 w=7): suffix "a b c"
    # occurred at 5 (then z w a b c) and at 0 (then x y a b c); most recent first.
    d = NgramDrafter(num_slots=1, num_nodes=8, max_depth=3, topk=2, min_n=2, max_n=3)
    hist = [1, 2, 3, 4, 5, 1, 2, 3, 6, 7, 1, 2, 3]
    assert d.continuations(hist) == [[6, 7, 1], [4, 5, 1]]
    d.start([0], [hist[:-1]], [hist[-1]])
    batch = d.propose(np.array([True]), np.array([3]), SamplingBatch.make_dummy(1))
    # Trie: z(0) -> w(1) -> a(2); x(3) -> y(4) -> a(5).
    assert batch.tokens[0, :6].tolist() == [6, 7, 1, 4, 5, 1]
    assert batch.parents[0].tolist() == [-1, 0, 1, -1, 3, 4, -2, -2]


def test_ngram_respects_budget_and_width():
    d = NgramDrafter(num_slots=1, num_nodes=3, max_depth=4, topk=1, min_n=1, max_n=2)
    hist = [9, 1, 2, 3, 4, 9, 1, 5, 6, 9]
    d.start([0], [hist[:-1]], [hist[-1]])
    b = d.propose(np.array([True]), np.array([9]), SamplingBatch.make_dummy(1))
    assert b.num_nodes[0] == 3  # budget
    assert b.parents[0].tolist() == [-1, 0, 1]  # topk=1: a chain (most recent match)
    assert b.tokens[0].tolist() == [1, 5, 6]


def test_verify_widths():
    assert verify_widths(8) == (0, 4, 8)
    assert verify_widths(16) == (0, 4, 8, 16)
    assert verify_widths(12) == (0, 4, 8, 12)
    assert verify_widths(3) == (0, 3)
    assert verify_widths(0) == (0,)


def _trees(*rows, width=8) -> DraftBatch:
    """Rows given as parent lists (tokens = 10 + node index), padded to `width`."""
    b = DraftBatch.empty(len(rows), width)
    for i, parents in enumerate(rows):
        b.parents[i, : len(parents)] = parents
        b.tokens[i, : len(parents)] = 10 + np.arange(len(parents))
    return b


def test_narrowest_takes_the_smallest_width_that_holds_every_active_tree():
    active = np.array([True, True, False])
    b = _trees([], [-1, 0, 1], [-1, 0, 1, 2, 3, 4])  # the inactive row's 6 nodes do not count
    n = narrowest(b, active)
    assert n.tokens.shape == n.parents.shape == (3, 4)
    assert n.parents[1].tolist() == [-1, 0, 1, -2] and n.tokens[1, :3].tolist() == [10, 11, 12]
    assert narrowest(_trees([], [], []), active).tokens.shape == (3, 0)  # nothing: plain decode
    assert narrowest(_trees([-1] * 5, [-1]), np.ones(2, bool)).tokens.shape == (2, 8)
    assert narrowest(b, np.zeros(3, bool)).tokens.shape == (3, 0)


def test_narrowest_slices_draft_probs_and_leaves_device_trees_alone():
    import jax.numpy as jnp

    b = _trees([-1, 0], [-1])
    b.draft_probs = np.arange(2 * 9 * 3, dtype=np.float32).reshape(2, 9, 3)
    b.child_sampling = ChildSampling.IID
    n = narrowest(b, np.ones(2, bool))
    assert n.draft_probs.shape == (2, 5, 3) and n.child_sampling is ChildSampling.IID
    np.testing.assert_array_equal(n.draft_probs, b.draft_probs[:, :5])
    on_device = DraftBatch(jnp.asarray(b.tokens), jnp.asarray(b.parents), None, b.child_sampling)
    assert narrowest(on_device, np.ones(2, bool)) is on_device


def test_truncate_keeps_each_trees_first_nodes():
    b = _trees([-1, 0, 1, -1, 3], [-1, -1])
    b.draft_probs = np.arange(2 * 9 * 3, dtype=np.float32).reshape(2, 9, 3)
    t = truncate(b, 4)
    assert t.parents.tolist() == [[-1, 0, 1, -1], [-1, -1, -2, -2]]
    assert t.tokens[0].tolist() == [10, 11, 12, 13]
    np.testing.assert_array_equal(t.draft_probs, b.draft_probs[:, :5])
    assert truncate(b, 8) is b and truncate(b, 0).tokens.shape == (2, 0)


def test_width_chooser_weighs_nodes_against_cost():
    active = np.array([True, True, False])
    b = _trees([-1, 0, 1, 2, 3, 4], [-1], [-1] * 8)  # 6, 1 and (inactive, not counted) 8
    flat = WidthChooser(lambda w: 1.0)
    assert flat.choose(b.parents, active) == 8  # as cheap as a decode: keep every node
    # cost(4) = 1.5, cost(8) = 3: value(0) = 2, value(4) = (2 + .5 * 5) / 1.5 = 3,
    # value(8) = (2 + .5 * 7) / 3 = 1.83.
    steep = WidthChooser(lambda w: {4: 1.5, 8: 3.0}[w])
    assert steep.choose(b.parents, active) == 4
    dear = WidthChooser(lambda w: 4.0)
    assert dear.choose(b.parents, active) == 0  # (2 + .5 * 7) / 4 < 2
    assert dear.choose(b.parents, np.zeros(3, bool)) == 0
    # A wider width that timed cheaper counts as the narrower one's cost (noise).
    noisy = WidthChooser(lambda w: {4: 1.5, 8: 1.0}[w])
    assert noisy.choose(b.parents, active) == 8  # value(8) = (2 + 3.5) / 1.5 = 3.67


def test_width_chooser_learns_the_acceptance_rate():
    c = WidthChooser(lambda w: 1.0, prior=0.5, learn=0.5, relax=0.5)
    c.observe(verified=10, accepted=1)  # 0.5 -> 0.5 + 0.5 * (0.1 - 0.5)
    assert c.rate == pytest.approx(0.3)
    c.observe(verified=0, accepted=0)  # nothing verified: back towards the prior
    assert c.rate == pytest.approx(0.4)
    low = WidthChooser(lambda w: {4: 1.5, 8: 3.0}[w], prior=0.5, learn=1.0)
    parents = _trees([-1, 0, 1]).parents
    assert low.choose(parents, np.ones(1, bool)) == 4  # (1 + .5 * 3) / 1.5 > 1
    low.observe(verified=3, accepted=0)
    assert low.choose(parents, np.ones(1, bool)) == 0  # nothing accepted: rate 0


def test_width_cost_is_the_faster_librarys_product_ratio(pair, monkeypatch):
    """A model big enough for its products to matter: cost(width) = the faster library's
    seconds at S * (width + 1) rows over its seconds at S rows (one decode step), and
    each row count's library is the faster one there; all decided once, in the plan."""
    from specdec import plan as plan_mod
    from specdec.kernels.config import ModelConfig

    asked = []

    def fake_costs(cfg, dtype, rows):
        asked.append(list(rows))
        return {"default": {2: 1.0, 10: 3.0, 18: 5.0}, "eigen": {2: 0.5, 10: 4.0, 18: 4.5}}

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip
    monkeypatch.setattr(plan_mod.sizing, "weight_bytes", lambda cfg, dtype: 1 << 30)
    monkeypatch.setattr(plan_mod.sizing, "cached_costs", fake_costs)
    plan = plan_mod.make_plan(cfg, dtype="float32", spec=None, num_slots=2, max_tree_nodes=8)
    assert asked == [[2, 10, 18]]  # widths 0, 4 and 8, timed once
    assert plan.width_cost(4) == pytest.approx(3.0 / 0.5)
    assert plan.width_cost(8) == pytest.approx(4.5 / 0.5)
    assert (plan.library(2), plan.library(10), plan.library(18)) == ("eigen", "default", "eigen")
    monkeypatch.setattr(plan_mod.sizing, "weight_bytes", lambda cfg, dtype: 1 << 10)
    small = plan_mod.make_plan(cfg, dtype="float32", spec=None, num_slots=2, max_tree_nodes=8)
    assert small.width_cost(8) == 1.0 and small.library(18) == "default"  # nothing timed
    assert len(asked) == 1
    # The engine reads the plan; it never times anything while serving.
    target = LLM(pair, max_model_len=64, max_num_seqs=2).engine.target
    assert target.widths.cost == target.plan.width_cost


def test_uniforms_are_prefix_stable():
    """A verify at a narrower width draws the same numbers for the nodes it keeps
    (`workers.narrowest`): uniforms(n) must start with uniforms(m) for m < n."""
    s = SamplingBatch.make_dummy(3)
    s.seed[:] = [1, 2, 3]
    s.counter[:] = [0, 5, 9]
    wide = np.asarray(s.uniforms(9))
    for m in (1, 5):
        np.testing.assert_array_equal(np.asarray(s.uniforms(m)), wide[:, :m])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize(
    ("nodes", "depth", "topk"),
    [
        (10, 3, 3),
        *(pytest.param(*s, marks=pytest.mark.slow) for s in [(1, 1, 1), (6, 6, 1), (7, 4, 2)]),
    ],
)
def test_model_drafter_trees_are_valid(pair, nodes, depth, topk):
    spec = {"method": "draft_model", "model": str(pair), "num_speculative_tokens": nodes,
            "max_depth": depth, "topk": topk}  # fmt: skip
    llm = LLM(pair, max_model_len=64, max_num_seqs=2, speculative_config=spec)
    drafter = llm.engine.drafter
    drafter.start([0], [[5, 6, 7]], [8])
    active = np.array([True, False])
    b = drafter.propose(active, np.array([8, 0]), SamplingBatch.make_dummy(2))
    par = b.parents[0]
    assert b.num_nodes[0] == drafter.max_nodes == min(nodes, topk + (depth - 1) * topk**2)
    assert (b.parents[1] == -2).all()  # inactive row is all padding
    depths = []
    for i, p in enumerate(par):
        assert -1 <= p < i  # topological
        depths.append(1 if p == -1 else depths[p] + 1)
    assert max(depths) <= depth
    for parent in set(par.tolist()):  # siblings carry distinct tokens (top-k)
        kids = b.tokens[0][par == parent]
        assert len(set(kids.tolist())) == len(kids) <= topk
    # The greedy chain is always present: depth min(depth, nodes) is reached.
    assert max(depths) == min(depth, nodes)


def test_draft_with_other_tokenizer_is_refused(tmp_path, pair):
    other = tmp_path / "other"
    v = write_tokenizer(other, vocab_size=290)
    write_model(other, tiny_config(v))
    with pytest.raises(ValueError, match=r"draft vocabulary 290 tokens, target 320"):
        LLM(pair, speculative_config={"method": "draft_model", "model": str(other)})


def test_draft_with_padding_rows_is_accepted(tmp_path, pair):
    padded = tmp_path / "padded"
    write_tokenizer(padded)  # the same tokenizer (same corpus, same trainer)
    write_model(padded, tiny_config(384))  # 64 trailing padding rows
    spec = {"method": "draft_model", "model": str(padded), "num_speculative_tokens": 4}
    llm = LLM(pair, max_model_len=64, speculative_config=spec)
    assert llm.engine.drafter.vocab_limit == 320


def test_draft_without_tokenizers_needs_equal_sizes(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_model(a, tiny_config(100))
    write_model(b, tiny_config(120))
    with pytest.raises(ValueError, match=r"draft's vocabulary \(120 tokens\) differs from the "
                                         r"target's \(100\)"):  # fmt: skip
        LLM(a, speculative_config={"method": "draft_model", "model": str(b)})


def test_plan_tree_picks_a_candidate_with_monotone_costs():
    plan = plan_tree(tiny_config(320))
    assert (plan.num_nodes, plan.max_depth, plan.topk) in {c[:3] for c in CANDIDATES}
    costs = [plan.cost[n] for n, *_ in CANDIDATES]
    assert costs == sorted(costs) and costs[0] >= 1.0
    assert plan.score[plan.num_nodes] == max(plan.score.values())
    json.dumps(plan.cost)  # reportable


@pytest.mark.slow
def test_a_tree_no_bigger_than_its_depth_is_grown_as_the_chain(tmp_path):
    """N <= max_depth nodes are the greedy chain's first N whatever topk: the drafter
    grows only that chain, and the steps match a topk=1 chain of depth N."""
    target = tiny_pair(tmp_path / "t")
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in (4, 11)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for n, depth, topk in ((3, 5, 3), (3, 3, 1)):
        spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": n,
                "max_depth": depth, "topk": topk}  # fmt: skip
        llm = LLM(target, max_num_seqs=2, speculative_config=spec)
        assert (llm.engine.drafter.topk, llm.engine.drafter.max_depth) == (1, 3)
        outs = llm.generate(prompts, params, use_tqdm=False)
        m = llm.get_metrics()
        runs.append(([o.outputs[0].token_ids for o in outs], m["num_drafts"],
                     m["num_accepted_tokens"]))  # fmt: skip
    assert runs[0] == runs[1]


@pytest.mark.slow
def test_draft_cache_after_steps_equals_a_fresh_prefill(tmp_path):
    """A drafter keeps its step's K/V (pending tokens, tree levels) in a side buffer and
    writes back what the verdict keeps. After steps with partial acceptance, its
    committed cache must equal a prefill of the same tokens."""
    from specdec.checkpoint import load_model
    from specdec.kernels.runner import ModelRunner

    target = tiny_pair(tmp_path / "t")
    # A draft that agrees with the target often, not always.
    cfg, noisy = load_model(noisy_copy(target, tmp_path / "d", noise=0.4))
    rng = np.random.default_rng(1)
    spec = {"method": "draft_model", "model": str(tmp_path / "d"), "num_speculative_tokens": 7,
            "max_depth": 4, "topk": 2}  # fmt: skip
    llm = LLM(target, max_model_len=96, max_num_seqs=2, speculative_config=spec)
    engine, drafter = llm.engine, llm.engine.drafter
    params_ = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, n in enumerate((5, 11)):
        engine.add_request(f"r{i}", None, rng.integers(0, 300, n).tolist(), params_)
    fresh = ModelRunner(cfg, noisy, num_slots=1, max_len=96)
    for _ in range(8):
        engine.step()
        drafter._flush()  # the write-back otherwise waits for the next `_grow`
        for seq in engine.running:
            c = int(drafter.runner.cache_lens[seq.slot])
            tokens = [*seq.prompt_token_ids, *seq.output_ids][:c]
            fresh.prefill([0], [tokens])
            for got, want in zip(drafter.runner.slot_kv(seq.slot, c), fresh.slot_kv(0, c),
                                 strict=True):  # fmt: skip
                np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    rates = llm.get_metrics()["per_position_acceptance_rate"]
    assert 0 < rates[-1] and rates[0] < 1  # some steps accepted deep, some rejected early
