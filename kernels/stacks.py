"""Stacked layouts of models whose layers differ, for the verify megakernel.

The megakernel streams weights stacked on a leading layer axis. A model whose layers
are not alike keeps `params["layers"]` as a tuple of per-layer dicts
(`transformer.param_shapes`); these functions restack it by kind and back:

* dense first layers (DeepSeek-V3's `first_k_dense_replace`): everything but the MLP
  stacked over all L layers; the dense MLP (w_gate, w_up, w_down) over the Ld dense
  layers; the MoE weights (router, experts, e_bias, shared experts) over the Lm MoE
  layers. Layer i's MLP is entry `mlp_index(cfg, i)` of its kind's stack.
* hybrid linear-attention models: `linear_attention.stacked_layout`.

The XLA forward reads either form (`per_layer`), so a megakernel target holds one copy.
"""

from __future__ import annotations

import jax.numpy as jnp

from specdec.kernels.config import ModelConfig

DENSE_MLP = ("w_gate", "w_up", "w_down")
MOE_MLP = ("router", "e_gate", "e_up", "e_down", "e_bias", "s_gate", "s_up", "s_down")


def is_mixed_moe(cfg: ModelConfig) -> bool:
    """A MoE model with dense first layers (two MLP stacks)."""
    return cfg.is_moe and not cfg.is_hybrid and cfg.first_k_dense_replace > 0


def mlp_index(cfg: ModelConfig, i: int) -> int:
    """Layer i's index in its MLP kind's stack."""
    return i - cfg.first_k_dense_replace if cfg.moe_layer(i) else i


def moe_stacked(cfg: ModelConfig, params: dict) -> dict:
    """A mixed MoE model's per-layer tuple as kind stacks (module docstring)."""
    layers = params["layers"]
    if isinstance(layers, dict):
        return params
    dense = [lp for i, lp in enumerate(layers) if not cfg.moe_layer(i)]
    moes = [lp for i, lp in enumerate(layers) if cfg.moe_layer(i)]
    common = [k for k in layers[0] if k not in DENSE_MLP]
    stacked = {k: jnp.stack([lp[k] for lp in layers]) for k in common}
    stacked |= {k: jnp.stack([lp[k] for lp in dense]) for k in DENSE_MLP}
    stacked |= {k: jnp.stack([lp[k] for lp in moes]) for k in MOE_MLP if k in moes[0]}
    return {**params, "layers": stacked}


def per_layer(cfg: ModelConfig, layers: dict) -> tuple:
    """`moe_stacked`'s stacks back as per-layer dicts (static slices)."""
    out = []
    for i in range(cfg.num_layers):
        j = mlp_index(cfg, i)
        mine = MOE_MLP if cfg.moe_layer(i) else DENSE_MLP
        lp = {k: v[i] for k, v in layers.items() if k not in DENSE_MLP + MOE_MLP}
        lp |= {k: layers[k][j] for k in mine if k in layers}
        out.append(lp)
    return tuple(out)
