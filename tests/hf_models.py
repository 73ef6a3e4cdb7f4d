"""Tiny random Hugging Face checkpoints, one per supported family, for parity tests.

Each `Variant` names a transformers family and its config kwargs; `write_model` builds
the model with a fixed torch seed, re-initialises every weight at a scale where each part
of the network moves the logits (HF's default std 0.02, unit RMSNorm weights and zero
biases would hide RoPE, norm and bias bugs under a 1e-4 tolerance), and saves it with
`save_pretrained` (safetensors; transformers 5 writes `rope_parameters` and
`num_local_experts`, the Hugging Face hub's older checkpoints `rope_theta`/`rope_scaling`
and `num_experts`).

`ModelZoo` writes each variant at most once per pytest session: the `hf_zoo` fixture is
session-scoped and the files live under the session's base temp dir, so two test modules
that both bind the fixture share the same folders.

    zoo["qwen3_moe"]            -> Path of the HF folder (config.json, model.safetensors, ...)
    zoo.torch_model("qwen3_moe") -> the same weights loaded back by transformers (eager, f32)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

# transformers / torch / tokenizers are test-only and imported lazily (import cost).
_VOCAB_SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2 (bos = 1, eos = 2)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One tiny checkpoint: how to build its config and how to save it."""

    family: str  # transformers model family: llama / mistral / qwen2 / qwen3 / qwen3_moe
    config: dict  # kwargs of the family's `*Config`
    seed: int = 0  # torch.manual_seed before building and re-initialising the model
    max_shard_size: str | None = None  # e.g. "20KB" -> model.safetensors.index.json + shards


_COMMON = dict(
    num_hidden_layers=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    attn_implementation="eager",
    dtype="float32",
)

_LLAMA = dict(
    _COMMON,
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
)

_QWEN3 = dict(
    _COMMON,
    vocab_size=300,  # not a power of two
    hidden_size=48,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,  # != hidden_size // num_attention_heads (12)
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
)

_QWEN3_MOE = dict(
    _QWEN3,
    moe_intermediate_size=32,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)

_DEEPSEEK_V3 = dict(
    _COMMON,
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=40,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,  # max_position_embeddings / factor
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

# Hybrid linear attention: gated DeltaNet layers (2 key heads serving 4 value heads, a
# 4-tap convolution) and gated full attention with partial RoPE (a quarter of 16 dims).
_QWEN3_5 = dict(
    _COMMON,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
)

# Kimi Linear: KDA layers (per-channel decay, low-rank gates) around MLA layers without
# positions, sigmoid routing limited to 1 of 2 groups with a shared expert, a dense
# first layer.
_KIMI_LINEAR = dict(
    _COMMON,
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    pad_token_id=0,
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    num_local_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    linear_num_heads=4,
    linear_head_dim=8,
    linear_conv_kernel_dim=4,
)

VARIANTS: dict[str, Variant] = {
    "llama": Variant("llama", _LLAMA),
    # MHA (kv heads == heads) and a shared embedding / LM head matrix.
    "llama_tied": Variant(
        "llama", dict(_LLAMA, num_key_value_heads=4, tie_word_embeddings=True), seed=1
    ),
    "llama_mqa": Variant("llama", dict(_LLAMA, num_key_value_heads=1), seed=2),
    # Llama-3 frequency scaling with a small original context, so that the scaled
    # frequencies already differ at the positions the tests use (see test_parity.py).
    "llama3_rope": Variant(
        "llama",
        dict(
            _LLAMA,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500_000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        seed=3,
    ),
    # Explicit head_dim != hidden / heads, as in Mistral-Nemo.
    "mistral": Variant(
        "mistral",
        dict(
            _LLAMA,
            head_dim=24,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        seed=4,
    ),
    # A window shorter than the test prompts, so that it masks keys in prefill and decode.
    "mistral_swa": Variant("mistral", dict(_LLAMA, sliding_window=6), seed=9),
    "qwen2": Variant(
        "qwen2",
        dict(
            _LLAMA,
            vocab_size=300,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        ),
        seed=5,
    ),
    "qwen3": Variant("qwen3", _QWEN3, seed=6),
    "qwen3_moe": Variant(
        "qwen3_moe",
        dict(_QWEN3_MOE, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
        seed=7,
    ),
    "qwen3_moe_nonorm": Variant(
        "qwen3_moe",
        dict(_QWEN3_MOE, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False),
        seed=8,
    ),
    # The same weights as "llama", saved as model.safetensors.index.json + several shards.
    "llama_sharded": Variant("llama", _LLAMA, max_shard_size="20KB"),
    # DeepSeek-V3: MLA with a low-rank query path, YaRN (with mscale_all_dim, so the
    # softmax scale moves too), sigmoid routing limited to 1 of 2 groups, a shared
    # expert, and a dense first layer.
    "deepseek_v3": Variant("deepseek_v3", _DEEPSEEK_V3, seed=10),
    # Without the query low-rank path, groups or dense layers; default RoPE.
    "deepseek_v3_plain": Variant(
        "deepseek_v3",
        dict(
            _DEEPSEEK_V3,
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=0,
            n_routed_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        seed=11,
    ),  # fmt: skip
    "qwen3_5": Variant("qwen3_5", _QWEN3_5, seed=12),
    # Qwen3-Next: fused q|k|v|z and b|a projections, sparse MoE with a gated shared
    # expert; three linear layers before the full one (transformers' default pattern).
    "qwen3_next": Variant(
        "qwen3_next",
        dict(
            _QWEN3_5,
            layer_types=None,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
        ),
        seed=13,
    ),
    "kimi_linear": Variant("kimi_linear", _KIMI_LINEAR, seed=14),
}


def _classes(family: str):
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "qwen3_5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
        "kimi_linear": (transformers.KimiLinearConfig, transformers.KimiLinearForCausalLM),
    }[family]


def _reinit_(model) -> None:
    """Re-draw every weight so that norms, biases and attention all matter.

    Matrices, embeddings included, ~ N(0, 1/fan_in) (fan_in is the last axis, also for
    fused expert tensors [E, out, in]; a larger tied embedding would make every model
    echo its input token), RMSNorm weights ~ 1 + 0.5 N(0, 1), biases
    ~ 0.5 N(0, 1). Tied LM heads follow the embedding (one shared Parameter).
    DeepSeek-V3's routing correction bias (a buffer, zero when built) ~ 0.5 N(0, 1), so
    that it steers which experts are chosen.
    """
    import torch

    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn_like(b))
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.5 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)


def _write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over "<unk> <s> </s> t3 ... t{V-1}" (one token per word)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_VOCAB_SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(_VOCAB_SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def write_model(name: str, path: Path) -> Path:
    """Build variant `name` with its seed and save it (weights + tokenizer) to `path`."""
    import torch

    variant = VARIANTS[name]
    config_cls, model_cls = _classes(variant.family)
    torch.manual_seed(variant.seed)
    config = config_cls(**variant.config)
    model = model_cls(config).to(torch.float32).eval()
    _reinit_(model)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if variant.max_shard_size is None else {"max_shard_size": variant.max_shard_size}
    model.save_pretrained(path, **kwargs)
    _write_tokenizer(path, config.vocab_size)
    return path


def load_torch_model(path: Path):
    """Load an HF folder back with transformers: float32, eager attention, eval mode.

    EOS is switched off in its generation config: `generate` merges the model's defaults
    into any config passed to it, so `eos_token_id=None` there alone does not stop it.
    """
    import torch
    import transformers

    # Tiny models on a shared 2-core host: intra-op threads only contend (3x48 greedy
    # tokens took 5-11 s with 2 threads, 0.4 s with 1).
    torch.set_num_threads(1)

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    model.generation_config.eos_token_id = None
    return model.eval()


class ModelZoo:
    """Lazily written HF folders under `root`, one per variant; see the module docstring."""

    _torch_models: dict[Path, object] = {}  # shared by every zoo in the process

    def __init__(self, root: Path):
        self.root = Path(root)

    def __getitem__(self, name: str) -> Path:
        path = self.root / name
        if not (path / "config.json").exists():
            write_model(name, path)
        return path

    def torch_model(self, name: str):
        path = self[name]
        if path not in self._torch_models:
            self._torch_models[path] = load_torch_model(path)
        return self._torch_models[path]


@pytest.fixture(scope="session")
def hf_zoo(tmp_path_factory) -> ModelZoo:
    """Session-wide `ModelZoo` (bind it in a test module with `hf_zoo = hf_models.hf_zoo`)."""
    return ModelZoo(tmp_path_factory.getbasetemp() / "hf_models")


# ---------------------------------------------------------------------------------------
# Helpers shared by the tests.


def random_prompts(lengths, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Random prompts of the given lengths, avoiding the special ids 0-2."""
    rng = np.random.default_rng(seed)
    return [rng.integers(len(_VOCAB_SPECIALS), vocab_size, size=n).tolist() for n in lengths]


def pad_right(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded batch: ([[5, 6], [7]] -> tokens [[5, 6], [7, pad]], lengths [2, 1])."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), int(lengths.max())), pad_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lengths


def hf_logits(model, prompt: list[int]) -> np.ndarray:
    """f32[T, V] logits of one unpadded prompt."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt], dtype=torch.long))
    return out.logits[0].float().numpy()


def hf_greedy(
    model, prompt: list[int], max_new_tokens: int, repetition_penalty: float = 1.0
) -> list[int]:
    """`model.generate` greedy continuation of one prompt, EOS disabled (exact length)."""
    import torch
    from transformers import GenerationConfig

    gen = GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        repetition_penalty=repetition_penalty,
    )
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], dtype=torch.long), generation_config=gen)
    new = out[0, len(prompt) :].tolist()
    if len(new) != max_new_tokens:
        raise AssertionError(f"HF stopped after {len(new)} of {max_new_tokens} tokens.")
    return new


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def write_config(path: Path, config: dict) -> None:
    (Path(path) / "config.json").write_text(json.dumps(config, indent=2))


def write_dflash(
    folder: Path, *, vocab: int, hidden: int = 32, layers: int = 2, target_layer_ids=(1, 3),
    num_target_layers: int = 6, block_size: int = 8, mask_token_id: int = 7, seed: int = 0,
    nested: bool = True, v2: dict | None = None, **extra,
):  # fmt: skip
    """A random DFlash drafter in the `dflash` package's own format, written by its
    `save_pretrained` (every tensor, norms included, drawn at random so each one
    matters); returns the torch model. The block fields go in `dflash_config`
    (`nested`) or at the config's top level. `v2`: a DFlash2 drafter with these
    fields (conv_kernel_size, conv_group_size, selector_rank, selector_top_k)."""
    import dflash.model as dflash_pkg  # test-only: `pip install --no-deps dflash`
    import torch
    import transformers

    fields = {"block_size": block_size, "mask_token_id": mask_token_id,
              "target_layer_ids": list(target_layer_ids)} | (v2 or {}) | extra  # fmt: skip
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_theta=10000.0,
    )  # fmt: skip
    config.num_target_layers = num_target_layers
    config.architectures = ["DFlash2DraftModel" if v2 else "DFlashDraftModel"]
    if nested:
        config.dflash_config = fields
    else:
        for k, v in fields.items():
            setattr(config, k, v)
    torch.manual_seed(seed)
    cls = dflash_pkg.DFlash2DraftModel if v2 else dflash_pkg.DFlashDraftModel
    model = cls(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.5) + (p.ndim == 1))
    model.save_pretrained(folder)
    return model
