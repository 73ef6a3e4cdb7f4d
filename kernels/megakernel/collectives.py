"""In-kernel collectives of the n-device verify megakernel: remote DMAs and semaphores.

Everything here runs inside the kernel (one instance per device of a 1-D mesh
axis, under `jax.shard_map`); `jnp_all_reduce` / `jnp_argmax` beside them are the
plain-jnp statements of what they compute (tests/collectives_check.py compares).

All-reduce of an f32 [M, D] partial sum (two per layer): two one-shot phases.

1. Reduce-scatter: device i sends column chunk j (D / n columns) of its partial
   to device j's inbox `scat[i]` (n - 1 DMAs in flight at once), and keeps chunk
   i. Device j adds its inbox in device order 0, 1, ..., n - 1.
2. All-gather: device j sends its summed chunk to every other device's `gath[j]`.

Chunks are whole vector lanes on TPU (DMA slices of a [M, D] buffer start and end
on 128-column boundaries). When D / n is not (DeepSeek-V3's 7168 over 16 devices),
the columns are cut into `chunking(D, n)` = (w, c) chunks of w = D / c columns, c
the largest divisor of D / 128 not above n: devices 0 .. c - 1 own one chunk each
and the others only send and receive (7168 over 16: 14 owners of 512 columns).

Why this shape. Bytes: each device sends 2 (n - 1) / n * M * D * 4, the least any
all-reduce can (a ring sends the same), against (n - 1) * M * D * 4 for a
one-shot all-to-all of whole partials, and its inboxes hold 2 * M * D * 4 bytes of
VMEM, not n * M * D * 4. Latency: two DMA hops, against 2 (n - 1) dependent hops
for a ring; a verify block is a few hundred rows, so a reduction is a few MiB at
most and latency-bound, and hops are what it pays for. Determinism: every chunk
is summed once, by one device, in a fixed order, and the others receive that sum,
so the residual stream is bit-identical on every device and all of them reach
the same verdict.

One inbox slot suffices. Device i's next write into j's `scat[i]` comes after i
has finished this all-reduce, which needs j's gathered chunk, which j sends only
after summing (reading) its `scat`; likewise i's next write into j's `gath[i]`
needs j's next reduce-scatter chunk, sent after j read `gath`. Every DMA a device
starts, it waits for (`wait_send`), and every DMA into a device, that device
waits for (`wait_recv`), so none is in flight when the kernel ends. A barrier at
the start (`barrier`) keeps a device from writing into a peer that has not yet
entered the kernel.

Greedy argmax over a vocabulary split n ways: each device packs its per-row
(max, argmax) into one [M, 128] f32 tile (lanes 0-63 the max, 64-127 the id, exact
in f32 below 2^24) and sends it to all others; every device then scans the n
tiles in device order with a strict `>`, so a tie goes to the lower device,
whose ids are lower: `jnp.argmax`'s lowest id, on every device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
AXIS = "tp"  # the mesh axis the kernel is split over (`kernels.sharding.AXIS`)
HALF = 64  # lanes of the packed (max, argmax) tile that hold the max

# Fault injection for the tests only: when True, every exchange skips its wait for
# the first peer's DMA, the bug the one-slot argument above rules out. The tests set
# it to prove the interpreter's race detector (or a wrong result) catches it.
DROP_RECV_WAIT = False

# Rows of the collective semaphore array `coll_sem` [6, n]: (send, recv) per phase.
SCATTER_SEND, SCATTER_RECV, GATHER_SEND, GATHER_RECV, ARGMAX_SEND, ARGMAX_RECV = range(6)


def _device(j):
    return {"device_id": (j,), "device_id_type": pl.DeviceIdType.MESH}


def _peer(me, k, n):
    """The device k steps after `me` on the ring of n (k in 1..n-1)."""
    return jax.lax.rem(me + k, n)


def barrier(me, n: int) -> None:
    """Waits until all n devices have entered the kernel."""
    sem = pltpu.get_barrier_semaphore()
    for k in range(1, n):
        pl.semaphore_signal(sem, 1, **_device(_peer(me, k, n)))
    pl.semaphore_wait(sem, n - 1)


def _when(cond, fn) -> None:
    """fn() where the traced `cond` holds; always when cond is None."""
    if cond is None:
        fn()
    else:
        pl.when(cond)(fn)


def _exchange(src, inbox, sem, send_row, recv_row, me, n, targets_chunk=None,
              sends_to=None, hears_from=None) -> None:  # fmt: skip
    """Sends `src` (or chunk j of it, for target j) to inbox[me] of every other device,
    then waits for the n - 1 inbox entries from the others and for its own sends.
    `sends_to(j)` / `hears_from(s)` (traced bools) narrow both to some devices: every
    device must agree, s sending to me exactly when me hears from s."""

    # A gather inbox holds the owners' entries only: a non-owner, which sends nothing
    # into it, names the last entry (the descriptors need a slice of the right size).
    def entry(i):
        return inbox.at[i if inbox.shape[0] == n else jnp.minimum(i, inbox.shape[0] - 1)]

    own = entry(me)
    sends = []
    for k in range(1, n):
        j = _peer(me, k, n)
        piece = src if targets_chunk is None else targets_chunk(j)
        cp = pltpu.make_async_remote_copy(
            piece, own, sem.at[send_row, k], sem.at[recv_row, me], **_device(j)
        )
        _when(None if sends_to is None else sends_to(j), cp.start)
        sends.append((j, cp))
    for k in range(1, n):
        if DROP_RECV_WAIT and k == 1:
            continue
        s = _peer(me, n - k, n)  # device s wrote inbox[s]; its size is inbox[me]'s
        recv = pltpu.make_async_remote_copy(
            own, entry(s), sem.at[send_row, k], sem.at[recv_row, s], **_device(s)
        )
        _when(None if hears_from is None else hears_from(s), recv.wait_recv)
    for j, cp in sends:
        _when(None if sends_to is None else sends_to(j), cp.wait_send)


def chunking(d: int, n: int) -> tuple[int, int]:
    """(columns per chunk, owners) of the all-reduce of [M, d] over n devices: n
    chunks of d / n when those are whole lanes (or d is not, as in interpret-mode
    test models), else the module docstring's fewer, wider chunks."""
    if d % n == 0 and ((d // n) % LANES == 0 or d % LANES):
        return d // n, n
    if d % LANES:
        raise ValueError(f"hidden_size {d} splits neither {n} ways nor into whole lanes.")
    lanes = d // LANES
    owners = max(c for c in range(1, n + 1) if lanes % c == 0)
    return d // owners, owners


def all_reduce_add(part, x, scat, gath, sem, me, n: int) -> None:
    """x += sum over devices of `part` (f32 [M, D] refs), the module's two phases.
    `scat` is [n, M, w] and `gath` [owners, M, w] (`chunking`)."""
    chunk, owners = chunking(part.shape[1], n)
    owns = None if owners == n else (lambda j: j < owners)

    def cols(j):
        start = j * chunk
        return pl.ds(pl.multiple_of(start, LANES) if chunk % LANES == 0 else start, chunk)

    _exchange(
        None, scat, sem, SCATTER_SEND, SCATTER_RECV, me, n,
        targets_chunk=lambda j: part.at[:, cols(j)], sends_to=owns,
        hears_from=None if owns is None else (lambda s: me < owners),
    )  # fmt: skip

    def reduce_mine():
        scat[me] = part[:, cols(me)]
        total = scat[0]
        for s in range(1, n):  # fixed order: the same sum whichever device computes it
            total = total + scat[s]
        gath[me] = total

    _when(None if owns is None else me < owners, reduce_mine)
    mine = gath.at[jnp.minimum(me, owners - 1)]  # a non-owner's sends are all skipped
    _exchange(mine, gath, sem, GATHER_SEND, GATHER_RECV, me, n,
              sends_to=None if owns is None else (lambda j: me < owners),
              hears_from=owns)  # fmt: skip
    for s in range(owners):
        sl = pl.ds(s * chunk, chunk)
        x[:, sl] = x[:, sl] + gath[s]


def global_argmax(mx, am, amx, sem, me, n: int):
    """The vocabulary-wide (max, argmax) per row from each device's f32 / i32 [M, 1]."""
    rows = mx.shape[0]
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, 2 * HALF), 1)
    amx[me] = jnp.where(lane < HALF, mx, am.astype(jnp.float32))
    _exchange(amx.at[me], amx, sem, ARGMAX_SEND, ARGMAX_RECV, me, n)
    best, arg = amx[0][:, 0:1], amx[0][:, HALF : HALF + 1]
    for s in range(1, n):
        tile = amx[s]
        m_s, a_s = tile[:, 0:1], tile[:, HALF : HALF + 1]
        better = m_s > best  # strict: the lower device (lower ids) keeps a tie
        best, arg = jnp.where(better, m_s, best), jnp.where(better, a_s, arg)
    return best, arg.astype(jnp.int32)


# ----------------------------------------------------------------- plain-jnp statements


def jnp_all_reduce(parts: jax.Array) -> jax.Array:
    """parts f32[n, M, D] -> their sum as `all_reduce_add` forms it (chunk-wise, device order)."""
    total = parts[0]
    for s in range(1, parts.shape[0]):
        total = total + parts[s]
    return total


def jnp_argmax(logits_by_device: jax.Array) -> jax.Array:
    """f32[n, M, V / n] shards -> the argmax over the whole vocabulary (lowest id on ties)."""
    n, m, vs = logits_by_device.shape
    return jnp.argmax(jnp.moveaxis(logits_by_device, 0, 1).reshape(m, n * vs), axis=-1)
