"""Child process of tests/test_megakernel_{hybrid,moe,mla}.py: the hybrid, MoE or MLA
megakernel split over n virtual CPU devices (linear and attention heads; whole experts
per device, combined by the all-reduce; MLA heads over a replicated latent cache)
against the one-device reference. Needs XLA_FLAGS with >= n host devices; prints one JSON line.

    python tests/split_check.py --tp 4 --model hybrid   # or qwen3-moe, deepseek-moe, deepseek-mla
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

from specdec.kernels import sharding
from specdec.kernels.megakernel import BlockSizes, collectives, kernel, reference, shard
from specdec.verify.batch import SamplingBatch
from specdec.verify.tree import ChildSampling


def case(model: str, shape: str = "tree"):
    """(cfg, params, cache, batch, block sizes) of one test model."""
    if model == "hybrid":
        import test_megakernel_hybrid as t

        # Four key / eight value heads: every device holds whole heads at n = 4.
        cfg, params = t.hybrid_model(linear_num_key_heads=4, linear_num_value_heads=8,
                                     vocab_size=300)  # fmt: skip
        blocks = BlockSizes(proj_cols=16, out_rows=16, mlp_cols=32, vocab_cols=96, kv_rows=16)
        return cfg, params, t.hybrid_cache(cfg, jnp.float32), t.batch(shape), blocks
    if model == "deepseek-mla":
        import test_megakernel_mla as t

        # With 16-column "lanes" (`main`), hidden 48 is not 4 whole-lane chunks: 3
        # devices own the all-reduce's chunks (`collectives.chunking`), as DeepSeek-V3's
        # 7168 columns over 16 devices with TPU's 128-column lanes.
        cfg, params = t.mla_model(vocab_size=300, hidden_size=48)
        # The dense first layer's 96 columns and the shared expert's 32 split 4 ways.
        blocks = dataclasses.replace(t.BLOCKS, mlp_cols=8)
        return cfg, params, t.mla_cache(cfg, jnp.float32), t.batch(shape), blocks
    import test_megakernel_moe as t

    cfg, params = t.moe_model(routing=model.split("-")[0], vocab_size=300)
    # A shared expert (32 wide) splits n ways: its tiles must divide 32 / n.
    blocks = dataclasses.replace(t.BLOCKS, mlp_cols=8) if cfg.shared_intermediate else t.BLOCKS
    return cfg, params, t.moe_cache(cfg, jnp.float32), t.batch(shape), blocks


def max_err(a, b, rows) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))[rows]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    models = ["hybrid", "qwen3-moe", "deepseek-moe", "deepseek-mla"]
    ap.add_argument("--model", required=True, choices=models)
    # The all-reduce's chunk quantum (128 on TPU). The interpreter stalls on this
    # 2-core host once the residual is 128 columns wide over 4 devices, so tests reach
    # the fewer-owners path (`collectives.chunking`) with narrower "lanes" instead.
    ap.add_argument("--lanes", type=int, default=collectives.LANES)
    ap.add_argument("--shape", default="tree", choices=["tree", "chain"])
    args = ap.parse_args()
    collectives.LANES = args.lanes
    n = args.tp
    cfg, params, cache, (roots, tokens, parents, slots, lens), blocks = case(args.model, args.shape)
    b, nodes = tokens.shape
    sampling, uniforms = SamplingBatch.make_dummy(b), np.zeros((b, nodes + 1), np.float32)
    rest = (roots, tokens, parents, None, slots, lens, sampling, uniforms)
    topk = ChildSampling.DETERMINISTIC_TOPK
    ref = reference.verify(params, jax.tree.map(jnp.copy, cache), *rest, cfg=cfg,
                           child_sampling=topk)  # fmt: skip

    mesh = sharding.make_mesh(jax.devices()[:n])
    cfg_n, params_n = shard.prepare_params(cfg, params, n)
    reps = cfg_n.num_kv_heads // cfg.num_kv_heads
    cache_n = dataclasses.replace(cache, k=jnp.repeat(cache.k, reps, axis=2),
                                  v=jnp.repeat(cache.v, reps, axis=2))  # fmt: skip
    out = kernel.verify(
        params_n, cache_n, *rest, cfg=cfg_n, child_sampling=topk, block_sizes=blocks,
        interpret=pltpu.InterpretParams(detect_races=True), mesh=mesh,
    )  # fmt: skip
    jax.block_until_ready(out)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    live = slots >= 0  # an inactive row's answer is nobody's
    found = {
        "races": bool(tpu_interpret.races is not None and tpu_interpret.races.races_found),
        "verdict_equal": bool(
            np.array_equal(np.asarray(out.bonus)[live], np.asarray(ref.bonus)[live])
            and np.array_equal(
                np.asarray(out.accepted_nodes)[live], np.asarray(ref.accepted_nodes)[live]
            )
        ),  # fmt: skip
        "logit_err": max_err(out.logits, ref.logits, live),
        "record_err": 0.0,
    }
    if cfg.is_hybrid:
        valid = np.concatenate([np.ones((b, 1), bool), parents >= -1], axis=1) & live[:, None]
        found["record_err"] = max(
            max_err(getattr(out.lin, f), getattr(ref.lin, f), (slice(None), valid))
            for f in ("x", "k", "u", "g")
        )
    found["owners"] = collectives.chunking(cfg.hidden_size, n)[1]
    if cfg.is_mla:  # every device wrote the same latents into its copy of the cache
        found["cache_err"] = max(
            max_err(out.cache.k[:, slot, :, length : length + nodes + 1],
                    ref.cache.k[:, slot, :, length : length + nodes + 1], ...)
            for slot, length in zip(slots, lens, strict=True) if slot >= 0
        )  # fmt: skip
    print(json.dumps(found))


if __name__ == "__main__":
    main()
