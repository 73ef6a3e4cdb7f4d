"""The verify megakernel on hybrid targets (gated DeltaNet + gated attention layers,
Qwen3.5-style) in Pallas TPU interpret mode against `reference.verify`: logits, greedy
verdict, the attention layers' block K/V and the linear layers' records, for chains and
trees, committed and fresh rows, padding rows; race detector on; split over devices in
a child process (`split_check.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import linear_attention as la
from specdec.kernels import transformer as T
from specdec.kernels.config import Architecture, ModelConfig
from specdec.kernels.megakernel import BlockSizes, kernel, reference
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

TOPK = ChildSampling.DETERMINISTIC_TOPK
TESTS = Path(__file__).resolve().parent
MAX_LEN = 64
BLOCKS = BlockSizes(proj_cols=16, out_rows=16, mlp_cols=64, vocab_cols=96, kv_rows=16)
LAYERS = ("linear_attention", "full_attention", "linear_attention", "linear_attention")


def hybrid_model(dtype=jnp.float32, **overrides) -> tuple[ModelConfig, dict]:
    """A tiny Qwen3.5-style target whose linear layers move the logits (their
    convolution and output scaled up) and whose decays differ per head."""
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, architecture=Architecture.QWEN3_5, qk_norm=True,
        attn_output_gate=True, partial_rotary_factor=0.5, layer_types=LAYERS,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16,
    )  # fmt: skip
    cfg = ModelConfig(**(kw | overrides))
    params = T.init_params(cfg, jax.random.key(0), jnp.float32)
    hv = cfg.linear_num_value_heads
    layers = list(params["layers"])
    for i in cfg.linear_layers:
        layers[i] = layers[i] | {
            "conv": layers[i]["conv"] * 10, "w_out": layers[i]["w_out"] * 5,
            "a_log": jnp.linspace(-1.0, 0.5, hv), "dt_bias": jnp.linspace(0.3, -0.3, hv),
        }  # fmt: skip
    params["layers"] = tuple(layers)
    return cfg, jax.tree.map(lambda x: x.astype(dtype), params)


def hybrid_cache(cfg, dtype, num_slots=4, seed=1) -> T.KVCache:
    """Random committed K/V and linear states in every slot (rows read their own)."""
    cache = T.KVCache.create(cfg, num_slots, MAX_LEN, dtype)
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    k = jax.random.normal(k1, cache.k.shape).astype(dtype)
    lin = la.LinearState(
        conv=jax.random.normal(k2, cache.lin.conv.shape).astype(cache.lin.conv.dtype),
        rec=0.3 * jax.random.normal(k3, cache.lin.rec.shape),
    )
    return T.KVCache(k=k, v=(k * 0.5).astype(dtype), lin=lin)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)  # the calls donate their cache


def batch(shape: str):
    """Rows: a chain or trees at several committed lengths, a fresh row (length 0), and
    an inactive padding row (slot -1)."""
    if shape == "chain":
        parents = np.array([[-1, 0, 1, 2, 3, 4, 5]] * 4, np.int32)
    else:
        parents = np.array(
            [[-1, 0, 0, 1, 3, 2, -2], [-1, -1, 0, 2, 3, 1, 5], [-1, 0, 1, 1, 0, 4, 2],
             [-1, 0, -1, 2, -2, -2, -2]], np.int32,
        )  # fmt: skip
    slots = np.array([1, 3, 0, -1], np.int32)
    lens = np.array([9, 0, 23, 5], np.int32)
    rng = np.random.default_rng(len(shape))
    tokens = rng.integers(0, 256, parents.shape).astype(np.int32)
    roots = rng.integers(0, 256, 4).astype(np.int32)
    return roots, tokens, parents, slots, lens


def run_both(cfg, params, cache, shape, interpret, blocks=BLOCKS):
    roots, tokens, parents, slots, lens = batch(shape)
    b, n = tokens.shape
    sampling, uniforms = SamplingBatch.make_dummy(b), np.zeros((b, n + 1), np.float32)
    args = (roots, tokens, parents, None, slots, lens, sampling, uniforms)
    ref = reference.verify(params, copy(cache), *args, cfg=cfg, child_sampling=TOPK)
    out = kernel.verify(params, copy(cache), *args, cfg=cfg, child_sampling=TOPK,
                        block_sizes=blocks, interpret=interpret)  # fmt: skip
    jax.block_until_ready(out)
    return out, ref, (parents, slots, lens)


def assert_same(out, ref, rows, atol):
    parents, slots, lens = rows
    live = slots >= 0  # an inactive row's answer is nobody's (the kernel reads no cache)
    np.testing.assert_array_equal(np.asarray(out.bonus)[live], np.asarray(ref.bonus)[live])
    np.testing.assert_array_equal(
        np.asarray(out.accepted_nodes)[live], np.asarray(ref.accepted_nodes)[live]
    )
    np.testing.assert_allclose(
        np.asarray(out.logits)[live], np.asarray(ref.logits)[live], atol=atol, rtol=0
    )
    valid = np.concatenate([np.ones((len(slots), 1), bool), parents >= -1], axis=1)
    valid &= (slots >= 0)[:, None]
    for name in ("x", "k", "u", "g"):
        got, want = np.asarray(getattr(out.lin, name)), np.asarray(getattr(ref.lin, name))
        np.testing.assert_allclose(got[:, valid], want[:, valid], atol=atol, rtol=0, err_msg=name)
    for b, (s, n) in enumerate(zip(slots, lens, strict=True)):  # K/V written at [n, n + N + 1)
        if s >= 0:
            end = n + valid.shape[1]
            for name in ("k", "v"):
                got = np.asarray(getattr(out.cache, name), np.float32)[:, s, :, n:end]
                want = np.asarray(getattr(ref.cache, name), np.float32)[:, s, :, n:end]
                np.testing.assert_allclose(got, want, atol=atol, rtol=0, err_msg=f"{name} row {b}")
    np.testing.assert_array_equal(out.cache.lin.rec, ref.cache.lin.rec)  # left to the caller


@pytest.mark.parametrize("shape", [pytest.param("chain", marks=pytest.mark.slow), "tree"])
def test_kernel_matches_the_reference(shape):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    cfg, params = hybrid_model()
    cache = hybrid_cache(cfg, jnp.float32)
    out, ref, rows = run_both(cfg, params, cache, shape, pltpu.InterpretParams(detect_races=True))
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
    assert_same(out, ref, rows, atol=2e-5)


def deepest_paths(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row, block indices of the root-to-deepest-valid-node path (root first,
    padded with 0) and its length."""
    keep = np.zeros((parents.shape[0], parents.shape[1] + 1), np.int32)
    counts = np.zeros(parents.shape[0], np.int32)
    for b, row in enumerate(parents):
        node = max(i for i in range(len(row)) if row[i] >= -1)
        path = []
        while node >= 0:
            path.append(node + 1)
            node = row[node]
        path = [0, *path[::-1]]
        keep[b, : len(path)], counts[b] = path, len(path)
    return keep, counts


@pytest.mark.slow
def test_committing_the_kernels_record_gives_the_reference_state():
    """write_kv(keep, counts) of a deep path on the kernel's record equals it on the
    reference's: the accepted path's recurrent and convolution states."""
    cfg, params = hybrid_model()
    cache = hybrid_cache(cfg, jnp.float32)
    out, ref, (parents, slots, lens) = run_both(cfg, params, cache, "tree", True)
    keep, counts = deepest_paths(parents)
    assert counts.max() >= 4
    kv = jnp.zeros((1, 4, 7, 2, 16))  # the K/V part is not under test here

    def commit(res):
        return T.write_kv(copy(res.cache), T.HybridKV(k=kv, lin=res.lin), kv, slots, lens, keep,
                          counts)  # fmt: skip

    got, want = commit(out), commit(ref)
    np.testing.assert_allclose(got.lin.rec, want.lin.rec, atol=2e-5, rtol=0)
    np.testing.assert_allclose(got.lin.conv, want.lin.conv, atol=2e-5, rtol=0)
    assert not np.allclose(got.lin.rec, cache.lin.rec)  # something was committed


@pytest.mark.slow
def test_bfloat16_weights_and_cache():
    cfg, params = hybrid_model(jnp.bfloat16)
    cache = hybrid_cache(cfg, jnp.bfloat16)
    out, ref, rows = run_both(cfg, params, cache, "tree", pltpu.InterpretParams(detect_races=True))
    assert_same(out, ref, rows, atol=3e-2)


def test_unsupported_hybrids_are_refused_by_name():
    cfg, params = hybrid_model()
    kda = ModelConfig(**{**cfg.__dict__, "linear_kind": "kda", "linear_num_value_heads": 2})
    roots, tokens, parents, slots, lens = batch("chain")
    sampling, uniforms = SamplingBatch.make_dummy(4), np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="gated DeltaNet"):
        kernel.verify(params, hybrid_cache(cfg, jnp.float32), roots, tokens, parents, None,
                      slots, lens, sampling, uniforms, cfg=kda, child_sampling=TOPK,
                      interpret=True)  # fmt: skip
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        from specdec.kernels.megakernel import shard

        shard.check_shardable(cfg, 4)


@pytest.mark.slow
@pytest.mark.parametrize("n", ["4"])  # 2 devices: the dense cases cover the collectives
def test_split_over_devices_matches_the_reference(n):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "split_check.py", "--tp", n, "--model", "hybrid"], cwd=TESTS, env=env,
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not found["races"]
    assert found["verdict_equal"]
    assert found["logit_err"] < 2e-5, found
    assert found["record_err"] < 2e-5, found


@pytest.mark.slow
def test_the_kernels_stacks_serve_the_xla_forward():
    """`stacked_layout` (what a megakernel target holds) gives the model's logits and
    records through the XLA forward (`linear_attention.per_layer`)."""
    cfg, params = hybrid_model()
    stacked = la.stacked_layout(cfg, params)
    assert "lin" in stacked and stacked["lin"]["w_lq"].shape == (3, 64, 32)
    cache = hybrid_cache(cfg, jnp.float32)
    roots, tokens, parents, slots, lens = batch("tree")
    block, positions, mask = reference.tree_block(roots, tokens, parents, lens)
    want = T.block_logits_kv(params, cache, block, positions, mask, slots, lens, cfg=cfg)
    got = T.block_logits_kv(stacked, cache, block, positions, mask, slots, lens, cfg=cfg)
    for w, g in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)
