"""Drafters: propose token trees for the target to verify."""

from .base import DraftBatch, Drafter
from .model import ModelDrafter
from .ngram import NgramDrafter

__all__ = ["DraftBatch", "Drafter", "ModelDrafter", "NgramDrafter"]
