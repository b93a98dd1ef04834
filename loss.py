"""
The GRPO policy loss of a micro-batch, from logits: the PyTorch reference, and the entry point
(policy_loss) that train.py calls whichever implementation runs.

Per completion token t of sequence i, with advantage A_i (advantage.py):
    ratio_t  = exp(logp_t - old_logp_t)                        (importance ratio, PPO)
    pg_t     = -min(ratio_t * A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) * A_i)
    kl_t     = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (k3 estimator, always >= 0)
    loss_t   = pg_t * w_t + beta * kl_t
    loss     = reduce(loss_t) - entropy_coef * mean_t H_t

Variants:
    loss_type "grpo"    : mean over sequences of each sequence's token mean (DeepSeekMath eq. 3)
              "bnpo"    : sum over tokens / number of unmasked tokens
              "dr_grpo" : sum / (B * max_completion_length), no length bias (Dr. GRPO, arXiv 2503.20783)
              "dapo"    : sum / num_items, the unmasked tokens of the whole batch (DAPO, arXiv 2503.14476)
    importance_sampling_level "token" (GRPO), or "sequence" (GSPO, arXiv 2507.18071: one ratio per
        sequence, exp of the masked mean of its token log-ratios)
    w_t = min(exp(old_logp_t - sampling_logp_t), tis_cap): truncated importance sampling for the
        engine / trainer mismatch (Yao et al. 2025, "Your efficient RL framework secretly brings you
        off-policy RL training"); w = 1 when off.
    H_t: the entropy of softmax(logits / temperature), an optional exploration bonus: the mean
        per-token entropy whatever the loss type, as TRL applies it.

A micro-batch of a minibatch: train.py passes the minibatch's sequence count and its unmasked tokens
on all ranks / W (minibatch_tokens), and each micro-batch's loss is its share of the minibatch loss:
the shares add up to it at any --micro-batch-size, and with DDP averaging gradients over W ranks,
bnpo, dapo and the entropy bonus are token means over the whole minibatch of every rank.

Which path runs: impl="torch" is model.selective_log_softmax + grpo_loss below, the readable reference;
impl="triton" is kernels/grpo.py, the same loss fused into one pass over the logits (token-level
ratio only; Triton is imported on first use). resolve_impl turns --loss-impl auto into "triton" on
CUDA with the token-level ratio, "torch" otherwise.
Tests (they hold the two paths together): python -m pytest -q tests/test_loss.py tests/test_kernel.py

Simplifications:
1. old_logps=None means on-policy (one update per generation): the ratio is 1 in value but keeps
   its gradient (logp - logp.detach()), so the loss is the plain policy gradient.
2. The KL term needs ref_logps only when beta != 0; it is never clipped or importance-weighted.
3. Metrics are masked token means over the micro-batch, as plain floats (one sync); step_metrics
   weighs them by tokens into the step's means over every micro-batch and rank.
4. With tis_cap and old_logps=None (on-policy) the weight uses the current log-probs, detached.
"""
import torch
import torch.distributed as dist

from common import collective_device, ddp, world
from model import entropy_from_logits, selective_log_softmax

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")
IMPLS = ("torch", "triton")


# -----------------------------------------------------------------------------
# the loss

def _check(loss_type, num_items, max_completion_length, importance_sampling_level="token"):
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {LOSS_TYPES}")
    if importance_sampling_level not in IS_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r}: "
                         f"choose one of {IS_LEVELS}")
    if loss_type == "dapo" and num_items is None:
        raise ValueError("loss_type='dapo' divides by num_items: pass the number of unmasked "
                         "completion tokens of the whole minibatch (all ranks / W: see "
                         "minibatch_tokens)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by B * max_completion_length: "
                         "pass max_completion_length")


def reduce_loss(per_token_loss, mask, loss_type="grpo", num_items=None,
                max_completion_length=None, num_sequences=None):
    """(B, T) per-token loss and completion mask -> scalar, normalised as loss_type says.
    For a micro-batch of a minibatch pass the minibatch's num_sequences (grpo, dr_grpo) and num_items
    (bnpo, dapo: its unmasked tokens, all ranks / W, see minibatch_tokens): the micro-batches'
    results then add up to the minibatch's. Without them the batch is its own minibatch."""
    _check(loss_type, num_items, max_completion_length)
    mask = mask.to(per_token_loss.dtype)  # (B, T)
    masked = per_token_loss * mask  # (B, T)
    B = num_sequences or per_token_loss.size(0)
    if loss_type == "grpo":  # each sequence weighs the same, whatever its length
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / B
    if loss_type == "dr_grpo":  # constant normaliser: no bias toward short or long answers
        return masked.sum() / (B * max_completion_length)
    # bnpo, dapo: each token of the minibatch weighs the same
    return masked.sum() / _tokens(mask, num_items)


def _tokens(mask, num_items):
    return num_items if num_items is not None else mask.sum().clamp(min=1.0)


def minibatch_tokens(mask):
    """The minibatch's unmasked completion tokens on all ranks / W: (N, T) this rank's mask -> a
    scalar tensor, the same on every rank (a collective). DDP averages gradients over the W ranks, so
    a rank's token sum divided by this comes out, after the average, as the token mean over every
    rank's tokens (TRL's num_items_in_batch)."""
    tokens = mask.sum().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tokens)
        tokens = tokens / dist.get_world_size()
    return tokens


def entropy_bonus(entropies, mask, entropy_coef, num_items=None):
    """entropy_coef * the mean per-token entropy (over num_items tokens when given, else this
    batch's): subtracted from the loss, the same for every loss type."""
    mask = mask.to(entropies.dtype)  # (B, T)
    return entropy_coef * (entropies * mask).sum() / _tokens(mask, num_items)


def truncated_is_weight(old_logps, sampling_logps, tis_cap):
    """min(exp(old_logps - sampling_logps), tis_cap): (B, T), constant to autograd. The one place the
    TIS weight is built; both paths of policy_loss take it from here."""
    if sampling_logps is None:
        raise ValueError("tis_cap needs sampling_logps (the rollout engine's log-probs of the "
                         "sampled tokens)")
    return torch.clamp(torch.exp(old_logps - sampling_logps), max=tis_cap).detach()  # (B, T)


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, loss_type="grpo",
              epsilon_low=0.2, epsilon_high=0.2, beta=0.0, num_items=None,
              max_completion_length=None, num_sequences=None, importance_sampling_level="token",
              entropies=None, entropy_coef=0.0, is_weight=None):
    """Clipped surrogate + k3 KL (- entropy bonus) -> (scalar loss, metrics dict of floats).
    logps, old_logps, ref_logps, mask, entropies, is_weight (truncated_is_weight): (B, T);
    advantages: (B,). num_sequences, num_items: the minibatch's, when this batch is one of its
    micro-batches (reduce_loss)."""
    _check(loss_type, num_items, max_completion_length, importance_sampling_level)
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs); "
                         f"or set beta=0")
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
    clipped_ratio = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # (B, T)
    per_token = -torch.min(ratio * A, clipped_ratio * A)  # (B, T)
    if is_weight is not None:  # a constant: corrects the sampling distribution, no gradient
        per_token = per_token * is_weight
    kl = None
    if ref_logps is not None:
        delta = ref_logps - logps  # (B, T)
        # k3 (Schulman 2020, "Approximating KL divergence")
        kl = torch.exp(delta) - delta - 1  # (B, T)
        if beta != 0:
            per_token = per_token + beta * kl
    loss = reduce_loss(per_token, mask, loss_type, num_items, max_completion_length, num_sequences)
    if entropies is not None and entropy_coef != 0:  # maximise entropy: keeps exploring
        loss = loss - entropy_bonus(entropies, mask, entropy_coef, num_items)

    clip_low = (ratio < 1 - epsilon_low) & (A < 0)  # (B, T): clipped from below, gradient is 0
    clip_high = (ratio > 1 + epsilon_high) & (A > 0)  # (B, T): clipped from above
    return loss, _metrics(mask, clip_low, clip_high, ratio, kl, entropies)


def _metrics(mask, clip_low, clip_high, ratio, kl=None, entropies=None):
    """(B, T) per-token stats -> dict of floats, masked token means over the micro-batch (one sync).
    Both paths of policy_loss report through here, so they log the same names."""
    with torch.no_grad():
        def masked_mean(x):
            return (x * mask).sum() / mask.sum().clamp(min=1.0)
        stats = {"clip_low": masked_mean(clip_low.to(mask.dtype)),
                 "clip_high": masked_mean(clip_high.to(mask.dtype)),
                 "clip_region": masked_mean((clip_low | clip_high).to(mask.dtype)),
                 "ratio_mean": masked_mean(ratio)}
        if kl is not None:
            stats["kl"] = masked_mean(kl)
        if entropies is not None:
            stats["entropy"] = masked_mean(entropies)
        return dict(zip(stats, torch.stack(list(stats.values())).tolist()))


# -----------------------------------------------------------------------------
# a micro-batch, from logits: the one entry point train.py calls

def resolve_impl(loss_impl, device, importance_sampling_level="token"):
    """--loss-impl "auto" | "torch" | "triton" -> "triton" or "torch". auto: the fused kernel on
    CUDA when the ratio is token-level (the kernel has no GSPO); PyTorch on CPU, where Triton only
    interprets."""
    if loss_impl not in ("auto",) + IMPLS:
        raise ValueError(f"loss_impl={loss_impl!r}: choose one of {('auto',) + IMPLS}")
    if loss_impl != "auto":
        return loss_impl
    if torch.device(device).type == "cuda" and importance_sampling_level == "token":
        return "triton"
    return "torch"


def policy_loss(logits, completion_ids, advantages, completion_mask, old_logps=None,
                ref_logps=None, sampling_logps=None, *, minibatch_size, minibatch_tokens,
                loss_type="grpo", temperature=1.0, epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                entropy_coef=0.0, tis_cap=0.0, importance_sampling_level="token",
                max_completion_length=None, impl="torch"):
    """-> (this micro-batch's share of the minibatch loss, ready for .backward(); metrics: floats
    with the same names whichever path ran: clip_low, clip_high, clip_region, ratio_mean, kl (with
    ref_logps), entropy (with entropy_coef), loss (that share), tokens (its unmasked tokens)).
    logits (n, T, V); completion_ids, completion_mask, old/ref/sampling_logps (n, T); advantages (n,).
    minibatch_size: sequences in the minibatch on this rank; minibatch_tokens: minibatch_tokens(its
    mask). tis_cap: 0 = off. impl: "torch" or "triton" (resolve_impl)."""
    _check(loss_type, minibatch_tokens, max_completion_length, importance_sampling_level)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}: choose one of {IMPLS} (resolve_impl turns 'auto' into one)")
    if impl == "triton" and importance_sampling_level != "token":
        raise ValueError("impl='triton' has the token-level ratio only; use impl='torch' for "
                         "importance_sampling_level='sequence'")
    share = dict(num_sequences=minibatch_size, num_items=minibatch_tokens,
                 max_completion_length=max_completion_length)
    logps = None
    is_weight = None
    entropies = entropy_from_logits(logits, temperature) if entropy_coef else None  # (n, T)
    if impl == "torch":
        logps = selective_log_softmax(logits, completion_ids, temperature)  # (n, T)
    if tis_cap:
        old = old_logps
        # on-policy: the current log-probs, constant (the kernel path has none yet: one more pass)
        if old is None and logps is not None:
            old = logps.detach()  # (n, T)
        elif old is None:
            old = selective_log_softmax(logits.detach(), completion_ids, temperature)  # (n, T)
        is_weight = truncated_is_weight(old, sampling_logps, tis_cap)  # (n, T)

    if impl == "torch":
        loss, metrics = grpo_loss(
            logps, old_logps, ref_logps, advantages, completion_mask, loss_type=loss_type,
            epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
            importance_sampling_level=importance_sampling_level, entropies=entropies,
            entropy_coef=entropy_coef, is_weight=is_weight, **share)
    else:
        from kernels import fused_grpo_token_loss  # imports Triton: only when this path runs

        # (n, T) each; logps and stats detached, 0 at masked tokens. The kernel's entropy term would
        # be weighed by the loss type's reduction: the bonus is added below instead
        per_token, logps, stats = fused_grpo_token_loss(
            logits, completion_ids, advantages, completion_mask, old_logps, ref_logps,
            temperature=temperature, epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
            entropy_coef=0.0, is_weight=is_weight)
        loss = reduce_loss(per_token, completion_mask, loss_type, **share)
        if entropies is not None:
            loss = loss - entropy_bonus(entropies, completion_mask, entropy_coef, minibatch_tokens)
        mask = completion_mask.to(logps.dtype)  # (n, T)
        with torch.no_grad():
            # the ratio as grpo_loss has it; * mask: masked tokens have logps 0, and exp(0 - old)
            # could overflow there
            if old_logps is not None:
                ratio = torch.exp((logps - old_logps) * mask)  # (n, T)
            else:
                ratio = torch.ones_like(logps)  # (n, T)
            # the kernel computes the KL only when beta != 0; grpo_loss logs it at beta = 0 too
            kl = stats.get("kl")  # (n, T)
            if kl is None and ref_logps is not None:
                delta = ref_logps - logps  # (n, T)
                kl = torch.exp(delta) - delta - 1  # (n, T)
        detached_entropies = None if entropies is None else entropies.detach()
        metrics = _metrics(mask, stats["is_clipped_low"], stats["is_clipped_high"], ratio, kl,
                           detached_entropies)
    metrics["loss"] = loss.item()
    metrics["tokens"] = completion_mask.sum().item()
    return loss, metrics


# -----------------------------------------------------------------------------
# the step's metrics, over its micro-batches and the ranks

def step_metrics(micro_metrics, grad_norms):
    """The step's logged numbers, unchanged by --micro-batch-size and the same on every rank:
    "loss" is the minibatch loss (the sum of its micro-batches' shares) averaged over the step's
    optimizer steps and the ranks (as DDP averages gradients), grad_norm the mean over the optimizer
    steps, and every other metric a token mean over the whole step on every rank, each micro-batch
    weighted by its "tokens"."""
    keys = [k for k in micro_metrics[0] if k not in ("loss", "tokens")]
    tokens = [m["tokens"] for m in micro_metrics]
    sums = [sum(m[k] * t for m, t in zip(micro_metrics, tokens)) for k in keys]
    loss = sum(m["loss"] for m in micro_metrics) / len(grad_norms)
    grad_norm = torch.stack(grad_norms).float().mean().item()
    values = torch.tensor(sums + [sum(tokens), loss, grad_norm], dtype=torch.float64)
    if ddp:
        values = values.to(collective_device())
        dist.all_reduce(values)
        # token sums stay sums; the loss and grad norm become means over the ranks
        divisors = torch.tensor([1.0] * (len(keys) + 1) + [world, world], dtype=torch.float64)
        values = values.cpu() / divisors
    result = {k: (v / values[-3]).item() for k, v in zip(keys, values)}
    result["loss"] = values[-2].item()
    result["grad_norm"] = values[-1].item()
    return result
