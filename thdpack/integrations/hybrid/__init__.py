"""Hybrid models (linear attention, SSM, short convolutions) exact on packs: :func:`packed_model` and the
family registry (docs/hybrid.md)."""

from thdpack.integrations.hybrid.mixers import FAMILIES, HybridFamily
from thdpack.integrations.hybrid.packed_model import packed_model

__all__ = ["FAMILIES", "HybridFamily", "packed_model"]
