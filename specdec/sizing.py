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

The real matrices are timed, not one wide product: a single [m, D] x [D, L * 3F]
product stays flat to far more rows than a model's separate products do, and
would pick trees far too big. The draft's cost is not counted (yet).

On CPU each row count is timed under each dot library worth trying
(`kernels/dot_library.py`: XLA's default YNNPACK path, or its Eigen GEMM for
float32); cost(N) takes the faster, and the target's verify is compiled for
the library that won at its row count (`specdec/plan.py`). One row is timed in
the layout a one-slot float32 target reads then, its [out, in] copies
(`xla_layout.one_row_copies`). Timings are kept per machine, dtype and model
shape in $SPECDEC_CACHE/product_costs_v2.json. Everything here runs when a plan
is made (`specdec/plan.py`), never while requests are served.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from specdec.kernels import dot_library, xla_layout
from specdec.kernels.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TreePlan:
    """The chosen tree shape and the measurements behind it."""

    num_nodes: int  # N, tree nodes per step
    max_depth: int
    topk: int  # widest expansion the tree needs (`SpeculativeConfig.topk` may narrow it)
    cost: dict[int, float]  # N -> verify cost of N nodes relative to a 1-token decode
    score: dict[int, float]  # N -> expected tokens per unit of decode time
    library: dict[int, str] = dataclasses.field(default_factory=dict)  # N -> faster dot library
    batch: int = 1  # sequences per step the costs were measured for


# (num_nodes, max_depth, topk, expected acceptance length) for a distilled draft. The
# smallest is the depth-4 chain plus its best side branch (topk 2 offers every
# second-best child), which accepts more than the chain at about the chain's cost.
CANDIDATES = ((5, 4, 2, 2.7), (8, 5, 2, 2.9), (16, 6, 4, 3.3), (32, 6, 4, 3.6), (64, 7, 4, 3.8))


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
    QKV (MLA: its query and latent projections, the per-head up-projections as one
    matrix each; a linear-attention layer: its q|k|v|z|b|a and output projections),
    output, gate+up and down projections (an MoE layer: its routed
    and shared experts' share, top-k experts wide), then the LM head."""
    d, hd, h = cfg.hidden_size, cfg.head_dim, cfg.num_heads
    if cfg.is_mla:
        c, nope = cfg.kv_lora_rank, cfg.qk_nope_head_dim
        q = [(d, cfg.q_lora_rank), (cfg.q_lora_rank, h * (nope + hd))] if cfg.q_lora_rank else [
            (d, h * (nope + hd))]  # fmt: skip
        attn = [*q, (d, c + hd), (h * nope, c), (c, h * cfg.v_head_dim),
                (h * cfg.v_head_dim, d)]  # fmt: skip
    else:
        attn = [(d, (h + 2 * cfg.num_kv_heads) * hd), (h * hd, d)]
    if cfg.attn_output_gate:  # the gate's columns come with the query's
        attn = [(d, (2 * h + 2 * cfg.num_kv_heads) * hd), (h * hd, d)]
    kd, vd, cd = cfg.linear_dims
    linear = [(d, cd + vd + 2 * cfg.linear_num_value_heads), (vd, d)]  # qkv|z|b|a, out
    shapes = []
    for i in range(cfg.num_layers):
        if cfg.moe_layer(i):
            ffn = cfg.moe_intermediate_size * cfg.num_experts_per_tok + cfg.shared_intermediate
        else:
            ffn = cfg.intermediate_size
        shapes += [*(linear if cfg.linear_layer(i) else attn), (d, 2 * ffn), (ffn, d)]
    return shapes + [(d, cfg.vocab_size)]


def product_costs(
    cfg: ModelConfig, dtype, rows: list[int], *, max_bytes: int = 256 << 20
) -> dict[str, dict[int, float]]:
    """Seconds for one pass over the weight products at each row count, per dot
    library worth trying here (`libraries`).

    Times the first matrices of `weight_shapes` that fit in `max_bytes` (a large
    model's first layers: the cost ratio is per layer). A library whose compile
    options this XLA rejects is left out."""
    itemsize = jnp.dtype(dtype).itemsize
    shapes, total = [], 0
    for shape in weight_shapes(cfg):
        if shapes and total + shape[0] * shape[1] * itemsize > max_bytes:
            break
        shapes.append(shape)
        total += shape[0] * shape[1] * itemsize
    ws = [{"w": jnp.full(shape, 0.01, dtype)} for shape in shapes]
    if xla_layout.wants_one_row_copies(cfg, dtype):
        # One-row steps read [out, in] copies (`xla_layout.one_row_copies`): time those.
        ws = [{**w, "one_row": {"w": jnp.transpose(w["w"])}} for w in ws]
    layout = xla_layout.for_backend(cfg)  # the products as the runner lays them out
    jits = dot_library.jit_each(
        lambda ws, xs: [layout.linear(w, "w", x) for x, w in zip(xs, ws, strict=True)]
    )
    out: dict[str, dict[int, float]] = {}
    for name in libraries(cfg, dtype):
        costs = {}
        try:
            for m in rows:
                xs = [jnp.ones((m, shape[0]), dtype) for shape in shapes]
                costs[m] = _time(lambda xs, f=jits[name]: f(ws, xs), xs)
        except Exception as e:  # noqa: BLE001 - an XLA without this library's flag
            if name == "default":
                raise
            logger.warning("dot library %r unavailable here (%s); using XLA's default", name, e)
            continue
        out[name] = costs
    return out


def faster_library(costs: dict[str, dict[int, float]], rows: int) -> str:
    """The library in `product_costs`' table whose products took least time at `rows`."""
    return min(costs, key=lambda name: costs[name][rows])


def fastest(costs: dict[str, dict[int, float]]) -> dict[int, float]:
    """Per row count, the seconds of the faster library in `product_costs`' table."""
    return {m: min(c[m] for c in costs.values()) for m in next(iter(costs.values()))}


def plan_from_costs(costs: dict[str, dict[int, float]], batch: int = 1) -> TreePlan:
    """The best candidate tree for per-library product timings at `batch` rows (one
    decode step of `batch` sequences) and batch * (N + 1) rows (their trees).

    cost(N) = best library's time at batch * (N + 1) rows / its time at `batch` rows;
    candidates with no timing are not considered."""
    best = fastest(costs)
    base = best[batch]
    cost, score, library = {}, {}, {}
    floor = 1.0  # a bigger block never costs less (timing noise aside)
    for n, _, _, prior in CANDIDATES:
        rows = batch * (n + 1)
        if rows not in best:
            continue
        floor = cost[n] = max(floor, best[rows] / base)
        score[n] = prior / cost[n]
        library[n] = faster_library(costs, rows)
    pick = max((c for c in CANDIDATES if c[0] in score), key=lambda c: score[c[0]])
    return TreePlan(num_nodes=pick[0], max_depth=pick[1], topk=pick[2], cost=cost, score=score,
                    library=library, batch=batch)  # fmt: skip


PLAN_ROWS = [1] + [n + 1 for n, *_ in CANDIDATES]


def plan_tree(cfg: ModelConfig, dtype=jnp.float32, max_bytes: int = 256 << 20) -> TreePlan:
    """Measures the verify-cost curve on this machine and picks the tree size."""
    return plan_from_costs(product_costs(cfg, dtype, PLAN_ROWS, max_bytes=max_bytes))


def host_cpu() -> str:
    """This host's CPU as /proc/cpuinfo names it (model name, family/model and a
    digest of its flags; a VM's model name may hide the rest), or "" where unknown.

    Part of every remembered timing's key: a cache folder can outlive the machine
    (a home directory moved to another host), and the timings are the CPU's."""
    fields = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags", "Features"):
                fields.setdefault(key, value.strip())
            elif not line.strip() and fields:
                break  # the first processor's block is enough
    except OSError:
        return ""
    flags = fields.get("flags", fields.get("Features", ""))
    digest = hashlib.sha1(flags.encode()).hexdigest()[:8]
    return (f"{fields.get('model name', '?')}/{fields.get('cpu family', '?')}/"
            f"{fields.get('model', '?')}/{digest}")  # fmt: skip


def _cache_key(cfg: ModelConfig, dtype) -> str:
    dev = jax.devices()[0]
    shapes = ",".join(f"{a}x{b}" for a, b in sorted(set(weight_shapes(cfg))))
    host = host_cpu() if dev.platform == "cpu" else ""
    return (f"{dev.platform}:{dev.device_kind}:{host}:{os.cpu_count()}:"
            f"{jnp.dtype(dtype).name}:{shapes}")  # fmt: skip


def cached_costs(cfg: ModelConfig, dtype, rows: list[int]) -> dict[str, dict[int, float]]:
    """`product_costs`, remembered per machine, backend, dtype and model shape in
    $SPECDEC_CACHE (default ~/.cache/specdec); only missing row counts are timed."""
    home = Path(os.environ.get("SPECDEC_CACHE", Path.home() / ".cache" / "specdec"))
    path = home / "product_costs_v2.json"
    key = _cache_key(cfg, dtype)
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    known = {lib: {int(m): t for m, t in c.items()} for lib, c in table.get(key, {}).items()}
    missing = [m for m in rows if not known or any(m not in c for c in known.values())]
    if missing:
        for lib, c in product_costs(cfg, dtype, missing).items():
            known.setdefault(lib, {}).update(c)
        table[key] = {lib: {str(m): t for m, t in c.items()} for lib, c in known.items()}
        try:
            home.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(table, indent=1))
            tmp.replace(path)
        except OSError:
            pass  # unwritable cache: measure again next time
    return {lib: {m: c[m] for m in rows} for lib, c in known.items() if all(m in c for m in rows)}


def cached_plan(cfg: ModelConfig, dtype=jnp.float32, batch: int = 1) -> TreePlan:
    """`plan_tree` over remembered timings (`cached_costs`) for steps of `batch`
    sequences, timing candidates in order of size and stopping once no bigger one
    can win: a bigger tree needs cost < its prior / the best score so far, and
    costs only grow (on two CPU cores this skips the 33- and 65-row timings, the
    slowest ones)."""
    top_prior = max(c[-1] for c in CANDIDATES)
    rows = [batch]
    for n, *_ in CANDIDATES:
        rows.append(batch * (n + 1))
        plan = plan_from_costs(cached_costs(cfg, dtype, rows), batch)
        if plan.cost[n] >= top_prior / plan.score[plan.num_nodes]:
            break
    return plan


# Below this many weight bytes a model's products are not what its steps wait on
# (they sit in cache; dispatch dominates): XLA's default library, nothing timed.
LIBRARY_MIN_BYTES = 16 << 20


def weight_bytes(cfg: ModelConfig, dtype) -> int:
    """Bytes of the `weight_shapes` matrices one step streams, in `dtype`."""
    return sum(a * b for a, b in weight_shapes(cfg)) * jnp.dtype(dtype).itemsize


def libraries(cfg: ModelConfig, dtype) -> tuple[str, ...]:
    """The dot libraries worth timing for this model (`dot_library.candidates`)."""
    if weight_bytes(cfg, dtype) < LIBRARY_MIN_BYTES:
        return ("default",)
    return dot_library.candidates(dtype)


def faster_dtype(cfg: ModelConfig, rows: int, dtypes=("bfloat16", "float32")) -> str:
    """Of `dtypes`, the one whose weight products (in their faster library) take
    least time at `rows` rows here; a tie goes to the first."""
    best = {}
    for name in dtypes:
        best[name] = fastest(cached_costs(cfg, jnp.dtype(name), [rows]))[rows]
    return min(dtypes, key=best.__getitem__)


def best_library(cfg: ModelConfig, dtype, rows: int) -> str:
    """The dot library with the faster weight products at `rows` rows (timed once)."""
    if len(libraries(cfg, dtype)) == 1:
        return "default"
    return faster_library(cached_costs(cfg, dtype, [rows]), rows)


def describe(plan: TreePlan) -> str:
    curve = ", ".join(f"N={n}: {c:.2f}x" for n, c in plan.cost.items())
    lib = plan.library.get(plan.num_nodes, "default")
    seqs = "1 sequence" if plan.batch == 1 else f"{plan.batch} sequences"
    return (f"tree of {plan.num_nodes} nodes, depth {plan.max_depth}, topk {plan.topk} "
            f"(verify cost at {seqs} a step {curve}; {lib} dot library)")  # fmt: skip


__all__ = [
    "CANDIDATES", "LIBRARY_MIN_BYTES", "TreePlan", "best_library", "cached_costs", "cached_plan",
    "describe", "faster_dtype", "faster_library", "fastest", "libraries", "plan_from_costs",
    "plan_tree", "product_costs", "weight_bytes", "weight_shapes",
]  # fmt: skip
