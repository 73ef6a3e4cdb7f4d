"""Which library XLA on CPU hands a program's matrix products to.

XLA CPU sends dots to YNNPACK by default ("ynn_fusion" in a profile); with
YNN fusions switched off for one compilation it runs them with its own Eigen
GEMM instead. Neither is faster everywhere: which one wins depends on the CPU,
the dtype and the row count (Eigen has no bfloat16 GEMM, so bfloat16 products
stay with the default). So a program is compiled for a library only after
`sizing` has timed both on this machine, per dtype and row count, into the plan
(`specdec/plan.py`); the choice is a compile option, so each library is its own
jitted copy of the same function (`jit_each`).

Eigen reads a transposed operand slowly, hence `xla_layout.untie_head` for the
CPU layout, and attention scores against keys copied out transposed in programs
compiled for Eigen (`XlaLayout.for_library`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

# Compile options per library; None = XLA's defaults.
LIBRARIES: dict[str, dict | None] = {
    "default": None,
    "eigen": {"xla_cpu_experimental_ynn_fusion_type": ""},
}


def candidates(dtype) -> tuple[str, ...]:
    """The libraries worth timing for products in `dtype` on this backend.

    Off CPU there is one. On CPU Eigen is only tried for float32: its
    bfloat16 products convert element by element.
    """
    if jax.default_backend() != "cpu" or jnp.dtype(dtype) != jnp.float32:
        return ("default",)
    return tuple(LIBRARIES)


def jit_each(fun: Callable, **jit_kwargs) -> dict[str, Callable]:
    """`fun` jitted once per library (same static and donated arguments). What a copy
    traces depends on its arguments alone: a program that lays its work out per
    library takes that layout as a static argument (`XlaLayout.for_library`)."""
    return {
        name: jax.jit(fun, compiler_options=options, **jit_kwargs)
        for name, options in LIBRARIES.items()
    }
