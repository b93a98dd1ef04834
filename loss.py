"""
The GRPO policy loss of a micro-batch: PPO's clipped surrogate, a k3 KL to the
reference, each sequence's token mean, and an entropy bonus. policy_loss is the
one entry point train.py calls; grpo_loss is the PyTorch reference, from
log-probs.

Per completion token t of sequence i, with advantage A_i (advantage.py), over
the micro-batch's B sequences and each one's |o_i| completion tokens:

    ratio_t = exp(logp_t - old_logp_t)
    pg_t    = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3, always >= 0)
    loss    = 1/B sum_i 1/|o_i| sum_t (pg_t + beta kl_t)     (DeepSeekMath eq. 3)
              - entropy_coef * (the token mean of the policy's entropy H_t)

Run it: python train.py (the default run: this loss on the built-in task; the
recipe's entropy_coef is 0.1, beta 0).
Tests:  python -m pytest -q tests/test_loss.py tests/test_loss_rows.py
        tests/test_loss_knobs.py tests/test_kernel.py tests/test_loss_2ranks.py

Simplifications:
1. old_logps=None means on-policy (one update per generation). The ratio is 1
   in value but keeps its gradient (logp - logp.detach()), so the loss is the
   plain policy gradient.
2. The KL term needs ref_logps only when beta != 0. It is the k3 estimate
   (Schulman 2020, "Approximating KL divergence") on the sampled tokens.
3. The entropy bonus is a token mean over the minibatch (num_items: every
   rank's tokens / W), whatever the loss type's reduction.
4. A micro-batch's loss is its share of the minibatch's: train.py passes the
   minibatch's sequence count and tokens (minibatch_tokens), so the shares add
   up to it at any --micro-batch-size, and DDP's average over W ranks gives the
   mean over every rank's sequences.
5. Metrics are masked token means over the completion tokens, in one sync
   (runlog.metrics.token_stats). clip_* are the shares each clip bound holds.

Everything else is a variant, in its own file behind its setting, imported only
when that setting is on (the default run imports none of them):
    variants/objectives.py     the other pg_t: cispo, sapo, vespo; --delta's cap
                               on the clip (INTELLECT-2); GSPO's sequence ratio
    variants/reductions.py     the other normalisations: bnpo, dr_grpo, dapo, luspo
    variants/token_weights.py  w_t, a constant weight on pg_t: the IS correction,
                               the off-policy mask, the high-entropy mask,
                               and --mask-truncated's share
    kernels/fused_loss.py      impl="triton": the same loss fused in one pass over
                               the logits (kernels/grpo.py), from the same settings

The settings: one frozen LossSettings a run, each field the flag of its name
(LossSettings.from_flags). The rules between them are config.check_loss_settings,
which config.check_flags runs on the flags; the loss itself checks only what a
call passes it.

Truncated sampling (--top-k, --top-p, --min-p; TRL issue #6789): the logits
arrive here already FILTERED outside the sampler's kept set
(sampling/truncation.py, attached in train.py), as do old_logps and
ref_logps. So every log-prob, and with them the ratio, the entropies and the KL,
is over the truncated, renormalized distribution the sampler drew from: this
file is unchanged. The repetition penalty is not replayed (sampling/truncation.py).
"""
import dataclasses

import torch
import torch.distributed as dist

from config import CLIPPED_LOSS_TYPES, LOSS_IMPLS, LOSS_TYPES
from runlog.metrics import token_stats
from model import entropy_from_logits, selective_log_softmax


def choose_impl(loss_impl, device, importance_sampling_level="token", loss_type="grpo"):
    """--loss-impl "auto" | "torch" | "triton" -> (impl, why, for the start-up line).

    auto: the fused kernel on CUDA when the loss is token-level (the kernel has
    no GSPO, luspo or vespo); PyTorch on CPU, where Triton only interprets.
    """
    if loss_impl not in ("auto",) + LOSS_IMPLS:
        raise ValueError(f"loss_impl={loss_impl!r}: choose one of {('auto',) + LOSS_IMPLS}")

    if loss_impl != "auto":
        return loss_impl, f"--loss-impl {loss_impl}"
    if loss_type in ("luspo", "vespo"):
        return "torch", f"auto: --loss-type {loss_type} is sequence-level, the kernel per token"
    if torch.device(device).type != "cuda":
        return "torch", "auto: no CUDA, where Triton would only interpret"
    if importance_sampling_level != "token":
        return "torch", "auto: the kernel has no sequence-level ratio"
    return "triton", "auto: the fused kernel on CUDA"


@dataclasses.dataclass(frozen=True)
class LossSettings:
    """The loss's hyperparameters, the same for every micro-batch of a run.

    Each field but impl is the flag of its name (config.py): train.py builds
    it with from_flags, which lists no field. The variants' settings are here
    too (each one's file says what it does with them). The rules between the
    fields: config.check_loss_settings.
    """

    loss_type: str = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # cispo: the weight's cap itself
    beta: float = 0.0  # the KL coefficient
    kl_bias_correction: bool = False
    sapo_tau: tuple[float, float] = (1.0, 1.05)  # sapo: the gate's tau for A > 0, A <= 0
    vespo_k: tuple[float, float] = (2.0, 3.0)  # vespo: phi's k for A >= 0, A < 0
    vespo_lambda: tuple[float, float] = (3.0, 2.0)  # and its lambda
    delta: float | None = None  # INTELLECT-2's cap on the ratio, > 1 + epsilon_high
    entropy_coef: float = 0.0
    temperature: float = 1.0  # the sampling temperature: logits / T
    importance_sampling_level: str = "token"  # "sequence": GSPO
    is_correction: str = "off"
    is_min: float = 0.0
    is_max: float = 3.0
    off_policy_mask: float | None = None  # delta
    max_new_tokens: int | None = None  # dr_grpo's normaliser (TRL's max_completion_length)
    impl: str = "torch"  # or "triton": kernels/ (choose_impl, from --loss-impl)

    @classmethod
    def from_flags(cls, args, impl):
        """The settings of train.py's parsed flags (config.py): each field from the
        flag of its name. impl: choose_impl's, which resolves --loss-impl."""
        flags = {}
        for field in dataclasses.fields(cls):
            if field.name == "impl":
                continue
            value = getattr(args, field.name)
            # the pairs (--sapo-tau POS NEG) parse as lists: tuples keep the settings frozen
            flags[field.name] = tuple(value) if isinstance(value, list) else value
        return cls(**flags, impl=impl)


# -----------------------------------------------------------------------------
# pg_t: PPO's clipped surrogate
#
# Every objective (this one, and variants/objectives.py's OBJECTIVES) takes
# ratio (B, T), logps (B, T), A (B, 1), the settings and phi (B, 1), a constant
# weight per sequence (vespo's; None for the others), and returns ((B, T) pg_t,
# {metric name: (B, T) tensor}): its own metrics, the clip shares where it clips.

def clipped(ratio, logps, A, settings, phi=None):
    """PPO's clipped surrogate: grpo, bnpo, dr_grpo, dapo, luspo.

    pg_t = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i).
    The metrics: the tokens each clip bound holds. logps, phi: unused.
    """
    s = settings
    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)  # (B, T)
    per_token = -torch.min(ratio * A, clipped_ratio * A)  # (B, T)
    return per_token, clip_stats(ratio, A, s)


def clip_stats(ratio, A, settings):
    """The tokens each clip bound holds: {name: (B, T) bool}."""
    s = settings
    # clipped from below: the gradient is 0
    clip_low = (ratio < 1 - s.epsilon_low) & (A < 0)  # (B, T)
    # clipped from above
    clip_high = (ratio > 1 + s.epsilon_high) & (A > 0)  # (B, T)
    return {"clip_low": clip_low, "clip_high": clip_high, "clip_region": clip_low | clip_high}


def loss_metrics(objective_stats, ratio, kl, entropies):
    """The metrics both paths log, as (B, T) tensors: the objective's own,
    ratio_mean, and kl and entropy when there are any."""
    stats = dict(objective_stats)
    stats["ratio_mean"] = ratio
    if kl is not None:
        stats["kl"] = kl
    if entropies is not None:
        stats["entropy"] = entropies
    return stats


# -----------------------------------------------------------------------------
# The loss of a micro-batch's log-probs: the reference

def grpo_loss(logps, old_logps, ref_logps, advantages, mask, settings, *, entropies=None,
              token_weight=None, is_weight=None, truncated=None, counts=None,
              num_items=None, num_sequences=None):
    """The policy objective + k3 KL (- entropy bonus) -> (scalar loss, metrics).

    logps, old_logps, ref_logps, mask, entropies, token_weight (w_t) and
    is_weight (vespo's is_t; both from variants/token_weights.py's
    policy_weight): (B, T). advantages, truncated (bool: leave the loss),
    counts (the rows each one stands for: batch.unique_rows): (B,).
    num_sequences, num_items: the minibatch's, for one of its micro-batches
    (reduce_loss, which refuses a loss type's missing normaliser). The metrics
    are floats (token_stats).
    """
    s = settings
    if s.loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={s.loss_type!r}: choose one of {LOSS_TYPES}")
    if is_weight is not None and s.loss_type != "vespo":
        raise ValueError("is_weight is vespo's: pass the IS weight of other loss types "
                         "in token_weight")
    if s.beta != 0 and ref_logps is None:
        raise ValueError(f"beta={s.beta} needs ref_logps (the reference's log-probs), "
                         f"or set beta=0")
    if s.entropy_coef != 0 and entropies is None:
        raise ValueError(f"entropy_coef={s.entropy_coef} needs entropies "
                         f"(see entropy_from_logits)")

    # 1) the ratio, per token
    mask = mask.to(logps.dtype)  # (B, T)
    old = logps.detach() if old_logps is None else old_logps  # (B, T)
    # 0 at masked tokens: there the fused head's log-probs are 0
    # (fast/update.py's completion_logps) and exp(0 - old) could overflow
    log_ratio = (logps - old) * mask  # (B, T)
    if s.importance_sampling_level == "sequence":  # GSPO: one a sequence (variants/objectives.py)
        from variants.objectives import sequence_log_ratio
        log_ratio = sequence_log_ratio(log_ratio, mask)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)

    # 2) pg_t: PPO's clipped surrogate, or a variant's objective; then w_t, a
    # constant (no gradient)
    A = advantages.unsqueeze(-1)  # (B, 1)
    if s.loss_type in CLIPPED_LOSS_TYPES and s.delta is None:
        per_token, objective_stats = clipped(ratio, logps, A, s)  # (B, T)
    else:  # cispo, sapo, vespo, or --delta's cap on the clip: variants/objectives.py
        from variants.objectives import variant_objective
        per_token, objective_stats = variant_objective(ratio, logps, A, s, log_ratio, mask,
                                                       is_weight)  # (B, T)
    if token_weight is not None:
        per_token = per_token * token_weight

    # 3) the KL term: k3 (Schulman 2020, "Approximating KL divergence")
    kl = None
    if ref_logps is not None:
        delta = ref_logps - logps  # (B, T)
        kl = torch.exp(delta) - delta - 1  # (B, T)
        if s.beta != 0 and s.kl_bias_correction:  # DeepSeek-V3.2 (variants/objectives.py)
            per_token = per_token + s.beta * (kl * ratio)
        elif s.beta != 0:
            per_token = per_token + s.beta * kl

    # 4) reduce over the kept tokens; the bonus keeps the policy exploring
    kept = kept_mask(mask, truncated)  # (B, T)
    loss = reduce_loss(per_token, kept, s.loss_type, num_items, s.max_new_tokens,
                       num_sequences, counts)
    w = row_weights(counts)  # (B, 1): weighs the bonus and the means
    if entropies is not None and s.entropy_coef != 0:
        loss = loss - entropy_bonus(entropies, kept * w, s.entropy_coef, num_items)

    stats = loss_metrics(objective_stats, ratio, kl, entropies)
    return loss, token_stats(mask * w, stats)


# -----------------------------------------------------------------------------
# How the per-token loss adds up: grpo's normalisation (the others:
# variants/reductions.py), the kept tokens, a micro-batch's share

def reduce_loss(per_token_loss, mask, loss_type="grpo", num_items=None,
                max_new_tokens=None, num_sequences=None, counts=None):
    """(B, T) per-token loss and completion mask -> a scalar, as loss_type says.

    For a micro-batch of a minibatch, pass the minibatch's num_sequences (grpo,
    dr_grpo, luspo) and num_items (bnpo, dapo: its unmasked tokens, all ranks / W, see
    minibatch_tokens). The micro-batches' results then add up to the minibatch's.
    Without them the batch is its own minibatch. max_new_tokens: dr_grpo's
    completion limit. counts (B,): the identical sequences each row stands for
    (batch.unique_rows).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {LOSS_TYPES}")
    reduction = grpo_reduction
    if loss_type != "grpo":  # the loss type's own: variants/reductions.py
        from variants.reductions import reduction_of
        reduction = reduction_of(loss_type, num_items, max_new_tokens)

    mask = mask.to(per_token_loss.dtype)  # (B, T)
    w = row_weights(counts)  # (B, 1)
    masked = per_token_loss * mask * w  # (B, T)
    if num_sequences:
        B = num_sequences
    elif counts is None:
        B = per_token_loss.size(0)
    else:
        B = counts.sum()
    return reduction(masked, mask, w, B, num_items, max_new_tokens)


def grpo_reduction(masked, mask, w, B, num_items=None, max_new_tokens=None):
    """The mean over sequences of each one's token mean (DeepSeekMath eq. 3):
    each sequence weighs the same, whatever its length.

    masked (B, T): the per-token loss * mask * w; mask (B, T); w (B, 1), the
    rows' counts (row_weights); B: the minibatch's sequences. Every reduction
    (variants/reductions.py's REDUCTIONS) takes these; num_items and
    max_new_tokens are the others' normalisers.
    """
    return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / B


def kept_mask(mask, truncated=None):
    """(B, T) completion mask minus the sequences that leave the loss.

    truncated: (B,) bool (--mask-truncated, DAPO, arXiv 2503.14476), or None
    when none leave. -> (B, T) in mask's dtype.
    """
    if truncated is None:
        return mask
    return mask * (~truncated).to(mask.dtype).unsqueeze(-1)  # (B, T)


def row_weights(counts):
    """batch.unique_rows' counts (B,) -> (B, 1), what each row's terms are multiplied by.

    1.0 for None: every row stands for itself.
    """
    if counts is None:
        return 1.0
    return counts.unsqueeze(-1)


def token_count(mask, num_items):
    """num_items when given, else the mask's tokens (at least 1)."""
    if num_items is not None:
        return num_items
    return mask.sum().clamp(min=1.0)


def minibatch_tokens(mask, truncated=None):
    """The minibatch's unmasked completion tokens on all ranks / W.

    (N, T) this rank's mask, and its (N,) truncated sequences, which leave the
    loss -> a scalar tensor, the same on every rank (a collective). DDP averages
    gradients over the W ranks, so a rank's token sum divided by this comes out,
    after the average, as the token mean over every rank's tokens (TRL's
    num_items_in_batch).
    """
    tokens = kept_mask(mask, truncated).sum().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tokens)

    # --mask-truncated can leave a minibatch with no kept token. Its loss is
    # then 0, not 0 / 0 = NaN.
    tokens = tokens.clamp(min=1.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        tokens = tokens / dist.get_world_size()
    return tokens


def entropy_bonus(entropies, mask, entropy_coef, num_items=None):
    """entropy_coef * the mean per-token entropy, subtracted from the loss.

    The mean is over num_items tokens when given, else this batch's; the same
    for every loss type.
    """
    mask = mask.to(entropies.dtype)  # (B, T)
    return entropy_coef * (entropies * mask).sum() / token_count(mask, num_items)


# -----------------------------------------------------------------------------
# A micro-batch, from logits: the one entry point train.py calls

def policy_loss(logits, batch, settings, *, minibatch_size, minibatch_tokens, logps=None,
                entropies=None):
    """A micro-batch's share of the minibatch loss -> (loss, metrics).

    logits (n, T, V) predict batch.completion_ids (n, T); batch is the
    micro-batch's rows (batch.UpdateBatch). logps (n, T), the current
    log-probs (the torch path's; the kernel computes its own), and entropies
    (n, T), the policy's entropy at each token: the caller's where it has them
    (train.py's forward), else computed here from the logits, the entropies
    only for the bonus (entropy_coef != 0; given, they are logged either way).
    logits may be None where the loss needs nothing else: the torch path given
    logps, and entropies for a bonus (train.py's fused LM head on the CPU,
    fast/update.py's completion_logps). minibatch_size: the minibatch's
    sequences on this rank; minibatch_tokens: minibatch_tokens(its mask,
    truncated). The loss is for .backward(); the metrics are floats named the
    same whichever path ran: loss_metrics's, each knob's (policy_weight),
    "loss" (this share) and "tokens".
    """
    s = settings
    ids = batch.completion_ids  # (n, T)
    mask = batch.completion_mask  # (n, T)
    counted = mask * row_weights(batch.counts)  # (n, T): each row as often as it stands for

    # 1) the current log-probs and entropies, unless given; the kernel computes
    # its own log-probs
    if logits is None and (s.impl != "torch" or (s.entropy_coef and entropies is None)):
        raise ValueError("policy_loss: log-probs alone serve the torch path (with the "
                         "entropies for an entropy bonus); pass the logits")
    if s.entropy_coef and entropies is None:
        entropies = entropy_from_logits(logits, s.temperature)  # (n, T)
    current = None  # constant: the off-policy mask's, and the IS ratio's on-policy
    if s.impl == "torch":
        if logps is None:
            logps = selective_log_softmax(logits, ids, s.temperature)  # (n, T)
        current = logps.detach()
    on_policy = batch.old_logps is None
    needs_current = s.off_policy_mask is not None or (s.is_correction != "off" and on_policy)
    if current is None and needs_current:  # the kernel path has none: one more pass
        current = selective_log_softmax(logits.detach(), ids, s.temperature)  # (n, T)

    # 2) w_t, the knobs' constant weight on pg_t (variants/token_weights.py): 1,
    # and no metrics, with every knob off
    weight, is_weight, knob_stats = None, None, {}
    if (s.is_correction != "off" or s.off_policy_mask is not None
            or batch.truncated is not None or batch.high_entropy is not None):
        from variants.token_weights import policy_weight
        ratio_old_logps = current if on_policy else batch.old_logps
        weight, is_weight, knob_stats = policy_weight(batch, ratio_old_logps, current, s)

    # 3) the loss of this micro-batch's rows, as a share of the minibatch's
    if s.impl == "torch":
        loss, metrics = grpo_loss(
            logps, batch.old_logps, batch.ref_logps, batch.advantages, mask, s,
            entropies=entropies, token_weight=weight, is_weight=is_weight,
            truncated=batch.truncated, counts=batch.counts, num_items=minibatch_tokens,
            num_sequences=minibatch_size)
    else:  # the fused kernel: Triton, imported only on this path
        from kernels.fused_loss import fused_loss
        loss, metrics = fused_loss(logits, batch, s, weight, entropies, minibatch_size,
                                   minibatch_tokens)

    # 4) the metrics
    if knob_stats:
        metrics.update(token_stats(counted, knob_stats))
    metrics["loss"] = loss.item()
    metrics["tokens"] = counted.sum().item()
    return loss, metrics
