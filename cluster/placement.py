"""Reserving each worker group's resources and starting its actors there.

One placement group per worker group, one bundle per host, so the draft and
the target never share devices:

* plain bundles (`GroupConfig.resources` per host): custom resources in CPU
  tests (`{"target_group": 1}`), `{"TPU": 4}` on single-host TPU groups;
* a whole TPU slice (`tpu_topology` + `accelerator_version`) through
  `ray.util.tpu.SlicePlacementGroup`, whose arguments differ across Ray
  releases: only the ones this Ray accepts are passed (feature detection).

A multi-host group starts its rank-0 actor first, asks it for its node's
address and hands `<ip>:<port>` to every rank as the `jax.distributed`
coordinator.
"""

from __future__ import annotations

import inspect
import logging
import uuid

from specdec.cluster.config import GroupConfig

logger = logging.getLogger(__name__)

JAX_COORDINATOR_PORT = 8476
RESERVE_TIMEOUT_S = 120.0


def reserve(group: GroupConfig, name: str, timeout_s: float = RESERVE_TIMEOUT_S):
    """A ready placement group for `group` (`ValueError` naming what is missing)."""
    import ray
    from ray.util.placement_group import placement_group

    if group.tpu_topology is not None:
        pg = _slice_placement_group(group, name)
    else:
        pg = placement_group(
            [dict(group.resources)] * group.num_hosts,
            strategy=group.placement_strategy,
            name=f"{name}-{uuid.uuid4().hex[:6]}",
        )
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.util.remove_placement_group(pg)
        raise ValueError(
            f"Could not reserve the {name} group ({group.num_hosts} x {dict(group.resources)}) "
            f"within {timeout_s:.0f} s; the cluster has {ray.cluster_resources()} in total and "
            f"{ray.available_resources()} free."
        ) from None
    return pg


def _slice_placement_group(group: GroupConfig, name: str):
    import ray.util.tpu as tpu

    cls = getattr(tpu, "SlicePlacementGroup", None)
    if cls is None:
        raise ValueError(
            "tpu_topology needs ray.util.tpu.SlicePlacementGroup, which this Ray "
            f"({__import__('ray').__version__}) lacks; reserve hosts with resources={{'TPU': n}}."
        )
    wanted = {
        "topology": group.tpu_topology,
        "accelerator_version": group.accelerator_version,
        "resources_per_bundle": dict(group.resources),
        "strategy": group.placement_strategy,
        "name": name,
    }
    accepted = inspect.signature(cls).parameters
    handle = cls(**{k: v for k, v in wanted.items() if k in accepted})
    if getattr(handle, "num_hosts", group.num_hosts) != group.num_hosts:
        raise ValueError(
            f"{name}: topology {group.tpu_topology} has {handle.num_hosts} hosts, but "
            f"num_hosts={group.num_hosts}."
        )
    return getattr(handle, "placement_group", None) or handle.slice_placement_group


def tpu_summary() -> dict:
    """TPU chips and slice heads the running cluster advertises (empty without TPUs)."""
    import ray

    res = ray.cluster_resources()
    heads = sorted(k for k in res if k.startswith("TPU-") and k.endswith("-head"))
    return {"chips": res.get("TPU", 0), "slice_heads": heads} if "TPU" in res else {}


def spawn(cls, group: GroupConfig, pg, name: str, *args, **kwargs) -> list:
    """Starts `cls` once per host of `group` inside `pg`; returns the actor handles."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    res = dict(group.resources)
    num_cpus = res.pop("CPU", 0)
    num_gpus = res.pop("GPU", 0)
    res.pop("memory", None)

    def options(rank: int):
        return ray.remote(cls).options(
            name=f"{name}-{uuid.uuid4().hex[:6]}-h{rank}",
            max_restarts=group.max_restarts,
            max_task_retries=0,  # a retried verify on a restarted actor would see no state
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            resources=res,
            runtime_env={"env_vars": dict(group.env_vars)} if group.env_vars else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank
            ),
        )

    if group.num_hosts == 1:
        return [options(0).remote(*args, num_hosts=1, rank=0, **kwargs)]
    # Rank 0 hosts the jax.distributed coordinator; the others need its address first.
    first = options(0)
    probe = ray.remote(lambda: ray.util.get_node_ip_address()).options(
        num_cpus=0,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=0
        ),
    )
    coordinator = f"{ray.get(probe.remote())}:{JAX_COORDINATOR_PORT}"
    handles = [first.remote(*args, num_hosts=group.num_hosts, rank=0, coordinator=coordinator,
                            **kwargs)]  # fmt: skip
    for rank in range(1, group.num_hosts):
        handles.append(
            options(rank).remote(
                *args, num_hosts=group.num_hosts, rank=rank, coordinator=coordinator, **kwargs
            )
        )
    logger.info("%s: %d hosts, jax coordinator %s", name, group.num_hosts, coordinator)
    return handles
