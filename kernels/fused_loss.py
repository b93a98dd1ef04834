"""loss.policy_loss's impl="triton" path: kernels/grpo.py's per-token loss,
fused in one pass over the logits, reduced as loss.py reduces the reference's.

The kernel computes pg_t (PPO's clip, --delta's cap, cispo or sapo), w_t (the
knobs' weight, from variants/token_weights.py as on the torch path) and the KL
per token, from the same LossSettings; the reduction, the kept tokens and the
entropy bonus are loss.py's. It has the token-level ratio only (so no GSPO or
luspo) and no vespo: config.check_loss_settings refuses those with
--loss-impl triton, and loss.choose_impl's auto never picks it for them.
policy_loss imports this file only on this path, and this file imports Triton.

Tests: python -m pytest -q tests/test_kernel.py (on the CPU: TRITON_INTERPRET=1)
"""
import torch

from kernels.grpo import fused_grpo_token_loss
from loss import entropy_bonus, kept_mask, loss_metrics, reduce_loss, row_weights
from runlog.metrics import token_stats


def fused_loss(logits, batch, settings, weight, entropies, minibatch_size, minibatch_tokens):
    """policy_loss's impl="triton" path: the kernel's per-token loss, reduced here.

    weight: w_t (n, T) or None; entropies (n, T) or None; minibatch_size,
    minibatch_tokens: as policy_loss takes them.

    The entropy bonus is added here as a token mean, whatever the loss type
    (the kernel's own per-token entropy term stays off). -> (loss, metrics).
    """
    s = settings
    # (n, T) each, detached, 0 at masked tokens
    per_token, logps, stats = fused_grpo_token_loss(
        logits, batch.completion_ids, batch.advantages, batch.completion_mask, batch.old_logps,
        batch.ref_logps, token_weight=weight, settings=s)

    kept = kept_mask(batch.completion_mask, batch.truncated)  # (n, T)
    loss = reduce_loss(per_token, kept, s.loss_type, minibatch_tokens, s.max_new_tokens,
                       minibatch_size, batch.counts)
    counted = batch.completion_mask * row_weights(batch.counts)  # (n, T)
    if entropies is not None and s.entropy_coef != 0:
        bonus_mask = kept_mask(counted, batch.truncated)  # (n, T)
        loss = loss - entropy_bonus(entropies, bonus_mask, s.entropy_coef, minibatch_tokens)

    fused = fused_stats(s.loss_type, logps, batch.old_logps, batch.ref_logps,
                        batch.completion_mask, stats, entropies)
    return loss, token_stats(counted, fused)


@torch.no_grad()
def fused_stats(loss_type, logps, old_logps, ref_logps, mask, stats, entropies):
    """The kernel path's loss.loss_metrics, from its detached logps (0 at masked tokens)."""
    ratio = torch.ones_like(logps)  # (n, T)
    if old_logps is not None:
        # * mask: masked tokens have logps 0, and exp(0 - old) could overflow there
        ratio = torch.exp((logps - old_logps) * mask)  # (n, T)

    # the kernel computes the KL only when beta != 0; grpo_loss logs it at beta = 0 too
    kl = stats.get("kl")  # (n, T)
    if kl is None and ref_logps is not None:
        delta = ref_logps - logps  # (n, T)
        kl = torch.exp(delta) - delta - 1  # (n, T)

    # the kernel's clip masks, named as the loss type's objective names them
    # (loss.clipped, variants/objectives.py)
    clip_low = stats["is_clipped_low"]  # (n, T)
    clip_high = stats["is_clipped_high"]  # (n, T): cispo's capped weights
    if loss_type == "cispo":
        objective_stats = {"clip_high": clip_high}
    elif loss_type == "sapo":
        objective_stats = {}
    else:  # clipped, or --delta's cap on it
        objective_stats = {"clip_low": clip_low, "clip_high": clip_high,
                           "clip_region": clip_low | clip_high}
    return loss_metrics(objective_stats, ratio, kl, entropies)
