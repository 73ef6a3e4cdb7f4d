"""Shared pieces of the benchmarks: held-out prompts and timing."""

from __future__ import annotations

import os
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


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start
