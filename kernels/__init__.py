"""Fused Triton kernels; the plain-PyTorch reference each one must match lives in loss.py."""
from .grpo import fused_grpo_token_loss

__all__ = ["fused_grpo_token_loss"]
