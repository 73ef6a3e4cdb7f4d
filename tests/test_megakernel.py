"""The verify megakernel (Pallas interpret mode on CPU) against its plain-jnp reference.

Grid: dtype {f32, bf16} x tree {chain 8, tree 16, tree 64} x kv_heads {1, 2, 4} x
context {0, 100, 1000}. To compile each kernel once per (dtype, kv_heads), every tree
is padded to 64 nodes and the nine (tree, context) cases are the nine rows of one
batch; each test id then checks its own row. Unused cache positions are NaN, so a
stray read of one poisons the logits.

Tree tokens are built from the reference's own argmax (a fixed point: a designated
child takes the argmax at its parent), so paths are accepted deep and duplicate
sibling tokens occur (the first one must win). The LM head is scaled x10 so logits
are O(1) and the bf16 argmax margins dwarf the kernel-vs-reference differences.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import transformer as T
from specdec.kernels.config import Architecture, ModelConfig
from specdec.kernels.megakernel import BlockSizes, kernel, reference, tuning
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

TOPK = ChildSampling.DETERMINISTIC_TOPK
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
LOGIT_TOL = {"f32": 1e-4, "bf16": 5e-2}
KV_TOL = {"f32": 1e-5, "bf16": 2e-2}
TREES = ("chain8", "tree16", "tree64")
CONTEXTS = (0, 100, 1000)
NODES = 64  # every tree is padded to this many nodes
MAX_LEN = 1152  # cache positions per slot: >= 1000 + 65, a multiple of 128
# Several tiles per stream: 1-4 qkv tiles, 2 wo tiles, 2 MLP tiles, a vocab tile plus a
# 128-column tail, 8 KV tiles at context 1000.
# Rings deeper than two: what the engine's own choice (`tuning.step_block_sizes`) runs.
BLOCKS = BlockSizes(proj_cols=32, out_rows=64, mlp_cols=128, vocab_cols=256, kv_rows=128,
                    weight_ring=3, mlp_ring=4)  # fmt: skip


def model(dtype, kv_heads: int, **overrides) -> tuple[ModelConfig, dict]:
    kw = dict(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=kv_heads, head_dim=32,
    )  # fmt: skip
    cfg = ModelConfig(**(kw | overrides))
    params = T.init_params(cfg, jax.random.key(kv_heads), jnp.float32)
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    params[head] = params[head] * 10.0
    if cfg.attention_bias:  # zero biases would test nothing
        for name in ("bq", "bk", "bv"):
            params["layers"][name] = 0.1 * jax.random.normal(
                jax.random.key(7), params["layers"][name].shape
            )
    return cfg, jax.tree.map(lambda x: x.astype(dtype), params)


def nan_cache(cfg, dtype, slots, lens, num_slots, max_len=MAX_LEN, seed=0) -> T.KVCache:
    """Random committed K/V at positions [0, lens[b]) of slots[b]; NaN everywhere else."""
    shape = (cfg.num_layers, num_slots, cfg.num_kv_heads, max_len, cfg.head_dim)
    live = np.zeros((num_slots, max_len), bool)
    for s, n in zip(slots, lens, strict=True):
        if s >= 0:
            live[s, :n] = True
    live = live[None, :, None, :, None]
    k, v = jax.random.normal(jax.random.key(seed), (2, *shape))
    nan = jnp.full(shape, jnp.nan)
    return T.KVCache(
        k=jnp.where(live, k, nan).astype(dtype), v=jnp.where(live, v, nan).astype(dtype)
    )


def copy_cache(cache: T.KVCache) -> T.KVCache:
    return jax.tree.map(jnp.copy, cache)  # the calls donate their cache


def chain(n: int) -> np.ndarray:
    return np.arange(-1, n - 1, dtype=np.int32)


def random_tree(rng, n: int) -> np.ndarray:
    """Topological parents with a bias to recent nodes, so trees get deep."""
    return np.array([-1] + [rng.integers(max(-1, i - 4), i) for i in range(1, n)], np.int32)


def pad_tree(parents: np.ndarray, n: int = NODES) -> np.ndarray:
    return np.concatenate([parents, np.full(n - len(parents), -2, np.int32)])


def matched_tokens(run_reference, roots, parents, designated, rng, vocab) -> np.ndarray:
    """Tokens where each designated node is the argmax at its parent (a fixed point).

    A node's token changes only its descendants' logits, so `depth` passes converge.
    """
    tokens = rng.integers(0, vocab, parents.shape).astype(np.int32)
    for _ in range(NODES):
        argmax = np.asarray(jnp.argmax(run_reference(tokens).logits, axis=-1))
        at_parent = np.take_along_axis(argmax, np.maximum(parents + 1, 0), axis=1)
        new = np.where(designated, at_parent, tokens).astype(np.int32)
        if np.array_equal(new, tokens):
            return tokens
        tokens = new
    raise AssertionError("token fixed point did not converge")


def grid_rows(rng, cases):
    """Padded parents and designated-match masks for (tree, context) rows: chain8 rows
    match at nodes 0..5 (6 accepted, bonus at node 5), random trees at ~70% of nodes."""
    parents, designated = [], []
    for tree, _ in cases:
        if tree == "chain8":
            p, d = chain(8), np.arange(8) < 6
        else:
            p = random_tree(rng, 16 if tree == "tree16" else 64)
            d = rng.random(len(p)) < 0.7
        parents.append(pad_tree(p))
        designated.append(np.concatenate([d, np.zeros(NODES - len(d), bool)]))
    return np.stack(parents), np.stack(designated)


def reference_case(cfg, params, dtype, cases, rng, max_len=MAX_LEN) -> SimpleNamespace:
    """One batch of `cases` rows: NaN-padded cache (one slot left unused), trees whose
    designated nodes match the reference's argmax, and the reference's result."""
    parents, designated = grid_rows(rng, cases)
    b = len(cases)
    lens = np.array([ctx for _, ctx in cases], np.int32)
    slots = rng.permutation(b + 1)[:b].astype(np.int32)  # one slot stays unused (all NaN)
    roots = rng.integers(0, cfg.vocab_size, b).astype(np.int32)
    cache = nan_cache(cfg, dtype, slots, lens, b + 1, max_len=max_len)
    sampling = SamplingBatch.make_dummy(b)
    uniforms = np.zeros((b, NODES + 1), np.float32)

    def run_reference(tokens):
        return reference.verify(
            params, copy_cache(cache), roots, tokens, parents, None, slots, lens, sampling,
            uniforms, cfg=cfg, child_sampling=TOPK,
        )  # fmt: skip

    tokens = matched_tokens(run_reference, roots, parents, designated, rng, cfg.vocab_size)
    return SimpleNamespace(
        cache=cache, roots=roots, tokens=tokens, parents=parents, slots=slots, lens=lens,
        sampling=sampling, uniforms=uniforms, ref=run_reference(tokens),
    )  # fmt: skip


@functools.cache
def grid_case(dtype_name: str, kv_heads: int) -> dict:
    """Reference and kernel results for the nine (tree, context) rows of one model."""
    dtype = DTYPES[dtype_name]
    cfg, params = model(dtype, kv_heads)
    cases = [(tree, ctx) for tree in TREES for ctx in CONTEXTS]
    c = reference_case(cfg, params, dtype, cases, np.random.default_rng(kv_heads))
    cache, roots, tokens, parents = c.cache, c.roots, c.tokens, c.parents
    slots, lens, sampling, uniforms, ref = c.slots, c.lens, c.sampling, c.uniforms, c.ref
    out = kernel.verify(
        params, copy_cache(cache), roots, tokens, parents, None, slots, lens, sampling, uniforms,
        cfg=cfg, child_sampling=TOPK, block_sizes=BLOCKS, interpret=True,
    )  # fmt: skip

    def np_tree(r):
        return {
            **jax.tree.map(np.asarray, r._asdict()),
            "cache": {"k": np.asarray(r.cache.k), "v": np.asarray(r.cache.v)},
        }

    return dict(cases=cases, slots=slots, lens=lens, ref=np_tree(ref), out=np_tree(out))


def check_row(res: dict, row: int, dtype_name: str) -> None:
    ref, out = res["ref"], res["out"]
    np.testing.assert_array_equal(out["accepted_nodes"][row], ref["accepted_nodes"][row])
    assert out["num_accepted"][row] == ref["num_accepted"][row]
    assert out["bonus"][row] == ref["bonus"][row]
    np.testing.assert_allclose(
        out["logits"][row], ref["logits"][row], atol=LOGIT_TOL[dtype_name], rtol=0
    )
    slot, n = res["slots"][row], res["lens"][row]
    for name in ("k", "v"):  # committed prefix untouched, block written, rest still NaN
        got = out["cache"][name][:, slot].astype(np.float32)
        want = ref["cache"][name][:, slot].astype(np.float32)
        np.testing.assert_allclose(
            got[:, :, : n + NODES + 1], want[:, :, : n + NODES + 1], atol=KV_TOL[dtype_name]
        )
        assert np.isnan(got[:, :, n + NODES + 1 :]).all()


GRID = [
    pytest.param(
        d, kv, tree, ctx,
        marks=() if (d, kv) == ("f32", 2) else pytest.mark.slow,
        id=f"{d}-kv{kv}-{tree}-ctx{ctx}",
    )
    for d in DTYPES for kv in (1, 2, 4) for tree in TREES for ctx in CONTEXTS
    if d == "f32" or kv == 2  # bfloat16 once (suite time: each group compiles ~10 s)
]  # fmt: skip


@pytest.mark.parametrize(("dtype_name", "kv_heads", "tree", "context"), GRID)
def test_kernel_matches_reference(dtype_name, kv_heads, tree, context):
    res = grid_case(dtype_name, kv_heads)
    row = res["cases"].index((tree, context))
    check_row(res, row, dtype_name)
    if tree == "chain8":  # by construction: nodes 0..5 match their parent's argmax
        assert res["out"]["num_accepted"][row] == 6
        np.testing.assert_array_equal(res["out"]["accepted_nodes"][row][:7], [0, 1, 2, 3, 4, 5, -1])


@pytest.mark.parametrize("dtype_name", ["f32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_untouched_slot_stays_nan(dtype_name):
    res = grid_case(dtype_name, 2)
    unused = sorted(set(range(len(res["slots"]) + 1)) - set(res["slots"].tolist()))
    assert np.isnan(res["out"]["cache"]["k"][:, unused].astype(np.float32)).all()


def expected_features(cfg, params, c, taps) -> np.ndarray:
    """The block's features at `taps` (`transformer.block_logits_kv`) for case `c`."""
    block, positions, mask = reference.tree_block(c.roots, c.tokens, c.parents, c.lens)
    *_, feats = T.block_logits_kv(
        params, copy_cache(c.cache), block, positions, mask, c.slots, c.lens, cfg=cfg, taps=taps
    )  # fmt: skip
    return np.asarray(feats)


@pytest.mark.parametrize("taps", [(0,), (1, 0), pytest.param((0, 1), marks=pytest.mark.slow)])
def test_kernel_features_match_block_logits_kv(taps):
    """With `taps` the kernel also returns the block's residual after those layers (the
    last layer's after the final norm), as the XLA forward gives a block drafter; the
    verdict and logits are unchanged. Rows: a chain over a long context, a tree over
    none."""
    cfg, params = model(jnp.float32, 2)
    c = reference_case(cfg, params, jnp.float32, [("chain8", 1000), ("tree16", 0)],
                       np.random.default_rng(5))  # fmt: skip
    out = kernel.verify(
        params, copy_cache(c.cache), c.roots, c.tokens, c.parents, None, c.slots, c.lens,
        c.sampling, c.uniforms, cfg=cfg, child_sampling=TOPK, block_sizes=BLOCKS,
        interpret=True, taps=taps,
    )  # fmt: skip
    want = expected_features(cfg, params, c, taps)
    assert out.features.shape == want.shape == (2, NODES + 1, len(taps) * cfg.hidden_size)
    np.testing.assert_allclose(np.asarray(out.features), want, atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(out.accepted_nodes, c.ref.accepted_nodes)
    np.testing.assert_allclose(out.logits, c.ref.logits, atol=LOGIT_TOL["f32"], rtol=0)
    with pytest.raises(ValueError, match=r"taps \[2\] are outside the model's 2 layers"):
        kernel.verify(
            params, copy_cache(c.cache), c.roots, c.tokens, c.parents, None, c.slots, c.lens,
            c.sampling, c.uniforms, cfg=cfg, child_sampling=TOPK, block_sizes=BLOCKS,
            interpret=True, taps=(2,),
        )  # fmt: skip


VARIANTS = {
    # attention bias + tied embeddings (LM head = embed rows, transposed matmul)
    "qwen2_tied": dict(
        architecture=Architecture.QWEN2, attention_bias=True, tie_word_embeddings=True
    ),
    "qwen3_qk_norm": dict(architecture=Architecture.QWEN3, qk_norm=True),
    "mistral_window": dict(architecture=Architecture.MISTRAL, sliding_window=40),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variants(name):
    """f32 variants; rows: a full KV tile ending at the cache's end (the last tile slides
    back), a short context, and an inactive row (slot -1: nothing written)."""
    cfg, params = model(jnp.float32, 2, **VARIANTS[name])
    max_len, n = 128, 12
    rng = np.random.default_rng(3)
    parents = np.stack([random_tree(rng, n), chain(n), random_tree(rng, n)])
    tokens = rng.integers(0, cfg.vocab_size, (3, n)).astype(np.int32)
    tokens[0, 1] = tokens[0, 0]  # duplicate siblings somewhere, if they are siblings
    slots = np.array([1, 0, -1], np.int32)
    lens = np.array([max_len - n - 1, 5, 50], np.int32)
    roots = np.array([1, 2, 3], np.int32)
    cache = nan_cache(cfg, jnp.float32, slots, lens, 2, max_len=max_len)
    args = (params, None, roots, tokens, parents, None, slots, lens)
    sampling, uniforms = SamplingBatch.make_dummy(3), np.zeros((3, n + 1), np.float32)
    blocks = dataclasses.replace(BLOCKS, kv_rows=48)
    ref = reference.verify(
        *args[:1], copy_cache(cache), *args[2:], sampling, uniforms, cfg=cfg, child_sampling=TOPK
    )
    out = kernel.verify(
        *args[:1], copy_cache(cache), *args[2:], sampling, uniforms, cfg=cfg,
        child_sampling=TOPK, block_sizes=blocks, interpret=True,
    )  # fmt: skip
    np.testing.assert_allclose(out.logits[:2], ref.logits[:2], atol=1e-4, rtol=0)
    np.testing.assert_array_equal(out.accepted_nodes[:2], ref.accepted_nodes[:2])
    np.testing.assert_array_equal(out.bonus[:2], ref.bonus[:2])
    for got, want in ((out.cache.k, ref.cache.k), (out.cache.v, ref.cache.v)):
        np.testing.assert_allclose(got, want, atol=1e-5)  # NaN where both are NaN


@pytest.mark.slow
@pytest.mark.parametrize(
    "rule",
    [ChildSampling.IID, pytest.param(ChildSampling.WITHOUT_REPLACEMENT, marks=pytest.mark.slow)],
)
def test_sampling_rows_match_reference(rule):
    """Temperature > 0 rows use the stochastic rule on the kernel's logits (same uniforms)."""
    cfg, params = model(jnp.float32, 2)
    b, n = 4, 10
    rng = np.random.default_rng(5)
    parents = np.stack([random_tree(rng, n) for _ in range(b)])
    tokens = rng.integers(0, cfg.vocab_size, (b, n)).astype(np.int32)
    draft = jax.nn.softmax(3 * jax.random.normal(jax.random.key(2), (b, n + 1, cfg.vocab_size)))
    slots, lens = np.arange(b, dtype=np.int32), np.array([0, 7, 30, 64], np.int32)
    roots = np.arange(b, dtype=np.int32)
    sampling = dataclasses.replace(
        SamplingBatch.make_dummy(b),
        temperature=np.array([0.0, 1.0, 0.7, 1.3], np.float32),
        top_k=np.array([0, 0, 50, 0], np.int32),
        top_p=np.array([1.0, 0.9, 1.0, 1.0], np.float32),
    )
    uniforms = jax.random.uniform(jax.random.key(9), (b, n + 1))
    cache = nan_cache(cfg, jnp.float32, slots, lens, b, max_len=128)
    common = (parents, draft, slots, lens, sampling, uniforms)
    ref = reference.verify(
        params, copy_cache(cache), roots, tokens, *common, cfg=cfg, child_sampling=rule
    )
    out = kernel.verify(
        params, copy_cache(cache), roots, tokens, *common, cfg=cfg, child_sampling=rule,
        block_sizes=dataclasses.replace(BLOCKS, kv_rows=32), interpret=True,
    )  # fmt: skip
    np.testing.assert_array_equal(out.accepted_nodes, ref.accepted_nodes)
    np.testing.assert_array_equal(out.bonus, ref.bonus)
    assert int(ref.num_accepted.sum()) > 0  # the rule accepted something somewhere


def race_case(dtype):
    cfg = ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16,
    )  # fmt: skip
    params = T.init_params(cfg, jax.random.key(0), dtype)
    parents = np.array([[-1, 0, 0, 1, -2], [-1, -1, 0, 2, 3]], np.int32)
    tokens = np.arange(10, dtype=np.int32).reshape(2, 5)
    slots, lens = np.array([1, 0], np.int32), np.array([20, 0], np.int32)
    cache = nan_cache(cfg, dtype, slots, lens, 2, max_len=64)
    blocks = BlockSizes(proj_cols=16, out_rows=32, mlp_cols=64, vocab_cols=96, kv_rows=16)
    args = (params, cache, np.array([3, 4], np.int32), tokens, parents, None, slots, lens)
    return cfg, args, blocks


@pytest.mark.parametrize("mode", [pytest.param("on_wait", marks=pytest.mark.slow), "eager"])
@pytest.mark.parametrize("dtype_name", ["f32", pytest.param("bf16", marks=pytest.mark.slow)])
@pytest.mark.parametrize(  # (weight_ring, mlp_ring)
    "rings",
    [pytest.param(r, marks=pytest.mark.slow) for r in ((2, 2), (3, 6), (6, 3))],
)
def test_no_races(mode, dtype_name, rings):
    """Weight rings of any depth give the reference's answer with no DMA race: streams
    of 1 to 4 tiles here, so a deep ring starts tiles two streams ahead, and rings of
    different depths meet at the MLP's ends (a deeper ring's extra tiles start at once)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    cfg, args, blocks = race_case(DTYPES[dtype_name])
    blocks = dataclasses.replace(blocks, weight_ring=rings[0], mlp_ring=rings[1])
    sampling, uniforms = SamplingBatch.make_dummy(2), np.zeros((2, 6), np.float32)
    ref = reference.verify(
        *args[:1], copy_cache(args[1]), *args[2:], sampling, uniforms, cfg=cfg, child_sampling=TOPK
    )
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    out = kernel.verify(
        *args, sampling, uniforms, cfg=cfg, child_sampling=TOPK, block_sizes=blocks,
        interpret=params,
    )  # fmt: skip
    jax.block_until_ready(out)
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
    np.testing.assert_array_equal(out.bonus, ref.bonus)
    np.testing.assert_array_equal(out.accepted_nodes, ref.accepted_nodes)
    np.testing.assert_allclose(out.logits, ref.logits, atol=LOGIT_TOL[dtype_name], rtol=0)


def test_race_detector_reports_a_race():
    """The detector is live: reading a DMA's destination before waiting is flagged."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    def racy(x_hbm, o_ref, buf, sem):
        copy = pltpu.make_async_copy(x_hbm, buf, sem.at[0])
        copy.start()
        o_ref[...] = buf[...]  # races with the copy
        copy.wait()

    x = jnp.ones((8, 128), jnp.float32)
    jax.block_until_ready(
        pl.pallas_call(
            racy,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA((1,))],
            interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"),
        )(x)
    )
    assert tpu_interpret.races.races_found


def test_input_errors():
    cfg, params = model(jnp.float32, 2)
    cache = nan_cache(cfg, jnp.float32, [0], [4], 1, max_len=128)
    args = (params, cache, np.zeros(1, np.int32), np.zeros((1, 4), np.int32),
            chain(4)[None], None, np.zeros(1, np.int32), np.array([4], np.int32),
            SamplingBatch.make_dummy(1), np.zeros((1, 5), np.float32))  # fmt: skip
    kw = dict(cfg=cfg, child_sampling=TOPK, interpret=True)
    with pytest.raises(ValueError, match="proj_cols .* must divide"):
        kernel.verify(*args, **kw, block_sizes=dataclasses.replace(BLOCKS, proj_cols=48))
    with pytest.raises(ValueError, match="multiple of 128 on TPU"):
        BLOCKS.validate(cfg, max_len=128, tpu=True)
    with pytest.raises(ValueError, match="uniforms must have shape"):
        kernel.verify(*args[:-1], np.zeros((1, 3), np.float32), **kw, block_sizes=BLOCKS)
    moe = ModelConfig(
        vocab_size=384, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, architecture=Architecture.QWEN3_MOE, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, n_shared_experts=1,
        shared_expert_gate=True,
    )  # fmt: skip
    with pytest.raises(ValueError, match="gated shared expert"):
        kernel.verify(*args, cfg=moe, child_sampling=TOPK, interpret=True)
    unstacked = {**params, "layers": tuple({"wq": w} for w in params["layers"]["wq"])}
    with pytest.raises(ValueError, match="stacked layer weights"):
        kernel.verify(unstacked, *args[1:], **kw)


def test_block_rows_and_vmem_plan():
    # 64 nodes + root = 65 rows -> 80 in bf16 (16-row tiles), 72 in f32 (8-row tiles).
    assert tuning.block_rows(64, jnp.bfloat16) == 80
    assert tuning.block_rows(64, jnp.float32) == 72
    # bf16 [80, 100] pads to [80, 128]: 80 * 128 * 2 bytes.
    assert tuning.padded_bytes((80, 100), jnp.bfloat16) == 80 * 128 * 2
    # A 65-row bf16 write at any offset needs an aligned 80-row window.
    assert tuning.kv_write_rows(64, jnp.bfloat16) == 80
    cfg, _ = model(jnp.float32, 2)
    bs = tuning.default_block_sizes(
        cfg, batch=2, num_nodes=16, weight_dtype=jnp.float32, cache_dtype=jnp.float32,
        max_len=256,
    )  # fmt: skip
    bs.validate(cfg, max_len=256, tpu=False)
    # num_kv_heads * head_dim = 64 < 128 lanes: one whole-width tile (interpret mode only).
    assert (bs.proj_cols, bs.out_rows, bs.mlp_cols, bs.vocab_cols, bs.kv_rows) == (
        64,
        128,
        256,
        384,
        256,
    )
    with pytest.raises(ValueError, match="multiple of 128 on TPU"):
        bs.validate(cfg, max_len=256, tpu=True)
