"""Child process of tests/test_megakernel_tp.py: the megakernel split over n virtual CPU
devices against the one-device reference. Needs XLA_FLAGS with enough host devices;
prints one JSON line of findings (the parent asserts on them).

    python tests/tp_check.py --tp 4 --dtype f32 --kv-heads 2 --mode eager
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu
from test_megakernel import (
    CONTEXTS,
    DTYPES,
    NODES,
    TOPK,
    TREES,
    expected_features,
    model,
    reference_case,
)  # fmt: skip

from specdec.kernels import sharding
from specdec.kernels.megakernel import BlockSizes, kernel, shard

VOCAB = 400  # no n x 128 divides it: every split pads
MAX_LEN = 1152


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mode", default="eager", choices=["eager", "on_wait"])
    ap.add_argument("--batch", type=int, default=9)
    ap.add_argument("--drop-wait", action="store_true", help="skip one semaphore wait")
    ap.add_argument("--config", default="{}", help="ModelConfig overrides, JSON")
    ap.add_argument("--rings", default="2,2", help="weight_ring,mlp_ring")
    ap.add_argument("--taps", default="", help="layers whose features to return, e.g. 0,1")
    args = ap.parse_args()
    n, dtype = args.tp, DTYPES[args.dtype]
    overrides = dict(vocab_size=VOCAB, num_heads=8, head_dim=16, intermediate_size=256)
    cfg, params = model(dtype, args.kv_heads, **(overrides | json.loads(args.config)))
    rng = np.random.default_rng(n * 10 + args.kv_heads)
    grid = [(tree, ctx) for tree in TREES for ctx in CONTEXTS]
    if args.batch < len(grid):  # the first `batch` rows of a shuffle
        grid = [grid[i] for i in rng.permutation(len(grid))[: args.batch]]
    c = reference_case(cfg, params, dtype, grid, rng, max_len=MAX_LEN)
    cache, roots, tokens, parents = c.cache, c.roots, c.tokens, c.parents
    slots, lens, sampling, uniforms, ref = c.slots, c.lens, c.sampling, c.uniforms, c.ref

    # The split model: K/V heads repeated to n where fewer, vocabulary padded.
    mesh = sharding.make_mesh(jax.devices()[:n])
    cfg_n, params_n = shard.prepare_params(cfg, params, n)
    reps = cfg_n.num_kv_heads // cfg.num_kv_heads
    cache_n = jax.tree.map(lambda x: jnp.repeat(x, reps, axis=2), cache)
    cache_n = sharding.shard_cache(cfg_n, cache_n, mesh)
    params_n = sharding.shard_params(cfg_n, params_n, mesh)
    if args.drop_wait:
        from specdec.kernels.megakernel import collectives

        collectives.DROP_RECV_WAIT = True
    weight_ring, mlp_ring = (int(x) for x in args.rings.split(","))
    taps = tuple(int(i) for i in args.taps.split(",")) if args.taps else ()
    blocks = BlockSizes(proj_cols=16, out_rows=16, mlp_cols=32, vocab_cols=96, kv_rows=128,
                        weight_ring=weight_ring, mlp_ring=mlp_ring)  # fmt: skip
    ip = pltpu.InterpretParams(detect_races=True, dma_execution_mode=args.mode)
    out = kernel.verify(
        params_n, cache_n, roots, tokens, parents, None, slots, lens, sampling, uniforms,
        cfg=cfg_n, child_sampling=TOPK, block_sizes=blocks, interpret=ip, mesh=mesh,
        taps=taps,
    )  # fmt: skip
    jax.block_until_ready(out)
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    races = bool(tpu_interpret.races is not None and tpu_interpret.races.races_found)
    logit_err = float(np.nanmax(np.abs(np.asarray(out.logits) - np.asarray(ref.logits))))
    kv_err = 0.0
    for name in ("k", "v"):
        got = np.asarray(getattr(out.cache, name)).astype(np.float32)
        want = np.repeat(np.asarray(getattr(ref.cache, name)).astype(np.float32), reps, axis=2)
        for row, slot in enumerate(slots):
            upto = lens[row] + NODES + 1
            diff = got[:, slot, :, :upto] - want[:, slot, :, :upto]
            kv_err = max(kv_err, float(np.max(np.abs(diff))))
    feat_err = None
    if taps:  # against the one-device XLA forward's (`test_megakernel.expected_features`)
        want = expected_features(cfg, params, c, taps)
        feat_err = float(np.max(np.abs(np.asarray(out.features) - want)))
    print(json.dumps({
        "races": races,
        "feat_err": feat_err,
        "paths_equal": bool(np.array_equal(out.accepted_nodes, ref.accepted_nodes)
                            and np.array_equal(out.num_accepted, ref.num_accepted)),
        "bonus_equal": bool(np.array_equal(out.bonus, ref.bonus)),
        "accepted": int(np.asarray(ref.num_accepted).sum()),
        "logit_err": logit_err,
        "kv_err": kv_err,
        "nan_logits": bool(np.isnan(np.asarray(out.logits)).any()),
        "cases": [f"{t}-ctx{c}" for t, c in grid],
        "sharding": str(getattr(out.cache.k.sharding, "spec", "")),
    }))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
