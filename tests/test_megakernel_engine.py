"""`LLM(kernel=...)`: the megakernel (Pallas interpret mode on CPU) through the engine."""

import numpy as np
import pytest
from fixtures import tiny_config, tiny_pair, write_model

from specdec import LLM, SamplingParams
from specdec.kernels.config import Architecture

MAX_LEN = 96


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return tiny_pair(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [{"prompt_token_ids": rng.integers(0, 300, n).tolist()} for n in rng.integers(1, 40, 20)]


def generate(target_dir, prompts, kernel, spec, params):
    llm = LLM(target_dir, max_model_len=MAX_LEN, max_num_seqs=8, speculative_config=spec,
              kernel=kernel)  # fmt: skip
    assert llm.engine.target.kernel == kernel
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.slow
def test_greedy_megakernel_equals_xla_on_20_prompts(target_dir, prompts):
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 8,
            "max_depth": 4, "topk": 2}  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    xla = generate(target_dir, prompts, "xla", spec, greedy)
    mega = generate(target_dir, prompts, "megakernel", spec, greedy)
    assert mega == xla
    assert all(len(t) == 16 for t in mega)


@pytest.mark.slow
def test_plain_and_sampled_decode_match(target_dir, prompts):
    """No drafter (N = 0 nodes) and seeded sampling rows: same tokens on both backends."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)
    assert generate(target_dir, prompts[:4], "megakernel", None, params) == generate(
        target_dir, prompts[:4], "xla", None, params
    )


def test_auto_is_xla_on_cpu(target_dir):
    llm = LLM(target_dir, max_model_len=MAX_LEN, max_num_seqs=1)
    assert llm.engine.target.kernel == "xla"


def test_kernel_errors(target_dir, tmp_path):
    with pytest.raises(
        ValueError, match="kernel must be 'auto', 'megakernel' or 'xla', got 'cuda'"
    ):
        LLM(target_dir, max_model_len=MAX_LEN, kernel="cuda")
    moe = tiny_config(
        architecture=Architecture.QWEN3_MOE, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, qk_norm=True,
    )  # fmt: skip
    write_model(tmp_path / "moe", moe)
    assert LLM(tmp_path / "moe", max_model_len=MAX_LEN).engine.target.kernel == "xla"


@pytest.mark.slow
def test_moe_target_on_the_megakernel_equals_xla(tmp_path, prompts):
    """A Qwen3-MoE target, routing in the kernel: greedy tree speculation gives the XLA
    target's tokens (its draft: the same model)."""
    moe = tiny_config(
        architecture=Architecture.QWEN3_MOE, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, qk_norm=True,
    )  # fmt: skip
    write_model(tmp_path / "moe", moe)
    spec = {"method": "draft_model", "model": str(tmp_path / "moe"), "num_speculative_tokens": 6,
            "max_depth": 3, "topk": 2}  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    xla = generate(tmp_path / "moe", prompts[:6], "xla", spec, greedy)
    assert generate(tmp_path / "moe", prompts[:6], "megakernel", spec, greedy) == xla


@pytest.mark.slow
def test_penalised_rows_stay_in_the_kernel(target_dir, prompts, monkeypatch):
    """A repetition penalty no longer sends the step to XLA: the kernel runs every step
    and `reference.decide` redoes its greedy walk on the penalised logits."""
    from specdec import workers

    calls = []
    kernel_step = workers.VERIFY_BACKENDS["megakernel"]

    def spy(*a, **k):
        calls.append(1)
        return kernel_step(*a, **k)

    monkeypatch.setitem(workers.VERIFY_BACKENDS, "megakernel", spy)
    spec = {"method": "draft_model", "model": str(target_dir), "num_speculative_tokens": 4,
            "max_depth": 3, "topk": 2}  # fmt: skip
    penalised = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               repetition_penalty=1.5)  # fmt: skip
    mega = generate(target_dir, prompts[:3], "megakernel", spec, penalised)
    assert calls, "the megakernel never ran"
    steps = len(calls)
    xla = generate(target_dir, prompts[:3], "xla", spec, penalised)
    assert mega == xla and len(calls) == steps  # the XLA engine never called the kernel
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert generate(target_dir, prompts[:3], "xla", spec, plain) != xla  # the penalty bites


@pytest.mark.slow
def test_cli_megakernel_with_the_bundled_pairs_defaults(capsys):
    """`specdec generate --kernel megakernel` with the demo pair's own defaults (penalty
    1.2) runs the kernel, says so in its JSON, and prints what `--kernel xla` prints."""
    import json

    from specdec.cli import main

    argv = ["generate", "def fib(n):", "--max-tokens", "24", "--json"]
    results = {}
    for kernel in ("megakernel", "xla"):
        assert main([*argv, "--kernel", kernel]) == 0
        results[kernel] = json.loads(capsys.readouterr().out)
    assert results["megakernel"]["kernel"] == "megakernel" and results["xla"]["kernel"] == "xla"
    assert results["megakernel"]["token_ids"] == results["xla"]["token_ids"]
    assert len(results["xla"]["token_ids"]) == 24


@pytest.mark.slow
def test_deepseek_target_on_the_megakernel_equals_xla(tmp_path, prompts):
    """A DeepSeek-V3-class target (MLA over the latent cache, YaRN, routed + shared
    experts after a dense layer) on the megakernel: greedy tree speculation with a
    partly right draft gives the XLA target's tokens."""
    from fixtures import noisy_copy, write_tokenizer
    from test_deepseek_spec import deepseek_config

    v = write_tokenizer(tmp_path / "ds")
    target = write_model(tmp_path / "ds", deepseek_config(v), seed=1, scale=30.0)
    draft = noisy_copy(target, tmp_path / "noisy", noise=0.3)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 8,
            "max_depth": 4, "topk": 2}  # fmt: skip
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    xla = generate(target, prompts[:6], "xla", spec, greedy)
    assert generate(target, prompts[:6], "megakernel", spec, greedy) == xla
