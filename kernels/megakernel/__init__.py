"""Verify megakernel: the target's whole verify step as one Pallas TPU program."""

from specdec.kernels.megakernel.kernel import verify
from specdec.kernels.megakernel.reference import VerifyResult, tree_block
from specdec.kernels.megakernel.reference import verify as verify_reference
from specdec.kernels.megakernel.tuning import BlockSizes, default_block_sizes

__all__ = [
    "BlockSizes",
    "VerifyResult",
    "default_block_sizes",
    "tree_block",
    "verify",
    "verify_reference",
]
