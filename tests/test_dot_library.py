"""CPU dot libraries (`kernels/dot_library.py`): same answers, measured choice, used."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fixtures import tiny_config, tiny_pair

from specdec import LLM, SamplingParams, sizing, workers
from specdec.checkpoint import load_config
from specdec.kernels import dot_library, transformer, xla_layout
from specdec.kernels.runner import ModelRunner
from specdec.kernels.transformer import init_params, unstack_layers

DEMO_TARGET = Path(sizing.__file__).parent / "assets" / "demo" / "target"


def test_candidates_per_dtype_on_cpu():
    assert dot_library.candidates(jnp.float32) == ("default", "eigen")
    assert dot_library.candidates(jnp.bfloat16) == ("default",)  # Eigen has no bf16 GEMM


def test_only_models_past_the_cache_size_time_libraries():
    demo = load_config(DEMO_TARGET)  # 27M parameters: 109 MB in float32
    assert sizing.libraries(demo, jnp.float32) == ("default", "eigen")
    assert sizing.libraries(demo, jnp.bfloat16) == ("default",)
    assert sizing.libraries(tiny_config(), jnp.float32) == ("default",)
    assert sizing.best_library(tiny_config(), jnp.float32, 9) == "default"  # nothing timed


def test_eigen_copy_compiles_without_ynnpack_and_agrees():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(64, 96)), jnp.float32)
    jits = dot_library.jit_each(lambda x, w: transformer.matmul(x, w))
    text = jits["eigen"].lower(x, w).compile().as_text().lower()
    assert "ynn_fusion" not in text and "dot(" in text  # the option reached the compiler
    np.testing.assert_allclose(jits["eigen"](x, w), jits["default"](x, w), rtol=1e-5, atol=1e-5)


def test_untie_head_gives_the_same_logits():
    cfg = tiny_config(tie_word_embeddings=True)
    params = unstack_layers(init_params(cfg, jax.random.key(0)))
    assert "lm_head" not in params
    untied = xla_layout.untie_head(params)
    np.testing.assert_array_equal(untied["lm_head"], np.asarray(params["embed"]).T)
    assert xla_layout.untie_head(untied) is untied  # idempotent
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 3, cfg.hidden_size)), jnp.float32)
    want = transformer.lm_head(cfg, params, x)
    np.testing.assert_allclose(transformer.lm_head(cfg, untied, x), want, rtol=1e-6, atol=1e-6)
    # The CPU runner streams the [D, V] copy; the stacked (megakernel) layout keeps it tied.
    assert "lm_head" in ModelRunner(cfg, params, num_slots=1, max_len=32).params
    stacked = init_params(cfg, jax.random.key(0))
    assert "lm_head" not in ModelRunner(cfg, stacked, num_slots=1, max_len=32, stacked=True).params


@pytest.mark.parametrize(
    "tied", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["tied", "untied"]
)
def test_one_row_copies_serve_one_row_products_and_only_those(tied):
    cfg = tiny_config(tie_word_embeddings=tied)
    params = xla_layout.untie_head(unstack_layers(init_params(cfg, jax.random.key(0))))
    copies = xla_layout.one_row_copies(params, tied)
    for lp, cp in zip(params["layers"], copies["layers"], strict=True):
        names = [k for k in xla_layout.ONE_ROW_KEYS if k in lp]
        assert names and set(names) <= set(cp["one_row"])
        for k in names:
            np.testing.assert_array_equal(cp["one_row"][k], np.asarray(lp[k]).T)
    head = copies["one_row"]["lm_head"]
    if tied:  # the tied head's [V, D] layout is the embedding itself: no copy
        assert head is params["embed"]
    else:
        np.testing.assert_array_equal(head, np.asarray(params["lm_head"]).T)
    rng = np.random.default_rng(0)
    one = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 1)), jnp.int32)
    layout = xla_layout.XlaLayout()
    np.testing.assert_allclose(
        transformer.prefill_logits(copies, cfg, one, [1], layout),
        transformer.prefill_logits(params, cfg, one, [1]), rtol=1e-5, atol=1e-5,
    )  # fmt: skip
    # One row reads the copies, more rows the originals: spoil the copies to see which.
    spoiled = {**copies, "one_row": {"lm_head": jnp.zeros_like(head)}}
    assert not np.any(transformer.prefill_logits(spoiled, cfg, one, [1], layout))
    # The reference layout never reads them.
    assert np.any(transformer.prefill_logits(spoiled, cfg, one, [1]))
    two = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 2)), jnp.int32)
    np.testing.assert_array_equal(
        transformer.prefill_logits(spoiled, cfg, two, [2], layout),
        transformer.prefill_logits(params, cfg, two, [2], layout),
    )  # fmt: skip
    with pytest.raises(ValueError, match="per-layer params"):
        xla_layout.one_row_copies(init_params(cfg, jax.random.key(0)), tied)


def test_runner_makes_one_row_copies_for_float32_targets():
    cfg = tiny_config()
    params = init_params(cfg, jax.random.key(0))

    def copied(**kw):
        runner = ModelRunner(cfg, params if kw.get("stacked") else {**params}, max_len=32, **kw)
        return "one_row" in runner.params

    assert copied(num_slots=1, one_row=True)
    params_t = ModelRunner(cfg, {**params}, num_slots=1, max_len=32, one_row=True).params
    made = sum(w.nbytes for lp in params_t["layers"] for w in lp["one_row"].values())
    made += params_t["one_row"]["lm_head"].nbytes
    assert made == xla_layout.one_row_copy_bytes(cfg, jnp.float32)
    assert not copied(num_slots=1)  # the drafter's runner
    assert not copied(num_slots=1, one_row=True, stacked=True)  # megakernel layout
    bf16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    assert "one_row" not in ModelRunner(cfg, bf16, num_slots=1, max_len=32,
                                        one_row=True).params  # fmt: skip
    assert "one_row" in workers.TargetWorker(cfg, params, num_slots=1,
                                             max_model_len=32).runner.params  # fmt: skip
    # Steps run over the live rows only: a lone request decodes one row in any slot count.
    assert "one_row" in workers.TargetWorker(cfg, params, num_slots=2,
                                             max_model_len=32).runner.params  # fmt: skip


def test_product_costs_time_one_row_in_the_layout_the_runner_reads(monkeypatch):
    seen = []
    linear = xla_layout.XlaLayout.linear

    def spy(self, p, name, x):
        seen.append((x.shape[0], name in p.get("one_row", {})))
        return linear(self, p, name, x)

    monkeypatch.setattr(xla_layout.XlaLayout, "linear", spy)
    sizing.product_costs(tiny_config(), jnp.float32, [1, 3])
    assert seen and all(has_t for _, has_t in seen)  # float32: copies, read at one row
    seen.clear()
    sizing.product_costs(tiny_config(), jnp.bfloat16, [1])
    assert seen and not any(has_t for _, has_t in seen)


@pytest.mark.slow
def test_verify_step_same_verdict_under_both_libraries(tmp_path):
    """Greedy verdicts and K/V of one tree verify match between the compiled copies."""
    target = tiny_pair(tmp_path / "t")
    llm = LLM(target, dtype="float32", max_num_seqs=2)
    tw = llm.engine.target
    r = tw.runner
    tw.prefill([0, 1], [[5, 6, 7, 8], [9, 10]], llm.engine._sampling(llm.engine.slots))
    r.cache_lens[:2] = [4, 2]
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 300, (2, 6)), jnp.int32)
    parents = jnp.asarray([[-1, 0, 0, 1, 2, 3], [-1, -1, 0, 1, -2, -2]], jnp.int32)
    args = (r.params, r.cache, jnp.asarray([3, 4], jnp.int32), tokens, parents, None,
            jnp.asarray([0, 1], jnp.int32), jnp.asarray(r.cache_lens),
            llm.engine._sampling(llm.engine.slots))  # fmt: skip
    kw = dict(cfg=tw.cfg, child_sampling=workers.ChildSampling.DETERMINISTIC_TOPK, kv_len=128)
    want = workers.VERIFY_STEPS["default"](*args, **kw, layout=r.layout.for_library("default"))
    got = workers.VERIFY_STEPS["eigen"](*args, **kw, layout=r.layout.for_library("eigen"))
    for a, b in zip(want[:3], got[:3], strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(want[3:], got[3:], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def _fake_costs(monkeypatch, tmp_path, eigen_rows_faster_from: int):
    """A cost table where Eigen wins at and above `eigen_rows_faster_from` rows."""
    calls = []

    def fake(cfg, dtype, rows, **kw):
        calls.append(list(rows))
        return {"default": {m: 1e-3 * (1 + m) for m in rows},
                "eigen": {m: 1e-3 * (1 + m) + (-5e-4 if m >= eigen_rows_faster_from else 5e-4)
                          for m in rows}}  # fmt: skip

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sizing, "product_costs", fake)
    monkeypatch.setattr(sizing, "LIBRARY_MIN_BYTES", 0)  # tiny models choose too
    return calls


def test_plan_and_best_library_use_the_faster_library(monkeypatch, tmp_path):
    calls = _fake_costs(monkeypatch, tmp_path, eigen_rows_faster_from=7)
    cfg = tiny_config()
    plan = sizing.cached_plan(cfg, jnp.float32)
    assert plan.library == {5: "default", 8: "eigen", 16: "eigen"}  # bigger cannot win
    # cost(N) = best time at N + 1 rows over the best at one row
    assert plan.cost[8] == pytest.approx((1e-3 * 10 - 5e-4) / 2e-3)
    assert "eigen dot library" in sizing.describe(sizing.plan_from_costs(
        {"default": {1: 1.0, 6: 9.0, 9: 9.0, 17: 9.0, 33: 9.0, 65: 9.0},
         "eigen": {1: 2.0, 6: 2.0, 9: 9.5, 17: 9.5, 33: 9.5, 65: 9.5}}))  # fmt: skip
    assert sizing.best_library(cfg, jnp.float32, 5) == "default"
    assert sizing.best_library(cfg, jnp.float32, 9) == "eigen"
    assert sizing.best_library(cfg, jnp.bfloat16, 9) == "default"  # nothing to choose
    # Timings are remembered: a second lookup times nothing new.
    assert calls == [[1, 6], [9], [17], [5]]  # rows 9 was already timed by the plan
    table = json.loads((tmp_path / "cache" / "product_costs_v2.json").read_text())
    assert set(next(iter(table.values()))) == {"default", "eigen"}
    sizing.best_library(cfg, jnp.float32, 9)
    sizing.cached_plan(cfg, jnp.float32)
    assert len(calls) == 4
    # The same cache folder on another CPU (a home directory that moved) times again.
    monkeypatch.setattr(sizing, "host_cpu", lambda: "Some Other CPU/25/17/0badf1a9")
    sizing.best_library(cfg, jnp.float32, 9)
    assert calls[4:] == [[9]]


@pytest.mark.slow
def test_engine_verifies_with_the_chosen_library(monkeypatch, tmp_path):
    """A tree engine whose verify rows favour Eigen runs the Eigen copy, and greedy
    output still equals plain decoding."""
    _fake_costs(monkeypatch, tmp_path, eigen_rows_faster_from=2)
    target = tiny_pair(tmp_path / "t")
    used = []

    def spy(library, fn):
        def run(*a, **k):
            used.append(library)
            return fn(*a, **k)

        return run

    for library, fn in workers.VERIFY_STEPS.items():
        monkeypatch.setitem(workers.VERIFY_STEPS, library, spy(library, fn))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4,
            "max_depth": 3, "topk": 2}  # fmt: skip
    tree = LLM(target, dtype="float32", max_num_seqs=2, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in tree.generate(prompts, params, use_tqdm=False)]
    # 2 slots x 5 block rows = 10 rows: the plan timed a lone request's 5 (`Plan.library`)
    assert used and set(used) == {"eigen"}
    assert tree.plan.library(10) == tree.plan.library(5) == "eigen"
    used.clear()
    ar = LLM(target, dtype="float32", max_num_seqs=1)
    want = [o.outputs[0].token_ids for o in ar.generate(prompts, params, use_tqdm=False)]
    assert set(used) == {"default"}  # one slot, one row: the default is faster
    assert got == want


def test_auto_plan_stops_timing_once_no_bigger_tree_can_win(monkeypatch, tmp_path):
    """Costs that climb fast: 17, 33 and 65 rows are never timed."""
    timed = []

    def fake(cfg, dtype, rows, **kw):
        timed.extend(rows)
        return {"default": {m: {1: 1.0, 6: 1.2, 9: 3.0, 17: 5.0, 33: 9.0, 65: 17.0}[m]
                            for m in rows}}  # fmt: skip

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(sizing, "product_costs", fake)
    plan = sizing.cached_plan(tiny_config(), jnp.float32)
    # N=5 scores 2.7 / 1.2; N=8 costs 3.0 >= 3.8 / (2.7 / 1.2): nothing bigger can win.
    assert (plan.num_nodes, plan.topk, sorted(plan.cost)) == (5, 2, [5, 8])
    assert sorted(set(timed)) == [1, 6, 9]
    full = sizing.plan_from_costs(fake(None, None, sizing.PLAN_ROWS))
    assert full.num_nodes == plan.num_nodes  # the same pick as timing every candidate


def _bf16_config(folder, **sizes):
    from specdec.checkpoint import config_to_hf

    folder.mkdir()
    hf = config_to_hf(tiny_config(**sizes), torch_dtype="bfloat16")
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


@pytest.mark.parametrize("bf16_cost, expected", [(2.0, "float32"), (0.5, "bfloat16")])
def test_auto_dtype_times_a_bfloat16_checkpoint_on_cpu(monkeypatch, tmp_path, bf16_cost, expected):
    """dtype="auto" with the rows of a step: the dtype whose products time faster."""
    import specdec.plan as plan_mod
    from specdec.params import SpeculativeConfig
    from specdec.plan import resolve_dtype, verify_rows

    def default_dtype(folder, rows=None):
        return resolve_dtype(folder, "auto", rows=rows)

    asked = []

    def fake(cfg, dtype, rows, **kw):
        asked.append((jnp.dtype(dtype).name, list(rows)))
        scale = bf16_cost if jnp.dtype(dtype) == jnp.bfloat16 else 1.0
        # bfloat16 products gain more from rows: at 40 rows it always wins
        return {"default": {m: scale * m * (0.1 if scale != 1.0 and m >= 40 else 1) for m in rows}}

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(sizing, "product_costs", fake)
    big = _bf16_config(tmp_path / "big", hidden_size=1024, intermediate_size=4096, num_heads=8,
                       num_kv_heads=8, head_dim=128)  # fmt: skip  # ~64 MB in float32
    assert default_dtype(big) == "bfloat16"  # no rows: the checkpoint's dtype, nothing timed
    assert asked == []
    assert default_dtype(big, rows=5) == expected
    assert sorted(asked) == [("bfloat16", [5]), ("float32", [5])]
    # float32 only where it is faster both for one request and for a batch
    assert default_dtype(big, rows=(5, 40)) == "bfloat16"
    small = _bf16_config(tmp_path / "small")
    assert default_dtype(small, rows=5) == "bfloat16"  # too small to time
    assert plan_mod.dtype_rows(6, 1) == (6,) and plan_mod.dtype_rows(6, 256) == (6, 48)
    assert verify_rows(None, 8) == 8
    assert verify_rows(SpeculativeConfig(method="draft_model", model="x",
                                          num_speculative_tokens=6), 2) == 14  # fmt: skip
    auto = SpeculativeConfig(method="draft_model", model="x", num_speculative_tokens="auto")
    assert verify_rows(auto, 1) == 1 + sizing.CANDIDATES[0][0]


def test_speculative_config_of_the_wrong_type_is_refused(tmp_path):
    target = tiny_pair(tmp_path / "t")
    with pytest.raises(ValueError, match="speculative_config must be a SpeculativeConfig, a "
                                         "dict of its fields or None, got str"):  # fmt: skip
        LLM(target, speculative_config="draft_model")


def test_each_library_gets_its_layout_explicitly():
    """A program compiled for Eigen copies cached keys out transposed: the layout says
    so as a static argument (nothing is read from ambient state while tracing)."""
    cfg = tiny_config()
    base = xla_layout.for_backend(cfg, "cpu")
    assert base.per_kv_head and base.two_row_bf16 and not base.keys_transposed
    assert base.for_library("eigen").keys_transposed
    assert not base.for_library("default").keys_transposed
    assert not xla_layout.for_backend(cfg, "tpu").for_library("eigen").keys_transposed
    assert base.for_library("eigen") != base  # two compiled copies
    copies = dot_library.jit_each(lambda x: x + 1)
    assert set(copies) == set(dot_library.LIBRARIES)
    assert all(int(f(jnp.int32(1))) == 2 for f in copies.values())


def test_auto_plan_is_sized_for_the_batch(monkeypatch, tmp_path):
    """At batch B a step verifies B trees: cost(N) = time(B * (N + 1)) / time(B). Products
    that cost their bytes up to 17 rows and their flops past them: batch 1 affords
    a 16-node tree, batch 8 the smallest."""
    timed = []

    def fake(cfg, dtype, rows, **kw):
        timed.extend(rows)
        return {"default": {m: max(17, m) for m in rows}}

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(sizing, "product_costs", fake)
    one = sizing.cached_plan(tiny_config(), jnp.float32)
    assert (one.num_nodes, one.topk, one.cost[16]) == (16, 4, 1.0)
    timed.clear()
    eight = sizing.cached_plan(tiny_config(), jnp.float32, batch=8)
    assert (eight.num_nodes, eight.topk) == (5, 2)
    assert eight.cost[5] == pytest.approx(48 / 17)  # 8 trees of 6 rows over 8 decode rows
    assert timed == [8, 48, 72]  # then no bigger tree can win
    assert "at 8 sequences a step" in sizing.describe(eight)
    assert "at 1 sequence a step" in sizing.describe(one)
