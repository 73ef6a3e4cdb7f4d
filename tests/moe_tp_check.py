"""Child process of tests/test_megakernel_moe.py: the MoE megakernel split over n
virtual CPU devices (whole experts per device, routed outputs combined by the
all-reduce) against the one-device reference. Needs XLA_FLAGS with >= n host devices;
prints one JSON line.

    python tests/moe_tp_check.py --tp 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from test_megakernel_moe import BLOCKS, TOPK, batch, copy, moe_cache, moe_model

from specdec.kernels import sharding
from specdec.kernels.megakernel import kernel, reference, shard
from specdec.verify.batch import SamplingBatch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--routing", default="qwen3", choices=["qwen3", "deepseek"])
    args = ap.parse_args()
    n = args.tp
    cfg, params = moe_model(routing=args.routing, vocab_size=300)
    cache = moe_cache(cfg, jnp.float32)
    roots, tokens, parents, slots, lens = batch("tree")
    b, nodes = tokens.shape
    sampling, uniforms = SamplingBatch.make_dummy(b), np.zeros((b, nodes + 1), np.float32)
    rest = (roots, tokens, parents, None, slots, lens, sampling, uniforms)
    ref = reference.verify(params, copy(cache), *rest, cfg=cfg, child_sampling=TOPK)

    mesh = sharding.make_mesh(jax.devices()[:n])
    cfg_n, params_n = shard.prepare_params(cfg, params, n)
    reps = cfg_n.num_kv_heads // cfg.num_kv_heads
    cache_n = type(cache)(k=jnp.repeat(cache.k, reps, axis=2), v=jnp.repeat(cache.v, reps, axis=2))
    # The shared expert (32 wide) splits n ways: its tiles must divide 32 / n.
    blocks = dataclasses.replace(BLOCKS, mlp_cols=8) if cfg.shared_intermediate else BLOCKS
    out = kernel.verify(
        params_n, cache_n, *rest, cfg=cfg_n, child_sampling=TOPK, block_sizes=blocks,
        interpret=pltpu.InterpretParams(detect_races=True), mesh=mesh,
    )  # fmt: skip
    jax.block_until_ready(out)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    live = slots >= 0
    print(json.dumps({
        "races": bool(tpu_interpret.races is not None and tpu_interpret.races.races_found),
        "verdict_equal": bool(
            np.array_equal(np.asarray(out.bonus)[live], np.asarray(ref.bonus)[live])
            and np.array_equal(np.asarray(out.accepted_nodes)[live],
                               np.asarray(ref.accepted_nodes)[live])
        ),
        "logit_err": float(np.max(np.abs(np.asarray(out.logits) - np.asarray(ref.logits))[live])),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
