"""
The GRPO policy loss of a micro-batch, from logits: the PyTorch reference
(grpo_loss), and the entry point train.py calls whichever path runs
(policy_loss). How the per-token terms add up: reduction.py.

Per completion token t of sequence i, with advantage A_i (advantage.py):

    ratio_t = exp(logp_t - old_logp_t)     (GSPO, arXiv 2507.18071: one per
              sequence, exp of the mean of its token log-ratios)
    pg_t    = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)
                                                grpo, bnpo, dr_grpo, dapo, luspo
              -sg(min(ratio_t, eps_high)) A_i logp_t   cispo
              -sigmoid(tau_i (ratio_t - 1)) 4 / tau_i A_i   sapo
              -sg(phi_i) A_i logp_t                    vespo
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1    (k3, always >= 0)
    loss_t  = pg_t * w_t + beta * kl_t
    loss    = reduce(loss_t over the kept tokens)
              - entropy_coef * (the mean entropy of the kept tokens)

The objectives and knobs:
- cispo (MiniMax-M1, arXiv 2506.13585) clips the IS weight, not the update
  (sg: a constant), so every token keeps a gradient. eps_high is the cap
  itself (5 in ScaleRL, arXiv 2510.13786).
- sapo (arXiv 2511.20347) is a soft gate, not a hard clip. tau_i is
  sapo_tau_pos (1.0) if A_i > 0, else sapo_tau_neg (1.05). At ratio 1 its
  gradient is grpo's.
- luspo (arXiv 2602.05261) is GSPO with each sequence's loss scaled by its
  length: reduction.py sums a sequence's tokens where grpo averages them. It
  needs importance_sampling_level="sequence".
- vespo (arXiv 2602.10693) reshapes instead of clipping: phi_i, a constant,
  is a Gamma-shaped function of the sequence's whole ratio W_i (the product
  of its token ratios, not GSPO's geometric mean). In log space, with TRL's
  clamps (get_gamma_weights; is_t: the IS weight, below):
    log W_i = clamp(sum_t clamp(logp_t - old_t, -20, 20)
                    + sum_t clamp(log is_t, log 1e-8, 20), log 1e-8, 20)
    phi_i   = exp(lambda + k log W_i - lambda W_i)   (= e^lambda W^k e^-lambda W;
              NaN and inf -> 0)
  k, lambda are vespo_k_pos, vespo_lambda_pos (2, 3) if A_i >= 0, else
  vespo_k_neg, vespo_lambda_neg (3, 2): phi(1) = 1, and it fades for W far
  from 1 on either side. is_t enters W_i instead of w_t, so only the token_*
  modes. Token-level ratio only; it reduces like dapo.
- delta (INTELLECT-2's two-sided clip, arXiv 2505.07291; not off_policy_mask's
  delta), for grpo's family and luspo:
  ratio_t -> min(ratio_t, delta) in the min's first term, after the clip's
  (TRL). delta must exceed 1 + eps_high, so where A_i >= 0 the clip binds
  first and nothing changes. Where A_i < 0 the loss stops at -delta A_i: a
  ratio above delta gets no gradient, where the plain clip lets it grow.
- kl_bias_correction (DeepSeek-V3.2, arXiv 2512.02556) uses kl_t * ratio_t.
  Its gradient is the unbiased reverse-KL gradient when the tokens come from
  the old policy.
- w_t is a constant on the policy term only: the product of these (each 1
  when off).
    is_t  is_correction, the sampler/trainer mismatch (Yao et al. 2025, "Your
          efficient RL framework secretly brings you off-policy RL training";
          TRL's vLLM importance sampling). The ratio is
          r = exp(old_t - sampling_t)           "token_*", or
          r = exp(sum_t (old_t - sampling_t))   "sequence_*".
          "*_truncate" uses clip(r, is_min, is_max); "*_mask" uses r inside
          [is_min, is_max], else 0. vespo takes it into W_i instead.
    op_i  off_policy_mask delta (DeepSeek-V3.2, eq. 9): 0 for a sequence with
          A_i < 0 whose sampled KL(sampler || policy), the mean over t of
          (sampling_t - logp_t), exceeds delta.
    h_t   high_entropy (arXiv 2506.01939): 1 for the top-rho share of the
          step's tokens by entropy, over all ranks (batch.py), 0 for the rest.
- The kept tokens are the completion mask minus the truncated completions
  (mask_truncated, DAPO, arXiv 2503.14476). Those leave the loss, its KL, the
  entropy bonus and the normaliser.

Which path runs (kernels.choose_impl says why):
- impl="torch": model.selective_log_softmax, then grpo_loss below. The
  reference.
- impl="triton": kernels/grpo.py, the same per-token loss fused in one pass
  over the logits. It has delta, the KL correction and every objective but
  vespo, and the token-level ratio only (so no luspo). w_t and the kept
  tokens come from here.

Truncated sampling (--top-k, --top-p, --min-p; TRL issue #6789): the logits
arrive here already FILTERED outside the sampler's kept set
(model.truncate_logits, in train.py), as do old_logps and ref_logps. So every
log-prob, and with them the ratio, the IS weight, the off-policy mask, the
entropies and the KL, is over the truncated, renormalized distribution the
sampler drew from: both paths unchanged. The repetition penalty is not
replayed (model.py).

Tests: python -m pytest -q tests/test_loss.py tests/test_kernel.py

Simplifications:
1. old_logps=None means on-policy (one update per generation). The ratio is 1
   in value but keeps its gradient (logp - logp.detach()), so the loss is the
   plain policy gradient.
2. The KL term needs ref_logps only when beta != 0. w_t never weighs it.
3. Metrics are masked token means over the completion tokens, truncated ones
   too, in one sync. frac_* are a mask's shares. On-policy, the IS ratio uses
   the current log-probs; the off-policy mask always does.
"""
import dataclasses
import math

import torch

from config import CLIPPED_LOSS_TYPES, IS_CORRECTIONS, IS_LEVELS
from metrics import token_stats
from model import entropy_from_logits, selective_log_softmax
from reduction import (REDUCTION, check_reduction, entropy_bonus, kept_mask, reduce_loss,
                       row_weights)


IMPLS = ("torch", "triton")


def choose_impl(loss_impl, device, importance_sampling_level="token", loss_type="grpo"):
    """--loss-impl "auto" | "torch" | "triton" -> (impl, why, for the start-up line).

    auto: the fused kernel on CUDA when the loss is token-level (the kernel has
    no GSPO, luspo or vespo); PyTorch on CPU, where Triton only interprets.
    """
    if loss_impl not in ("auto",) + IMPLS:
        raise ValueError(f"loss_impl={loss_impl!r}: choose one of {('auto',) + IMPLS}")

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

    train.py builds it once from the flags (config.py): each field is the flag
    of the same name.
    """

    loss_type: str = "grpo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2  # cispo: the weight's cap itself
    beta: float = 0.0  # the KL coefficient
    kl_bias_correction: bool = False
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    vespo_k_pos: float = 2.0  # vespo: phi's k and lambda for A >= 0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0  # and for A < 0
    vespo_lambda_neg: float = 2.0
    delta: float | None = None  # INTELLECT-2's cap on the ratio, > 1 + epsilon_high
    entropy_coef: float = 0.0
    temperature: float = 1.0  # the sampling temperature: logits / T
    importance_sampling_level: str = "token"  # "sequence": GSPO
    is_correction: str = "off"
    is_min: float = 0.0
    is_max: float = 3.0
    off_policy_mask: float | None = None  # delta
    max_completion_length: int | None = None  # dr_grpo's normaliser
    impl: str = "torch"  # or "triton": kernels/grpo.py

    def __post_init__(self):
        if self.loss_type not in REDUCTION:
            raise ValueError(f"loss_type={self.loss_type!r}: choose one of {tuple(REDUCTION)}")

        level = self.importance_sampling_level
        if level not in IS_LEVELS:
            raise ValueError(f"importance_sampling_level={level!r}: choose one of {IS_LEVELS}")

        if self.is_correction not in IS_CORRECTIONS:
            raise ValueError(f"is_correction={self.is_correction!r}: choose one of "
                             f"{IS_CORRECTIONS}")

        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r}: choose one of {IMPLS} "
                             f"(choose_impl resolves 'auto')")

        if self.impl == "triton" and level != "token":
            raise ValueError("impl='triton' has the token-level ratio only; use impl='torch' "
                             "for importance_sampling_level='sequence'")

        if self.impl == "triton" and self.loss_type == "vespo":
            raise ValueError("impl='triton' has no per-sequence weight: use impl='torch' for "
                             "loss_type='vespo'")

        if self.loss_type == "luspo" and level != "sequence":
            raise ValueError("loss_type='luspo' is GSPO's sequence-level ratio, weighed by "
                             "length: set importance_sampling_level='sequence'")

        if self.loss_type == "vespo" and level != "token":
            raise ValueError("loss_type='vespo' builds its sequence weight from the token "
                             "ratios: set importance_sampling_level='token'")

        if self.loss_type == "vespo" and self.is_correction.startswith("sequence"):
            raise ValueError(f"loss_type='vespo' adds the token IS ratios to its sequence "
                             f"ratio: use a token_* is_correction, not {self.is_correction!r}")

        vespo = (self.vespo_k_pos, self.vespo_lambda_pos, self.vespo_k_neg,
                 self.vespo_lambda_neg)
        if not all(x > 0 for x in vespo):
            raise ValueError(f"vespo's k and lambda must be > 0, got {vespo}")

        if self.delta is not None and self.loss_type not in CLIPPED_LOSS_TYPES:
            raise ValueError(f"delta caps the clipped ratio, and loss_type={self.loss_type!r} "
                             f"has no clip: use one of {CLIPPED_LOSS_TYPES}, or delta=None")

        if self.delta is not None and not self.delta > 1 + self.epsilon_high:
            raise ValueError(f"delta={self.delta} caps the ratio where A < 0 above the clip: "
                             f"it must be > 1 + epsilon_high = {1 + self.epsilon_high}")


# -----------------------------------------------------------------------------
# The per-token terms

def surrogate(ratio, logps, A, settings, phi=None):
    """pg_t of settings.loss_type.

    ratio, logps (B, T), A (B, 1), phi (B, 1): vespo's weight (vespo_weight) ->
    ((B, T) per-token policy loss, clip_low, clip_high). The clip masks are
    (B, T) bool or None: the tokens each clip bound holds (of the ratio before
    delta's cap, which with delta > 1 + eps_high are TRL's).
    """
    s = settings

    if s.loss_type == "vespo":  # a constant weight per sequence, like cispo's per token
        return -phi * A * logps, None, None

    if s.loss_type == "cispo":  # the weight is capped, the token keeps its gradient
        capped = torch.clamp(ratio, max=s.epsilon_high).detach()  # (B, T)
        return -capped * A * logps, None, ratio > s.epsilon_high

    if s.loss_type == "sapo":  # the gradient fades smoothly as the ratio leaves 1
        tau = torch.full_like(A, s.sapo_tau_neg).masked_fill(A > 0, s.sapo_tau_pos)  # (B, 1)
        return -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A, None, None

    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)  # (B, T)
    capped_ratio = ratio
    if s.delta is not None:  # INTELLECT-2's two-sided clip: binds where A < 0
        capped_ratio = torch.clamp(ratio, max=s.delta)  # (B, T)
    per_token = -torch.min(capped_ratio * A, clipped_ratio * A)  # (B, T)
    # clipped from below: the gradient is 0
    clip_low = (ratio < 1 - s.epsilon_low) & (A < 0)  # (B, T)
    # clipped from above
    clip_high = (ratio > 1 + s.epsilon_high) & (A > 0)  # (B, T)
    return per_token, clip_low, clip_high


def _stats(loss_type, clip_low, clip_high, ratio, kl, entropies, phi=None):
    """The metrics both paths log, as (B, T) tensors.

    Both bounds of the hard clip (cispo: its capped weights; sapo has no clip;
    vespo: phi_i's mean), ratio_mean, and kl and entropy when there are any.
    """
    stats = {}
    if loss_type == "cispo":
        stats = {"clip_high": clip_high}
    elif loss_type == "vespo":  # a token mean, as every metric here (TRL's: a sequence mean)
        stats = {"vespo_phi_mean": phi.expand_as(ratio)}
    elif loss_type != "sapo":
        stats = {"clip_low": clip_low, "clip_high": clip_high, "clip_region": clip_low | clip_high}

    stats["ratio_mean"] = ratio
    if kl is not None:
        stats["kl"] = kl
    if entropies is not None:
        stats["entropy"] = entropies
    return stats


def importance_weight(old_logps, sampling_logps, mask, mode, is_min=0.0, is_max=3.0):
    """is_t, the sampler-vs-trainer correction of mode (IS_CORRECTIONS).

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


@torch.no_grad()
def vespo_weight(log_ratio, mask, A, is_weight, settings):
    """phi_i, VESPO's Gamma weight of the sequence ratio: TRL's get_gamma_weights.

    log_ratio (B, T): logp - old_logp per token; mask (B, T); A (B, 1);
    is_weight (B, T): is_t (importance_weight), or None when IS is off.
    -> (B, 1), a constant (no gradient).
    """
    s = settings
    mask = mask.to(log_ratio.dtype)  # (B, T)
    # the floor of log W: TRL's, which is the original's W.clamp(min=1e-8)
    lowest = math.log(1e-8)

    # log W = sum_t log(pi / old) + sum_t log is_t: the sequence's product of ratios
    token_log_ratio = torch.clamp(log_ratio, -20.0, 20.0)  # (B, T)
    log_w = (token_log_ratio * mask).sum(-1, keepdim=True)  # (B, 1)
    if is_weight is not None:
        # TRL sums over every position; * mask makes padding count for nothing
        # even when [is_min, is_max] leaves out its is_t = 1
        log_is = torch.clamp(torch.log(is_weight), lowest, 20.0)  # (B, T)
        log_w = log_w + (log_is * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(log_w, lowest, 20.0)  # (B, 1)

    # k and lambda by the advantage's sign, in log_w's dtype
    positive = A >= 0  # (B, 1)
    k = torch.full_like(log_w, s.vespo_k_neg).masked_fill(positive, s.vespo_k_pos)  # (B, 1)
    lam = torch.full_like(log_w, s.vespo_lambda_neg).masked_fill(positive, s.vespo_lambda_pos)
    lam = lam.clamp(min=1e-4)  # (B, 1)

    # log phi = lambda + k log W - lambda W
    log_phi = lam + k * log_w - lam * torch.exp(log_w)  # (B, 1)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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


def policy_weight(batch, ratio_old_logps, logps, settings):
    """w_t: the product of the knobs that reweigh or drop policy-gradient tokens.

    batch: a micro-batch (batch.UpdateBatch). ratio_old_logps: the IS ratio's
    old log-probs (the current ones on-policy); logps: the current ones,
    detached. -> ((B, T) constant weight, None with every knob off; (B, T) is_t
    for vespo, which takes it into phi_i instead of w_t, else None;
    {metric name: (B, T) tensor}, what each knob removes).
    """
    s = settings
    mask = batch.completion_mask  # (B, T)
    factors = []
    is_weight = None
    stats = {}

    if batch.truncated is not None:
        stats["frac_masked_truncated"] = batch.truncated.unsqueeze(-1).expand_as(mask)  # (B, T)

    if s.is_correction != "off":
        weight, ratio, outside = importance_weight(ratio_old_logps, batch.sampling_logps, mask,
                                                   s.is_correction, s.is_min, s.is_max)
        if s.loss_type == "vespo":  # into the sequence ratio W_i, not onto the loss (TRL)
            is_weight = weight
        else:
            factors.append(weight)
        if outside is not None:
            stats["frac_is_masked"] = outside
        stats["is_ratio_mean"] = ratio
        stats["is_ratio_max"] = ratio

    if s.off_policy_mask is not None:
        keep = off_policy_keep(batch.advantages, logps, batch.sampling_logps, mask,
                               s.off_policy_mask)  # (B,)
        factors.append(keep.to(mask.dtype).unsqueeze(-1).expand_as(mask))  # (B, T)
        stats["frac_off_policy_masked"] = ~keep.unsqueeze(-1).expand_as(mask)  # (B, T)

    if batch.high_entropy is not None:
        factors.append(batch.high_entropy.to(mask.dtype))  # (B, T)
        low_entropy = kept_mask(mask, batch.truncated) * ~batch.high_entropy  # (B, T)
        stats["frac_low_entropy"] = low_entropy

    weight = math.prod(factors) if factors else None
    return weight, is_weight, stats


def grpo_loss(logps, old_logps, ref_logps, advantages, mask, settings, *, entropies=None,
              token_weight=None, is_weight=None, truncated=None, counts=None,
              num_items=None, num_sequences=None):
    """The policy objective + k3 KL (- entropy bonus) -> (scalar loss, metrics).

    logps, old_logps, ref_logps, mask, entropies, token_weight and is_weight
    (vespo's is_t; both from policy_weight): (B, T). advantages, truncated
    (bool: leave the loss), counts (the rows each one stands for: unique_rows):
    (B,). num_sequences, num_items: the minibatch's, for one of its
    micro-batches (reduce_loss). The metrics are floats (token_stats).
    """
    s = settings
    check_reduction(s.loss_type, num_items, s.max_completion_length)
    if is_weight is not None and s.loss_type != "vespo":
        raise ValueError("is_weight is vespo's: pass the IS weight of other loss types "
                         "in token_weight")
    if s.beta != 0 and ref_logps is None:
        raise ValueError(f"beta={s.beta} needs ref_logps (the reference's log-probs), "
                         f"or set beta=0")
    if s.entropy_coef != 0 and entropies is None:
        raise ValueError(f"entropy_coef={s.entropy_coef} needs entropies "
                         f"(see entropy_from_logits)")

    # 1) the ratio: per token, or one per sequence (GSPO, eq. 7)
    mask = mask.to(logps.dtype)  # (B, T)
    old = logps.detach() if old_logps is None else old_logps  # (B, T)
    # 0 at masked tokens: there the fused head's log-probs are 0 (model.completion_logps)
    # and exp(0 - old) could overflow
    log_ratio = (logps - old) * mask  # (B, T)
    if s.importance_sampling_level == "sequence":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
        log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logps)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)

    # 2) the policy term, reweighed by w_t (a constant: no gradient)
    A = advantages.unsqueeze(-1)  # (B, 1)
    phi = None
    if s.loss_type == "vespo":  # one weight per sequence, from the token log-ratios
        phi = vespo_weight(log_ratio, mask, A, is_weight, s)  # (B, 1)
    per_token, clip_low, clip_high = surrogate(ratio, logps, A, s, phi)
    if token_weight is not None:
        per_token = per_token * token_weight

    # 3) the KL term: k3 (Schulman 2020, "Approximating KL divergence")
    kl = None
    if ref_logps is not None:
        delta = ref_logps - logps  # (B, T)
        kl = torch.exp(delta) - delta - 1  # (B, T)
        if s.beta != 0 and s.kl_bias_correction:
            per_token = per_token + s.beta * (kl * ratio)
        elif s.beta != 0:
            per_token = per_token + s.beta * kl

    # 4) reduce over the kept tokens; the bonus keeps the policy exploring
    kept = kept_mask(mask, truncated)  # (B, T)
    loss = reduce_loss(per_token, kept, s.loss_type, num_items, s.max_completion_length,
                       num_sequences, counts)
    w = row_weights(counts)  # (B, 1): weighs the bonus and the means
    if entropies is not None and s.entropy_coef != 0:
        loss = loss - entropy_bonus(entropies, kept * w, s.entropy_coef, num_items)

    stats = _stats(s.loss_type, clip_low, clip_high, ratio, kl, entropies, phi)
    return loss, token_stats(mask * w, stats)


# -----------------------------------------------------------------------------
# A micro-batch, from logits: the one entry point train.py calls

def policy_loss(logits, batch, settings, *, minibatch_size, minibatch_tokens, logps=None):
    """A micro-batch's share of the minibatch loss -> (loss, metrics).

    logits (n, T, V) predict batch.completion_ids (n, T); batch is the
    micro-batch's rows (batch.UpdateBatch). Or logits is None and logps (n, T)
    are the current log-probs, computed by the caller (train.py's fused LM
    head on the CPU, model.completion_logps): then the loss can need nothing
    else (the torch path, no entropy bonus). minibatch_size: the minibatch's
    sequences on this rank; minibatch_tokens: minibatch_tokens(its mask,
    truncated). The loss is for .backward(); the metrics are floats named the
    same whichever path ran: _stats's, each knob's (policy_weight), "loss" (this
    share) and "tokens".
    """
    s = settings
    check_reduction(s.loss_type, minibatch_tokens, s.max_completion_length)
    ids = batch.completion_ids  # (n, T)
    mask = batch.completion_mask  # (n, T)
    counted = mask * row_weights(batch.counts)  # (n, T): each row as often as it stands for

    # 1) the current log-probs; the kernel computes its own
    if logits is None and (s.impl != "torch" or s.entropy_coef):
        raise ValueError("policy_loss: log-probs alone serve the torch path without "
                         "an entropy bonus; pass the logits")
    entropies = None
    if s.entropy_coef:
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

    # 2) w_t, the knobs' weight
    ratio_old_logps = current if on_policy else batch.old_logps
    weight, is_weight, knob_stats = policy_weight(batch, ratio_old_logps, current, s)

    # 3) the loss of this micro-batch's rows, as a share of the minibatch's
    if s.impl == "torch":
        loss, metrics = grpo_loss(
            logps, batch.old_logps, batch.ref_logps, batch.advantages, mask, s,
            entropies=entropies, token_weight=weight, is_weight=is_weight,
            truncated=batch.truncated, counts=batch.counts, num_items=minibatch_tokens,
            num_sequences=minibatch_size)
    else:
        loss, metrics = _fused_loss(logits, batch, s, weight, entropies,
                                    minibatch_size, minibatch_tokens)

    # 4) the metrics
    if knob_stats:
        metrics.update(token_stats(counted, knob_stats))
    metrics["loss"] = loss.item()
    metrics["tokens"] = counted.sum().item()
    return loss, metrics


def _fused_loss(logits, batch, settings, weight, entropies, minibatch_size, minibatch_tokens):
    """policy_loss's impl="triton" path: the kernel's per-token loss, reduced here.

    The entropy bonus is added here as a token mean, whatever the loss type.
    -> (loss, metrics).
    """
    from kernels import FusedLossOptions, fused_grpo_token_loss  # Triton: only on this path

    s = settings
    objective = s.loss_type if s.loss_type in ("cispo", "sapo") else "clip"
    options = FusedLossOptions(
        temperature=s.temperature,
        epsilon_low=s.epsilon_low,
        epsilon_high=s.epsilon_high,
        beta=s.beta,
        kl_bias_correction=s.kl_bias_correction,
        sapo_tau_pos=s.sapo_tau_pos,
        sapo_tau_neg=s.sapo_tau_neg,
        delta=s.delta,
        objective=objective,
        entropy_coef=0.0,
    )
    # (n, T) each, detached, 0 at masked tokens
    per_token, logps, stats = fused_grpo_token_loss(
        logits, batch.completion_ids, batch.advantages, batch.completion_mask, batch.old_logps,
        batch.ref_logps, token_weight=weight, options=options)

    kept = kept_mask(batch.completion_mask, batch.truncated)  # (n, T)
    loss = reduce_loss(per_token, kept, s.loss_type, minibatch_tokens, s.max_completion_length,
                       minibatch_size, batch.counts)
    counted = batch.completion_mask * row_weights(batch.counts)  # (n, T)
    if entropies is not None:
        bonus_mask = kept_mask(counted, batch.truncated)  # (n, T)
        loss = loss - entropy_bonus(entropies, bonus_mask, s.entropy_coef, minibatch_tokens)

    fused = _fused_stats(s.loss_type, logps, batch.old_logps, batch.ref_logps,
                         batch.completion_mask, stats, entropies)
    return loss, token_stats(counted, fused)


@torch.no_grad()
def _fused_stats(loss_type, logps, old_logps, ref_logps, mask, stats, entropies):
    """The kernel path's _stats, from its detached logps (0 at masked tokens)."""
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
