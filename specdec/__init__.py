"""specdec: distributed speculative decoding with token trees on JAX.

from specdec import LLM, SamplingParams
"""

import glob as _glob
import os as _os

# With libtpu installed, JAX probes for a TPU (and takes /tmp/libtpu_lockfile) unless
# told otherwise; on a host with no TPU device files, default JAX to the CPU.
if "JAX_PLATFORMS" not in _os.environ and not (
    _glob.glob("/dev/accel*") or _glob.glob("/dev/vfio/[0-9]*")
):
    _os.environ["JAX_PLATFORMS"] = "cpu"

from specdec.outputs import CompletionOutput, RequestOutput
from specdec.params import SamplingParams, SpeculativeConfig

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in jax; keep `import specdec` light for the CLI's argument parsing.
    if name == "LLM":
        from specdec.api import LLM

        return LLM
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
