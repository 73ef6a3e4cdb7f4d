"""The verify megakernel on DeepSeek-V3-class targets (multi-head latent attention over
the latent cache, `megakernel.mla`; DeepSeek routing, a shared expert, a dense first
layer, YaRN) in Pallas TPU interpret mode against `reference.verify`: with and without
the low-rank query path, chains and trees, race detector on, NaN in every cache
position no row may read, bfloat16, and split over 4 devices (`split_check.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_megakernel_moe import TESTS, assert_same, batch, copy

from specdec.kernels import transformer as T
from specdec.kernels.config import Architecture, ModelConfig, RopeScaling
from specdec.kernels.megakernel import BlockSizes, kernel, mla, reference, shard
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

TOPK = ChildSampling.DETERMINISTIC_TOPK
# proj_cols divides the query's first product (64, or 4 heads x 24) and wkv_a's 40
# columns padded to 128; out_rows is one v-wide head.
BLOCKS = BlockSizes(proj_cols=32, out_rows=16, mlp_cols=16, vocab_cols=96, kv_rows=16)


def mla_model(dtype=jnp.float32, **overrides) -> tuple[ModelConfig, dict]:
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4,
        num_kv_heads=1, head_dim=8, architecture=Architecture.DEEPSEEK_V3, kv_lora_rank=32,
        q_lora_rank=64, qk_nope_head_dim=16, v_head_dim=16, num_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        scoring_func="sigmoid", expert_bias=True, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
        rope_scaling=RopeScaling(rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=16, mscale=1.0,
                                 mscale_all_dim=0.7),
    )  # fmt: skip
    cfg = ModelConfig(**(kw | overrides))
    params = T.init_params(cfg, jax.random.key(0), jnp.float32)
    layers = list(params["layers"])
    for i in range(cfg.first_k_dense_replace, cfg.num_layers):
        bias = 0.3 * jax.random.normal(jax.random.key(i), (cfg.num_experts,))
        layers[i] = layers[i] | {"router": layers[i]["router"] * 20, "e_bias": bias}
    params["layers"] = tuple(layers)
    return cfg, jax.tree.map(lambda x: x.astype(dtype), params)


def mla_cache(cfg, dtype, lens=(0, 9, 0), num_slots=3) -> T.KVCache:
    """Random latents up to each slot's length (slot s holds lens[s] tokens), NaN after:
    a kernel reading past a row's length, or dropping the padding of the values, fails."""
    cache = T.KVCache.create(cfg, num_slots, 64, dtype)
    k = jax.random.normal(jax.random.key(1), cache.k.shape)
    live = jnp.arange(cache.max_len)[None, :] < jnp.asarray(lens)[:, None]  # [S, T]
    k = jnp.where(live[None, :, None, :, None], k, jnp.nan)
    return T.KVCache(k=k.astype(dtype), v=cache.v)


def run_both(cfg, params, cache, shape, interpret):
    roots, tokens, parents, slots, lens = batch(shape)
    b, n = tokens.shape
    sampling, uniforms = SamplingBatch.make_dummy(b), np.zeros((b, n + 1), np.float32)
    rest = (roots, tokens, parents, None, slots, lens, sampling, uniforms)
    ref = reference.verify(params, copy(cache), *rest, cfg=cfg, child_sampling=TOPK)
    out = kernel.verify(params, copy(cache), *rest, cfg=cfg, child_sampling=TOPK,
                        block_sizes=BLOCKS, interpret=interpret)  # fmt: skip
    jax.block_until_ready(out)
    return out, ref, slots >= 0


def assert_cache_written(out, ref, cfg, lens, slots, n1, atol):
    """The block's latent rows went to the cache where the reference put them."""
    for b, (slot, length) in enumerate(zip(slots, lens, strict=True)):
        if slot < 0:
            continue
        got = np.asarray(out.cache.k, np.float32)[:, slot, :, length : length + n1]
        want = np.asarray(ref.cache.k, np.float32)[:, slot, :, length : length + n1]
        np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=f"row {b}")


@pytest.mark.parametrize("q_lora", [64, pytest.param(0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("shape", [pytest.param("chain", marks=pytest.mark.slow), "tree"])
def test_kernel_matches_the_reference(shape, q_lora):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    cfg, params = mla_model(q_lora_rank=q_lora)
    cache = mla_cache(cfg, jnp.float32)
    out, ref, live = run_both(cfg, params, cache, shape,
                              pltpu.InterpretParams(detect_races=True))  # fmt: skip
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
    assert_same(out, ref, live, atol=2e-5)
    roots, tokens, parents, slots, lens = batch(shape)
    assert_cache_written(out, ref, cfg, lens, slots, tokens.shape[1] + 1, atol=2e-5)
    assert out.cache.v.shape == cache.v.shape  # MLA keeps no values


@pytest.mark.slow
def test_the_committed_latents_are_read():
    """Changing the committed latents of a row's slot changes its logits: the kernel
    attends over the cache, not the block alone."""
    cfg, params = mla_model()
    cache = mla_cache(cfg, jnp.float32)
    other = T.KVCache(k=jnp.where(jnp.isnan(cache.k), cache.k, -cache.k), v=cache.v)
    out, _, live = run_both(cfg, params, cache, "tree", True)
    moved, _, _ = run_both(cfg, params, other, "tree", True)
    row = 0  # slot 1, 9 committed tokens
    assert live[row]
    diff = np.abs(np.asarray(out.logits)[row] - np.asarray(moved.logits)[row]).max()
    assert diff > 1e-2


@pytest.mark.slow
def test_bfloat16_weights_and_cache():
    cfg, params = mla_model(jnp.bfloat16)
    cache = mla_cache(cfg, jnp.bfloat16)
    out, ref, live = run_both(cfg, params, cache, "tree", True)
    assert_same(out, ref, live, atol=3e-2)


def test_prepared_params_keep_the_xla_forward():
    """`shard.prepare_params` pads wkv_a for the kernel; the XLA forward reads only its
    first c + r columns, so its logits do not move."""
    cfg, params = mla_model(num_layers=2)
    run_cfg, padded = shard.prepare_params(cfg, params, 1)
    assert run_cfg == cfg
    assert padded["layers"]["wkv_a"].shape[-1] == mla.kva_width(cfg) == 128
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 7)), jnp.int32)
    want = T.forward_train(params, cfg, tokens)
    got = T.forward_train(padded, cfg, tokens)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)


def test_refusals_name_the_cause():
    cfg, _ = mla_model()
    with pytest.raises(ValueError, match="num_heads"):
        shard.check_shardable(cfg, 3)
    kimi = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
        num_kv_heads=1, head_dim=8, architecture=Architecture.DEEPSEEK_V3, kv_lora_rank=16,
        qk_nope_head_dim=8, v_head_dim=8, use_rope=False,
    )  # fmt: skip
    with pytest.raises(ValueError, match="RoPE"):
        shard.check_shardable(kimi, 1)


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_split_over_four_devices_equals_one(shape):
    """Heads and experts split, the latent cache replicated, and the all-reduce's chunks
    owned by 3 of the 4 devices (`collectives.chunking`, with 16-column lanes)."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(TESTS))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(TESTS / "split_check.py"), "--tp", "4", "--model", "deepseek-mla",
         "--lanes", "16", "--shape", shape],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["owners"] == 3, found  # 48 columns in 16-column chunks: one device only sends
    assert not found["races"], found
    assert found["verdict_equal"], found
    assert found["logit_err"] < 2e-5, found
    assert found["cache_err"] < 2e-5, found
