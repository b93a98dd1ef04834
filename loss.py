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
  sapo_tau's first (1.0) if A_i > 0, else its second (1.05). At ratio 1 its
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
  k, lambda are the first of vespo_k, vespo_lambda (2, 3) if A_i >= 0, else
  the second (3, 2): phi(1) = 1, and it fades for W far
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

The settings: one frozen LossSettings a run, each field the flag of its name
(LossSettings.from_flags). The rules between them are check_settings's, which
config.check_flags runs on the flags; the loss itself checks only what a call
passes it (reduce_loss the normaliser, once a micro-batch).

Which path runs (choose_impl says why):
- impl="torch": model.selective_log_softmax, then grpo_loss below. The
  reference.
- impl="triton": kernels/grpo.py, the same per-token loss fused in one pass
  over the logits, from the same LossSettings. It has delta, the KL
  correction and every objective but vespo, and the token-level ratio only
  (so no luspo). w_t and the kept tokens come from here.

Truncated sampling (--top-k, --top-p, --min-p; TRL issue #6789): the logits
arrive here already FILTERED outside the sampler's kept set
(model.truncate_logits, in train.py), as do old_logps and ref_logps. So every
log-prob, and with them the ratio, the IS weight, the off-policy mask, the
entropies and the KL, is over the truncated, renormalized distribution the
sampler drew from: both paths unchanged. The repetition penalty is not
replayed (model.py).

In the code, grpo_loss reads as the math above: the ratio, pg_t (clipped, the
default, or the loss type's own: SURROGATES), w_t, kl_t, the reduction.
policy_weight builds w_t, one function per knob, each skipped when off.

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_rows.py
tests/test_loss_knobs.py tests/test_kernel.py

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
from runlog.metrics import token_stats
from model import entropy_from_logits, selective_log_softmax
from reduction import entropy_bonus, kept_mask, reduce_loss, row_weights


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

    Each field but impl is the flag of its name (config.py): train.py builds
    it with from_flags, which lists no field. The rules between the fields:
    check_settings.
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
    impl: str = "torch"  # or "triton": kernels/grpo.py (choose_impl, from --loss-impl)

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


def check_settings(settings):
    """ValueError, one line, at the first rule between the settings that they break.

    The one place these rules live: config.check_flags runs them on train.py's
    flags (so their words are the flags'), and a caller that builds LossSettings
    itself runs them once, at set-up. The values the flags' parser refuses are
    refused here too where a wrong one would not fail on its own (an unknown
    loss_type does: grpo_loss's SURROGATES, reduce_loss's check_reduction).
    """
    s = settings
    level = s.importance_sampling_level
    vespo = (*s.vespo_k, *s.vespo_lambda)

    # argparse's choices and ranges, for a caller that builds the settings itself
    choices = [
        (level in IS_LEVELS, f"importance_sampling_level={level!r}: choose one of {IS_LEVELS}"),
        (s.is_correction in IS_CORRECTIONS,
         f"is_correction={s.is_correction!r}: choose one of {IS_CORRECTIONS}"),
        (s.impl in IMPLS, f"impl={s.impl!r}: choose one of {IMPLS} (choose_impl resolves 'auto')"),
        (all(x > 0 for x in vespo), f"vespo's k and lambda must be > 0, got {vespo}"),
    ]

    # the rules between the settings
    rules = [
        (s.loss_type != "luspo" or level == "sequence",
         "--loss-type luspo is GSPO's sequence ratio, weighed by length: add "
         "--importance-sampling-level sequence"),
        (s.loss_type != "vespo" or level == "token",
         "--loss-type vespo builds its sequence weight from the token ratios: drop "
         "--importance-sampling-level sequence"),
        (s.loss_type != "vespo" or not s.is_correction.startswith("sequence"),
         f"--loss-type vespo adds the token IS ratios to its sequence ratio: use "
         f"--is-correction {s.is_correction.replace('sequence', 'token')}"),
        (s.impl != "triton" or level != "sequence",
         "--loss-impl triton supports --importance-sampling-level token only; "
         "use --loss-impl torch"),
        (s.impl != "triton" or s.loss_type != "vespo",
         "--loss-impl triton has no per-sequence weight for --loss-type vespo: "
         "use --loss-impl torch"),
        (s.delta is None or s.loss_type not in CLIPPED_LOSS_TYPES
         or s.delta > 1 + s.epsilon_high,
         f"--delta {s.delta} caps the ratio where A < 0 above the clip: give "
         f"--delta > 1 + --epsilon-high = {1 + s.epsilon_high:g} (INTELLECT-2: 4)"),
        (s.loss_type != "cispo" or s.epsilon_high >= 1,
         "--loss-type cispo caps the IS weight at --epsilon-high itself: "
         "give a cap >= 1 (e.g. 5)"),
        (s.is_min <= s.is_max,
         f"--is-min {s.is_min} must be <= --is-max {s.is_max}"),
    ]
    for ok, msg in choices + rules:
        if not ok:
            raise ValueError(msg)


# -----------------------------------------------------------------------------
# pg_t: the policy objective of each loss type (SURROGATES)
#
# Each takes ratio (B, T), logps (B, T), A (B, 1), the settings and phi (B, 1),
# vespo's weight (None for the others), and returns ((B, T) pg_t, {metric name:
# (B, T) tensor}): its own metrics, the clip shares where it clips.

def clipped(ratio, logps, A, settings, phi):
    """PPO's clipped surrogate, the default: grpo, bnpo, dr_grpo, dapo, luspo.

    pg_t = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i),
    with ratio_t -> min(ratio_t, delta) in the first term when delta is set.
    The metrics: the tokens each clip bound holds (of the ratio before delta's
    cap, which with delta > 1 + eps_high are TRL's). logps, phi: unused.
    """
    s = settings
    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)  # (B, T)
    capped_ratio = ratio
    if s.delta is not None:  # INTELLECT-2's two-sided clip: binds where A < 0
        capped_ratio = torch.clamp(ratio, max=s.delta)  # (B, T)
    per_token = -torch.min(capped_ratio * A, clipped_ratio * A)  # (B, T)

    # clipped from below: the gradient is 0
    clip_low = (ratio < 1 - s.epsilon_low) & (A < 0)  # (B, T)
    # clipped from above
    clip_high = (ratio > 1 + s.epsilon_high) & (A > 0)  # (B, T)
    stats = {"clip_low": clip_low, "clip_high": clip_high, "clip_region": clip_low | clip_high}
    return per_token, stats


def cispo(ratio, logps, A, settings, phi):
    """pg_t = -sg(min(ratio_t, eps_high)) A_i logp_t.

    The weight is capped, the token keeps its gradient. clip_high: the tokens
    whose weight the cap holds. phi: unused.
    """
    s = settings
    capped = torch.clamp(ratio, max=s.epsilon_high).detach()  # (B, T)
    per_token = -capped * A * logps  # (B, T)
    return per_token, {"clip_high": ratio > s.epsilon_high}


def sapo(ratio, logps, A, settings, phi):
    """pg_t = -sigmoid(tau_i (ratio_t - 1)) 4 / tau_i A_i.

    The gradient fades smoothly as the ratio leaves 1: no clip, so no metric.
    logps, phi: unused.
    """
    tau_pos, tau_neg = settings.sapo_tau
    tau = torch.full_like(A, tau_neg).masked_fill(A > 0, tau_pos)  # (B, 1)
    per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A  # (B, T)
    return per_token, {}


def vespo(ratio, logps, A, settings, phi):
    """pg_t = -sg(phi_i) A_i logp_t.

    phi_i (vespo_weight, grpo_loss builds it) is a constant weight per
    sequence, as cispo's is per token. vespo_phi_mean: a token mean, as every
    metric here (TRL's: a sequence mean).
    """
    per_token = -phi * A * logps  # (B, T)
    return per_token, {"vespo_phi_mean": phi.expand_as(ratio)}


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
    k_pos, k_neg = s.vespo_k
    lambda_pos, lambda_neg = s.vespo_lambda
    k = torch.full_like(log_w, k_neg).masked_fill(positive, k_pos)  # (B, 1)
    lam = torch.full_like(log_w, lambda_neg).masked_fill(positive, lambda_pos)
    lam = lam.clamp(min=1e-4)  # (B, 1)

    # log phi = lambda + k log W - lambda W
    log_phi = lam + k * log_w - lam * torch.exp(log_w)  # (B, 1)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# pg_t by loss type: the clipped surrogate for GRPO's family (luspo differs only
# in its ratio and its reduction), each other objective its own
SURROGATES = {
    "grpo": clipped,
    "bnpo": clipped,
    "dr_grpo": clipped,
    "dapo": clipped,
    "luspo": clipped,
    "cispo": cispo,
    "sapo": sapo,
    "vespo": vespo,
}


def _stats(objective_stats, ratio, kl, entropies):
    """The metrics both paths log, as (B, T) tensors: the objective's own
    (SURROGATES), ratio_mean, and kl and entropy when there are any."""
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

    logps, old_logps, ref_logps, mask, entropies, token_weight and is_weight
    (vespo's is_t; both from policy_weight): (B, T). advantages, truncated
    (bool: leave the loss), counts (the rows each one stands for: unique_rows):
    (B,). num_sequences, num_items: the minibatch's, for one of its
    micro-batches (reduce_loss, which refuses a loss type's missing normaliser).
    The metrics are floats (token_stats).
    """
    s = settings
    if s.loss_type not in SURROGATES:
        raise ValueError(f"loss_type={s.loss_type!r}: choose one of {tuple(SURROGATES)}")
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
    # 0 at masked tokens: there the fused head's log-probs are 0
    # (fast/update.py's completion_logps) and exp(0 - old) could overflow
    log_ratio = (logps - old) * mask  # (B, T)
    if s.importance_sampling_level == "sequence":
        seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
        log_ratio = seq_log_ratio.unsqueeze(-1).expand_as(logps)  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)

    # 2) pg_t: PPO's clipped surrogate for grpo's family (clipped), else the loss
    # type's own (SURROGATES); then w_t, a constant (no gradient)
    A = advantages.unsqueeze(-1)  # (B, 1)
    phi = None
    if s.loss_type == "vespo":  # one weight per sequence, from the token log-ratios
        phi = vespo_weight(log_ratio, mask, A, is_weight, s)  # (B, 1)
    per_token, objective_stats = SURROGATES[s.loss_type](ratio, logps, A, s, phi)  # (B, T)
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
    loss = reduce_loss(per_token, kept, s.loss_type, num_items, s.max_new_tokens,
                       num_sequences, counts)
    w = row_weights(counts)  # (B, 1): weighs the bonus and the means
    if entropies is not None and s.entropy_coef != 0:
        loss = loss - entropy_bonus(entropies, kept * w, s.entropy_coef, num_items)

    stats = _stats(objective_stats, ratio, kl, entropies)
    return loss, token_stats(mask * w, stats)


# -----------------------------------------------------------------------------
# w_t: the knobs that reweigh or drop policy-gradient tokens (policy_weight)
#
# Each knob's function returns (factor, metrics): its (B, T) factor of w_t, or
# None where it adds none, and {metric name: (B, T) tensor}, what it removes.

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
    same whichever path ran: _stats's, each knob's (policy_weight), "loss" (this
    share) and "tokens".
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

    The entropy bonus is added here as a token mean, whatever the loss type
    (the kernel's own per-token entropy term stays off). -> (loss, metrics).
    """
    from kernels import fused_grpo_token_loss  # Triton: only on this path

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

    # the kernel's clip masks, named as the loss type's function in SURROGATES names them
    clip_low = stats["is_clipped_low"]  # (n, T)
    clip_high = stats["is_clipped_high"]  # (n, T): cispo's capped weights
    if loss_type == "cispo":
        objective_stats = {"clip_high": clip_high}
    elif loss_type == "sapo":
        objective_stats = {}
    else:  # clipped
        objective_stats = {"clip_low": clip_low, "clip_high": clip_high,
                           "clip_region": clip_low | clip_high}
    return _stats(objective_stats, ratio, kl, entropies)
