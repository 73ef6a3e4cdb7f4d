"""Speculative decoding with a DeepSeek-V3-class target (MLA over the latent cache,
sigmoid group-limited routing, shared experts, a dense first layer): greedy output
equals plain decoding for chains and trees, and sampled output follows the target's
distribution (>= 5k seeded requests)."""

import dataclasses
import shutil

import numpy as np
import pytest
from fixtures import noisy_copy, tiny_config, write_model, write_tokenizer
from test_spec_engine import assert_first_two_tokens_follow_the_target

from specdec import LLM, SamplingParams
from specdec.kernels.config import Architecture, RopeScaling

MAX_LEN = 96
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def deepseek_config(vocab_size: int, **overrides):
    """A tiny DeepSeek-V3: MLA with a low-rank query, YaRN, 8 experts in 2 groups."""
    return dataclasses.replace(
        tiny_config(vocab_size),
        architecture=Architecture.DEEPSEEK_V3, num_kv_heads=1, head_dim=8, kv_lora_rank=16,
        q_lora_rank=24, qk_nope_head_dim=8, v_head_dim=8, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=16, norm_topk_prob=True, scoring_func="sigmoid",
        expert_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        n_shared_experts=1, first_k_dense_replace=1,
        rope_scaling=RopeScaling(rope_type="yarn", factor=4.0,
                                 original_max_position_embeddings=64, mscale_all_dim=1.0),
        **overrides,
    )  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(DeepSeek-V3 target, a noisy copy of it as draft, an unrelated tiny Llama draft),
    all sharing one tokenizer."""
    root = tmp_path_factory.mktemp("deepseek")
    v = write_tokenizer(root / "target")
    target = write_model(root / "target", deepseek_config(v), seed=1, scale=30.0)
    noisy = noisy_copy(target, root / "noisy", noise=0.3)
    llama = root / "llama"
    shutil.copytree(target, llama, ignore=shutil.ignore_patterns("*.safetensors*", "config.json"))
    write_model(llama, tiny_config(v), seed=2, scale=30.0)
    return target, noisy, llama


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, 50)
    return [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in lengths]


@pytest.mark.slow
def test_greedy_speculative_equals_plain_decoding(pair, prompts):
    target, noisy, llama = pair
    plain = LLM(target, max_model_len=MAX_LEN, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    # The close draft's trees are accepted in runs, on all 50 prompts; an unrelated
    # Llama draft (another architecture, same tokenizer) proposes chains, on 12.
    runs = {
        "tree": (noisy, dict(num_speculative_tokens=16, max_depth=5, topk=3), 50),
        "chain": (llama, dict(num_speculative_tokens=5, max_depth=5, topk=1), 12),
    }
    for name, (draft, shape, n) in runs.items():
        spec = {"method": "draft_model", "model": str(draft), **shape}
        llm = LLM(target, max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec)
        outs = llm.generate(prompts[:n], GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in outs]
        bad = [i for i, (a, b) in enumerate(zip(got, want[:n], strict=True)) if a != b]
        assert not bad, f"{draft.name} {name}: prompts {bad} differ from plain decoding"
        if draft == noisy:  # a close draft is accepted: verify really ran trees
            assert llm.get_metrics()["num_accepted_tokens"] > len(prompts)


@pytest.mark.slow
def test_first_two_tokens_match_the_deepseek_target_marginals(tmp_path):
    """>= 5k seeded requests (temperature 1), tree drafts from a less peaky copy."""
    cfg = deepseek_config(24, num_layers=2)
    target = write_model(tmp_path / "t", cfg, seed=3, scale=60.0)
    draft = write_model(tmp_path / "d", cfg, seed=3, scale=30.0)
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


def test_megakernel_takes_mla_with_rope_only():
    """DeepSeek-V3's MLA runs in the megakernel (`megakernel.mla`); MLA without
    positions (Kimi Linear's) is refused by name."""
    from specdec.kernels.megakernel.shard import check_shardable

    check_shardable(deepseek_config(64), 1)
    check_shardable(deepseek_config(64), 4)
    with pytest.raises(ValueError, match="position-free MLA must use kernel='xla'"):
        check_shardable(deepseek_config(64, use_rope=False), 1)
