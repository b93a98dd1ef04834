"""
The GRPO policy loss of a micro-batch, from logits: the PyTorch reference, and the entry point
(policy_loss) that train.py calls whichever implementation runs. How the per-token terms add up
(normalisations, micro-batch shares, the step's masks and metrics over ranks): reduction.py.

Per completion token t of sequence i, with advantage A_i (advantage.py):
    ratio_t = exp(logp_t - old_logp_t)                   (PPO; GSPO, arXiv 2507.18071: one per
              sequence, exp of the masked mean of its token log-ratios)
    pg_t    = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)   grpo, ..., dapo
              -sg(min(ratio_t, eps_high)) A_i logp_t                              cispo
              -sigmoid(tau_i (ratio_t - 1)) 4 / tau_i A_i                          sapo
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3 estimator, always >= 0)
    loss_t  = pg_t * w_t + beta * kl_t                      (kl_t * ratio_t: kl_bias_correction)
    loss    = reduce(loss_t over the kept tokens) - entropy_coef * (mean entropy of the kept tokens)
cispo (MiniMax-M1, arXiv 2506.13585) clips the IS weight, not the update (sg: a constant), so every
    token keeps a gradient; eps_high is the cap itself (5 in ScaleRL, arXiv 2510.13786).
sapo (arXiv 2511.20347): a soft gate, not a hard clip; tau_i = sapo_tau_pos (1.0) if A_i > 0, else
    sapo_tau_neg (1.05); at ratio 1 its gradient is grpo's.
kl_bias_correction (DeepSeek-V3.2, arXiv 2512.02556): kl_t * ratio_t, whose gradient is the
    unbiased reverse-KL gradient when the tokens come from the old policy.
w_t: a constant on the policy term only, the product of (each 1 when off):
    is_t  is_correction, the sampler/trainer mismatch (Yao et al. 2025, "Your efficient RL framework
          secretly brings you off-policy RL training"; TRL's vLLM importance sampling):
          r = exp(old_t - sampling_t) ("token_*") or exp(sum_t (old_t - sampling_t)) ("sequence_*");
          "*_truncate": clip(r, is_min, is_max); "*_mask": r inside [is_min, is_max], else 0
    op_i  off_policy_mask delta (DeepSeek-V3.2, eq. 9): 0 for a sequence with A_i < 0 whose
          mean_t (sampling_t - logp_t), the sampled KL(sampler || policy), exceeds delta
    h_t   high_entropy (arXiv 2506.01939): 1 for the top-rho fraction of the step's tokens by
          entropy, over all ranks (reduction.step_masks), 0 for the rest
Kept tokens: the completion mask minus the truncated completions (mask_truncated, DAPO, arXiv
    2503.14476): they leave the loss, its KL, the entropy bonus and the normaliser.

Which path runs (kernels.choose_impl says why): impl="torch" is model.selective_log_softmax +
grpo_loss below, the reference; impl="triton" is kernels/grpo.py, the same per-token loss fused in
one pass over the logits (every objective, the KL correction; w_t and the kept tokens from here;
token-level ratio only). Tests: python -m pytest -q tests/test_loss.py tests/test_kernel.py

Simplifications:
1. old_logps=None means on-policy (one update per generation): the ratio is 1 in value but keeps
   its gradient (logp - logp.detach()), so the loss is the plain policy gradient.
2. The KL term needs ref_logps only when beta != 0; w_t never weighs it.
3. Metrics: masked token means over the completion tokens (truncated ones too), one sync; frac_*
   are a mask's shares. On-policy the IS ratio uses current log-probs; the off-policy mask always.
4. The entropy mask is drawn once a step, before the update: every micro-batch and pass sees the
   same tokens (TRL redraws it per micro-batch); the bonus stays over all kept tokens.
"""
import math

import torch

from model import entropy_from_logits, selective_log_softmax
from reduction import (REDUCTION, check_reduction, entropy_bonus, kept_mask, reduce_loss,
                       row_weights, token_stats)
# re-exported: train.py, bench/ and the tests import them from here
from kernels import IMPLS, choose_impl as choose_impl, resolve_impl as resolve_impl
from reduction import (minibatch_tokens as minibatch_tokens, step_masks as step_masks,
                       step_metrics as step_metrics)

LOSS_TYPES = tuple(REDUCTION)  # grpo, bnpo, dr_grpo, dapo, cispo, sapo
IS_LEVELS = ("token", "sequence")
IS_CORRECTIONS = ("off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# -----------------------------------------------------------------------------
# the per-token terms

def _check(loss_type, num_items, max_completion_length, level="token", is_correction="off"):
    check_reduction(loss_type, num_items, max_completion_length)
    if level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level={level!r}: choose one of {IS_LEVELS}")
    if is_correction not in IS_CORRECTIONS:
        raise ValueError(f"is_correction={is_correction!r}: choose one of {IS_CORRECTIONS}")


def surrogate(ratio, logps, A, loss_type="grpo", epsilon_low=0.2, epsilon_high=0.2,
              sapo_tau_pos=1.0, sapo_tau_neg=1.05):
    """pg_t of the loss type: ratio, logps (B, T), A (B, 1) -> ((B, T) per-token policy loss,
    clip_low, clip_high: (B, T) bool or None, the tokens each clip bound holds)."""
    if loss_type == "cispo":  # the weight is capped, the token keeps its gradient
        capped = torch.clamp(ratio, max=epsilon_high).detach()  # (B, T)
        return -capped * A * logps, None, ratio > epsilon_high
    if loss_type == "sapo":  # the gradient fades smoothly as the ratio leaves 1
        tau = torch.full_like(A, sapo_tau_neg).masked_fill(A > 0, sapo_tau_pos)  # (B, 1)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A, None, None
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # (B, T)
    per_token = -torch.min(ratio * A, clipped_ratio * A)  # (B, T)
    clip_low = (ratio < 1 - epsilon_low) & (A < 0)  # (B, T): clipped from below, gradient is 0
    clip_high = (ratio > 1 + epsilon_high) & (A > 0)  # (B, T): clipped from above
    return per_token, clip_low, clip_high


def _stats(loss_type, clip_low, clip_high, ratio, kl, entropies):
    """The metrics both paths log, as (B, T) tensors: both bounds of the hard clip (cispo: its
    capped weights; sapo has no clip), ratio_mean, kl and entropy when there are any."""
    stats = {"clip_high": clip_high} if loss_type == "cispo" else {}
    if loss_type not in ("cispo", "sapo"):
        stats = {"clip_low": clip_low, "clip_high": clip_high, "clip_region": clip_low | clip_high}
    stats["ratio_mean"] = ratio
    if kl is not None:
        stats["kl"] = kl
    if entropies is not None:
        stats["entropy"] = entropies
    return stats


def importance_weight(old_logps, sampling_logps, mask, mode, is_min=0.0, is_max=3.0):
    """is_t, the sampler-vs-trainer correction of mode (IS_CORRECTIONS) -> ((B, T) weight, constant
    to autograd; (B, T) r before truncating or masking; (B, T) bool of the tokens a "*_mask" mode
    zeroes, None for "*_truncate"). The one place the weight is built; both paths take it here."""
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
    """DeepSeek-V3.2's off-policy sequence mask (eq. 9): (B,) advantages, (B, T) the current
    log-probs, the sampler's and the mask -> (B,) bool, False where A_i < 0 and the sequence's mean
    sampled KL(sampler || policy) exceeds delta."""
    if sampling_logps is None:
        raise ValueError("off_policy_mask needs sampling_logps (the rollout engine's log-probs)")
    mask = mask.to(logps.dtype)  # (B, T)
    kl = ((sampling_logps - logps.detach()) * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return (advantages >= 0) | (kl <= delta)


def policy_weight(advantages, mask, old_logps, logps, sampling_logps, *, truncated=None,
                  high_entropy=None, is_correction="off", is_min=0.0, is_max=3.0,
                  off_policy_mask=None):
    """w_t, the product of the knobs that reweigh or drop policy-gradient tokens, and what each
    removes -> ((B, T) constant weight, None with every knob off; {metric name: (B, T) tensor}).
    old_logps: the IS ratio's (the current ones on-policy); logps: the current ones, detached."""
    factors = []
    stats = {}
    if truncated is not None:
        stats["frac_masked_truncated"] = truncated.unsqueeze(-1).expand_as(mask)  # (B, T)
    if is_correction != "off":
        weight, ratio, outside = importance_weight(old_logps, sampling_logps, mask, is_correction,
                                                   is_min, is_max)
        factors.append(weight)
        if outside is not None:
            stats["frac_is_masked"] = outside
        stats["is_ratio_mean"] = ratio
        stats["is_ratio_max"] = ratio
    if off_policy_mask is not None:
        keep = off_policy_keep(advantages, logps, sampling_logps, mask, off_policy_mask)  # (B,)
        factors.append(keep.to(mask.dtype).unsqueeze(-1).expand_as(mask))  # (B, T)
        stats["frac_off_policy_masked"] = ~keep.unsqueeze(-1).expand_as(mask)  # (B, T)
    if high_entropy is not None:
        factors.append(high_entropy.to(mask.dtype))  # (B, T)
        stats["frac_low_entropy"] = kept_mask(mask, truncated) * ~high_entropy  # (B, T)
    weight = math.prod(factors) if factors else None
    return weight, stats


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, loss_type="grpo",
              epsilon_low=0.2, epsilon_high=0.2, beta=0.0, num_items=None,
              max_completion_length=None, num_sequences=None, importance_sampling_level="token",
              entropies=None, entropy_coef=0.0, token_weight=None, truncated=None,
              kl_bias_correction=False, sapo_tau_pos=1.0, sapo_tau_neg=1.05, counts=None):
    """The policy objective + k3 KL (- entropy bonus) -> (scalar loss, metrics dict of floats).
    logps, old_logps, ref_logps, mask, entropies, token_weight (policy_weight): (B, T); advantages,
    truncated (bool: leave the loss), counts (rows each one stands for: unique_rows): (B,).
    num_sequences, num_items: the minibatch's, for one of its micro-batches (reduce_loss)."""
    _check(loss_type, num_items, max_completion_length, importance_sampling_level)
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference's log-probs), or set beta=0")
    if entropy_coef != 0 and entropies is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs entropies (see entropy_from_logits)")
    mask = mask.to(logps.dtype)  # (B, T)
    old = logps.detach() if old_logps is None else old_logps  # (B, T)
    log_ratio = logps - old  # (B, T)
    if importance_sampling_level == "sequence":  # GSPO: one ratio per sequence, eq. 7
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
        log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logps)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    A = advantages.unsqueeze(-1)  # (B, 1)
    per_token, clip_low, clip_high = surrogate(ratio, logps, A, loss_type, epsilon_low,
                                               epsilon_high, sapo_tau_pos, sapo_tau_neg)
    if token_weight is not None:  # a constant: reweighs or drops tokens, no gradient
        per_token = per_token * token_weight
    kl = None
    if ref_logps is not None:
        delta = ref_logps - logps  # (B, T)
        # k3 (Schulman 2020, "Approximating KL divergence")
        kl = torch.exp(delta) - delta - 1  # (B, T)
        if beta != 0:
            per_token = per_token + beta * (kl * ratio if kl_bias_correction else kl)
    kept = kept_mask(mask, truncated)  # (B, T)
    loss = reduce_loss(per_token, kept, loss_type, num_items, max_completion_length, num_sequences,
                       counts)
    w = row_weights(counts)  # (B, 1): weighs the bonus and the means
    if entropies is not None and entropy_coef != 0:  # maximise entropy: keeps exploring
        loss = loss - entropy_bonus(entropies, kept * w, entropy_coef, num_items)
    return loss, token_stats(mask * w, _stats(loss_type, clip_low, clip_high, ratio, kl, entropies))


# -----------------------------------------------------------------------------
# a micro-batch, from logits: the one entry point train.py calls per micro-batch

def loss_options(args, impl):
    """train.py's flags -> policy_loss's keyword arguments, the same for every micro-batch.
    --tis-cap C (the older flag) is --is-correction token_truncate --is-max C."""
    names = ("loss_type", "temperature", "epsilon_low", "epsilon_high", "beta", "entropy_coef",
             "importance_sampling_level", "is_correction", "is_min", "is_max", "off_policy_mask",
             "kl_bias_correction")
    options = {name: getattr(args, name) for name in names}
    if args.tis_cap:
        options.update(is_correction="token_truncate", is_max=args.tis_cap)
    options.update(sapo_tau_pos=args.sapo_tau[0], sapo_tau_neg=args.sapo_tau[1])
    return dict(options, max_completion_length=args.max_new_tokens, impl=impl)


def policy_loss(logits, completion_ids, advantages, completion_mask, old_logps=None,
                ref_logps=None, sampling_logps=None, *, minibatch_size, minibatch_tokens,
                truncated=None, high_entropy=None, loss_type="grpo", temperature=1.0,
                epsilon_low=0.2, epsilon_high=0.2, beta=0.0, entropy_coef=0.0,
                importance_sampling_level="token", is_correction="off", is_min=0.0, is_max=3.0,
                off_policy_mask=None, kl_bias_correction=False, sapo_tau_pos=1.0,
                sapo_tau_neg=1.05, max_completion_length=None, impl="torch", counts=None):
    """-> (this micro-batch's share of the minibatch loss, for .backward(); metrics: floats named
    the same whichever path ran: _stats's, each knob's (policy_weight), loss (that share), tokens).
    logits (n, T, V); completion_ids, completion_mask, old/ref/sampling_logps, high_entropy (n, T);
    advantages, truncated, counts (n,). minibatch_size: the minibatch's sequences on this rank;
    minibatch_tokens: minibatch_tokens(its mask, truncated). impl: "torch" or "triton"."""
    _check(loss_type, minibatch_tokens, max_completion_length, importance_sampling_level,
           is_correction)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {IMPLS} (choose_impl resolves 'auto')")
    if impl == "triton" and importance_sampling_level != "token":
        raise ValueError("impl='triton' has the token-level ratio only; use impl='torch' for "
                         "importance_sampling_level='sequence'")
    share = dict(num_sequences=minibatch_size, num_items=minibatch_tokens,
                 max_completion_length=max_completion_length, counts=counts)
    counted = completion_mask * row_weights(counts)  # (n, T): each row as often as it stands for
    objective = dict(epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                     kl_bias_correction=kl_bias_correction, sapo_tau_pos=sapo_tau_pos,
                     sapo_tau_neg=sapo_tau_neg)
    entropies = entropy_from_logits(logits, temperature) if entropy_coef else None  # (n, T)
    # (n, T); the kernel computes its own
    logps = selective_log_softmax(logits, completion_ids, temperature) if impl == "torch" else None
    # the current log-probs, constant: the off-policy mask's, and the IS ratio's when on-policy
    current = None if logps is None else logps.detach()  # (n, T)
    needs_current = off_policy_mask is not None or (is_correction != "off" and old_logps is None)
    if current is None and needs_current:  # the kernel path has none: one more pass
        current = selective_log_softmax(logits.detach(), completion_ids, temperature)  # (n, T)
    weight, knob_stats = policy_weight(
        advantages, completion_mask, current if old_logps is None else old_logps, current,
        sampling_logps, truncated=truncated, high_entropy=high_entropy,
        is_correction=is_correction, is_min=is_min, is_max=is_max, off_policy_mask=off_policy_mask)

    if impl == "torch":
        loss, metrics = grpo_loss(
            logps, old_logps, ref_logps, advantages, completion_mask, loss_type=loss_type,
            importance_sampling_level=importance_sampling_level, entropies=entropies,
            entropy_coef=entropy_coef, token_weight=weight, truncated=truncated, **objective,
            **share)
    else:
        from kernels import fused_grpo_token_loss  # imports Triton: only when this path runs
        # (n, T) each, detached, 0 at masked; the bonus below is a token mean whatever the loss type
        per_token, logps, stats = fused_grpo_token_loss(
            logits, completion_ids, advantages, completion_mask, old_logps, ref_logps,
            temperature=temperature, entropy_coef=0.0, token_weight=weight,
            objective=loss_type if loss_type in ("cispo", "sapo") else "clip", **objective)
        kept = kept_mask(completion_mask, truncated)  # (n, T)
        loss = reduce_loss(per_token, kept, loss_type, **share)
        if entropies is not None:
            loss = loss - entropy_bonus(entropies, kept_mask(counted, truncated), entropy_coef,
                                        minibatch_tokens)
        metrics = token_stats(counted, _fused_stats(
            loss_type, logps, old_logps, ref_logps, completion_mask, stats, entropies))
    if knob_stats:
        metrics.update(token_stats(counted, knob_stats))
    metrics["loss"] = loss.item()
    metrics["tokens"] = counted.sum().item()
    return loss, metrics


@torch.no_grad()
def _fused_stats(loss_type, logps, old_logps, ref_logps, mask, stats, entropies):
    """The kernel path's _stats, from its detached logps (0 at masked tokens) and stats."""
    ratio = torch.ones_like(logps)  # (n, T)
    if old_logps is not None:
        # * mask: masked tokens have logps 0, and exp(0 - old) could overflow there
        ratio = torch.exp((logps - old_logps) * mask)  # (n, T)
    # the kernel computes the KL only when beta != 0; grpo_loss logs it at beta = 0 too
    kl = stats.get("kl")  # (n, T)
    if kl is None and ref_logps is not None:
        delta = ref_logps - logps  # (n, T)
        kl = torch.exp(delta) - delta - 1  # (n, T)
    return _stats(loss_type, stats["is_clipped_low"], stats["is_clipped_high"], ratio, kl,
                  entropies)
