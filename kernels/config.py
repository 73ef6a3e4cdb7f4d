"""Model shape and numerics, independent of where the weights come from.

`ModelConfig` is what every compute path (the pure-JAX reference in
`transformer.py`, the megakernel, the AOT compiler) needs to know about a
decoder-only transformer. It never reads files: `specdec/checkpoint.py` turns a
Hugging Face `config.json` into one.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Literal


class Architecture(enum.StrEnum):
    """Supported decoder families (Hugging Face `architectures[0]` names)."""

    LLAMA = "LlamaForCausalLM"
    MISTRAL = "MistralForCausalLM"
    QWEN2 = "Qwen2ForCausalLM"
    QWEN3 = "Qwen3ForCausalLM"
    QWEN3_MOE = "Qwen3MoeForCausalLM"
    DEEPSEEK_V3 = "DeepseekV3ForCausalLM"
    QWEN3_5 = "Qwen3_5ForCausalLM"
    QWEN3_NEXT = "Qwen3NextForCausalLM"
    KIMI_LINEAR = "KimiLinearForCausalLM"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: Llama-3's (`rope_type="llama3"`: factor, low / high
    frequency factors) or YaRN (`"yarn"`, DeepSeek-V3: factor, beta_fast / beta_slow,
    mscale / mscale_all_dim or an explicit attention_factor, truncate).
    `original_max_position_embeddings` is the pretraining context of both."""

    rope_type: Literal["llama3", "yarn"] = "llama3"
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0 = unset
    mscale_all_dim: float = 0.0  # 0 = unset
    attention_factor: float | None = None  # None = from factor and the two mscales
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ("llama3", "yarn"):
            raise ValueError(f"rope_type must be 'llama3' or 'yarn', got {self.rope_type!r}.")
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(
                f"rope_scaling factor and original_max_position_embeddings must be > 0, "
                f"got {self.factor} and {self.original_max_position_embeddings}."
            )
        if self.rope_type == "llama3":
            if self.low_freq_factor <= 0:
                raise ValueError(
                    f"rope_scaling low_freq_factor must be > 0, got {self.low_freq_factor}."
                )
            if self.high_freq_factor <= self.low_freq_factor:
                raise ValueError(
                    f"rope_scaling high_freq_factor ({self.high_freq_factor}) must exceed "
                    f"low_freq_factor ({self.low_freq_factor})."
                )
        elif self.beta_fast <= 0 or self.beta_slow <= 0:
            raise ValueError(
                f"yarn beta_fast and beta_slow must be > 0, got {self.beta_fast} and "
                f"{self.beta_slow}."
            )

    def yarn_attention_factor(self) -> float:
        """YaRN's factor on the rotated dims (transformers multiplies cos and sin by it)."""
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction, 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of a decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE /
    DeepSeek-V3).

    Example (a tiny Llama): vocab_size=256, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16.

    Multi-head latent attention (MLA, DeepSeek-V2/V3) is on when `kv_lora_rank` > 0.
    Its K/V are one latent per token, so `num_kv_heads` is 1 (every query head reads
    it: the absorbed form is multi-query attention) and `head_dim` is the rotary
    width, `qk_rope_head_dim` (as transformers sets it).
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
    n_shared_experts: int = 0  # an always-on MLP of n x moe_intermediate_size in MoE layers
    first_k_dense_replace: int = 0  # the first k layers keep a dense MLP (DeepSeek-V3)
    # Multi-head latent attention (class docstring); 0 = ordinary attention.
    kv_lora_rank: int = 0  # width of the compressed K/V latent the cache holds
    q_lora_rank: int = 0  # 0 = queries projected directly (no low-rank query path)
    qk_nope_head_dim: int = 0  # per-head query/key width without RoPE
    v_head_dim: int = 0  # per-head value width
    # Hybrid linear attention (Qwen3.5 / Qwen3-Next, `kernels/linear_attention.py`):
    # each layer's token mixer, "linear_attention" (gated DeltaNet) or
    # "full_attention"; None = every layer full attention.
    layer_types: tuple[str, ...] | None = None
    linear_num_key_heads: int = 0  # query / key heads of a DeltaNet layer
    linear_num_value_heads: int = 0  # value heads (a multiple of the key heads)
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4  # taps of the short causal convolution
    # "gated_deltanet" (Qwen3.5 / Qwen3-Next: one decay per head, SiLU output gate) or
    # "kda" (Kimi Delta Attention: one decay per key channel, sigmoid output gate,
    # low-rank forget and output gates; as many value heads as key heads).
    linear_kind: Literal["gated_deltanet", "kda"] = "gated_deltanet"
    use_rope: bool = True  # False: attention without positions (Kimi Linear's MLA)
    attn_output_gate: bool = False  # attention output times sigmoid(x @ wg) (Qwen3.5)
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim x this dims
    shared_expert_intermediate_size: int = 0  # 0 = n_shared_experts x moe_intermediate_size
    shared_expert_gate: bool = False  # the shared expert times sigmoid(x @ s_router)

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
        if self.kv_lora_rank:
            if self.num_kv_heads != 1:
                raise ValueError(
                    f"multi-head latent attention (kv_lora_rank > 0) reads one latent per "
                    f"token: num_kv_heads must be 1, got {self.num_kv_heads}."
                )
            for name in ("qk_nope_head_dim", "v_head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1 with kv_lora_rank > 0.")
            if self.attention_bias or self.qk_norm:
                raise ValueError("attention_bias and qk_norm are not supported with MLA.")
            if self.q_lora_rank < 0:
                raise ValueError(f"q_lora_rank must be >= 0, got {self.q_lora_rank}.")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # hashable
            self._check_hybrid()
        rot = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rot < 2 or rot % 2:
            raise ValueError(
                f"partial_rotary_factor must be in (0, 1] and leave an even rotary width >= 2 "
                f"(head_dim {self.head_dim} x {self.partial_rotary_factor} = {rot})."
            )
        if not 0 <= self.first_k_dense_replace <= self.num_layers:
            raise ValueError(
                f"first_k_dense_replace must be in [0, num_layers={self.num_layers}], got "
                f"{self.first_k_dense_replace}."
            )
        if self.n_shared_experts < 0:
            raise ValueError(f"n_shared_experts must be >= 0, got {self.n_shared_experts}.")
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

    def _check_hybrid(self) -> None:
        kinds = ("linear_attention", "full_attention")
        if len(self.layer_types) != self.num_layers or any(t not in kinds for t in
                                                           self.layer_types):  # fmt: skip
            raise ValueError(
                f"layer_types must list {self.num_layers} entries (num_layers), each one of "
                f"{list(kinds)}; got {list(self.layer_types)}."
            )
        if not self.is_hybrid:
            return
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 when a layer is linear_attention.")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple "
                f"of linear_num_key_heads ({self.linear_num_key_heads})."
            )
        if self.linear_kind not in ("gated_deltanet", "kda"):
            raise ValueError(
                f"linear_kind must be 'gated_deltanet' or 'kda', got {self.linear_kind!r}."
            )
        if self.linear_kind == "kda" and (
            self.linear_num_key_heads != self.linear_num_value_heads
            or self.linear_key_head_dim != self.linear_value_head_dim
        ):
            raise ValueError("kda layers have as many value heads as key heads, of one width.")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError(
                f"linear_conv_kernel_dim must be >= 2, got {self.linear_conv_kernel_dim}."
            )
        if self.sliding_window is not None:
            raise ValueError("linear-attention layers do not combine with sliding_window.")

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention (gated DeltaNet) with a recurrent state."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def linear_layer(self, i: int) -> bool:
        return self.is_hybrid and self.layer_types[i] == "linear_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers with softmax attention (the ones the KV cache holds)."""
        return tuple(i for i in range(self.num_layers) if not self.linear_layer(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.linear_layer(i))

    @property
    def num_cache_layers(self) -> int:
        """Layers whose K/V the cache holds: all of them but the linear-attention ones."""
        return len(self.attention_layers)

    def cache_layer(self, i: int) -> int:
        """Layer i's index among the cached (attention) layers or, for a linear layer,
        among the linear layers (the recurrent state's index)."""
        kind = self.linear_layers if self.linear_layer(i) else self.attention_layers
        return kind.index(i)

    @property
    def rotary_dim(self) -> int:
        """Dims of a head RoPE rotates (the first ones; the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_dims(self) -> tuple[int, int, int]:
        """(key width, value width, convolved channels = 2 x key + value) of a
        DeltaNet layer, heads flattened."""
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = self.linear_num_value_heads * self.linear_value_head_dim
        return kd, vd, 2 * kd + vd

    @property
    def shared_intermediate(self) -> int:
        """Width of the shared-expert MLP (0: none)."""
        if not self.is_moe:
            return 0
        return self.shared_expert_intermediate_size or (
            self.n_shared_experts * self.moe_intermediate_size
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def moe_layer(self, i: int) -> bool:
        """Whether layer i has routed experts (not one of the first dense layers)."""
        return self.is_moe and i >= self.first_k_dense_replace

    @property
    def uniform_layers(self) -> bool:
        """Every layer has the same weights' shapes (so they can be stacked [L, ...])."""
        return not self.is_hybrid and (not self.is_moe or self.first_k_dense_replace == 0)

    @property
    def qk_head_dim(self) -> int:
        """Width of one query head's scores: nope + rope under MLA, else head_dim."""
        return self.qk_nope_head_dim + self.head_dim if self.is_mla else self.head_dim

    @property
    def cache_dims(self) -> tuple[int, int]:
        """Widths of one cached K and V entry per K/V head. MLA caches the latent and
        the rotary key as one "K" entry (the values are its first kv_lora_rank
        entries), so its V is empty."""
        if self.is_mla:
            return self.kv_lora_rank + self.head_dim, 0
        return self.head_dim, self.head_dim

    @property
    def softmax_scale(self) -> float:
        """The factor on attention scores: 1 / sqrt(qk_head_dim), and under YaRN with
        `mscale_all_dim` its square (DeepSeek's softmax scale)."""
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.rope_type == "yarn" and rs.mscale_all_dim:
            scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return scale

    def layer_shapes(self, i: int) -> dict:
        """Shape of each of layer i's parameters (no L axis; names and layout:
        `kernels/transformer.py`)."""
        d, hd, h = self.hidden_size, self.head_dim, self.num_heads
        layers = {"attn_norm": (d,), "mlp_norm": (d,)}
        if self.linear_layer(i) and self.linear_kind == "kda":
            kd, vd, cd = self.linear_dims
            h_l, hd_l = self.linear_num_key_heads, self.linear_key_head_dim
            layers |= {"w_qkv": (d, cd), "conv": (self.linear_conv_kernel_dim, cd),
                       "w_b": (d, h_l), "w_fa": (d, hd_l), "w_fb": (hd_l, kd),
                       "dt_bias": (kd,), "a_log": (h_l,), "w_ga": (d, hd_l),
                       "w_gb": (hd_l, vd), "lin_norm": (hd_l,), "w_out": (vd, d)}  # fmt: skip
        elif self.linear_layer(i):
            kd, vd, cd = self.linear_dims
            hv = self.linear_num_value_heads
            layers |= {"w_qkv": (d, cd), "w_z": (d, vd), "w_b": (d, hv), "w_a": (d, hv),
                       "conv": (self.linear_conv_kernel_dim, cd), "dt_bias": (hv,),
                       "a_log": (hv,), "lin_norm": (self.linear_value_head_dim,),
                       "w_out": (vd, d)}  # fmt: skip
        elif self.is_mla:
            c, nope, vd = self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim
            qd = h * (nope + hd)
            if self.q_lora_rank:
                r = self.q_lora_rank
                layers |= {"wq_a": (d, r), "q_a_norm": (r,), "wq_b": (r, qd)}
            else:
                layers["wq"] = (d, qd)
            layers |= {"wkv_a": (d, c + hd), "kv_a_norm": (c,), "w_uk": (h, c, nope),
                       "w_uv": (h, c, vd), "wo": (h * vd, d)}  # fmt: skip
        else:
            qd, kvd = h * hd, self.num_kv_heads * hd
            layers |= {"wq": (d, qd), "wk": (d, kvd), "wv": (d, kvd), "wo": (qd, d)}
            if self.attention_bias:
                layers |= {"bq": (qd,), "bk": (kvd,), "bv": (kvd,)}
            if self.qk_norm:
                layers |= {"q_norm": (hd,), "k_norm": (hd,)}
            if self.attn_output_gate:
                layers["wg"] = (d, qd)
        if self.moe_layer(i):
            e, fe = self.num_experts, self.moe_intermediate_size
            layers |= {"router": (d, e), "e_gate": (e, d, fe), "e_up": (e, d, fe),
                       "e_down": (e, fe, d)}  # fmt: skip
            if self.expert_bias:
                layers["e_bias"] = (e,)
            if self.shared_intermediate:
                fs = self.shared_intermediate
                layers |= {"s_gate": (d, fs), "s_up": (d, fs), "s_down": (fs, d)}
                if self.shared_expert_gate:
                    layers["s_router"] = (d, 1)
        else:
            f = self.intermediate_size
            layers |= {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
        return layers

    def num_params(self) -> int:
        """Parameter count, embeddings and LM head included (tied counted once)."""
        d = self.hidden_size
        n = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        return n + sum(
            math.prod(s) for i in range(self.num_layers) for s in self.layer_shapes(i).values()
        )
