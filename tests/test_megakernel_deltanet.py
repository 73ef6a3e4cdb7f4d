"""The megakernel's gated DeltaNet mixing (`kernels/megakernel/deltanet.py`) in Pallas
TPU interpret mode against its jnp reference: chains and trees, committed states read
from HBM slots, fresh and padding rows, race detector on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import linear_attention as la
from specdec.kernels.megakernel import deltanet
from specdec.kernels.megakernel.reference import tree_block

DIMS = (2, 4, 8, 8)  # key heads, value heads (2 per key head), dk, dv
TAPS = 4


def random_tree(rng, n: int) -> np.ndarray:
    """Topological parents with a bias to recent nodes, so trees get deep."""
    return np.array([-1] + [rng.integers(max(-1, i - 3), i) for i in range(1, n)], np.int32)


def case(parents, lens, slots, seed=0):
    hk, hv, dk, dv = DIMS
    rng = np.random.default_rng(seed)
    b, n = parents.shape
    c = 2 * hk * dk + hv * dv
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    roots = jnp.zeros((b,), jnp.int32)
    _, positions, path = tree_block(roots, jnp.zeros((b, n), jnp.int32), parents, lens)
    sources = la.ancestor_sources(path, positions, lens, TAPS)
    lp = {
        "conv": f(TAPS, c) * 0.5, "a_log": f(hv) * 0.3, "dt_bias": f(hv) * 0.3,
        "lin_norm": 1.0 + 0.1 * f(dv),
    }  # fmt: skip
    rec = f(6, hv, dk, dv) * 0.3
    rec = rec.at[5].set(jnp.nan)  # a slot no row reads: NaN must not leak
    safe = jnp.clip(slots, 0, 5)
    s0 = jnp.where((lens > 0)[:, None, None, None], rec[safe], 0.0)
    window = jnp.where((lens > 0)[:, None, None], f(b, TAPS - 1, c), 0.0)
    args = (f(b, n + 1, c), f(b, n + 1, 2 * hv), f(b, n + 1, hv * dv), window)
    return args, rec, s0, path, sources, lp


@pytest.mark.parametrize(
    "shape",
    [pytest.param("chain", marks=pytest.mark.slow), "tree",
     pytest.param("deep_tree", marks=pytest.mark.slow)],
)  # fmt: skip
def test_mix_matches_the_reference(shape):
    rng = np.random.default_rng(1)
    n = {"chain": 7, "tree": 9, "deep_tree": 14}[shape]
    trees = []
    for i in range(3):
        if shape == "chain":
            trees.append(np.arange(-1, n - 1, dtype=np.int32))
        else:
            p = random_tree(rng, n)
            if i == 2:  # a partly padded tree
                p[n - 3 :] = -2
            trees.append(p)
    parents = jnp.asarray(np.stack(trees))
    lens = jnp.asarray([5, 0, 11], jnp.int32)  # the middle row is fresh: zero state
    slots = jnp.asarray([3, 5, 1], jnp.int32)  # slot 5 holds NaN, read by a fresh row only
    args, rec, s0, path, sources, lp = case(parents, lens, slots)
    want = deltanet.reference(*args, s0, path, sources, lp, dims=DIMS, eps=1e-6)
    got = deltanet.mix(*args, rec, slots, lens, path, sources, lp, dims=DIMS, eps=1e-6,
                       interpret=pltpu.InterpretParams(detect_races=True))  # fmt: skip
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    assert tpu_interpret.races is not None and not tpu_interpret.races.races_found
    valid = np.asarray(jnp.concatenate([jnp.ones((3, 1), bool), parents >= -1], axis=1))
    for name, w, g in zip(("o", "k", "u", "G"), want, got, strict=True):
        w, g = np.asarray(w), np.asarray(g)
        assert np.isfinite(g[valid]).all(), name
        np.testing.assert_allclose(g[valid], w[valid], atol=2e-5, rtol=2e-5, err_msg=name)


@pytest.mark.slow
def test_mix_with_an_inactive_row():
    """slot -1 (a padding row of the batch): computed from zeros, never reads a slot."""
    parents = jnp.asarray([[-1, 0, 1, 1], [-1, 0, 0, 2]], jnp.int32)
    lens = jnp.asarray([4, 9], jnp.int32)
    slots = jnp.asarray([2, -1], jnp.int32)
    args, rec, _, path, sources, lp = case(parents, lens, slots, seed=3)
    s0 = jnp.stack([rec[2], jnp.zeros_like(rec[2])])
    want = deltanet.reference(*args, s0, path, sources, lp, dims=DIMS, eps=1e-6)
    got = deltanet.mix(*args, rec, slots, lens, path, sources, lp, dims=DIMS, eps=1e-6,
                       interpret=True)  # fmt: skip
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 33])
def test_unit_lower_inverse(n):
    rng = np.random.default_rng(n)
    lower = np.tril(rng.uniform(-1, 1, (n, n)), -1).astype(np.float32)
    inv = np.asarray(deltanet.unit_lower_inverse(jnp.asarray(lower)))
    np.testing.assert_allclose(inv @ (np.eye(n) + lower), np.eye(n), atol=1e-4)


@pytest.mark.slow
def test_reference_is_the_models_deltanet_layer():
    """`reference` is what `transformer._deltanet` computes between its projections."""
    from specdec.kernels import transformer as T
    from specdec.kernels.config import ModelConfig

    hk, hv, dk, dv = DIMS
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, layer_types=("linear_attention", "full_attention"),
        linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
        linear_value_head_dim=dv, linear_conv_kernel_dim=TAPS,
    )  # fmt: skip
    lp = T.init_params(cfg, jax.random.key(0))["layers"][0]
    lp = lp | {"a_log": jnp.linspace(-1, 1, hv), "dt_bias": jnp.linspace(0.5, -0.5, hv)}
    parents = jnp.asarray([[-1, 0, 0, 1, 3]], jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    _, positions, path = tree_block(jnp.zeros(1, jnp.int32), parents * 0, parents, lens)
    sources = la.ancestor_sources(path, positions, lens, TAPS)
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((1, 6, 32)), jnp.float32)
    window = jnp.asarray(rng.standard_normal((1, TAPS - 1, 2 * hk * dk + hv * dv)), jnp.float32)
    s0 = jnp.asarray(rng.standard_normal((1, hv, dk, dv)), jnp.float32) * 0.3
    out, rec = T._deltanet(cfg, lp, h, positions, path, sources, window, s0, T.REFERENCE)
    ba = jnp.concatenate([h @ lp["w_b"], h @ lp["w_a"]], axis=-1)
    o, k, u, big_g = deltanet.reference(h @ lp["w_qkv"], ba, h @ lp["w_z"], window, s0, path,
                                        sources, lp, dims=DIMS, eps=cfg.rms_norm_eps)  # fmt: skip
    np.testing.assert_allclose(o.reshape(1, 6, -1) @ lp["w_out"], out, atol=1e-5)
    for a, b_ in ((k, rec.k), (u, rec.u), (big_g, rec.g)):
        np.testing.assert_allclose(a, b_, atol=1e-6)
