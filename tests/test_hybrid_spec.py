"""Speculative decoding with a hybrid linear-attention target (Qwen3.5 class: gated
DeltaNet layers with a recurrent and a convolution state, gated full attention with
partial RoPE): greedy output equals plain decoding for trees and chains on 100
prompts, and sampled output follows the target's distribution (>= 5k seeded requests).

The draft is the target without its linear-attention layers (a dense model of the
same family sharing its full-attention layers, embeddings and head), so its trees are
often right and verification really commits partial paths through the linear state."""

import dataclasses

import jax
import numpy as np
import pytest
from fixtures import write_tokenizer
from test_spec_engine import assert_first_two_tokens_follow_the_target

from specdec import LLM, SamplingParams
from specdec.checkpoint import save_checkpoint
from specdec.kernels.config import Architecture, ModelConfig
from specdec.kernels.transformer import init_params

MAX_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def hybrid_config(vocab_size: int, **overrides) -> ModelConfig:
    kw = dict(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=4,
        num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=256,
        architecture=Architecture.QWEN3_5, qk_norm=True, attn_output_gate=True,
        partial_rotary_factor=0.25, layer_types=("linear_attention", "full_attention") * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8,
    )  # fmt: skip
    return ModelConfig(**(kw | overrides))


def write_pair(root, cfg: ModelConfig, seed: int, scale: float, linear_gain: float = 8.0):
    """(target, draft) folders: random hybrid weights (embeddings x `scale`; the linear
    layers' convolution and output x `linear_gain` so they move the logits), and the
    same model without its linear layers."""
    params = init_params(cfg, jax.random.key(seed))
    params["embed"] = params["embed"] * scale
    layers = list(params["layers"])
    for i in cfg.linear_layers:
        layers[i] = layers[i] | {k: layers[i][k] * linear_gain for k in ("conv", "w_out")}
    params["layers"] = tuple(layers)
    target, draft = root / "target", root / "draft"
    save_checkpoint(target, cfg, params, dtype="float32")
    keep = cfg.attention_layers
    draft_cfg = dataclasses.replace(cfg, num_layers=len(keep),
                                    layer_types=("full_attention",) * len(keep))  # fmt: skip
    save_checkpoint(draft, draft_cfg, params | {"layers": tuple(layers[i] for i in keep)},
                    dtype="float32")  # fmt: skip
    return target, draft


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    v = write_tokenizer(root / "tok")
    target, draft = write_pair(root, hybrid_config(v), seed=1, scale=30.0)
    for folder in (target, draft):
        for f in (root / "tok").iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
    return target, draft


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 40, 100)
    return [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in lengths]


@pytest.mark.slow
def test_greedy_speculative_equals_plain_decoding(pair, prompts):
    target, draft = pair
    plain = LLM(target, max_model_len=MAX_LEN, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    for name, shape in {
        "tree": dict(num_speculative_tokens=16, max_depth=5, topk=3),
        "chain": dict(num_speculative_tokens=5, max_depth=5, topk=1),
    }.items():
        spec = {"method": "draft_model", "model": str(draft), **shape}
        llm = LLM(target, max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        bad = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
        assert not bad, f"{name}: prompts {bad} differ from plain decoding"
        m = llm.get_metrics()
        print(name, {k: m[k] for k in ("num_draft_tokens", "num_accepted_tokens")})
        # Drafts are accepted in part (paths cut short commit the state of a prefix)
        # and rejected in part (the state must not take the rejected nodes).
        assert len(prompts) < m["num_accepted_tokens"] < 0.9 * m["num_draft_tokens"], m


@pytest.mark.slow
def test_first_two_tokens_match_the_hybrid_target_marginals(tmp_path):
    """>= 5k seeded requests (temperature 1), tree drafts from the layer-skipped draft."""
    cfg = hybrid_config(24)
    target, draft = write_pair(tmp_path, cfg, seed=3, scale=60.0)
    llm = LLM(
        target, max_model_len=32, max_num_seqs=64,
        speculative_config={"method": "draft_model", "model": str(draft),
                            "num_speculative_tokens": 8, "max_depth": 3, "topk": 2},
    )  # fmt: skip
    prompt, n = [3, 1, 4, 1, 5], 5000
    sp = [SamplingParams(max_tokens=2, ignore_eos=True, seed=i, temperature=1.0) for i in range(n)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * n, sp, use_tqdm=False)
    toks = np.array([o.outputs[0].token_ids for o in outs])
    assert toks.shape == (n, 2)
    assert llm.get_metrics()["num_accepted_tokens"] > 0.05 * n  # drafts were accepted

    assert_first_two_tokens_follow_the_target(target, cfg, prompt, toks)


@pytest.mark.parametrize("per_channel", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_chunked_form_equals_the_recurrence(per_channel):
    """`gated_delta_block` over a chain (causal mask) from a non-zero state equals the
    gated delta rule applied token by token, outputs and final state
    (`commit_states`): one decay per head (gated DeltaNet) or per key channel (KDA)."""
    import jax.numpy as jnp

    from specdec.kernels import linear_attention as la

    rng = np.random.default_rng(0)
    b, n, h, dk, dv = 2, 40, 3, 8, 5
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    q, k = la.l2norm(f(b, n, h, dk)) * dk**-0.5, la.l2norm(f(b, n, h, dk))
    v, s0 = f(b, n, h, dv), f(b, h, dk, dv)
    g = -jnp.abs(f(b, n, h, dk) if per_channel else f(b, n, h)) * 0.3
    beta = jax.nn.sigmoid(f(b, n, h))
    path = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (b, n, n))
    o, u, big_g = la.gated_delta_block(q, k, v, g, beta, s0, path)

    s, outs = s0, []
    for t in range(n):
        s = s * (jnp.exp(g[:, t])[..., None] if per_channel else jnp.exp(g[:, t])[..., None, None])
        delta = (v[:, t] - jnp.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t][..., None]
        s = s + k[:, t][..., None] * delta[..., None, :]
        outs.append(jnp.einsum("bhkv,bhk->bhv", s, q[:, t]))
    np.testing.assert_allclose(np.asarray(o), np.stack(outs, 1), atol=1e-4, rtol=1e-4)

    state = la.LinearState(conv=jnp.zeros((1, b, 3, 4)), rec=s0[None])
    rec = la.LinearBlock(x=jnp.zeros((1, b, n, 4)), k=k[None], u=u[None], g=big_g[None])
    slots, starts = jnp.arange(b, dtype=jnp.int32), jnp.ones(b, jnp.int32)
    done = la.commit_states(state, rec, slots, starts, jnp.full(b, n, jnp.int32))
    np.testing.assert_allclose(np.asarray(done.rec[0]), np.asarray(s), atol=1e-4, rtol=1e-4)


def test_guards_name_what_is_wrong():
    from specdec.kernels.megakernel.shard import check_shardable

    with pytest.raises(ValueError, match="layer_types must list 4 entries"):
        hybrid_config(64, layer_types=("linear_attention",) * 3)
    with pytest.raises(ValueError, match="one of"):
        hybrid_config(64, layer_types=("linear_attention", "mamba") * 2)
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        hybrid_config(64, linear_num_key_heads=3)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        hybrid_config(64, partial_rotary_factor=0.05)
    check_shardable(hybrid_config(64), 1)  # gated DeltaNet runs in the megakernel
    kda = hybrid_config(64, linear_kind="kda", linear_num_value_heads=2)
    with pytest.raises(ValueError, match="gated DeltaNet.*kernel='xla'"):
        check_shardable(kda, 1)
    with pytest.raises(ValueError, match="splits linear_num_key_heads"):
        check_shardable(hybrid_config(64), 4)


@pytest.mark.slow
def test_a_hybrid_draft_is_refused_with_a_clear_error(tmp_path):
    cfg = hybrid_config(write_tokenizer(tmp_path / "tok"))
    target, _ = write_pair(tmp_path, cfg, seed=0, scale=1.0)
    for f in (tmp_path / "tok").iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    spec = {"method": "draft_model", "model": str(target), "num_speculative_tokens": 4}
    with pytest.raises(ValueError, match="draft model with linear-attention layers"):
        LLM(target, max_model_len=32, max_num_seqs=2, speculative_config=spec)


def test_the_kv_budget_counts_the_linear_state():
    """The per-slot recurrent state comes out of `kv_cache_memory` before K/V blocks,
    and caps the slots when it would take more than half."""
    from specdec.kernels import linear_attention as la
    from specdec.workers import kv_pool

    cfg = hybrid_config(64)
    state = la.bytes_per_slot(cfg, np.float32)
    assert state == 2 * (3 * (2 * 16 + 32) * 4 + 4 * 8 * 8 * 4)
    budget, block = 200_000, 16 * 2 * 2 * 2 * 16 * 4  # 16 positions of 2 layers' K and V
    slots, blocks = kv_pool(cfg, None, "float32", budget=budget, num_slots=256, max_len=32,
                            kernel="xla")  # fmt: skip
    assert slots == (budget // 2) // state < 256
    assert blocks == (budget - slots * state) // block
    with pytest.raises(ValueError, match="After the linear-attention state of 1 slots"):
        kv_pool(cfg, None, "float32", budget=2 * state, num_slots=8, max_len=32, kernel="xla")


@pytest.mark.slow
def test_megakernel_target_equals_xla(pair, prompts):
    """`kernel="megakernel"` on the hybrid target (Pallas interpret mode): the DeltaNet
    layers in the kernel, their state committed from its record along accepted tree
    paths; greedy output equals the XLA target's, tree speculation on."""
    target, draft = pair
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 8,
            "max_depth": 4, "topk": 2}  # fmt: skip
    outs = {}
    for kernel in ("xla", "megakernel"):
        llm = LLM(target, max_model_len=MAX_LEN, max_num_seqs=4, speculative_config=spec,
                  kernel=kernel)  # fmt: skip
        assert llm.engine.target.kernel == kernel
        res = llm.generate(prompts[:8], GREEDY, use_tqdm=False)
        outs[kernel] = [o.outputs[0].token_ids for o in res]
        m = llm.get_metrics()
        assert 8 < m["num_accepted_tokens"] < m["num_draft_tokens"], m
    assert outs["megakernel"] == outs["xla"]
