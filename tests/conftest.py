"""Test-wide settings: CPU JAX (libtpu is installed for AOT tests and would grab a TPU)."""

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"

# `python -m pytest` puts the repository root on sys.path, where the top-level
# source folders (kernels/, draft/, ...) would import as bare packages. They are
# only ever meant as specdec.kernels etc. (the editable install maps them), and a
# bare `kernels` shadows Hugging Face's `kernels` package, which transformers
# >= 5.25 imports: drop the root so the reference models load.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]
