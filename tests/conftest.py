"""Test-wide settings: CPU JAX (libtpu is installed for AOT tests and would grab a TPU)."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
