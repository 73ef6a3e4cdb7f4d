"""Model shape and numerics, independent of where the weights come from.

`ModelConfig` is what every compute path (the pure-JAX reference in
`transformer.py`, the megakernel, the AOT compiler) needs to know about a
decoder-only transformer. It never reads files: `specdec/checkpoint.py` turns a
Hugging Face `config.json` into one.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Literal


class Architecture(enum.StrEnum):
    """Supported decoder families (Hugging Face `architectures[0]` names)."""

    LLAMA = "LlamaForCausalLM"
    MISTRAL = "MistralForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    QWEN3_MOE = "Qwen3MoeForCausalLM"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_scaling.rope_type == "llama3"`)."""

    rope_type: Literal["llama3"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type != "llama3":
            raise ValueError(f"rope_type must be 'llama3', got {self.rope_type!r}.")
        if self.factor <= 0 or self.low_freq_factor <= 0:
            raise ValueError(
                f"rope_scaling factor and low_freq_factor must be > 0, got "
                f"{self.factor} and {self.low_freq_factor}."
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})."
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE).

    Example (a tiny Llama): vocab_size=256, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16.
    """

    vocab_size: int  # rows of the embedding table
    hidden_size: int  # D, the residual stream width
    intermediate_size: int  # F, dense MLP width (unused by MoE layers)
    num_layers: int  # L
    num_heads: int  # H query heads
    num_kv_heads: int  # K/V heads (GQA group = num_heads // num_kv_heads)
    head_dim: int  # per-head width; need not equal hidden_size // num_heads
    architecture: Architecture = Architecture.LLAMA
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # keys older than this many positions are masked
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    num_experts: int = 0  # 0 = dense MLP in every layer
    num_experts_per_tok: int = 0  # routed experts per token (top-k)
    moe_intermediate_size: int = 0  # width of each expert's MLP
    norm_topk_prob: bool = False  # renormalise the top-k router weights to sum to 1
    # DeepSeek-V3 routing (`transformer.route`): sigmoid scores, a per-expert
    # correction bias that steers the choice only, experts picked within the
    # `topk_group` best of `n_group` groups, weights scaled by `routed_scaling_factor`.
    scoring_func: Literal["softmax", "sigmoid"] = "softmax"
    expert_bias: bool = False  # layers/e_bias [L, E]: the choice's correction bias
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})."
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}.")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}.")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                    f"got {self.num_experts_per_tok}."
                )
            if self.moe_intermediate_size < 1:
                raise ValueError(
                    f"moe_intermediate_size must be >= 1, got {self.moe_intermediate_size}."
                )
            if self.scoring_func not in ("softmax", "sigmoid"):
                raise ValueError(
                    f"scoring_func must be 'softmax' or 'sigmoid', got {self.scoring_func!r}."
                )
            groups, per = self.n_group, self.num_experts // max(self.n_group, 1)
            if groups < 1 or self.num_experts % groups:
                raise ValueError(
                    f"n_group ({groups}) must be >= 1 and divide num_experts ({self.num_experts})."
                )
            if not 1 <= self.topk_group <= groups:
                raise ValueError(f"topk_group must be in [1, n_group={groups}], got "
                                 f"{self.topk_group}.")  # fmt: skip
            if groups > 1 and (per < 2 or self.num_experts_per_tok > self.topk_group * per):
                raise ValueError(
                    f"group-limited routing needs >= 2 experts per group and "
                    f"num_experts_per_tok <= topk_group x experts per group "
                    f"({self.topk_group} x {per}), got {self.num_experts_per_tok}."
                )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included (tied counted once)."""
        d, hd = self.hidden_size, self.head_dim
        attn = d * hd * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += hd * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * hd
        if self.is_moe:
            mlp = d * self.num_experts + self.num_experts * 3 * d * self.moe_intermediate_size
            mlp += self.num_experts if self.expert_bias else 0
        else:
            mlp = 3 * d * self.intermediate_size
        per_layer = attn + mlp + 2 * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d
