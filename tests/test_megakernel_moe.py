"""The verify megakernel on Qwen3-MoE targets (routing in the kernel, only the routed
experts' weights streamed) in Pallas TPU interpret mode against `reference.verify`:
chains and trees, race detector on, NaN in every expert no row routes to, and split
over devices with whole experts per device (`split_check.py`)."""

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

from specdec.kernels import transformer as T
from specdec.kernels.config import Architecture, ModelConfig
from specdec.kernels.megakernel import BlockSizes, kernel, moe, reference
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling

TOPK = ChildSampling.DETERMINISTIC_TOPK
TESTS = Path(__file__).resolve().parent
BLOCKS = BlockSizes(proj_cols=16, out_rows=16, mlp_cols=16, vocab_cols=96, kv_rows=16)


# DeepSeek-V3's routing on a grouped-query model: sigmoid scores with a correction
# bias, the 2 best of 4 groups, routed scaling, a shared expert, a dense first layer.
DEEPSEEK_ROUTING = dict(
    scoring_func="sigmoid", expert_bias=True, n_group=4, topk_group=2,
    routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
    intermediate_size=96,
)  # fmt: skip


def moe_model(dtype=jnp.float32, routing="qwen3", **overrides) -> tuple[ModelConfig, dict]:
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
        num_kv_heads=2, head_dim=16, architecture=Architecture.QWEN3_MOE, qk_norm=True,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    )  # fmt: skip
    if routing == "deepseek":
        kw |= DEEPSEEK_ROUTING
    cfg = ModelConfig(**(kw | overrides))
    params = T.init_params(cfg, jax.random.key(0), jnp.float32)
    if isinstance(params["layers"], dict):
        params["layers"]["router"] = params["layers"]["router"] * 20  # decisive routing
    else:
        layers = list(params["layers"])
        for i in range(cfg.first_k_dense_replace, cfg.num_layers):
            bias = 0.3 * jax.random.normal(jax.random.key(i), (cfg.num_experts,))
            layers[i] = layers[i] | {"router": layers[i]["router"] * 20, "e_bias": bias}
        params["layers"] = tuple(layers)
    return cfg, jax.tree.map(lambda x: x.astype(dtype), params)


def moe_cache(cfg, dtype, num_slots=3) -> T.KVCache:
    cache = T.KVCache.create(cfg, num_slots, 64, dtype)
    k = jax.random.normal(jax.random.key(1), cache.k.shape).astype(dtype)
    return T.KVCache(k=k, v=(k * 0.5).astype(dtype))


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def batch(shape: str):
    """A committed row, a fresh row and an inactive padding row (slot -1)."""
    if shape == "chain":
        parents = np.array([[-1, 0, 1, 2, 3, 4]] * 3, np.int32)
    else:
        parents = np.array([[-1, 0, 0, 1, 3, -2], [-1, -1, 0, 2, 3, 1], [-1, 0, 1, 1, 3, 4]],
                           np.int32)  # fmt: skip
    rng = np.random.default_rng(len(shape))
    tokens = rng.integers(0, 256, parents.shape).astype(np.int32)
    roots = rng.integers(0, 256, 3).astype(np.int32)
    return roots, tokens, parents, np.array([1, 0, -1], np.int32), np.array([9, 0, 3], np.int32)


def run_both(cfg, params, cache, shape, interpret, ref_params=None):
    roots, tokens, parents, slots, lens = batch(shape)
    b, n = tokens.shape
    sampling, uniforms = SamplingBatch.make_dummy(b), np.zeros((b, n + 1), np.float32)
    rest = (roots, tokens, parents, None, slots, lens, sampling, uniforms)
    ref = reference.verify(ref_params or params, copy(cache), *rest, cfg=cfg, child_sampling=TOPK)
    out = kernel.verify(params, copy(cache), *rest, cfg=cfg, child_sampling=TOPK,
                        block_sizes=BLOCKS, interpret=interpret)  # fmt: skip
    jax.block_until_ready(out)
    return out, ref, slots >= 0


def assert_same(out, ref, live, atol):
    np.testing.assert_array_equal(np.asarray(out.bonus)[live], np.asarray(ref.bonus)[live])
    np.testing.assert_array_equal(
        np.asarray(out.accepted_nodes)[live], np.asarray(ref.accepted_nodes)[live]
    )
    np.testing.assert_allclose(
        np.asarray(out.logits)[live], np.asarray(ref.logits)[live], atol=atol, rtol=0
    )


@pytest.mark.parametrize("routing", ["qwen3", "deepseek"])
@pytest.mark.parametrize("shape", [pytest.param("chain", marks=pytest.mark.slow), "tree"])
def test_kernel_matches_the_reference(shape, routing):
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    cfg, params = moe_model(routing=routing)
    out, ref, live = run_both(cfg, params, moe_cache(cfg, jnp.float32), shape,
                              pltpu.InterpretParams(detect_races=True))  # fmt: skip
    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
    assert_same(out, ref, live, atol=2e-5)


def test_experts_no_row_routes_to_are_never_read():
    """The MLP input keeps one channel and the router sends it to expert 0 or 1 and,
    second, to expert 2 (ties to the lowest id, as `lax.top_k`): experts 3.. hold NaN,
    so reading or multiplying any of them would poison the logits."""
    cfg, params = moe_model()
    layers = dict(params["layers"])
    layers["mlp_norm"] = jnp.zeros_like(layers["mlp_norm"]).at[:, 0].set(1.0)
    router = jnp.zeros_like(layers["router"]).at[:, 0, 0].set(5.0).at[:, 0, 1].set(-5.0)
    layers["router"] = router
    clean = {**params, "layers": layers}
    poisoned = {**clean, "layers": dict(layers)}
    for name in ("e_gate", "e_up", "e_down"):
        poisoned["layers"][name] = layers[name].at[:, 3:].set(jnp.nan)
    out, ref, live = run_both(cfg, poisoned, moe_cache(cfg, jnp.float32), "tree", True,
                              ref_params=clean)  # fmt: skip
    assert np.isfinite(np.asarray(out.logits)[live]).all()
    assert_same(out, ref, live, atol=2e-5)


@pytest.mark.slow
def test_bfloat16_weights_and_cache():
    cfg, params = moe_model(jnp.bfloat16)
    out, ref, live = run_both(cfg, params, moe_cache(cfg, jnp.bfloat16), "tree",
                              pltpu.InterpretParams(detect_races=True))  # fmt: skip
    assert_same(out, ref, live, atol=3e-2)


def test_routing_the_kernel_cannot_do_is_refused_by_name():
    from specdec.kernels.megakernel import shard

    cfg, _ = moe_model()
    gated = ModelConfig(**{**cfg.__dict__, "n_shared_experts": 1, "shared_expert_gate": True})
    with pytest.raises(ValueError, match="gated shared expert.*kernel='xla'"):
        shard.check_shardable(gated, 1)
    with pytest.raises(ValueError, match="splits num_experts"):
        shard.check_shardable(moe_model(num_experts=6)[0], 4)


def test_union_of_routed_experts():
    expected, worst = moe.union_experts(128, 8, 1)
    assert expected == pytest.approx(8.0) and worst == 8
    expected, worst = moe.union_experts(128, 8, 65)
    assert 124 < expected < 128 and worst == 128


@pytest.mark.slow
@pytest.mark.parametrize("n,routing,shape", [("4", "qwen3", "tree"), ("4", "deepseek", "tree"),
                                             ("4", "qwen3", "chain")])  # fmt: skip
def test_split_over_devices_matches_the_reference(n, routing, shape):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_PLATFORMS="cpu")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "split_check.py", "--tp", n, "--model", f"{routing}-moe", "--shape",
         shape], cwd=TESTS, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not found["races"] and found["verdict_equal"], found
    assert found["logit_err"] < 2e-5, found
