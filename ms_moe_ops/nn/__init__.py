"""Cells built on the operators."""
from .gating import GatingTopK

__all__ = ["GatingTopK"]
