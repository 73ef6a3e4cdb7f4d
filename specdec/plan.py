"""The plan: what is decided about this machine once, before the first request.

A `Plan` holds every choice that depends on timing this machine: the weight
dtype behind `dtype="auto"`, the tree behind `num_speculative_tokens="auto"`,
the CPU dot library each verify row count is compiled for, and what each tree
width costs to verify (which host-side trees are cut to, `workers.WidthChooser`).
It is made at `LLM` construction (or by a Ray actor at its start, on its own
host) from the target's weight-product timings (`sizing`, remembered per
machine and model shape in $SPECDEC_CACHE), then passed down, immutable. Nothing
in the request path times anything, so given the plan a seeded run's output is
fixed.

Example (the shape of one; its numbers depend on the machine): dtype float32, tree
(8 nodes, depth 5, topk 2), libraries {8: "default", 40: "eigen", 72: "eigen"},
width costs {4: 1.3, 8: 1.7}.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Literal

import jax

from specdec import sizing
from specdec.checkpoint import checkpoint_dtype, load_config
from specdec.kernels.config import ModelConfig
from specdec.params import SpeculativeConfig

logger = logging.getLogger(__name__)

DTypeName = Literal["float32", "bfloat16"]
AUTO_NGRAM_NODES = 8  # n-gram trees are cheap to draft but rarely deep: a fixed budget


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """The tree a drafter grows each step."""

    num_nodes: int  # N, tree nodes per step
    max_depth: int
    topk: int  # children per expanded node at most


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every timing-dependent choice, made once (module docstring)."""

    dtype: DTypeName  # the weights' dtype
    tree: TreeShape | None = None  # the drafter's tree; None = plain decoding
    widths: tuple[int, ...] = (0,)  # tree widths the target verifies (`make_plan`)
    libraries: tuple[tuple[int, str], ...] = ()  # verify rows -> CPU dot library
    width_costs: tuple[tuple[int, float], ...] = ()  # tree width -> verify cost / plain step
    tree_note: str = ""  # how an "auto" tree was sized, for the log

    def library(self, rows: int) -> str:
        """The dot library a verify over `rows` query rows is compiled for: the one
        timed faster at the largest timed row count up to `rows` (plans time a lone
        request's rows; a batch's step runs more), else the default."""
        timed = [(r, lib) for r, lib in self.libraries if r <= rows]
        return max(timed)[1] if timed else "default"

    def width_cost(self, width: int) -> float:
        """A verify of trees `width` nodes wide relative to a plain decode step (1 for
        widths the plan did not time: models whose products a step does not wait on)."""
        return dict(self.width_costs).get(width, 1.0)


def verify_widths(n: int) -> tuple[int, ...]:
    """Tree widths a verify of trees padded to `n` nodes may run at: 0 (plain
    decoding), the powers of two from 4 below n, and n. Example: 16 -> (0, 4, 8, 16).

    Each width is compiled once per process and KV length; a handful keeps that
    cheap while letting a step that found little to propose cost little."""
    widths, w = {0, n}, 4
    while w < n:
        widths.add(w)
        w *= 2
    return tuple(sorted(widths))


# Choices timed at start (dtype, tree size, verify widths) are made for one running
# request: the latency case, and what a step over the live rows of a lone request runs
# whatever max_num_seqs is (steps run over the running rows only, `runner.live_rows`).
PLAN_SLOTS = 1


def verify_rows(spec: SpeculativeConfig | None, max_num_seqs: int) -> int:
    """Rows one decode step verifies: every slot's root plus its tree (for an
    "auto"-sized tree, the smallest candidate)."""
    nodes = 0 if spec is None else spec.num_speculative_tokens
    if nodes == "auto":
        nodes = sizing.CANDIDATES[0][0]
    return max_num_seqs * (1 + nodes)


# dtype="auto" weighs a batch as well as a lone request: steps run over the live rows,
# from one running request up to max_num_seqs of them.
DTYPE_BATCH = 8


def dtype_rows(rows_per_seq: int, max_num_seqs: int) -> tuple[int, ...]:
    """The step sizes `resolve_dtype` times for sequences of `rows_per_seq` rows a step
    (`verify_rows(spec, 1)`): one running request, and a batch of
    min(max_num_seqs, `DTYPE_BATCH`)."""
    return tuple(sorted({rows_per_seq * PLAN_SLOTS, rows_per_seq * min(max_num_seqs, DTYPE_BATCH)}))


def resolve_dtype(
    folder: str | os.PathLike | None, requested: str = "auto", *,
    rows: int | Sequence[int] | None = None,
) -> DTypeName:  # fmt: skip
    """What `requested` ("auto", "float32" or "bfloat16") means here.

    "auto" is bfloat16 off CPU. On CPU, float32 for a checkpoint that is not
    bfloat16 (float32, float16, unknown); a bfloat16 checkpoint stays bfloat16
    unless `rows` is given and float32 weights run the model's products faster at
    each of those step sizes on this CPU (`dtype_rows`; timed once,
    `sizing.faster_dtype`: on a CPU without bfloat16 dot instructions a float32
    product streams the weights faster than the bfloat16 one converts them). Kept
    bfloat16 also halves the KV cache (`xla_layout.cache_dtype`). Models too small
    for their products to matter (`sizing.LIBRARY_MIN_BYTES`) are not timed."""
    if requested != "auto":
        return requested  # type: ignore[return-value]
    if jax.default_backend() != "cpu":
        return "bfloat16"
    if folder is None or checkpoint_dtype(folder) != "bfloat16":
        return "float32"
    if rows is None:
        return "bfloat16"
    cfg = load_config(folder)
    if sizing.weight_bytes(cfg, "float32") < sizing.LIBRARY_MIN_BYTES:
        return "bfloat16"
    counts = (rows,) if isinstance(rows, int) else tuple(rows)
    if all(sizing.faster_dtype(cfg, r) == "float32" for r in counts):
        return "float32"
    return "bfloat16"


def tree_shape(
    spec: SpeculativeConfig | None, cfg: ModelConfig, dtype: str, num_slots: int
) -> tuple[TreeShape | None, str]:
    """The drafter's tree for `spec` (sized here for "auto"), and a note saying how."""
    if spec is None:
        return None, ""
    n = spec.num_speculative_tokens
    if n != "auto":
        return TreeShape(n, spec.max_depth, spec.topk), ""
    if spec.method == "ngram":
        return TreeShape(AUTO_NGRAM_NODES, spec.max_depth, spec.topk), ""
    # Sized for this machine and batch from the target's measured verify-cost curve.
    sized = sizing.cached_plan(cfg, dtype, batch=num_slots)
    shape = TreeShape(sized.num_nodes, sized.max_depth, min(spec.topk, sized.topk))
    return shape, sizing.describe(sized)


def verify_costs(
    cfg: ModelConfig, dtype: str, *, num_slots: int, widths: tuple[int, ...]
) -> tuple[tuple[tuple[int, str], ...], tuple[tuple[int, float], ...]]:
    """The dot library of every verify row count a target of `num_slots` slots runs at
    tree `widths`, and each width's cost relative to a plain decode step (the faster
    library's weight products at those rows)."""
    rows = sorted({num_slots * (w + 1) for w in (0, *widths)})
    if sizing.weight_bytes(cfg, dtype) < sizing.LIBRARY_MIN_BYTES:
        return tuple((r, "default") for r in rows), ()  # nothing a step waits on: no timing
    costs = sizing.cached_costs(cfg, dtype, rows)
    libraries = tuple((r, sizing.faster_library(costs, r)) for r in rows)
    best = sizing.fastest(costs)
    base = best[num_slots]
    width_costs = tuple((w, best[num_slots * (w + 1)] / base) for w in widths if w > 0)
    return libraries, width_costs


def make_plan(
    cfg: ModelConfig,
    *,
    dtype: DTypeName,
    spec: SpeculativeConfig | None,
    num_slots: int,
    tree: TreeShape | None = None,
    max_tree_nodes: int | None = None,
    host_trees: bool = True,
) -> Plan:
    """The plan for a target of `cfg` in `dtype` over `num_slots` slots: the tree
    (`tree_shape`, unless given) and the verify costs for its node count
    (`max_tree_nodes` overrides it: a remote target verifies what its drafter sends).

    Host trees (n-gram, or sent over the wire) are verified at any `verify_widths`
    width that holds them (`workers.narrowest`); an in-process model drafter's
    trees stay on the device at full width (`host_trees=False`): only that width
    is timed, and compiled ahead (`LLMEngine.compile_shapes`)."""
    note = ""
    if tree is None:
        tree, note = tree_shape(spec, cfg, dtype, num_slots)
    nodes = max_tree_nodes if max_tree_nodes is not None else (tree.num_nodes if tree else 0)
    widths = verify_widths(nodes) if host_trees else (nodes,)
    libraries, width_costs = verify_costs(cfg, dtype, num_slots=num_slots, widths=widths)
    plan = Plan(dtype=dtype, tree=tree, widths=widths, libraries=libraries,
                width_costs=width_costs, tree_note=note)  # fmt: skip
    logger.info("plan: %s", describe(plan))
    return plan


def describe(plan: Plan) -> str:
    """One line: dtype, tree, libraries and width costs."""
    parts = [f"dtype {plan.dtype}"]
    if plan.tree is not None:
        t = plan.tree
        parts.append(f"tree {t.num_nodes} nodes, depth {t.max_depth}, topk {t.topk}")
    if plan.tree_note:
        parts.append(f"auto: {plan.tree_note}")
    if any(lib != "default" for _, lib in plan.libraries):
        parts.append("libraries " + ", ".join(f"{r} rows {lib}" for r, lib in plan.libraries))
    if plan.width_costs:
        parts.append("width costs " + ", ".join(f"{w}: {c:.2f}x" for w, c in plan.width_costs))
    return "; ".join(parts)


__all__ = [
    "AUTO_NGRAM_NODES", "DTYPE_BATCH", "PLAN_SLOTS", "Plan", "TreeShape", "describe",
    "dtype_rows", "make_plan", "resolve_dtype", "tree_shape", "verify_costs", "verify_rows",
    "verify_widths",
]  # fmt: skip
