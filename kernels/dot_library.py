"""Which library XLA on CPU hands a program's matrix products to.

XLA CPU sends dots to YNNPACK by default ("ynn_fusion" in a profile); with
YNN fusions switched off for one compilation it runs them with its own Eigen
GEMM instead. Neither is faster everywhere. On a 2-core AVX2 EPYC (Zen 2, no
AVX-512), over the demo target's weight products in float32:

    rows               1     2     5     6     9    17
    default (YNNPACK) 3.3   7.7  10.3  12.8  11.8  15.2 ms
    eigen             3.3   5.8   5.3   5.6   8.5  12.1 ms

and bfloat16 products were 5x slower through Eigen (no bfloat16 GEMM there).
So a program is compiled for a library only after `sizing` has timed both on
this machine, per dtype and row count; the choice is a compile option, so
each library is its own jitted copy of the same function (`jit_each`).

Eigen reads a transposed operand slowly (a tied LM head as `x @ embed.T`:
4.1 ms against 0.3 ms for a [D, V] copy), hence `transformer.untie_head` for
the CPU layout, and attention scores against keys copied out transposed when a
program is traced for Eigen (`tracing_for`): the demo target's 6-row verify
took 10.7 ms with q @ K.T and 9.95 ms with q @ (K.T copied); YNNPACK's one-row
decode was 0.3 ms slower the second way, so it keeps q @ K.T.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
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
    bfloat16 products convert element by element (5x slower above).
    """
    if jax.default_backend() != "cpu" or jnp.dtype(dtype) != jnp.float32:
        return ("default",)
    return tuple(LIBRARIES)


_TRACING = contextvars.ContextVar("dot_library", default="default")


def tracing_for() -> str:
    """The library the program being traced is compiled for ("default" outside `jit_each`)."""
    return _TRACING.get()


@contextlib.contextmanager
def _tracing(name: str):
    token = _TRACING.set(name)
    try:
        yield
    finally:
        _TRACING.reset(token)


def jit_each(fun: Callable, **jit_kwargs) -> dict[str, Callable]:
    """`fun` jitted once per library (same static and donated arguments); while a
    copy is traced, `tracing_for()` names its library."""

    def bound(name: str) -> Callable:
        @functools.wraps(fun)
        def traced(*args, **kwargs):
            with _tracing(name):
                return fun(*args, **kwargs)

        return traced

    return {
        name: jax.jit(bound(name), compiler_options=options, **jit_kwargs)
        for name, options in LIBRARIES.items()
    }
