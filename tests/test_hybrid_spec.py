"""Speculative decoding with a hybrid linear-attention target (Qwen3.5 class: gated
DeltaNet layers with a recurrent and a convolution state, gated full attention with
partial RoPE): greedy output equals plain decoding for trees and chains on 100
prompts, and sampled output follows the target's distribution (>= 5k seeded requests).

The draft is the target without its linear-attention layers (a dense model of the
same family sharing its full-attention layers, embeddings and head), so its trees are
often right and verification really commits partial paths through the linear state."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from fixtures import write_tokenizer
from test_spec_engine import chi2_pvalue

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
    import jax.numpy as jnp

    from specdec.checkpoint import load_model
    from specdec.kernels.transformer import prefill_logits
    from specdec.verify.sampling import sampling_probs

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

    _, weights = load_model(target)
    v = cfg.vocab_size
    seqs = np.array([prompt + [t] for t in range(v)])
    logits = prefill_logits(weights, cfg, seqs, np.full(v, len(prompt) + 1))
    probs = lambda lg: np.asarray(  # noqa: E731
        sampling_probs(lg, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0), jnp.float32(0.0))
    )
    p1 = probs(logits[0, len(prompt) - 1])
    p2 = p1 @ probs(logits[:, len(prompt)])
    c1, c2 = np.bincount(toks[:, 0], minlength=v), np.bincount(toks[:, 1], minlength=v)
    assert chi2_pvalue(c1, p1) > 1e-3
    assert chi2_pvalue(c2, p2) > 1e-3
    assert 0.5 * np.abs(c2 / n - p2).sum() < 3 * math.sqrt(v / n)
