"""Where the draft and the target run: one `GroupConfig` per worker group.

CPU (tests, a laptop): custom resources name the groups, and the target sees
four virtual XLA devices to shard over::

    ray.init(resources={"target_group": 1, "draft_group": 1})
    ClusterConfig.local_cpu(target_devices=4)

TPU (one host per group): Ray's `TPU` resource counts chips per host::

    ClusterConfig(target=GroupConfig(resources={"TPU": 4}),
                  draft=GroupConfig(resources={"TPU": 4}))

TPU slice (multi-host): name the topology; the group is reserved with
`ray.util.tpu.SlicePlacementGroup` (worker 0 of a slice carries
`TPU-{pod_type}-head`, e.g. `TPU-v6e-16-head`) and runs one actor per host::

    GroupConfig(resources={"TPU": 4}, num_hosts=4, tpu_topology="4x4",
                accelerator_version="v6e")
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Literal

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


def virtual_cpu_devices(n: int) -> dict[str, str]:
    """Environment for a process that sees n virtual CPU devices."""
    return {
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
        # XLA's CPU thread pool (default: the cores): an interpreted megakernel's n
        # instances block on each other while their callbacks still need the pool, so
        # it must be several times n.
        "NPROC": str(max(4 * n, os.cpu_count() or 1)),
    }


@dataclasses.dataclass(frozen=True)
class GroupConfig:
    """One worker group (the target's or the draft's): its resources and devices."""

    resources: Mapping[str, float]  # one host's bundle, e.g. {"TPU": 4} or {"draft_group": 1}
    num_hosts: int = 1  # hosts (one actor each); > 1 = a multi-host JAX world
    num_devices: int | None = None  # devices per host to shard over; None = all JAX sees
    env_vars: Mapping[str, str] = dataclasses.field(default_factory=dict)  # actor environment
    max_restarts: int = 3  # Ray restarts of a dead actor; -1 = unlimited, 0 = none
    strategy: Strategy | None = None  # placement across hosts; None = PACK / STRICT_SPREAD
    tpu_topology: str | None = None  # e.g. "4x4": reserve a whole slice
    accelerator_version: str | None = None  # e.g. "v6e" (with tpu_topology)

    def __post_init__(self):
        res = dict(self.resources)
        if not res or any(
            not isinstance(v, int | float) or isinstance(v, bool) or v <= 0 for v in res.values()
        ):
            raise ValueError(
                f"resources must be a non-empty map of positive amounts (a placement bundle), "
                f"got {res!r}."
            )
        object.__setattr__(self, "resources", res)
        object.__setattr__(self, "env_vars", {str(k): str(v) for k, v in self.env_vars.items()})
        if not isinstance(self.num_hosts, int) or self.num_hosts < 1:
            raise ValueError(f"num_hosts must be a positive integer, got {self.num_hosts!r}.")
        if self.num_devices is not None and (
            not isinstance(self.num_devices, int) or self.num_devices < 1
        ):
            raise ValueError(f"num_devices must be None or >= 1, got {self.num_devices!r}.")
        if not isinstance(self.max_restarts, int) or self.max_restarts < -1:
            raise ValueError(
                f"max_restarts must be -1 (unlimited) or >= 0, got {self.max_restarts}."
            )
        if (self.tpu_topology is None) != (self.accelerator_version is None):
            raise ValueError(
                "tpu_topology and accelerator_version go together (e.g. '4x4' and 'v6e'), got "
                f"{self.tpu_topology!r} and {self.accelerator_version!r}."
            )

    @property
    def placement_strategy(self) -> Strategy:
        if self.strategy is not None:
            return self.strategy
        return "PACK" if self.num_hosts == 1 else "STRICT_SPREAD"


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """Run the draft and the target as Ray actors on separate resource groups."""

    target: GroupConfig
    draft: GroupConfig
    overlap: bool = True  # draft tree t + 1 while the target verifies tree t
    address: str | None = None  # ray.init address; None = the running cluster, else a local one
    restart_timeout_s: float = 300.0  # wait at most this long for a restarted actor
    name: str = "specdec"  # actor name prefix: "<name>-target", "<name>-draft"

    def __post_init__(self):
        for field in ("target", "draft"):
            if not isinstance(getattr(self, field), GroupConfig):
                raise ValueError(f"{field} must be a GroupConfig, got {getattr(self, field)!r}.")
        if not self.restart_timeout_s > 0:
            raise ValueError(f"restart_timeout_s must be > 0, got {self.restart_timeout_s}.")

    @classmethod
    def local_cpu(
        cls, target_devices: int = 4, draft_devices: int = 1, max_restarts: int = 3, **kw
    ) -> ClusterConfig:
        """Custom resources `target_group` / `draft_group`, virtual CPU devices per group."""

        def env(n: int) -> dict[str, str]:
            return {"JAX_PLATFORMS": "cpu", **virtual_cpu_devices(n)}

        return cls(
            target=GroupConfig(
                {"target_group": 1}, num_devices=target_devices, env_vars=env(target_devices),
                max_restarts=max_restarts,
            ),
            draft=GroupConfig(
                {"draft_group": 1}, num_devices=draft_devices, env_vars=env(draft_devices),
                max_restarts=max_restarts,
            ),
            **kw,
        )  # fmt: skip
