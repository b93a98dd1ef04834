"""
kernels/grpo.py held to loss.py on a run's own settings, once at start-up.

The kernel is a second copy of the objective. A fork that edits the math in
loss.py and not in the kernel would train on GPUs with the old objective, and
nothing would say so. So wherever a run would use the kernel (loss impl
"triton", after loss.choose_impl), train.py first runs the two paths on one
small random micro-batch, through the entry point training calls:

    loss.policy_loss(logits, batch, replace(settings, impl="torch"))    loss.py
    loss.policy_loss(logits, batch, replace(settings, impl="triton"))   the kernel

with the run's LossSettings (loss type, epsilons, delta, beta with reference
log-probs, temperature, the knobs), and compares the loss and its gradient
w.r.t. the logits. Twice: on-policy (no old log-probs: the ratio is 1), and
off-policy, with old log-probs drawn so that the ratios spread over
[e^-2, e^2], on both sides of every bound (1 - eps_low, 1 + eps_high, cispo's
cap, delta), and never within 1e-3 of one.

checked_impl is train.py's decision (checked_settings): the kernel stays where it agrees. Where
it does not, --loss-impl auto falls back to loss.py, saying so in one line, and
--loss-impl triton stops the run with that line.

Simplifications:
1. fp32 only: the kernel takes no float64 logits. The tolerance is fp32's
   worst-case rounding at these sizes (agrees_with_reference), about 2e-3 of
   the loss; an edit that moves the loss or the gradient by less than that
   passes.
2. The numbers come from a private torch.Generator, on the CPU, then move to
   the device: the run's RNG streams, and so its metrics, are the same with
   the check as without.
3. Batch features that are not settings (--mask-truncated, the entropy mask,
   unique_rows' counts) stay off: both paths take them in the same PyTorch
   code after the kernel.

Tests: python -m pytest -q tests/test_kernel_check.py
"""
import dataclasses
import math

import torch

from batch import UpdateBatch
from common import fail, print0
from loss import kept_mask, policy_loss
from model import selective_log_softmax

ROWS, TOKENS, VOCAB = 4, 12, 256  # the micro-batch: a second or two under TRITON_INTERPRET=1
# fp32's unit roundoff. A sum of n fp32 terms is off by at most about n * EPS
# of the sum of their magnitudes (Higham, "Accuracy and Stability of Numerical
# Algorithms", 2002, sec. 4.2): each log-prob sums VOCAB exponentials, the
# loss sums ROWS * TOKENS terms. The two paths round differently (an online
# log-sum-exp in the kernel), so they agree to (VOCAB + ROWS * TOKENS) * EPS of
# the scale, 3.6e-5 here; the factor 64 leaves room for the exp of the ratio
# and the few operations per token. Seen: ~1e-7 of the scale.
EPS = torch.finfo(torch.float32).eps
TOLERANCE = 64 * (VOCAB + ROWS * TOKENS) * EPS  # 2.3e-3


def _micro_batch(settings, device, off_policy, generator):
    """A (ROWS, TOKENS, VOCAB) fp32 logits and its UpdateBatch, drawn from generator.

    Rows 1 and 3 end in padding; the advantages have both signs, and a mean
    away from 0 so that the loss is not a cancellation.
    """
    g = generator
    logits = 2.0 * torch.randn(ROWS, TOKENS, VOCAB, generator=g)  # (B, T, V)
    ids = torch.randint(VOCAB, (ROWS, TOKENS), generator=g)  # (B, T)
    mask = torch.ones(ROWS, TOKENS)  # (B, T)
    mask[1, TOKENS // 2:] = 0
    mask[3, 3:] = 0
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0] * (ROWS // 4) + [1.0] * (ROWS % 4))  # (B,)
    advantages = signs * (0.5 + torch.rand(ROWS, generator=g)) + 0.2  # (B,)
    logps = selective_log_softmax(logits.double(), ids, settings.temperature)  # (B, T)

    old_logps = None  # on-policy: the ratio is 1
    behaviour = logps
    if off_policy:
        log_ratio = 4.0 * torch.rand(ROWS, TOKENS, generator=g, dtype=torch.float64) - 2.0
        # off every bound by >= 1e-3: there a rounding could flip a clip between the paths
        s = settings
        bounds = [1 - s.epsilon_low, 1 + s.epsilon_high, s.epsilon_high, s.delta or 0.0]
        edges = torch.tensor([math.log(b) for b in bounds if b > 0], dtype=torch.float64)
        near = (log_ratio.unsqueeze(-1) - edges).abs().min(-1).values < 1e-3  # (B, T)
        log_ratio = torch.where(near, log_ratio + 3e-3, log_ratio)  # (B, T)
        old_logps = logps - log_ratio  # (B, T)
        behaviour = old_logps
    # the sampler's (the IS correction, the off-policy mask), and the reference's
    sampling_logps = behaviour + 0.3 * torch.randn(ROWS, TOKENS, generator=g, dtype=torch.float64)
    ref_logps = None
    if settings.beta != 0:
        ref_logps = logps + 0.5 * torch.randn(ROWS, TOKENS, generator=g, dtype=torch.float64)

    def place(x):
        return None if x is None else x.float().to(device)

    batch = UpdateBatch(completion_ids=ids.to(device), completion_mask=place(mask),
                        advantages=place(advantages), sampling_logps=place(sampling_logps),
                        old_logps=place(old_logps), ref_logps=place(ref_logps))
    return logits.to(device), batch


def _loss_and_grad(logits, batch, settings, impl):
    """policy_loss's loss on impl's path, and its gradient w.r.t. the logits."""
    logits = logits.detach().clone().requires_grad_(True)  # (B, T, V)
    tokens = kept_mask(batch.completion_mask, batch.truncated).sum()  # this rank's: no collective
    loss, _ = policy_loss(logits, batch, dataclasses.replace(settings, impl=impl),
                          minibatch_size=ROWS, minibatch_tokens=tokens)
    loss.backward()
    return loss.item(), logits.grad


def agrees_with_reference(settings, device):
    """Whether the kernel's loss and gradient match loss.py's on settings.

    settings: the run's loss.LossSettings (its impl is ignored); device: the
    run's (the kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU).
    -> (ok, numbers): numbers says how far apart the two paths are, in words,
    for the line the caller prints.
    """
    generator = torch.Generator().manual_seed(0)  # private: the global RNGs stay untouched
    for case in ("on-policy", "off-policy"):
        logits, batch = _micro_batch(settings, device, case == "off-policy", generator)
        loss_ref, grad_ref = _loss_and_grad(logits, batch, settings, "torch")
        loss_kernel, grad_kernel = _loss_and_grad(logits, batch, settings, "triton")

        loss_diff = abs(loss_kernel - loss_ref)
        grad_diff = (grad_kernel - grad_ref).abs().max().item()
        grad_scale = grad_ref.abs().max().item()
        # not `>`: a NaN must fail too
        ok = (loss_diff <= TOLERANCE * max(1.0, abs(loss_ref))
              and grad_diff <= TOLERANCE * grad_scale)
        numbers = (f"{case}: loss {loss_kernel:.4g} vs loss.py's {loss_ref:.4g}, gradient "
                   f"max diff {grad_diff:.2g}, its largest {grad_scale:.2g}")
        if not ok:
            return False, numbers
    return True, numbers


def checked_settings(loss_impl, why, settings, device):
    """checked_impl for train.py -> (settings with the impl it keeps, why)."""
    impl, why = checked_impl(loss_impl, why, settings, device)
    return dataclasses.replace(settings, impl=impl), why


def checked_impl(loss_impl, why, settings, device):
    """train.py's start-up check, where choose_impl chose the kernel -> (impl, why).

    loss_impl: the flag (--loss-impl auto or triton); why: choose_impl's. The
    kernel stays where it agrees with loss.py (agrees_with_reference). Else
    under auto the run uses loss.py ("torch") and prints one line saying so;
    under an explicit --loss-impl triton it stops with that line (common.fail).
    """
    ok, numbers = agrees_with_reference(settings, device)
    if ok:
        return "triton", f"{why}; agrees with loss.py"

    differs = f"kernels/grpo.py differs from loss.py on this run's settings ({numbers})"
    if loss_impl == "triton":
        fail(f"--loss-impl triton: {differs}. Update kernels/grpo.py to match, "
             f"or use --loss-impl torch")
    print0(f"loss: {differs}: using loss.py. Update kernels/grpo.py to match, "
           f"or pass --loss-impl torch")
    return "torch", "auto: kernels/grpo.py differs from loss.py"
