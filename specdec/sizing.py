"""Tree size for this hardware (`num_speculative_tokens="auto"`), Sequoia-style.

A bigger tree accepts more tokens per step but costs more to verify; where the
verify cost turns up depends on the machine: a TPU stays memory-bound (flat
cost) to hundreds of tokens, two CPU cores turn compute-bound past ~8. So at
start-up we time the target's own weight products at m = N + 1 rows for each
candidate tree size (per layer: the fused QKV, output, gate+up and down
projections, then the LM head, each matrix its own array, so every weight
byte streams once as in a decode step) and pick the size that maximises
expected tokens per unit of verify time:

    score(N) = acceptance_length_prior(N) / cost(N + 1) * cost(1)

The acceptance prior is a fixed table from EAGLE-2-style trees with a
distilled draft (measured acceptance replaces it once online adaptation
lands). Example: cost ratios [1, 1.1, 1.3, 2.2, 4.0] for N = 4..64 pick N = 16.

One wide [m, D] x [D, L * 3F] product (this module before) stayed nearly flat
to 65 rows on 2 CPU cores (1.48x) while the demo target's real products cost
1.2x at 5 rows and 1.8x at 17: it picked 64 nodes where 8 measured fastest.
The draft's cost is not counted (yet).
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
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - t)
    return best


def weight_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """The [in, out] matrices one decode step multiplies by: per layer the fused
    QKV, output, gate+up and down projections (an MoE layer: its routed experts'
    share, top-k experts wide), then the LM head."""
    d, hd = cfg.hidden_size, cfg.head_dim
    ffn = cfg.moe_intermediate_size * cfg.num_experts_per_tok if cfg.is_moe else (
        cfg.intermediate_size
    )  # fmt: skip
    layer = [(d, (cfg.num_heads + 2 * cfg.num_kv_heads) * hd), (cfg.num_heads * hd, d),
             (d, 2 * ffn), (ffn, d)]  # fmt: skip
    return layer * cfg.num_layers + [(d, cfg.vocab_size)]


def plan_tree(cfg: ModelConfig, dtype=jnp.float32, max_bytes: int = 256 << 20) -> TreePlan:
    """Measures the verify-cost curve on this machine and picks the tree size.

    Times the first matrices of `weight_shapes` that fit in `max_bytes` (a large
    model's first layers: the cost ratio is per layer)."""
    itemsize = jnp.dtype(dtype).itemsize
    shapes, total = [], 0
    for shape in weight_shapes(cfg):
        if shapes and total + shape[0] * shape[1] * itemsize > max_bytes:
            break
        shapes.append(shape)
        total += shape[0] * shape[1] * itemsize
    ws = [jnp.full(shape, 0.01, dtype) for shape in shapes]
    f = jax.jit(lambda ws, xs: [transformer.matmul(x, w) for x, w in zip(xs, ws, strict=True)])

    def cost_at(m: int) -> float:
        xs = [jnp.ones((m, shape[0]), dtype) for shape in shapes]
        return _time(lambda xs: f(ws, xs), xs)

    base = cost_at(1)
    cost, score = {}, {}
    floor = 1.0  # a bigger block never costs less (timing noise aside)
    for n, _, prior in CANDIDATES:
        floor = cost[n] = max(floor, cost_at(n + 1) / base)
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
    path = home / "tree_plans_v3.json"  # v3: timed over the model's own products
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


__all__ = ["CANDIDATES", "TreePlan", "cached_plan", "describe", "plan_tree", "weight_shapes"]
