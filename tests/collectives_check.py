"""Child process of tests/test_megakernel_tp.py: the in-kernel collectives alone, on n
virtual CPU devices in the TPU interpreter, against their plain-jnp statements
(`collectives.jnp_all_reduce`, `collectives.jnp_argmax`). Prints one JSON line.

    python tests/collectives_check.py --tp 4 [--hidden 384]

The default hidden width (256) splits into n chunks; 384 over 4 devices does not split
into whole 128-lane chunks, so 3 devices own a chunk each (`collectives.chunking`).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from specdec.kernels import sharding
from specdec.kernels.megakernel import collectives

M, VS = 16, 128  # rows, vocabulary per device


def kernel(part_ref, x_ref, logits_ref, x_out, arg_out, scat, gath, amx, sem, *, n):
    me = jax.lax.axis_index(collectives.AXIS)
    collectives.barrier(me, n)
    x_out[...] = x_ref[...]
    collectives.all_reduce_add(part_ref, x_out, scat, gath, sem, me, n)
    y = logits_ref[...]
    ids = jax.lax.broadcasted_iota(jnp.int32, y.shape, 1) + me * VS
    mx = jnp.max(y, axis=1, keepdims=True)
    am = jnp.min(jnp.where(y == mx, ids, 2**30), axis=1, keepdims=True)
    arg_out[...] = collectives.global_argmax(mx, am, amx, sem, me, n)[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--mode", default="eager", choices=["eager", "on_wait"])
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()
    n, mode, D = args.tp, args.mode, args.hidden
    chunk, owners = collectives.chunking(D, n)
    rng = np.random.default_rng(n)
    parts = rng.standard_normal((n, M, D)).astype(np.float32)
    x = rng.standard_normal((M, D)).astype(np.float32)
    # Logits on a coarse grid, so the row max ties across devices and within one.
    logits = rng.integers(0, 4, (n, M, VS)).astype(np.float32)
    logits[:, 0] = 3.0  # row 0: every id ties; the answer is id 0
    logits[:, 1] = 0.0
    logits[1:, 1, 5] = 7.0  # row 1: the max on devices 1.. only; lowest is device 1's id 5
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(
        lambda *refs: kernel(*refs, n=n),
        out_shape=(
            jax.ShapeDtypeStruct((M, D), jnp.float32),
            jax.ShapeDtypeStruct((M, 1), jnp.int32),
        ),  # fmt: skip
        in_specs=[vmem] * 3,
        out_specs=(vmem, vmem),
        scratch_shapes=[
            pltpu.VMEM((n, M, chunk), jnp.float32),
            pltpu.VMEM((owners, M, chunk), jnp.float32),
            pltpu.VMEM((n, M, 2 * collectives.HALF), jnp.float32),
            pltpu.SemaphoreType.DMA((6, n)),
        ],
        compiler_params=pltpu.CompilerParams(collective_id=0),
        interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode),
    )
    mesh = sharding.make_mesh(jax.devices()[:n])
    run = jax.jit(
        jax.shard_map(
            lambda p, xx, lg: call(p[0], xx, lg[0]),
            mesh=mesh,
            in_specs=(P(collectives.AXIS), P(), P(collectives.AXIS)),
            out_specs=(P(collectives.AXIS), P(collectives.AXIS)),
            check_vma=False,
        )
    )
    x_all, arg_all = run(parts, x, logits)
    jax.block_until_ready((x_all, arg_all))
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as tpu_interpret

    x_all = np.asarray(x_all).reshape(n, M, D)
    arg_all = np.asarray(arg_all).reshape(n, M)
    want_x = x + np.asarray(collectives.jnp_all_reduce(jnp.asarray(parts)))
    want_arg = np.asarray(collectives.jnp_argmax(jnp.asarray(logits)))
    print(json.dumps({
        "races": bool(tpu_interpret.races is not None and tpu_interpret.races.races_found),
        # bit-identical on every device: the same sums in the same order
        "x_same_on_all": bool(all(np.array_equal(x_all[0], x_all[i]) for i in range(n))),
        "x_err": float(np.max(np.abs(x_all[0] - want_x))),
        "arg_equal": bool(all(np.array_equal(arg_all[i], want_arg) for i in range(n))),
        "tie_rows": [int(want_arg[0]), int(want_arg[1])],
        "owners": owners,
    }))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
