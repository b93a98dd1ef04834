"""Fused Triton kernels. The plain-PyTorch reference each one must match lives
in loss.py, and loss.policy_loss is their one caller in training, through
fused_loss.py (loss.py's choose_impl says when it calls them). check.py holds
them to it on each run's own settings, at start-up: a run whose loss.py was
edited and its kernel not uses loss.py instead (--loss-impl auto), or stops
(--loss-impl triton).

    grpo.py        the per-token GRPO loss, fused in one pass over the logits
    fused_loss.py  policy_loss's impl="triton" path: grpo.py's loss, reduced
                   and logged as loss.py does the reference's
    check.py       the start-up check against loss.py

Importing this package does not import Triton: the first use of a kernel does
(PEP 562 __getattr__). transformers probes the module name `kernels` (the HF
kernels hub package) when it loads a model, and from the repo root it finds
this one. An eager import would pull in Triton there, and a machine without
Triton could not run train.py at all, not even its PyTorch path.

Run the tests: python -m pytest -q tests/test_kernel.py tests/test_kernel_check.py
tests/test_imports.py
"""
__all__ = ["fused_grpo_token_loss"]


def __getattr__(name):
    """Called only for names not already in the module.

    `from kernels import fused_...` imports the kernel's module on first use.
    (kernels.fused_loss imports Triton too: loss.policy_loss imports it only
    on the kernel's path.)
    """
    if name in __all__:
        from . import grpo
        return getattr(grpo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
