"""The coordinator: the engine's own step loop, driving remote workers through proxies.

`RemoteTarget` implements the `TargetWorker` interface (prefill / verify /
release) and `RemoteDrafter` the `Drafter` protocol (start / propose / commit /
release) by messaging the actors of cluster/actors.py, so `LLMEngine` runs
unchanged: one code path for the step logic, in-process and remote.

Walk-through (one engine step, overlap on; see cluster/actors.py for the
actors' side):

1. `drafter.propose` sends `propose(t)`, then collects the replies of the
   calls it had fired without waiting (`start`, `commit`, `release`, and
   `speculate(t - 1)`) and then tree t; it fires `speculate(t)` and returns.
2. `target.verify` sends `verify(t)` with tree t and waits for the verdict; the
   draft actor grows tree t + 1 meanwhile.
3. `drafter.commit` fires `commit(t)` with the verdict and returns at once.

Both proxies mirror every slot's committed tokens (prompt, then each step's
accepted tokens and bonus token) from the calls the engine makes anyway; that
mirror is what a restarted actor is re-prefilled from.

Faults:

* Draft actor lost (a call fails with `RayActorError`, or names an
  incarnation the actor no longer has): the drafter proposes empty trees, so
  steps decode target-only (output unchanged), while a `hello` waits in the
  restarting actor's queue; once it answers, `restore` re-prefills every
  running sequence and drafting resumes. Restarts exhausted: target-only for
  good, with an error logged.
* Target actor lost: the call waits for Ray to restart it, `restore`s it and
  repeats the failed call with the same inputs, so the output is unchanged.
  Restarts exhausted (or no restart within `restart_timeout_s`):
  `WorkerLostError` naming the actor and what was lost; the engine ends the
  running requests with `finish_reason="error"`, keeping their tokens.

Recovery times are logged and kept in `.recoveries` (seconds).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import numpy as np

from specdec.cluster import messages as m
from specdec.cluster.actors import DraftActor, StaleIncarnation, TargetActor
from specdec.cluster.config import ClusterConfig, GroupConfig
from specdec.draft.base import DraftBatch
from specdec.engine import WorkerLostError
from specdec.kernels.config import ModelConfig
from specdec.params import SpeculativeConfig
from specdec.verify.batch import SamplingBatch

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 600.0  # first start: model load and compilation
HELLO_RETRIES = 4


class WorkerDown(Exception):
    """The actor behind an endpoint died or was restarted under us."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail or message  # the full error text (a failed start's traceback)

    def reason(self) -> str:
        """The last line of the detail: usually the exception that killed the actor."""
        lines = [x.strip() for x in self.detail.splitlines() if x.strip()]
        return lines[-1] if lines else str(self)


# ----------------------------------------------------------------------------- endpoints


class Endpoint:
    """A worker group's host actors behind one call interface; rank 0 answers.

    Every call goes to every host (a multi-host group runs one SPMD program).
    """

    def __init__(self, name: str, handles: list, group: GroupConfig):
        self.name = name
        self.handles = handles
        self.group = group

    def submit(self, method: str, payload: bytes | None = None) -> list:
        args = () if payload is None else (payload,)
        return [getattr(h, method).remote(*args) for h in self.handles]

    def result(self, call: list, timeout: float | None = None, *, every: bool = False):
        """Rank 0's reply (every rank's with `every`); WorkerDown if an actor is gone."""
        import ray

        try:
            out = ray.get(call, timeout=timeout)
        except (ray.exceptions.RayActorError, StaleIncarnation) as e:
            first = (str(e).splitlines() or [""])[0][:300]
            raise WorkerDown(f"{type(e).__name__}: {first}", str(e)) from e
        return out if every else out[0]

    def ready(self, call: list) -> bool:
        import ray

        done, _ = ray.wait(call, num_returns=len(call), timeout=0)
        return len(done) == len(call)

    def kill(self) -> None:
        import ray

        for h in self.handles:
            ray.kill(h, no_restart=True)


class LocalEndpoint(Endpoint):
    """In-process actors (tests): each call runs at once; results wait to be collected."""

    def __init__(self, name: str, objects: list, group: GroupConfig | None = None):
        super().__init__(name, objects, group or GroupConfig({"local": 1}))

    def submit(self, method: str, payload: bytes | None = None) -> list:
        out = []
        for obj in self.handles:
            try:
                out.append((True, getattr(obj, method)(*(() if payload is None else (payload,)))))
            except Exception as e:  # noqa: BLE001 - handed back at `result`, like a Ray error
                out.append((False, e))
        return out

    def result(self, call: list, timeout: float | None = None, *, every: bool = False):
        for ok, value in call:
            if not ok:
                if isinstance(value, StaleIncarnation):
                    raise WorkerDown(str(value)) from value
                raise value
        return [value for _, value in call] if every else call[0][1]

    def ready(self, call: list) -> bool:
        return True

    def kill(self) -> None:
        pass


def _hello(endpoint: Endpoint, timeout: float) -> dict:
    """Rank 0's hello, with every rank's incarnation; retries while a restart is under way."""
    deadline = time.monotonic() + timeout
    for attempt in range(HELLO_RETRIES):
        try:
            left = max(deadline - time.monotonic(), 1.0)
            replies = endpoint.result(endpoint.submit("hello"), timeout=left, every=True)
            infos = [m.unpack(r, "hello") for r in replies]
            return infos[0] | {"incarnation": [i["incarnation"] for i in infos]}
        except WorkerDown:
            if attempt == HELLO_RETRIES - 1:
                raise
            time.sleep(0.5 * (attempt + 1))  # a call can race Ray's notice of the restart
    raise AssertionError("unreachable")


def _started(endpoint: Endpoint) -> dict:
    """The first hello: waits for the actors to load their models and start."""
    try:
        return _hello(endpoint, HELLO_TIMEOUT_S)
    except WorkerDown as e:
        raise RuntimeError(f"The {endpoint.name} actor did not start: {e.reason()}") from e


def _tokens(history: dict[int, list[int]]) -> tuple[list[int], list[list[int]]]:
    slots = sorted(history)
    return slots, [history[s] for s in slots]


# ----------------------------------------------------------------------------- target


class RemoteTarget:
    """The engine's `TargetWorker`, served by the target group's actors."""

    def __init__(self, endpoint: Endpoint, *, num_slots: int, max_tree_nodes: int,
                 vocab_size: int, restart_timeout_s: float = 300.0):  # fmt: skip
        self.endpoint = endpoint
        self.num_slots = num_slots
        self.max_tree_nodes = max_tree_nodes
        self.vocab_size = vocab_size
        self.restart_timeout_s = restart_timeout_s
        self.history: dict[int, list[int]] = {}  # slot -> committed tokens, root last
        self.reserved: dict[int, int] = {}  # slot -> planned length (`reserve`)
        self.round = 0
        self.recoveries: list[float] = []
        self.lost: WorkerLostError | None = None
        self._fired: list = []
        self.info = _started(endpoint)
        self.incarnation = self.info["incarnation"]

    def kv_capacity(self) -> tuple[int, int, int]:
        """The target actor's `TargetWorker.kv_capacity` (told at start-up)."""
        return tuple(self.info["kv_capacity"])

    def prefill(self, slots, prompts, sampling: SamplingBatch) -> np.ndarray:
        self.round += 1
        rnd, prompts = self.round, [[int(t) for t in p] for p in prompts]
        reply = self._call(
            "prefill",
            lambda inc: m.pack(
                "prefill",
                rnd,
                incarnation=inc,
                slots=np.asarray(slots, np.int32),
                prompts=prompts,
                reserve=[self.reserved.get(int(s), 0) for s in slots],
                **m.sampling_fields(sampling),
            ),  # fmt: skip
        )
        roots = m.decode_array(m.unpack(reply, "roots", rnd)["roots"], "roots")
        for s, p, r in zip(slots, prompts, roots, strict=True):
            self.history[int(s)] = [*p, int(r)]
        return roots

    def verify(self, roots, tree: DraftBatch, active, sampling: SamplingBatch):
        self.round += 1
        rnd = self.round
        active = np.asarray(active, bool)
        tree_msg = m.pack_tree(rnd, tree, active, {})
        reply = self._call(
            "verify",
            lambda inc: m.pack(
                "verify",
                rnd,
                incarnation=inc,
                roots=np.asarray(roots, np.int32),
                active=active,
                tree=tree_msg,
                **m.sampling_fields(sampling),
            ),  # fmt: skip
        )
        emitted, num, accepted = m.unpack_verdict(reply, rnd)
        for s in np.flatnonzero(active):
            self.history[int(s)].extend(int(t) for t in emitted[s, : num[s] + 1])
        return emitted, num, accepted

    def reserve(self, slots, lengths) -> None:
        """Remembered per slot; travels with the prefill (and any restore)."""
        self.reserved.update((int(s), int(n)) for s, n in zip(slots, lengths, strict=True))

    def release(self, slot: int) -> None:
        self.history.pop(int(slot), None)
        self.reserved.pop(int(slot), None)
        if self.lost is None:
            msg = m.pack("release", self.round, incarnation=self.incarnation, slot=int(slot))
            self._fired.append(self.endpoint.submit("release", msg))

    def _call(self, method: str, build) -> bytes:
        """Sends `build(incarnation)`; on a lost actor, restores it and sends again."""
        while True:
            if self.lost is not None:
                raise self.lost
            try:
                call = self.endpoint.submit(method, build(self.incarnation))
                fired, self._fired = self._fired, []
                for f in fired:
                    self.endpoint.result(f)
                return self.endpoint.result(call)
            except WorkerDown as e:
                self._recover(method, e)

    def _recover(self, method: str, cause: WorkerDown) -> None:
        t0 = time.perf_counter()
        self._fired = []
        name = self.endpoint.name
        slots, histories = _tokens(self.history)
        logger.warning("target actor %r lost during %s (%s); waiting for its restart", name,
                       method, cause)  # fmt: skip
        for _ in range(max(self.endpoint.group.max_restarts, 0) + 2):
            try:
                if self.endpoint.group.num_hosts > 1:
                    raise WorkerDown("a multi-host JAX world cannot re-admit one restarted host")
                self.incarnation = _hello(self.endpoint, self.restart_timeout_s)["incarnation"]
            except Exception as e:  # noqa: BLE001 - dead for good, or no restart in time
                cause = e
                break
            try:
                msg = m.pack("restore", self.round, incarnation=self.incarnation, slots=slots,
                             histories=histories,
                             reserve=[self.reserved.get(s, 0) for s in slots])  # fmt: skip
                self.endpoint.result(self.endpoint.submit("restore", msg))
            except WorkerDown as e:  # died again while re-prefilling: wait for the next restart
                cause = e
                continue
            dt = time.perf_counter() - t0
            self.recoveries.append(dt)
            logger.warning(
                "target actor %r restarted and re-prefilled %d sequences (%d committed tokens) "
                "in %.2f s; repeating %s of round %d",
                name, len(slots), sum(map(len, histories)), dt, method, self.round,
            )  # fmt: skip
            return
        self.lost = WorkerLostError(
            f"The target actor {name!r} died and was not restarted (max_restarts="
            f"{self.endpoint.group.max_restarts} exhausted, or no restart within "
            f"{self.restart_timeout_s:.0f} s; cause: {cause}). Lost: its KV cache of "
            f"{len(slots)} running sequences; their {sum(map(len, histories))} committed "
            "tokens are kept, and every unfinished request ends with finish_reason='error'."
        )
        raise self.lost


# ----------------------------------------------------------------------------- draft


class RemoteDrafter:
    """The engine's `Drafter`, served by the draft group's actors; never changes output."""

    def __init__(self, endpoint: Endpoint, *, num_slots: int, vocab_size: int,
                 overlap: bool = True):  # fmt: skip
        self.endpoint = endpoint
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.info = _started(endpoint)
        self.incarnation = self.info["incarnation"]
        self.max_nodes = int(self.info["max_nodes"])
        self.overlap = overlap and bool(self.info["can_speculate"])
        self.history: dict[int, list[int]] = {}
        self.reserved: dict[int, int] = {}  # slot -> planned length (`reserve`)
        self.round = 0
        self.recoveries: list[float] = []
        self.target_only_steps = 0
        self._fired: list = []
        self._stats = {"hits": 0, "misses": 0}
        self._stats_base = {"hits": 0, "misses": 0}  # from earlier incarnations
        self._down_since: float | None = None
        self._down_steps = 0
        self._comeback = None  # a hello queued on the restarting actor
        self._comeback_failures = 0
        self.dead = False

    # -- the Drafter protocol

    def kv_capacity(self) -> tuple[int, int, int] | None:
        """The draft actor's KV capacity (None: an n-gram drafter holds no cache)."""
        cap = self.info.get("kv_capacity")
        return None if cap is None else tuple(cap)

    def start(self, slots, prompts, roots) -> None:
        prompts = [[int(t) for t in p] for p in prompts]
        roots = [int(r) for r in roots]
        for s, p, r in zip(slots, prompts, roots, strict=True):
            self.history[int(s)] = [*p, r]
        self._fire("start", slots=[int(s) for s in slots], prompts=prompts, roots=roots,
                   reserve=[self.reserved.get(int(s), 0) for s in slots])  # fmt: skip

    def propose(self, active, roots, sampling: SamplingBatch) -> DraftBatch:
        self.round += 1
        rnd = self.round
        if self._up():
            try:
                call = self.endpoint.submit("propose", m.pack(
                    "propose", rnd, incarnation=self.incarnation,
                    active=np.asarray(active, bool), roots=np.asarray(roots, np.int32),
                    **m.sampling_fields(sampling),
                ))  # fmt: skip
                self._collect()
                tree, self._stats = m.unpack_tree(
                    self.endpoint.result(call), rnd, num_slots=self.num_slots,
                    max_nodes=self.max_nodes, vocab_size=self.vocab_size,
                )  # fmt: skip
                if self.overlap:
                    self._fire("speculate")
                return tree
            except WorkerDown as e:
                self._go_down(e)
        self.target_only_steps += 1
        self._down_steps += 1
        return DraftBatch.empty(self.num_slots, self.max_nodes)

    def commit(self, active, accepted_nodes, num_accepted, emitted) -> None:
        active = np.asarray(active, bool)
        for s in np.flatnonzero(active):
            self.history[int(s)].extend(int(t) for t in emitted[s, : num_accepted[s] + 1])
        verdict = m.pack_verdict(self.round, emitted, num_accepted, accepted_nodes)
        self._fire("commit", active=active, verdict=verdict)

    def reserve(self, slots, lengths) -> None:
        """Remembered per slot; travels with the start (and any restore)."""
        self.reserved.update((int(s), int(n)) for s, n in zip(slots, lengths, strict=True))

    def release(self, slot: int) -> None:
        self.history.pop(int(slot), None)
        self.reserved.pop(int(slot), None)
        self._fire("release", slot=int(slot))

    # -- overlap figures

    def overlap_stats(self) -> dict:
        """Guesses that hit / missed so far (all incarnations), target-only steps, recoveries."""
        if self._down_since is None and not self.dead:
            try:
                self._collect()
            except WorkerDown as e:
                self._go_down(e)
        hits = self._stats_base["hits"] + self._stats["hits"]
        misses = self._stats_base["misses"] + self._stats["misses"]
        return {
            "overlap": self.overlap,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "target_only_steps": self.target_only_steps,
            "recoveries_s": list(self.recoveries),
        }

    # -- plumbing

    def _fire(self, method: str, **fields) -> None:
        """Sends without waiting; `propose` collects the reply (actors run calls in order)."""
        if self.dead or self._down_since is not None:
            return
        msg = m.pack(method, self.round, incarnation=self.incarnation, **fields)
        self._fired.append(self.endpoint.submit(method, msg))

    def _collect(self) -> None:
        fired, self._fired = self._fired, []
        for call in fired:
            reply = m.unpack(self.endpoint.result(call), "ack")  # checked like any reply
            if "stats" in reply:  # commit acks carry the running hit / miss counts
                self._stats = reply["stats"]

    def _go_down(self, cause: WorkerDown) -> None:
        self._fired = []
        self._down_since = time.perf_counter()
        self._down_steps = 0
        self._stats_base = {k: self._stats_base[k] + self._stats[k] for k in self._stats_base}
        self._stats = {"hits": 0, "misses": 0}
        logger.warning(
            "draft actor %r lost (%s); decoding target-only until it is restarted",
            self.endpoint.name, cause,
        )  # fmt: skip
        if self.endpoint.group.num_hosts > 1:
            self._give_up("a multi-host JAX world cannot re-admit one restarted host")
            return
        self._comeback = self.endpoint.submit("hello")

    def _give_up(self, why: str) -> None:
        self.dead = True
        logger.error(
            "draft actor %r is gone for good (%s; max_restarts=%d); decoding target-only from "
            "now on: output is unchanged, only slower. Lost: the draft KV cache of %d sequences.",
            self.endpoint.name, why, self.endpoint.group.max_restarts, len(self.history),
        )  # fmt: skip

    def _up(self) -> bool:
        """Whether the actor can draft now; brings a restarted actor back first."""
        if self.dead:
            return False
        if self._down_since is None:
            return True
        if not self.endpoint.ready(self._comeback):
            return False
        try:
            incarnations = [
                m.unpack(r, "hello")["incarnation"]
                for r in self.endpoint.result(self._comeback, every=True)
            ]
        except WorkerDown as e:
            self._comeback_failures += 1
            if self._comeback_failures >= HELLO_RETRIES:
                self._give_up(str(e))
            else:
                self._comeback = self.endpoint.submit("hello")
            return False
        self.incarnation = incarnations
        slots, histories = _tokens(self.history)
        try:
            msg = m.pack("restore", self.round, incarnation=self.incarnation, slots=slots,
                         histories=histories,
                         reserve=[self.reserved.get(s, 0) for s in slots])  # fmt: skip
            self.endpoint.result(self.endpoint.submit("restore", msg))
        except WorkerDown as e:
            self._go_down(e)
            return False
        dt = time.perf_counter() - self._down_since
        self.recoveries.append(dt)
        self._down_since, self._comeback_failures = None, 0
        logger.warning(
            "draft actor %r restarted and re-prefilled %d sequences in %.2f s (%d steps "
            "decoded target-only meanwhile)",
            self.endpoint.name, len(slots), dt, self._down_steps,
        )  # fmt: skip
        return True


# ----------------------------------------------------------------------------- building


@dataclasses.dataclass
class Cluster:
    """The actors and placement groups behind one engine; `shutdown()` frees them."""

    target: RemoteTarget
    drafter: RemoteDrafter | None
    placement_groups: list

    def shutdown(self) -> None:
        import ray

        for proxy in (self.drafter, self.target):
            if proxy is not None:
                proxy.endpoint.kill()
        for pg in self.placement_groups:
            ray.util.remove_placement_group(pg)
        self.placement_groups = []


def default_cluster() -> ClusterConfig:
    """`distributed_executor_backend="ray"` without a ClusterConfig: one host per group.

    TPU hosts when the cluster advertises `TPU` (all chips of a host per group),
    else one CPU each.
    """
    from specdec.cluster import placement

    tpu = placement.tpu_summary()
    if tpu:
        import ray.util.tpu

        chips = ray.util.tpu.get_num_tpu_chips_on_node() or 4
        return ClusterConfig(target=GroupConfig({"TPU": chips}), draft=GroupConfig({"TPU": chips}))
    return ClusterConfig(target=GroupConfig({"CPU": 1}), draft=GroupConfig({"CPU": 1}))


def remote_workers(
    cluster: ClusterConfig | None,
    *,
    model: str | Path,
    dtype: str,
    model_config: ModelConfig,
    speculative_config: SpeculativeConfig | None,
    num_slots: int,
    max_model_len: int,
    kernel: str = "auto",
    kv_cache_memory: int | None = None,  # per group: each budgets its own host's memory
) -> tuple[RemoteTarget, RemoteDrafter | None]:
    """Reserves both groups, starts the actors and returns the engine's two proxies.

    Joins the running Ray cluster (or `cluster.address`; a local one if none).
    """
    import ray

    from specdec.cluster import placement

    if not ray.is_initialized():
        ray.init(address=cluster.address if cluster is not None else None)
    cluster = cluster or default_cluster()
    model = str(Path(model).resolve())
    pgs, spawned = [], []
    drafter = None
    try:
        if speculative_config is not None:
            spec = dataclasses.asdict(speculative_config)
            if spec.get("model"):
                spec["model"] = str(Path(spec["model"]).resolve())
            pg = placement.reserve(cluster.draft, f"{cluster.name}-draft")
            pgs.append(pg)
            handles = placement.spawn(
                DraftActor, cluster.draft, pg, f"{cluster.name}-draft", spec, target_model=model,
                dtype=dtype, num_slots=num_slots, max_model_len=max_model_len,
                num_devices=cluster.draft.num_devices, kv_cache_memory=kv_cache_memory,
            )  # fmt: skip
            spawned += handles
            drafter = RemoteDrafter(
                Endpoint(f"{cluster.name}-draft", handles, cluster.draft),
                num_slots=num_slots, vocab_size=model_config.vocab_size, overlap=cluster.overlap,
            )  # fmt: skip
        pg = placement.reserve(cluster.target, f"{cluster.name}-target")
        pgs.append(pg)
        handles = placement.spawn(
            TargetActor, cluster.target, pg, f"{cluster.name}-target", model, dtype=dtype,
            num_slots=num_slots, max_model_len=max_model_len,
            max_tree_nodes=drafter.max_nodes if drafter is not None else 0,
            num_devices=cluster.target.num_devices, kernel=kernel,
            kv_cache_memory=kv_cache_memory,
        )  # fmt: skip
        spawned += handles
        target = RemoteTarget(
            Endpoint(f"{cluster.name}-target", handles, cluster.target),
            num_slots=num_slots, max_tree_nodes=drafter.max_nodes if drafter else 0,
            vocab_size=model_config.vocab_size, restart_timeout_s=cluster.restart_timeout_s,
        )  # fmt: skip
    except BaseException:
        for h in spawned:
            ray.kill(h, no_restart=True)
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        raise
    handle = Cluster(target, drafter, pgs)
    target.cluster = handle
    if drafter is not None:
        drafter.cluster = handle
    logger.info("target placement: %s", target.info.get("placement"))
    return target, drafter
