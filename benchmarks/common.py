"""Shared pieces of the benchmarks: held-out prompts and timing."""

from __future__ import annotations

import os
import platform
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEMO = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "demo"


def heldout_prompts(n: int | None = None, lines: int = 30) -> list[str]:
    """The first `lines` lines of each held-out standard-library file (never trained on)."""
    listing = DEMO / "heldout_files.txt"
    if not listing.is_file():
        raise SystemExit(f"{listing} is missing: the bundled demo pair is not installed.")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for rel in listing.read_text().split():
        f = stdlib / rel
        if f.is_file():
            text = "".join(f.read_text(errors="replace").splitlines(keepends=True)[:lines])
            if text.strip():
                prompts.append(text)
    return prompts[:n] if n else prompts


# CPU flags that change how XLA CPU runs the products: whether bfloat16 is multiplied in
# hardware (else widened to float32 in every product) and the vector width.
_FLAGS_OF_NOTE = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "bf16", "sve")


def machine() -> dict:
    """What the figures were measured on: CPU model, cores, the flags of note.

    Ratios move with the machine, not only with the code: the same pair and tree ran
    at 1.74x AR on an AVX-512 EPYC with bfloat16 dot products and at 1.26x on an
    AVX2-only one (README, Performance).
    """
    model, flags, family = platform.processor() or platform.machine(), set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("cpu family", "model") and key.strip() not in family:
                family[key.strip()] = value.strip()  # a VM's model name may hide both
            elif key.strip() in ("flags", "Features"):
                flags.update(value.split())
    except OSError:
        pass
    generation = "/".join(family.get(k, "?") for k in ("cpu family", "model")) if family else "-"
    return {"cpu": model, "cores": os.cpu_count(), "family/model": generation,
            "flags": [f for f in _FLAGS_OF_NOTE if f in flags]}  # fmt: skip


def describe_machine() -> str:
    m = machine()
    return (f"machine: {m['cpu']} (family/model {m['family/model']}), {m['cores']} cores, "
            f"flags of note: {' '.join(m['flags']) or '-'}")  # fmt: skip


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
