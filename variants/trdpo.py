"""--sync-ref-every N, --ref-mixup-alpha alpha: TR-DPO's moving reference
(arXiv 2404.09656; TRL's SyncRefModelCallback). After every N-th optimizer step
the reference moves toward the policy:

    ref <- alpha * policy + (1 - alpha) * ref

train.py attaches it once, at set-up, after each optimizer step; the checkpoints
hold the reference (checkpoint.py: the moving reference).

Tests: python -m pytest -q tests/test_ref_sync.py
"""
import torch


@torch.no_grad()
def mix_reference(reference, policy, alpha):
    """The soft update in place, parameter by parameter, as TRL computes it:
    ref.mul_(1 - alpha).add_(policy, alpha=alpha). The reference holds --dtype
    weights: each mix rounds to them."""
    for ref_param, param in zip(reference.parameters(), policy.parameters(), strict=True):
        ref_param.mul_(1 - alpha).add_(param, alpha=alpha)


def every(n, reference, policy, alpha):
    """-> fn(opt_step): mix_reference after every n-th optimizer step (TRL's on_step_end).
    The reference log-probs of the step's batch are already computed."""
    def after_optimizer_step(opt_step):
        if opt_step % n == 0:
            mix_reference(reference, policy, alpha)

    return after_optimizer_step
