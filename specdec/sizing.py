"""Tree size for this hardware (`num_speculative_tokens="auto"`), Sequoia-style.

A bigger tree accepts more tokens per step but costs more to verify; where the
verify cost turns up depends on the machine: a TPU stays memory-bound (flat
cost) to hundreds of tokens, two CPU cores turn compute-bound past ~8. So at
start-up we time the target's weight-streaming matmul at m = N + 1 rows for
each candidate tree size (a [m, D] x [D, L * 3F] product: the bytes of every
layer's MLP, read once, as a decode step reads them) and pick the size that
maximises expected tokens per unit of verify time:

    score(N) = acceptance_length_prior(N) / cost(N + 1) * cost(1)

The acceptance prior is a fixed table from EAGLE-2-style trees with a
distilled draft (measured acceptance replaces it once online adaptation
lands). Example: cost ratios [1, 1.1, 1.3, 2.2, 4.0] for N = 4..64 pick N = 16.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specdec.kernels import transformer
from specdec.kernels.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TreePlan:
    """The chosen tree shape and the measurements behind it."""

    num_nodes: int  # N, tree nodes per step
    max_depth: int
    cost: dict[int, float]  # N -> verify cost of N nodes relative to a 1-token decode
    score: dict[int, float]  # N -> expected tokens per unit of decode time


# (num_nodes, max_depth, expected acceptance length) for a distilled draft.
CANDIDATES = ((4, 4, 2.5), (8, 5, 2.9), (16, 6, 3.3), (32, 6, 3.6), (64, 7, 3.8))


def _time(f, x, repeats: int = 5) -> float:
    f(x).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def plan_tree(cfg: ModelConfig, dtype=jnp.float32, max_bytes: int = 256 << 20) -> TreePlan:
    """Measures the verify-cost curve on this machine and picks the tree size."""
    d = cfg.hidden_size
    width = 3 * (cfg.moe_intermediate_size if cfg.is_moe else cfg.intermediate_size)
    width = min(width * cfg.num_layers, max_bytes // (d * jnp.dtype(dtype).itemsize))
    w = jnp.ones((d, width), dtype) * 0.01
    f = jax.jit(lambda x: transformer.matmul(x, w))  # the model's own product
    base = _time(f, jnp.ones((1, d), dtype))
    cost, score = {}, {}
    floor = 1.0  # a bigger block never costs less (timing noise aside)
    for n, _, prior in CANDIDATES:
        floor = cost[n] = max(floor, _time(f, jnp.ones((n + 1, d), dtype)) / base)
        score[n] = prior / cost[n]
    best = max(CANDIDATES, key=lambda c: score[c[0]])
    return TreePlan(num_nodes=best[0], max_depth=best[1], cost=cost, score=score)


def cached_plan(cfg: ModelConfig, dtype=jnp.float32) -> TreePlan:
    """`plan_tree`, remembered per machine, backend and model shape (~/.cache/specdec)."""
    home = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
    dev = jax.devices()[0]
    key = f"{dev.platform}:{dev.device_kind}:{os.cpu_count()}:{jnp.dtype(dtype).name}:" + (
        f"{cfg.hidden_size}x{cfg.intermediate_size}x{cfg.num_layers}x{cfg.moe_intermediate_size}"
    )
    path = home / "tree_plans_v2.json"
    try:
        plans = json.loads(path.read_text())
    except (OSError, ValueError):
        plans = {}
    if key in plans:
        p = plans[key]
        return TreePlan(
            num_nodes=p["num_nodes"], max_depth=p["max_depth"],
            cost={int(k): v for k, v in p["cost"].items()},
            score={int(k): v for k, v in p["score"].items()},
        )  # fmt: skip
    plan = plan_tree(cfg, dtype)
    plans[key] = dataclasses.asdict(plan)
    try:
        home.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(plans, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # unwritable cache: measure again next time
    return plan


def describe(plan: TreePlan) -> str:
    curve = ", ".join(f"N={n}: {c:.2f}x" for n, c in plan.cost.items())
    return f"tree of {plan.num_nodes} nodes, depth {plan.max_depth} (verify cost {curve})"


__all__ = ["CANDIDATES", "TreePlan", "cached_plan", "describe", "plan_tree"]
