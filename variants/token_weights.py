"""w_t: the knobs that reweigh or drop policy-gradient tokens, each behind its
flag. policy_weight multiplies the knobs that are on into one constant weight on
pg_t (loss.grpo_loss: loss_t = pg_t * w_t + beta * kl_t); each knob is 1 when
off, and w_t never weighs the KL. loss.policy_loss imports this file only when a
knob is on.

    is_t  --is-correction MODE, the sampler/trainer mismatch (Yao et al. 2025,
          "Your efficient RL framework secretly brings you off-policy RL
          training"; TRL's vLLM importance sampling). The ratio is
          r = exp(old_t - sampling_t)           "token_*", or
          r = exp(sum_t (old_t - sampling_t))   "sequence_*".
          "*_truncate" uses clip(r, is_min, is_max); "*_mask" uses r inside
          [is_min, is_max], else 0. vespo takes it into its W_i instead
          (variants/objectives.py). On-policy, old_t is the current log-prob.
    op_i  --off-policy-mask delta (DeepSeek-V3.2, arXiv 2512.02556, eq. 9): 0
          for a sequence with A_i < 0 whose sampled KL(sampler || policy), the
          mean over t of (sampling_t - logp_t), exceeds delta. It always uses
          the current log-probs.
    h_t   --top-entropy-quantile rho (arXiv 2506.01939): 1 for the top-rho share
          of the step's tokens by entropy, over all ranks (batch.py), 0 for the
          rest.

--mask-truncated (DAPO, arXiv 2503.14476) drops the truncated completions by
loss.kept_mask, not by w_t: they leave the loss, its KL, the entropy bonus and
the normaliser. Here only its share is logged.

Each knob's function returns (factor, metrics): its (B, T) factor of w_t, or
None where it adds none, and {metric name: (B, T) tensor}, what it removes
(frac_* are shares of the completion tokens).

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_rows.py tests/test_loss_knobs.py
"""
import math

import torch

from loss import kept_mask


def importance_weight(old_logps, sampling_logps, mask, mode, is_min=0.0, is_max=3.0):
    """is_t, the sampler-vs-trainer correction of mode (config.IS_CORRECTIONS).

    -> ((B, T) weight, constant to autograd; (B, T) r before truncating or
    masking; (B, T) bool of the tokens a "*_mask" mode zeroes, None for
    "*_truncate"). The one place the weight is built: both paths take it here.
    """
    if sampling_logps is None:
        raise ValueError(f"is_correction={mode!r} needs sampling_logps (the rollout engine's "
                         f"log-probs of the sampled tokens)")

    mask = mask.to(old_logps.dtype)  # (B, T)
    log_ratio = (old_logps - sampling_logps) * mask  # (B, T)
    if mode.startswith("sequence"):  # one ratio per sequence: the product of its token ratios
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)  # (B, T)
    ratio = torch.exp(log_ratio).detach()  # (B, T)

    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=is_min, max=is_max), ratio, None
    outside = (ratio < is_min) | (ratio > is_max)  # (B, T)
    return ratio.masked_fill(outside, 0.0), ratio, outside


def off_policy_keep(advantages, logps, sampling_logps, mask, delta):
    """DeepSeek-V3.2's off-policy sequence mask (eq. 9).

    (B,) advantages; (B, T) the current log-probs, the sampler's and the mask
    -> (B,) bool: False where A_i < 0 and the sequence's mean sampled
    KL(sampler || policy) exceeds delta.
    """
    if sampling_logps is None:
        raise ValueError("off_policy_mask needs sampling_logps (the rollout engine's log-probs)")

    mask = mask.to(logps.dtype)  # (B, T)
    kl = ((sampling_logps - logps.detach()) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return (advantages >= 0) | (kl <= delta)


def _truncation_mask(batch):
    """mask_truncated: the truncated completions leave the loss by kept_mask,
    not by w_t, so only their share is logged here."""
    mask = batch.completion_mask  # (B, T)
    dropped = batch.truncated.unsqueeze(-1).expand_as(mask)  # (B, T)
    return None, {"frac_masked_truncated": dropped}


def _importance_correction(batch, ratio_old_logps, settings):
    """is_t (importance_weight), and its ratio's mean and max before truncating
    or masking, and the share a "*_mask" mode zeroes."""
    s = settings
    weight, ratio, outside = importance_weight(ratio_old_logps, batch.sampling_logps,
                                               batch.completion_mask, s.is_correction,
                                               s.is_min, s.is_max)  # (B, T) each

    stats = {}
    if outside is not None:
        stats["frac_is_masked"] = outside
    stats["is_ratio_mean"] = ratio
    stats["is_ratio_max"] = ratio
    return weight, stats


def _off_policy_mask(batch, logps, delta):
    """op_i (off_policy_keep) on every token of its sequence, and the share it drops."""
    mask = batch.completion_mask  # (B, T)
    keep = off_policy_keep(batch.advantages, logps, batch.sampling_logps, mask, delta)  # (B,)

    factor = keep.to(mask.dtype).unsqueeze(-1).expand_as(mask)  # (B, T)
    dropped = ~keep.unsqueeze(-1).expand_as(mask)  # (B, T)
    return factor, {"frac_off_policy_masked": dropped}


def _high_entropy_mask(batch):
    """h_t (batch.py chose the tokens), and the share of kept tokens it drops."""
    mask = batch.completion_mask  # (B, T)
    factor = batch.high_entropy.to(mask.dtype)  # (B, T)
    low_entropy = kept_mask(mask, batch.truncated) * ~batch.high_entropy  # (B, T)
    return factor, {"frac_low_entropy": low_entropy}


def policy_weight(batch, ratio_old_logps, logps, settings):
    """w_t: the product of the knobs that reweigh or drop policy-gradient tokens.

    batch: a micro-batch (batch.UpdateBatch). ratio_old_logps: the IS ratio's
    old log-probs (the current ones on-policy); logps: the current ones,
    detached. -> ((B, T) constant weight, None with every knob off; (B, T) is_t
    for vespo, which takes it into phi_i instead of w_t, else None;
    {metric name: (B, T) tensor}, what each knob removes).
    """
    s = settings
    is_weight = None
    knobs = []  # (factor, metrics) of each knob that is on

    if batch.truncated is not None:
        knobs.append(_truncation_mask(batch))
    if s.is_correction != "off":
        is_t, is_stats = _importance_correction(batch, ratio_old_logps, s)
        if s.loss_type == "vespo":  # into the sequence ratio W_i, not onto the loss (TRL)
            is_weight = is_t
            is_t = None
        knobs.append((is_t, is_stats))
    if s.off_policy_mask is not None:
        knobs.append(_off_policy_mask(batch, logps, s.off_policy_mask))
    if batch.high_entropy is not None:
        knobs.append(_high_entropy_mask(batch))

    if not knobs:  # every knob off: w_t = 1
        return None, None, {}

    factors = [factor for factor, _ in knobs if factor is not None]
    weight = math.prod(factors) if factors else None
    stats = {}
    for _, knob_stats in knobs:
        stats.update(knob_stats)
    return weight, is_weight, stats
