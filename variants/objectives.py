"""The policy objectives other than PPO's clip (loss.clipped), the default: one
function each, listed in OBJECTIVES; GSPO's sequence ratio; --delta's cap on
the clip. loss.grpo_loss imports this file only when --loss-type, --delta or
--importance-sampling-level sequence asks for it.

Per completion token t of sequence i, with advantage A_i and ratio_t (loss.py),
sg() a constant (no gradient):

    cispo    pg_t = -sg(min(ratio_t, eps_high)) A_i logp_t
    sapo     pg_t = -sigmoid(tau_i (ratio_t - 1)) 4 / tau_i A_i
    vespo    pg_t = -sg(phi_i) A_i logp_t
    --delta  pg_t = -min(min(ratio_t, delta) A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)

and, with --importance-sampling-level sequence (GSPO, arXiv 2507.18071; luspo),
one ratio per sequence instead of ratio_t: the exp of the mean of its token
log-ratios (sequence_log_ratio).

Each has the signature of loss.clipped: (ratio (B, T), logps (B, T), A (B, 1),
settings, phi (B, 1) or None) -> ((B, T) pg_t, {metric name: (B, T) tensor}).
How each loss type reduces: variants/reductions.py. The fused kernel
(kernels/grpo.py) has cispo, sapo and --delta, token-level only.

--kl-bias-correction (DeepSeek-V3.2, arXiv 2512.02556) stays in loss.grpo_loss,
one line of its KL term: kl_t -> kl_t * ratio_t. Its gradient is the unbiased
reverse-KL gradient when the tokens come from the old policy.

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_rows.py tests/test_kernel.py
"""
import math

import torch

from config import CLIPPED_LOSS_TYPES
from loss import clip_stats


def sequence_log_ratio(log_ratio, mask):
    """GSPO (arXiv 2507.18071, eq. 7): one log-ratio per sequence, the mean of
    its token log-ratios, on each of its tokens.

    luspo (arXiv 2602.05261) is GSPO with each sequence's loss scaled by its
    length: variants/reductions.py sums a sequence's tokens where grpo averages
    them. It needs importance_sampling_level="sequence" (config.check_loss_settings).

    log_ratio (B, T), 0 at masked tokens; mask (B, T) -> (B, T).
    """
    seq_log_ratio = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return seq_log_ratio.unsqueeze(-1).expand_as(log_ratio)  # (B, T)


def clipped_delta(ratio, logps, A, settings, phi):
    """--delta: INTELLECT-2's two-sided clip (arXiv 2505.07291; not
    --off-policy-mask's delta), for grpo's family and luspo.

    ratio_t -> min(ratio_t, delta) in the min's first term, after the clip's
    (TRL). delta must exceed 1 + eps_high, so where A_i >= 0 the clip binds
    first and nothing changes. Where A_i < 0 the loss stops at -delta A_i: a
    ratio above delta gets no gradient, where the plain clip lets it grow. The
    metrics: loss.clipped's, of the ratio before delta's cap (which with
    delta > 1 + eps_high are TRL's). logps, phi: unused.
    """
    s = settings
    clipped_ratio = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)  # (B, T)
    capped_ratio = torch.clamp(ratio, max=s.delta)  # (B, T)
    per_token = -torch.min(capped_ratio * A, clipped_ratio * A)  # (B, T)
    return per_token, clip_stats(ratio, A, s)


def cispo(ratio, logps, A, settings, phi):
    """cispo (MiniMax-M1, arXiv 2506.13585): pg_t = -sg(min(ratio_t, eps_high)) A_i logp_t.

    It clips the IS weight, not the update, so every token keeps a gradient.
    eps_high is the cap itself (5 in ScaleRL, arXiv 2510.13786). clip_high: the
    tokens whose weight the cap holds. phi: unused.
    """
    s = settings
    capped = torch.clamp(ratio, max=s.epsilon_high).detach()  # (B, T)
    per_token = -capped * A * logps  # (B, T)
    return per_token, {"clip_high": ratio > s.epsilon_high}


def sapo(ratio, logps, A, settings, phi):
    """sapo (arXiv 2511.20347): pg_t = -sigmoid(tau_i (ratio_t - 1)) 4 / tau_i A_i.

    A soft gate, not a hard clip: the gradient fades smoothly as the ratio
    leaves 1, and at ratio 1 it is grpo's. tau_i is sapo_tau's first (1.0) if
    A_i > 0, else its second (1.05). No clip, so no metric. logps, phi: unused.
    """
    tau_pos, tau_neg = settings.sapo_tau
    tau = torch.full_like(A, tau_neg).masked_fill(A > 0, tau_pos)  # (B, 1)
    per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * A  # (B, T)
    return per_token, {}


def vespo(ratio, logps, A, settings, phi):
    """vespo (arXiv 2602.10693): pg_t = -sg(phi_i) A_i logp_t.

    It reshapes instead of clipping: phi_i (vespo_weight) is a constant weight
    per sequence, as cispo's is per token. vespo_phi_mean: a token mean, as
    every metric here (TRL's: a sequence mean).
    """
    per_token = -phi * A * logps  # (B, T)
    return per_token, {"vespo_phi_mean": phi.expand_as(ratio)}


@torch.no_grad()
def vespo_weight(log_ratio, mask, A, is_weight, settings):
    """phi_i, VESPO's Gamma weight of the sequence ratio: TRL's get_gamma_weights.

    phi_i is a Gamma-shaped function of the sequence's whole ratio W_i (the
    product of its token ratios, not GSPO's geometric mean). In log space, with
    TRL's clamps (is_t: the IS weight, variants/token_weights.py):

        log W_i = clamp(sum_t clamp(logp_t - old_t, -20, 20)
                        + sum_t clamp(log is_t, log 1e-8, 20), log 1e-8, 20)
        phi_i   = exp(lambda + k log W_i - lambda W_i)   (= e^lambda W^k e^-lambda W;
                  NaN and inf -> 0)

    k, lambda are the first of vespo_k, vespo_lambda (2, 3) if A_i >= 0, else
    the second (3, 2): phi(1) = 1, and it fades for W far from 1 on either side.
    is_t enters W_i instead of w_t, so only the token_* modes. Token-level
    ratio only; it reduces like dapo.

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


# pg_t by name: a loss type's, or "delta" for grpo's family with --delta
OBJECTIVES = {
    "delta": clipped_delta,
    "cispo": cispo,
    "sapo": sapo,
    "vespo": vespo,
}


def variant_objective(ratio, logps, A, settings, log_ratio, mask, is_weight):
    """pg_t of the settings' objective (OBJECTIVES) -> ((B, T) pg_t, metrics).

    ratio, logps, A, settings: as every objective takes them. log_ratio,
    mask (B, T) and is_weight (B, T) or None: vespo's, for phi_i (vespo_weight).
    """
    s = settings
    name = "delta" if s.loss_type in CLIPPED_LOSS_TYPES else s.loss_type
    phi = None
    if name == "vespo":  # one weight per sequence, from the token log-ratios
        phi = vespo_weight(log_ratio, mask, A, is_weight, s)  # (B, 1)
    return OBJECTIVES[name](ratio, logps, A, s, phi)
