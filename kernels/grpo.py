"""
The GRPO per-token loss fused into one Triton kernel per direction: logits in,
loss and dlogits out.

The (B, T, V) logits are the only big tensor of the policy update. bf16 logits
for 32k tokens of Qwen's V = 151,936 take 10 GB, and a plain log_softmax adds
an fp32 copy of 20 GB: the usual GRPO OOM. Liger-Kernel's triton_grpo_loss
fuses it the same way. Each program walks one row of V logits with an online
log-sum-exp (Milakov & Gimelshein 2018), keeping O(1) numbers per row. The
backward recomputes the softmax from them. Extra memory: O(B*T);
inplace_backward writes dlogits in place.

Forward, per unmasked token (b, t), with x = logits[b, t] (raw), id = ids[b, t]
and T = the temperature. One pass over V in blocks, in fp32:

    m     = max_v x_v,  d_v = (x_v - m) / T,  s = sum_v exp(d_v)
    logp  = d_id - log s                  (= log_softmax(x / T)[id])
    ratio = exp(logp - old_logp)          (exactly 1 without old_logps)
    pg    = w * objective                 (loss.py's pg_t; w = token_weight or 1)
            "clip"   (every loss type but cispo and sapo)
                     -min(r1 * A_b, clamp(ratio, 1 - eps_low, 1 + eps_high) * A_b),
                     r1 = min(ratio, delta) with delta (INTELLECT-2), else ratio
            "cispo"  -sg(min(ratio, eps_high)) * A_b * logp
            "sapo"   -sigmoid(tau (ratio - 1)) * 4 / tau * A_b,
                     tau = tau_pos if A_b > 0 else tau_neg  (sapo_tau)
    kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1
            (k3, if beta; kl_bias_correction: * ratio)
    H     = log s - mu,  mu = sum_v p_v d_v,  p = softmax(x / T)
            (when the kernel's entropy_coef != 0)
    loss  = pg + beta * kl - entropy_coef * H
            (masked tokens: 0, without a pass over V)

The max is taken on the raw logits and subtracted before dividing by T. x - m
is exact in fp32 near the max, so large logits (1e4) lose nothing, where
x / T - max(x / T) would lose ulp(1e4 / T) ~ 1e-3.

Backward, with g = d Loss / d loss, the upstream gradient of the per-token loss:

    dpg/dlogp   = w * (clip:  -A * ratio * (u [ratio <= delta] + (1 - u) c);
                       cispo: -sg(min(ratio, eps_high)) * A;
                       sapo:  -4 A * sigma (1 - sigma) * ratio,
                              sigma = sigmoid(tau (ratio - 1)))
    dkl/dlogp   = 1 - exp(ref_logp - logp)
                  (kl_bias_correction: ratio * (that + kl))
    dlogp/dx_j  = ([j == id] - p_j) / T,   dH/dx_j = -p_j (d_j - mu) / T
    dlogits_j   = g / T * (dloss/dlogp * ([j == id] - p_j)
                           + entropy_coef * p_j (d_j - mu))

u is 1 if the min picks the unclipped side, 0 if the clipped one, 1/2 at a
tie (torch splits it). c is 1 inside [1 - eps_low, 1 + eps_high], else 0;
[ratio <= delta] is 1 without delta (clamp passes its bounds). Without delta
the clipped side wins only outside the bounds, so the share is 1, 0, or
(1 + c) / 2 at a tie. p_j = exp(d_j - log s) is recomputed from the saved m
and log s. The forward saves dloss/dlogp per token, so the backward reads
only the logits and a few numbers per row.

The numbers (eps, beta, T, tau, delta) are loss.py's: the kernel reads them
from the run's loss.LossSettings.

Tests: python -m pytest -q tests/test_kernel.py (CPU: TRITON_INTERPRET=1);
python -m bench kernel

Simplifications:
1. Only the token-level ratio: GSPO, luspo and vespo stay in loss.py and
   variants/objectives.py. Reductions, weights, masks and metrics stay in
   PyTorch. kernels/fused_loss.py (loss.policy_loss's impl="triton"), the one
   caller in training, takes token_weight from variants/token_weights.py,
   reduces the per-token loss and reports the stats under grpo_loss's names. It leaves the kernel's
   entropy_coef at 0: its bonus is the mean token entropy instead.
2. BLOCK_V and num_warps are fixed, not autotuned: autotuning would rerun the
   in-place backward.
3. ids must lie in [0, V) at unmasked positions. They are not checked: that
   would sync the GPU.
"""
import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # logits per loop step: 8 KB of bf16 per program in flight
NUM_WARPS = 8
# the kernel's OBJECTIVE by loss_type: cispo's and sapo's own, and 0, the
# clipped surrogate, for every other one (grpo, bnpo, dr_grpo, dapo; luspo and
# vespo never come here: config.check_loss_settings)
OBJECTIVES = {"cispo": 1, "sapo": 2}


@triton.jit
def _grpo_forward_kernel(
    logits_ptr, stride_b, stride_t, ids_ptr, valid_ptr, advantages_ptr, old_logps_ptr,
    ref_logps_ptr, weight_ptr, loss_ptr, logps_ptr, kl_ptr, entropy_ptr, clipped_low_ptr,
    clipped_high_ptr, row_max_ptr, log_sum_ptr, mean_d_ptr, dloss_dlogp_ptr,
    T, V, inv_temperature, ratio_low, ratio_high, beta, entropy_coef, tau_pos, tau_neg,
    delta,
    OBJECTIVE: tl.constexpr, HAS_OLD: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    HAS_KL: tl.constexpr, KL_IS: tl.constexpr, HAS_ENTROPY: tl.constexpr,
    HAS_DELTA: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # the token index b * T + t; int64 so that row * stride cannot overflow
    row = tl.program_id(0).to(tl.int64)
    if tl.load(valid_ptr + row) == 0:  # masked token: outputs stay 0, skip the V loop
        return
    b = row // T
    x_ptr = logits_ptr + b * stride_b + (row % T) * stride_t

    # online log-sum-exp over V: m = running max of x, d = (x - m) / T,
    # s = sum e^d, acc = sum e^d d
    m = -3.4028234663852886e38  # lowest fp32, not -inf: m - m_new is never inf - inf
    s = 0.0
    acc = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))
        shift = (m - m_new) * inv_temperature  # <= 0: moves the old sums to the new max
        alpha = tl.exp(shift)
        d = (x - m_new) * inv_temperature
        e = tl.exp(d)  # 0 for padding and -inf logits
        if HAS_ENTROPY:
            # the old terms: e -> alpha e, d -> d + shift; where alpha = 0 they
            # vanish (no 0 * inf)
            acc = alpha * acc + tl.where(alpha > 0, alpha * s * shift, 0.0)
            acc += tl.sum(e * tl.where(e > 0, d, 0.0), 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new

    log_s = tl.log(s)
    x_id = tl.load(x_ptr + tl.load(ids_ptr + row)).to(tl.float32)
    logp = (x_id - m) * inv_temperature - log_s  # log_softmax(x / T)[id]

    # the policy objective: loss.clipped (with --delta: variants/objectives.py's
    # clipped_delta), or variants/objectives.py's cispo or sapo
    advantage = tl.load(advantages_ptr + b)
    if HAS_OLD:
        ratio = tl.exp(logp - tl.load(old_logps_ptr + row))
    else:
        # on-policy: old = logp (logps - logps.detach() in loss.py); exactly 1,
        # not a GPU exp(0)
        ratio = logp - logp + 1.0

    if OBJECTIVE == 0:  # the clipped surrogate
        # torch.clamp
        clipped_ratio = tl.minimum(tl.maximum(ratio, ratio_low), ratio_high)
        # at a tie torch.minimum splits the gradient, and clamp's is 1 inside its bounds
        in_range = ((ratio >= ratio_low) & (ratio <= ratio_high)).to(tl.float32)
        clipped_surrogate = clipped_ratio * advantage
        if HAS_DELTA:  # the two-sided clip: the unclipped side capped, after the clamp
            surrogate = tl.minimum(ratio, delta) * advantage
            below_cap = (ratio <= delta).to(tl.float32)  # clamp passes its bound
            # with delta the min may pick the clipped side inside its bounds
            tie_share = 0.5 * below_cap + 0.5 * in_range
            clipped_share = tl.where(surrogate == clipped_surrogate, tie_share, in_range)
            unclipped_share = tl.where(surrogate < clipped_surrogate, below_cap,
                                       clipped_share)
        else:
            surrogate = ratio * advantage
            tie_share = tl.where(surrogate == clipped_surrogate, 0.5 + 0.5 * in_range, 0.0)
            unclipped_share = tl.where(surrogate < clipped_surrogate, 1.0, tie_share)
        loss = -tl.minimum(surrogate, clipped_surrogate)
        dloss_dlogp = -advantage * ratio * unclipped_share  # d ratio / d logp = ratio
        tl.store(clipped_low_ptr + row, (ratio < ratio_low) & (advantage < 0))
        tl.store(clipped_high_ptr + row, (ratio > ratio_high) & (advantage > 0))
    elif OBJECTIVE == 1:  # cispo: ratio_high is the cap itself, a constant
        dloss_dlogp = -tl.minimum(ratio, ratio_high) * advantage
        loss = dloss_dlogp * logp
        tl.store(clipped_high_ptr + row, ratio > ratio_high)
    else:  # sapo
        tau = tl.where(advantage > 0, tau_pos, tau_neg)
        gate = tl.sigmoid(tau * (ratio - 1.0))
        loss = -gate * 4.0 / tau * advantage
        dloss_dlogp = -4.0 * advantage * gate * (1.0 - gate) * ratio

    if HAS_WEIGHT:  # a constant per-token weight (variants/token_weights.py's policy_weight)
        weight = tl.load(weight_ptr + row)
        loss = loss * weight
        dloss_dlogp = dloss_dlogp * weight

    if HAS_KL:
        delta = tl.load(ref_logps_ptr + row) - logp
        kl = tl.exp(delta) - delta - 1.0
        dkl_dlogp = 1.0 - tl.exp(delta)
        tl.store(kl_ptr + row, kl)
        if KL_IS:  # kl * ratio, d ratio / d logp = ratio
            dkl_dlogp = ratio * (dkl_dlogp + kl)
            kl = kl * ratio
        loss = loss + beta * kl
        dloss_dlogp += beta * dkl_dlogp

    if HAS_ENTROPY:
        mean_d = acc / s  # mu = sum_v p_v d_v
        entropy = log_s - mean_d
        loss = loss - entropy_coef * entropy
        tl.store(entropy_ptr + row, entropy)
        tl.store(mean_d_ptr + row, mean_d)

    tl.store(loss_ptr + row, loss)
    tl.store(logps_ptr + row, logp)
    tl.store(row_max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_s)
    tl.store(dloss_dlogp_ptr + row, dloss_dlogp)


@triton.jit
def _grpo_backward_kernel(
    logits_ptr, stride_b, stride_t, grad_ptr, grad_stride_b, grad_stride_t, ids_ptr,
    valid_ptr, grad_loss_ptr, row_max_ptr, log_sum_ptr, mean_d_ptr, dloss_dlogp_ptr,
    T, V, inv_temperature, entropy_coef,
    HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row % T
    x_ptr = logits_ptr + b * stride_b + t * stride_t
    # may be x_ptr (in place): each block is read before it is written
    dx_ptr = grad_ptr + b * grad_stride_b + t * grad_stride_t

    if tl.load(valid_ptr + row) == 0:  # masked token: zero gradient
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            zeros = tl.zeros([BLOCK_V], dtype=dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + cols, zeros, mask=cols < V)
        return

    grad_loss = tl.load(grad_loss_ptr + row)
    g_logp = grad_loss * tl.load(dloss_dlogp_ptr + row) * inv_temperature
    g_entropy = grad_loss * entropy_coef * inv_temperature
    m = tl.load(row_max_ptr + row)
    log_s = tl.load(log_sum_ptr + row)
    mean_d = 0.0
    if HAS_ENTROPY:
        mean_d = tl.load(mean_d_ptr + row)
    chosen = tl.load(ids_ptr + row)

    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        d = (x - m) * inv_temperature
        p = tl.exp(d - log_s)  # softmax, recomputed
        dx = tl.where(cols == chosen, g_logp, 0.0) - g_logp * p
        if HAS_ENTROPY:
            # p = 0 at -inf logits: no 0 * inf
            dx += g_entropy * p * tl.where(p > 0, d - mean_d, 0.0)
        tl.store(dx_ptr + cols, dx.to(dx_ptr.dtype.element_ty), mask=cols < V)


def _as_rows(x, N, name):
    """(B, T) tensor or None -> contiguous fp32 (N,) or None."""
    if x is None:
        return None
    if x.numel() != N:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; "
                         f"expected (B, T) with B * T = {N}")
    return x.reshape(N).float().contiguous()


class _FusedGRPOTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, advantages, mask, old_logps, ref_logps, token_weight,
                settings, entropy_coef, inplace_backward):
        """settings: the loss.LossSettings; the rest: fused_grpo_token_loss's."""
        s = settings
        B, T, V = logits.shape
        N = B * T
        valid = (mask != 0).reshape(N).contiguous()  # (N,) bool
        ids = ids.reshape(N).contiguous()  # (N,)

        # the outputs: zeros stay at masked tokens
        f32 = dict(device=logits.device, dtype=torch.float32)
        loss = torch.zeros(N, **f32)  # (N,)
        logps = torch.zeros(N, **f32)  # (N,)
        kl = torch.zeros(N, **f32) if s.beta != 0 else None
        entropy = torch.zeros(N, **f32) if entropy_coef != 0 else None
        clipped_low = torch.zeros(N, device=logits.device, dtype=torch.bool)  # (N,)
        clipped_high = torch.zeros(N, device=logits.device, dtype=torch.bool)  # (N,)
        # what the backward reads
        row_max, log_sum, mean_d, dloss_dlogp = torch.zeros(4, N, **f32)  # (4, N)

        old = _as_rows(old_logps, N, "old_logps")
        ref = _as_rows(ref_logps, N, "ref_logps")
        weight = _as_rows(token_weight, N, "token_weight")
        # cispo caps the ratio at eps_high itself
        if s.loss_type == "cispo":
            ratio_high = float(s.epsilon_high)
        else:
            ratio_high = 1.0 + float(s.epsilon_high)
        tau_pos, tau_neg = s.sapo_tau

        _grpo_forward_kernel[(N,)](
            logits, logits.stride(0), logits.stride(1), ids, valid,
            advantages.float().contiguous(), old, ref, weight,
            loss, logps, kl, entropy, clipped_low, clipped_high,
            row_max, log_sum, mean_d, dloss_dlogp,
            T, V, 1.0 / float(s.temperature), 1.0 - float(s.epsilon_low), ratio_high,
            float(s.beta), float(entropy_coef), float(tau_pos), float(tau_neg),
            float(s.delta or 0.0),
            OBJECTIVE=OBJECTIVES.get(s.loss_type, 0), HAS_OLD=old is not None,
            HAS_WEIGHT=weight is not None, HAS_KL=s.beta != 0,
            KL_IS=bool(s.kl_bias_correction), HAS_ENTROPY=entropy is not None,
            HAS_DELTA=s.delta is not None, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )

        ctx.save_for_backward(logits, ids, valid, row_max, log_sum, mean_d, dloss_dlogp)
        ctx.temperature = s.temperature
        ctx.entropy_coef = entropy_coef
        ctx.inplace_backward = inplace_backward
        buffers = (loss, logps, kl, entropy, clipped_low, clipped_high)
        outputs = [x.view(B, T) if x is not None else None for x in buffers]
        ctx.mark_non_differentiable(*[x for x in outputs[1:] if x is not None])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, grad_loss, *unused_grads):
        logits, ids, valid, row_max, log_sum, mean_d, dloss_dlogp = ctx.saved_tensors
        B, T, V = logits.shape
        if ctx.inplace_backward:
            # the gradient overwrites the logits (they are dead once this backward
            # has read them)
            grad = logits.detach()
        else:
            grad = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
        _grpo_backward_kernel[(B * T,)](
            logits, logits.stride(0), logits.stride(1),
            grad, grad.stride(0), grad.stride(1),
            ids, valid, grad_loss.reshape(B * T).float().contiguous(),
            row_max, log_sum, mean_d, dloss_dlogp,
            T, V, 1.0 / float(ctx.temperature), float(ctx.entropy_coef),
            HAS_ENTROPY=ctx.entropy_coef != 0, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )
        return (grad,) + (None,) * 9


# Dynamo is kept out of the op (compiled callers graph-break here): it is one
# fused kernel, and tracing user Triton kernels inside an autograd.Function is a
# path the CPU tests cannot cover.
@torch.compiler.disable
def fused_grpo_token_loss(logits, ids, advantages, mask, old_logps=None, ref_logps=None,
                          token_weight=None, *, settings, entropy_coef=0.0,
                          inplace_backward=False):
    """The GRPO per-token loss straight from logits, before loss.reduce_loss.

    It is what loss.grpo_loss computes before reducing, for settings'
    loss_type: the clipped surrogate for grpo, bnpo, dr_grpo and dapo (with
    settings.delta too), or cispo's, or sapo's.

    logits (B, T, V) bf16/fp16/fp32 with stride(-1) == 1 (views like
    logits[:, :-1] need no copy); ids, mask, old_logps, ref_logps,
    token_weight (B, T); advantages (B,). settings: a loss.LossSettings, of
    which the kernel reads loss_type, temperature, epsilon_low, epsilon_high,
    beta, kl_bias_correction, sapo_tau and delta (config.check_loss_settings
    has refused what it cannot compute). entropy_coef: the kernel's own
    per-token term, - entropy_coef * H_t, reduced as the loss type says; not
    settings' entropy_coef, whose bonus kernels/fused_loss.py adds as a token
    mean.

    Returns
      per_token_loss  (B, T) fp32, differentiable w.r.t. logits, 0 at masked
                      tokens;
      logps           (B, T) fp32, detached;
      stats           detached (B, T): is_clipped_low, is_clipped_high (bool;
                      cispo: its capped weights), kl (when beta != 0, not
                      * ratio), entropy (when entropy_coef != 0).
    Reduce with loss.reduce_loss(per_token_loss, mask, loss_type, ...), as
    kernels/fused_loss.py does.

    inplace_backward=True writes dlogits into the logits' storage, destroying
    them (as Liger's inplace=True): only when nothing reads them after this
    backward. For the full saving they must not be a view: autograd turns the
    gradient of logits[:, :-1] into a fresh (B, T + 1, V) tensor.
    """
    s = settings
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (B, T, V) with stride(-1) == 1, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}: "
                         f"pass logits.contiguous()")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits dtype {logits.dtype}: use float32, bfloat16 or float16 "
                         f"(loss.py covers float64)")

    B, T, V = logits.shape
    if ids.shape != (B, T) or mask.shape != (B, T) or advantages.shape != (B,):
        raise ValueError(f"with logits {tuple(logits.shape)} expected ids and mask "
                         f"({B}, {T}) and advantages ({B},), got {tuple(ids.shape)}, "
                         f"{tuple(mask.shape)}, {tuple(advantages.shape)}")
    if s.beta != 0 and ref_logps is None:
        raise ValueError(f"beta={s.beta} needs ref_logps (the reference model's "
                         f"log-probs); or set beta=0")
    if s.temperature <= 0:
        raise ValueError(f"temperature={s.temperature} must be > 0 "
                         f"(use the sampling temperature)")

    outputs = _FusedGRPOTokenLoss.apply(logits, ids, advantages, mask, old_logps,
                                        ref_logps, token_weight, s, entropy_coef,
                                        inplace_backward)
    loss, logps, kl, entropy, clipped_low, clipped_high = outputs

    stats = dict(is_clipped_low=clipped_low, is_clipped_high=clipped_high, kl=kl,
                 entropy=entropy)
    return loss, logps, {k: v for k, v in stats.items() if v is not None}
