"""Fused Triton kernels; the plain-PyTorch reference each one must match lives in loss.py, and
loss.policy_loss is the one caller in training.

Importing this package does not import Triton; the first use of a kernel does (PEP 562
__getattr__). transformers probes the module name `kernels` (the HF kernels hub package) when it
loads a model, and from the repo root it finds this one: an eager import would pull in Triton
there, and a machine without Triton could not run train.py at all, not even its PyTorch path.

choose_impl says which path loss.policy_loss takes: the kernel where it runs and covers the loss.

Run the tests: python -m pytest -q tests/test_kernel.py tests/test_imports.py
"""
import torch

__all__ = ["fused_grpo_token_loss"]
IMPLS = ("torch", "triton")


def choose_impl(loss_impl, device, importance_sampling_level="token"):
    """--loss-impl "auto" | "torch" | "triton" -> (impl, why, for the start-up line). auto: the
    fused kernel on CUDA when the ratio is token-level (the kernel has no GSPO); PyTorch on CPU,
    where Triton only interprets."""
    if loss_impl not in ("auto",) + IMPLS:
        raise ValueError(f"loss_impl={loss_impl!r}: choose one of {('auto',) + IMPLS}")
    if loss_impl != "auto":
        return loss_impl, f"--loss-impl {loss_impl}"
    if torch.device(device).type != "cuda":
        return "torch", "auto: no CUDA, where Triton would only interpret"
    if importance_sampling_level != "token":
        return "torch", "auto: the kernel has no sequence-level ratio"
    return "triton", "auto: the fused kernel on CUDA"


def resolve_impl(loss_impl, device, importance_sampling_level="token"):
    """choose_impl's impl alone: "triton" or "torch"."""
    return choose_impl(loss_impl, device, importance_sampling_level)[0]


def __getattr__(name):
    """Called only for names not already in the module: `from kernels import fused_...` imports
    the kernel's module on first use."""
    if name in __all__:
        from . import grpo
        return getattr(grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
