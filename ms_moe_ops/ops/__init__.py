"""Functional API: every operator of the package."""
from .gating import moe_gating_top_k, moe_gating_top_k_backward

__all__ = ["moe_gating_top_k", "moe_gating_top_k_backward"]
