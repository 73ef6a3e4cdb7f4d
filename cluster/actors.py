"""The two worker actors: `TargetActor` and `DraftActor`, one per host of their group.

Each owns its model, KV cache and devices; the coordinator (cluster/remote.py)
talks to them only in msgpack messages (cluster/messages.py). Walk-through of
one engine step with overlap on (round t):

1. coordinator -> draft   `propose(t)`: the draft returns tree t (or, when its
   guess about round t - 1 hit, the tree it already grew, at once).
2. coordinator -> draft   `speculate(t)` (no wait): the draft guesses the verdict
   on tree t (greedy chain accepted + its own next token) and grows tree t + 1.
   coordinator -> target  `verify(t)` at the same time, and waits for it: the
   target scores tree t, applies the acceptance rule (only the target decides),
   commits the accepted K/V and returns the verdict.
3. coordinator -> draft   `commit(t)` (no wait): the draft compares the verdict
   with its guess; a hit keeps tree t + 1, a miss rolls back to the root of
   tree t and leaves the real path for the next catch-up block.
4. The engine appends the accepted tokens, applies stop rules, `release`s and
   `start`s sequences (both actors), and the next step begins at 1.

Actors run one call at a time in arrival order, so `commit(t)` always follows
`speculate(t)`. Every message carries the round; every actor carries an
*incarnation* (a fresh id each time Ray restarts it) that requests must name,
so a request queued for a dead incarnation fails loudly instead of running on
an empty restarted actor. `restore` re-prefills a restarted actor from the
coordinator's committed tokens.

The classes are plain Python: `placement.spawn` wraps them with `ray.remote`,
and tests may also drive them in-process.
"""

from __future__ import annotations

import logging
import os
import uuid

import numpy as np

from specdec.cluster import messages as m
from specdec.draft.base import OverlapDrafter

logger = logging.getLogger(__name__)


def _reserve(worker, slots, msg: dict) -> None:
    """The rows' planned lengths (`reserve` field; absent = none), so a request reads
    one compiled K/V length from start to end, as in-process (`ModelRunner.reserve`)."""
    lengths = msg.get("reserve")
    if lengths is None:
        return
    if not isinstance(lengths, list) or len(lengths) != len(slots):
        raise m.MessageError(f"field 'reserve' must be a list of {len(slots)} lengths.")
    worker.reserve(list(slots), [int(n) for n in lengths])


class StaleIncarnation(RuntimeError):
    """A request addressed to an earlier incarnation of a restarted actor."""


class _Host:
    """What both actors share: JAX start-up on their devices, incarnation, round checks."""

    role = "worker"
    num_slots: int | None = None  # set by each actor; bounds the slots a message may name

    def __init__(self, num_devices: int | None, num_hosts: int, rank: int, coordinator: str | None):
        if num_hosts > 1:  # before any other JAX call (docs/design.md, Distributed)
            import jax

            jax.distributed.initialize(coordinator, num_processes=num_hosts, process_id=rank)
        import jax

        from specdec.kernels import sharding

        devices = jax.devices() if num_hosts > 1 else jax.local_devices()
        if num_devices is not None:
            if num_devices > len(devices):
                raise ValueError(
                    f"{self.role} group asks for {num_devices} devices, but JAX sees "
                    f"{len(devices)} ({devices[0].platform}); set XLA_FLAGS / the group's "
                    "resources accordingly."
                )
            devices = devices[:num_devices]
        self.mesh = sharding.make_mesh(devices)
        self.rank = rank
        self.incarnation = uuid.uuid4().hex
        self.last_round = -1

    def _open(self, data: bytes, kind: str) -> dict:
        msg = m.unpack(data, kind, num_slots=self.num_slots)  # slots in range for this actor
        named = msg.get("incarnation")
        if isinstance(named, list):  # one per host of the group, by rank
            named = named[self.rank] if self.rank < len(named) else None
        if named != self.incarnation:
            raise StaleIncarnation(
                f"{self.role} request {kind!r} of round {msg['round']} names incarnation "
                f"{named!r}, but this actor is {self.incarnation!r} (restarted)."
            )
        if msg["round"] < self.last_round:
            raise m.MessageError(
                f"{self.role} got {kind!r} for round {msg['round']} after round {self.last_round}."
            )
        self.last_round = msg["round"]
        return msg

    def _info(self, **extra) -> bytes:
        devices = self.mesh.devices.ravel().tolist()
        return m.pack(
            "hello",
            0,
            incarnation=self.incarnation,
            pid=os.getpid(),
            rank=self.rank,
            devices=[str(d) for d in devices],
            **extra,
        )

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()


class TargetActor(_Host):
    """The target model sharded over its group's mesh: prefill, verify, restore."""

    role = "target"

    def __init__(
        self,
        model: str,
        *,
        dtype: str,
        num_slots: int,
        max_model_len: int,
        max_tree_nodes: int,
        num_devices: int | None = None,
        num_hosts: int = 1,
        rank: int = 0,
        coordinator: str | None = None,
        kernel: str = "auto",
        kv_cache_memory: int | None = None,
    ):
        super().__init__(num_devices, num_hosts, rank, coordinator)
        from specdec import plan, workers
        from specdec.checkpoint import load_model
        from specdec.kernels import sharding

        # Decided here, on the host that runs the products (`plan.resolve_dtype`).
        rows = plan.dtype_rows(1 + max_tree_nodes, num_slots)
        dtype = plan.resolve_dtype(model, dtype, rows=rows)
        self.dtype = dtype
        self.cfg, params = load_model(model, dtype=dtype)
        # This group's own KV budget (its host's memory), for its own model only.
        _, num_blocks = workers.kv_pool(
            self.cfg, None, dtype, budget=kv_cache_memory, num_slots=num_slots,
            max_len=max_model_len + max_tree_nodes + 1,
            kernel=workers.resolve_kernel(kernel, self.cfg, self.mesh.size),
        )  # fmt: skip
        self.worker = workers.TargetWorker(
            self.cfg,
            params,
            num_slots=num_slots,
            max_model_len=max_model_len,
            max_tree_nodes=max_tree_nodes,
            kernel=kernel,
            plan=plan.make_plan(
                self.cfg,
                dtype=dtype,
                spec=None,
                num_slots=plan.PLAN_SLOTS,
                max_tree_nodes=max_tree_nodes,
            ),  # fmt: skip
            mesh=self.mesh,
            num_blocks=num_blocks,
        )
        self.num_slots = num_slots
        self.max_tree_nodes = max_tree_nodes
        # What the devices hold: the megakernel's copy may repeat K/V heads (`shard`).
        self.placement = sharding.describe(self.worker.runner.cfg, self.mesh.size)
        logger.info("target on %s: %s", self.mesh, self.placement)

    def hello(self) -> bytes:
        return self._info(
            vocab_size=self.cfg.vocab_size,
            placement=self.placement,
            dtype=self.dtype,
            kernel=self.worker.kernel,
            kv_capacity=list(self.worker.kv_capacity()),
        )

    def prefill(self, data: bytes) -> bytes:
        msg = self._open(data, "prefill")
        slots = m.decode_array(msg["slots"], "slots").tolist()
        _reserve(self.worker, slots, msg)
        roots = self.worker.prefill(slots, msg["prompts"], m.sampling_from(msg))
        return m.pack("roots", msg["round"], roots=np.asarray(roots, np.int32))

    def restore(self, data: bytes) -> bytes:
        """Re-prefills committed tokens (all but each row's root) after a restart."""
        msg = self._open(data, "restore")
        slots, histories = msg["slots"], msg["histories"]
        for s in range(self.num_slots):
            self.worker.release(s)
        _reserve(self.worker, slots, msg)
        if slots:
            self.worker.runner.prefill(slots, [h[:-1] for h in histories])
        return m.pack("ack", msg["round"])

    def verify(self, data: bytes) -> bytes:
        msg = self._open(data, "verify")
        tree, _ = m.unpack_tree(
            msg["tree"],
            msg["round"],
            num_slots=self.num_slots,
            max_nodes=self.max_tree_nodes,
            vocab_size=self.cfg.vocab_size,
        )
        emitted, num, accepted = self.worker.verify(
            m.decode_array(msg["roots"], "roots"),
            tree,
            m.decode_array(msg["active"], "active"),
            m.sampling_from(msg),
        )
        return m.pack_verdict(msg["round"], emitted, num, accepted)

    def release(self, data: bytes) -> bytes:
        msg = self._open(data, "release")
        self.worker.release(msg["slot"])
        return m.pack("ack", msg["round"])


class DraftActor(_Host):
    """A drafter (model or n-gram) with overlapped next-tree drafting."""

    role = "draft"

    def __init__(
        self,
        spec: dict,
        *,
        target_model: str,
        dtype: str,
        num_slots: int,
        max_model_len: int,
        num_devices: int | None = None,
        num_hosts: int = 1,
        rank: int = 0,
        coordinator: str | None = None,
        kv_cache_memory: int | None = None,
    ):
        super().__init__(num_devices, num_hosts, rank, coordinator)
        from specdec import plan, workers
        from specdec.checkpoint import load_config
        from specdec.kernels import sharding
        from specdec.params import SpeculativeConfig

        spec = SpeculativeConfig.from_dict(spec)
        # Decided here, for the rows a step verifies (as in-process), and the tree with it.
        dtype = plan.resolve_dtype(
            target_model, dtype, rows=plan.dtype_rows(plan.verify_rows(spec, 1), num_slots)
        )
        self.target_cfg = load_config(target_model)
        tree, note = plan.tree_shape(spec, self.target_cfg, dtype, plan.PLAN_SLOTS)
        num_blocks = None
        if spec.method == "draft_model":  # this group's own KV budget, for the draft only
            _, num_blocks = workers.kv_pool(
                workers.draft_config(spec), None, dtype, budget=kv_cache_memory,
                num_slots=num_slots, max_len=max_model_len + tree.num_nodes + 1, kernel="xla",
            )  # fmt: skip
        self.drafter = workers.build_drafter(
            spec,
            plan=plan.Plan(dtype=dtype, tree=tree, tree_note=note),
            target_path=target_model,
            target_config=self.target_cfg,
            num_slots=num_slots,
            max_model_len=max_model_len,
            num_blocks=num_blocks,
        )
        runner = getattr(self.drafter, "runner", None)
        if runner is not None and self.mesh.size > 1:
            sharding.shard_runner(runner, self.mesh)
        self.num_slots = num_slots
        self.can_speculate = isinstance(self.drafter, OverlapDrafter)
        self.spec = None  # the drafter's Speculation about the last proposed tree
        self.spec_round = -1  # the round whose tree the speculation guessed about
        self.hit = np.zeros(num_slots, bool)  # rows whose guess the target confirmed
        self.hit_round = -1  # the round the confirmed guesses are for
        self.last = None  # (round, active, tree, sampling) of the last proposal
        self.hits = self.misses = 0

    def hello(self) -> bytes:
        runner = getattr(self.drafter, "runner", None)
        cap = None if runner is None else list(runner.kv_capacity())
        return self._info(max_nodes=int(self.drafter.max_nodes), can_speculate=self.can_speculate,
                          kv_capacity=cap)  # fmt: skip

    def restore(self, data: bytes) -> bytes:
        msg = self._open(data, "restore")
        for s in range(self.num_slots):
            self.drafter.release(s)
        slots, histories = msg["slots"], msg["histories"]
        _reserve(self.drafter, slots, msg)
        if slots:
            self.drafter.start(slots, [h[:-1] for h in histories], [h[-1] for h in histories])
        self._forget()
        return m.pack("ack", msg["round"])

    def start(self, data: bytes) -> bytes:
        msg = self._open(data, "start")
        _reserve(self.drafter, msg["slots"], msg)
        self.drafter.start(msg["slots"], msg["prompts"], msg["roots"])
        self.hit[msg["slots"]] = False
        return m.pack("ack", msg["round"])

    def propose(self, data: bytes) -> bytes:
        msg = self._open(data, "propose")
        rnd = msg["round"]
        active = m.decode_array(msg["active"], "active")
        roots = m.decode_array(msg["roots"], "roots")
        sampling = m.sampling_from(msg)
        if self.spec is not None and self.hit_round == rnd - 1 and self.hit.any():
            tree = self.drafter.propose_reusing(self.spec, self.hit, active, roots, sampling)
        else:
            tree = self.drafter.propose(active, roots, sampling)
        self._forget()
        self.last = (rnd, active, tree, sampling)
        stats = {"hits": self.hits, "misses": self.misses}
        return m.pack_tree(rnd, tree, active, stats)

    def speculate(self, data: bytes) -> bytes:
        """Grows the next tree from the guessed verdict on the tree of this round."""
        msg = self._open(data, "speculate")
        if self.can_speculate and self.last is not None and self.last[0] == msg["round"]:
            _, active, tree, sampling = self.last
            self.spec = self.drafter.speculate(active, tree, sampling)
            self.spec_round = msg["round"]
        return m.pack("ack", msg["round"])

    def commit(self, data: bytes) -> bytes:
        msg = self._open(data, "commit")
        active = m.decode_array(msg["active"], "active")
        emitted, num, accepted = m.unpack_verdict(
            msg["verdict"], msg["round"], num_slots=self.num_slots
        )
        if self.spec is not None and self.spec_round == msg["round"]:
            self.hit = self.drafter.resolve(self.spec, active, accepted, num, emitted)
            self.hit_round = msg["round"]
            guessed = int((active & self.spec.rows).sum())
            self.hits += int(self.hit.sum())
            self.misses += guessed - int(self.hit.sum())
        else:
            self._forget()
            self.drafter.commit(active, accepted, num, emitted)
        return m.pack("ack", msg["round"], stats={"hits": self.hits, "misses": self.misses})

    def release(self, data: bytes) -> bytes:
        msg = self._open(data, "release")
        self.drafter.release(msg["slot"])
        self.hit[msg["slot"]] = False
        return m.pack("ack", msg["round"])

    def _forget(self) -> None:
        self.spec, self.spec_round, self.hit_round = None, -1, -1
        self.hit[:] = False
