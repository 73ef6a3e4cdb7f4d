"""Test-wide settings: CPU JAX (libtpu is installed for AOT tests and would grab a TPU)."""

import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ["JAX_PLATFORMS"] = "cpu"
# Tests never read or write the user's ~/.cache/specdec (tree plans, XLA programs):
# one fresh folder per session, so no run depends on what an earlier one left there.
os.environ.setdefault("SPECDEC_CACHE", tempfile.mkdtemp(prefix="specdec-test-cache-"))
# Each LLM's KV caches take at most this many bytes (the default, a share of the free
# RAM, would let a few engines alive at once in one test process crowd the machine).
os.environ.setdefault("SPECDEC_KV_CACHE_MEMORY", str(256 << 20))

# `python -m pytest` puts the repository root on sys.path, where the top-level
# source folders (kernels/, draft/, ...) would import as bare packages. They are
# only ever meant as specdec.kernels etc. (the editable install maps them), and a
# bare `kernels` shadows Hugging Face's `kernels` package, which transformers
# >= 5.25 imports: drop the root so the reference models load.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    """Drops each test module's compiled XLA programs once it is done.

    The whole suite in one process compiles thousands of programs; each maps code
    pages, and near the kernel's 65530-mapping limit (vm.max_map_count) the
    process died in libgcc's unwinder late in the run (rc 139, twice).
    """
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
