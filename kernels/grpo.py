"""The GRPO per-token loss fused into one Triton kernel per direction: logits in, loss and
dlogits out.

The (B, T, V) logits are the only big tensor of the policy update: bf16 logits for 32k tokens of
Qwen's V = 151,936 take 10 GB, and a plain log_softmax adds an fp32 copy of 20 GB (the usual GRPO
OOM; Liger-Kernel's triton_grpo_loss, PR #672, fuses it the same way). Here each program walks
one row of V logits with an online log-sum-exp (Milakov & Gimelshein 2018) and keeps only O(1)
numbers per row; the backward recomputes the softmax from them. Extra memory: O(B*T); with
inplace_backward the gradient even reuses the logits' storage.

Forward, per unmasked token (b, t) with x = logits[b, t] (raw), id = ids[b, t], T = temperature:
    m = max_v x_v,  d_v = (x_v - m) / T,  s = sum_v exp(d_v)   (one pass over V in blocks, fp32)
    logp  = d_id - log s                       (= log_softmax(x / T)[id])
    ratio = exp(logp - old_logp)               (exactly 1 when old_logps is None: on-policy)
    pg    = -min(ratio * A_b, clamp(ratio, 1 - eps_low, 1 + eps_high) * A_b) * w
                                               (w = is_weight or 1)
    kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1          (k3, when beta != 0)
    H     = log s - mu,  mu = sum_v p_v d_v,  p = softmax(x / T)   (when entropy_coef != 0)
    loss  = pg + beta * kl - entropy_coef * H  (masked tokens: 0, without a pass over V)
The max is taken on the raw logits and subtracted before dividing by T: x - m is exact in fp32
near the max, so large logits (1e4) lose nothing, where x / T - max(x / T) loses
ulp(1e4 / T) ~ 1e-3.
Backward, with g = d Loss / d loss (the upstream gradient of the per-token loss):
    dloss/dlogp = -A * ratio * w * u + beta * (1 - exp(ref_logp - logp))
                  u = 1 if the min picks the unclipped side, 0 if the clipped one; at a tie
                  PyTorch's torch.minimum sends half to each side and clamp passes its bounds:
                  u = 1 inside [1 - eps_low, 1 + eps_high] (bounds included), 1/2 outside
    dlogp/dx_j  = ([j == id] - p_j) / T
    dH/dx_j     = -p_j (x_j / T - sum_k p_k x_k / T) / T = -p_j (d_j - mu) / T
    dlogits_j   = g / T * (dloss/dlogp * ([j == id] - p_j) + entropy_coef * p_j (d_j - mu))
with p_j = exp(d_j - log s) recomputed from the saved m and log s. The forward saves dloss/dlogp
per token, so the backward reads only the logits and a few numbers per row (no old/ref logps,
no advantages).

Run the tests:  python -m pytest -q tests/test_kernel.py   (CPU: under TRITON_INTERPRET=1)
Benchmark:      python -m bench kernel  (GPU)   /   python -m bench kernel --tiny  (CPU)

Simplifications:
1. Only the token-level ratio (GRPO/DAPO); the sequence-level one (GSPO) stays in loss.py.
2. The loss_type reductions and the metrics stay in PyTorch: loss.policy_loss (impl="triton"),
   the one caller in training, reduces the (B, T) per-token loss with loss.reduce_loss and
   reports the stats under loss.grpo_loss's metric names. It passes entropy_coef=0: folded in
   per token, the entropy term would be weighed by the loss type's reduction, and loss.py's
   bonus is the mean token entropy instead.
3. BLOCK_V and num_warps are fixed, not autotuned: autotuning would rerun the in-place backward.
4. ids must lie in [0, V) at unmasked positions; they are not checked (that would sync the GPU).
"""
import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # logits per loop step: 8 KB of bf16 per program in flight
NUM_WARPS = 8


@triton.jit
def _grpo_forward_kernel(
    logits_ptr, stride_b, stride_t, ids_ptr, valid_ptr, advantages_ptr, old_logps_ptr,
    ref_logps_ptr, weight_ptr, loss_ptr, logps_ptr, kl_ptr, entropy_ptr, clipped_low_ptr,
    clipped_high_ptr, row_max_ptr, log_sum_ptr, mean_d_ptr, dloss_dlogp_ptr,
    T, V, inv_temperature, ratio_low, ratio_high, beta, entropy_coef,
    HAS_OLD: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_KL: tl.constexpr,
    HAS_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # the token index b * T + t; int64 so that row * stride cannot overflow
    row = tl.program_id(0).to(tl.int64)
    if tl.load(valid_ptr + row) == 0:  # masked token: outputs stay 0, skip the V loop
        return
    b = row // T
    x_ptr = logits_ptr + b * stride_b + (row % T) * stride_t

    # online log-sum-exp over V: m = running max of x, d = (x - m) / T, s = sum exp(d),
    # acc = sum exp(d) * d
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
            # the old terms: e -> alpha e, d -> d + shift; where alpha = 0 they vanish (no 0 * inf)
            acc = alpha * acc + tl.where(alpha > 0, alpha * s * shift, 0.0)
            acc += tl.sum(e * tl.where(e > 0, d, 0.0), 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    x_id = tl.load(x_ptr + tl.load(ids_ptr + row)).to(tl.float32)
    logp = (x_id - m) * inv_temperature - log_s  # log_softmax(x / T)[id]

    # clipped surrogate, in the order of loss.grpo_loss
    advantage = tl.load(advantages_ptr + b)
    if HAS_OLD:
        ratio = tl.exp(logp - tl.load(old_logps_ptr + row))
    else:
        # on-policy: old = logp (logps - logps.detach() in loss.py); exactly 1, not a GPU exp(0)
        ratio = logp - logp + 1.0
    clipped_ratio = tl.minimum(tl.maximum(ratio, ratio_low), ratio_high)  # torch.clamp
    surrogate = ratio * advantage
    clipped_surrogate = clipped_ratio * advantage
    loss = -tl.minimum(surrogate, clipped_surrogate)
    # clamp's gradient is 1 here
    in_range = ((ratio >= ratio_low) & (ratio <= ratio_high)).to(tl.float32)
    # torch.minimum's tie rule
    tie_share = tl.where(surrogate == clipped_surrogate, 0.5 + 0.5 * in_range, 0.0)
    unclipped_share = tl.where(surrogate < clipped_surrogate, 1.0, tie_share)
    dloss_dlogp = -advantage * ratio * unclipped_share  # d ratio / d logp = ratio
    if HAS_WEIGHT:  # a constant per-token weight (e.g. truncated importance sampling)
        weight = tl.load(weight_ptr + row)
        loss = loss * weight
        dloss_dlogp = dloss_dlogp * weight
    if HAS_KL:
        delta = tl.load(ref_logps_ptr + row) - logp
        kl = tl.exp(delta) - delta - 1.0
        loss = loss + beta * kl
        dloss_dlogp += beta * (1.0 - tl.exp(delta))
        tl.store(kl_ptr + row, kl)
    if HAS_ENTROPY:
        mean_d = acc / s  # mu = sum_v p_v d_v
        entropy = log_s - mean_d
        loss = loss - entropy_coef * entropy
        tl.store(entropy_ptr + row, entropy)
        tl.store(mean_d_ptr + row, mean_d)
    tl.store(loss_ptr + row, loss)
    tl.store(logps_ptr + row, logp)
    tl.store(clipped_low_ptr + row, (ratio < ratio_low) & (advantage < 0))
    tl.store(clipped_high_ptr + row, (ratio > ratio_high) & (advantage > 0))
    tl.store(row_max_ptr + row, m)
    tl.store(log_sum_ptr + row, log_s)
    tl.store(dloss_dlogp_ptr + row, dloss_dlogp)


@triton.jit
def _grpo_backward_kernel(
    logits_ptr, stride_b, stride_t, grad_ptr, grad_stride_b, grad_stride_t, ids_ptr, valid_ptr,
    grad_loss_ptr, row_max_ptr, log_sum_ptr, mean_d_ptr, dloss_dlogp_ptr,
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
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected (B, T) with B * T = {N}")
    return x.reshape(N).float().contiguous()


class _FusedGRPOTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, advantages, mask, old_logps, ref_logps, is_weight, temperature,
                epsilon_low, epsilon_high, beta, entropy_coef, inplace_backward):
        B, T, V = logits.shape
        N = B * T
        valid = (mask != 0).reshape(N).contiguous()  # (N,) bool
        ids = ids.reshape(N).contiguous()  # (N,)
        f32 = dict(device=logits.device, dtype=torch.float32)
        # zeros stay at masked tokens
        loss = torch.zeros(N, **f32)  # (N,)
        logps = torch.zeros(N, **f32)  # (N,)
        kl = torch.zeros(N, **f32) if beta != 0 else None
        entropy = torch.zeros(N, **f32) if entropy_coef != 0 else None
        clipped_low = torch.zeros(N, device=logits.device, dtype=torch.bool)  # (N,)
        clipped_high = torch.zeros(N, device=logits.device, dtype=torch.bool)  # (N,)
        # saved for backward: O(N)
        row_max, log_sum, mean_d, dloss_dlogp = torch.zeros(4, N, **f32)  # (4, N)
        old = _as_rows(old_logps, N, "old_logps")
        ref = _as_rows(ref_logps, N, "ref_logps")
        weight = _as_rows(is_weight, N, "is_weight")
        _grpo_forward_kernel[(N,)](
            logits, logits.stride(0), logits.stride(1), ids, valid,
            advantages.float().contiguous(), old, ref, weight,
            loss, logps, kl, entropy, clipped_low, clipped_high,
            row_max, log_sum, mean_d, dloss_dlogp,
            T, V, 1.0 / temperature, 1.0 - epsilon_low, 1.0 + epsilon_high,
            float(beta), float(entropy_coef),
            HAS_OLD=old is not None, HAS_WEIGHT=weight is not None, HAS_KL=beta != 0,
            HAS_ENTROPY=entropy_coef != 0, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )
        ctx.save_for_backward(logits, ids, valid, row_max, log_sum, mean_d, dloss_dlogp)
        ctx.temperature = temperature
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
            # the gradient overwrites the logits (they are dead once this backward has read them)
            grad = logits.detach()
        else:
            grad = torch.empty((B, T, V), dtype=logits.dtype, device=logits.device)
        _grpo_backward_kernel[(B * T,)](
            logits, logits.stride(0), logits.stride(1), grad, grad.stride(0), grad.stride(1),
            ids, valid, grad_loss.reshape(B * T).float().contiguous(),
            row_max, log_sum, mean_d, dloss_dlogp,
            T, V, 1.0 / ctx.temperature, float(ctx.entropy_coef),
            HAS_ENTROPY=ctx.entropy_coef != 0, BLOCK_V=BLOCK_V, num_warps=NUM_WARPS,
        )
        return (grad,) + (None,) * 12


# Dynamo is kept out of the op: it is one fused kernel already, and tracing user Triton kernels
# inside an autograd.Function would add a path that the CPU tests cannot cover. Compiled callers
# graph-break here.
@torch.compiler.disable
def fused_grpo_token_loss(logits, ids, advantages, mask, old_logps=None, ref_logps=None, *,
                          temperature=1.0, epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                          entropy_coef=0.0, is_weight=None, inplace_backward=False):
    """GRPO per-token loss straight from logits, as loss.grpo_loss computes it before reduce_loss.

    logits (B, T, V) bf16/fp16/fp32 with stride(-1) == 1 (views like logits[:, :-1] need no copy);
    ids, mask, old_logps, ref_logps, is_weight (B, T); advantages (B,).
    Returns (per_token_loss (B, T) fp32, differentiable w.r.t. logits, 0 at masked tokens;
             logps (B, T) fp32 detached;
             stats: dict of detached (B, T) tensors: is_clipped_low, is_clipped_high (bool),
                    kl (when beta != 0), entropy (when entropy_coef != 0)).
    Reduce with loss.reduce_loss(per_token_loss, mask, loss_type, ...); loss.policy_loss does.
    inplace_backward=True writes dlogits into the logits' storage (they are destroyed; peak
    memory is then the logits alone, as Liger's inplace=True): only when nothing reads the logits
    after this backward (no second backward through the graph). For the full saving the logits
    must not be a view: autograd turns the gradient of logits[:, :-1] into a fresh (B, T + 1, V)
    tensor.
    """
    if logits.dim() != 3 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (B, T, V) with stride(-1) == 1, got shape "
                         f"{tuple(logits.shape)} and strides {logits.stride()}: "
                         f"pass logits.contiguous()")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits dtype {logits.dtype}: use float32, bfloat16 or float16 "
                         f"(loss.py covers float64)")
    B, T, V = logits.shape
    if ids.shape != (B, T) or mask.shape != (B, T) or advantages.shape != (B,):
        raise ValueError(f"with logits {tuple(logits.shape)} expected ids and mask ({B}, {T}) and "
                         f"advantages ({B},), got {tuple(ids.shape)}, {tuple(mask.shape)}, "
                         f"{tuple(advantages.shape)}")
    if beta != 0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's log-probs); "
                         f"or set beta=0")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0 (use the sampling temperature)")
    loss, logps, kl, entropy, clipped_low, clipped_high = _FusedGRPOTokenLoss.apply(
        logits, ids, advantages, mask, old_logps, ref_logps, is_weight, float(temperature),
        float(epsilon_low), float(epsilon_high), float(beta), float(entropy_coef),
        bool(inplace_backward))
    stats = {"is_clipped_low": clipped_low, "is_clipped_high": clipped_high}
    if kl is not None:
        stats["kl"] = kl
    if entropy is not None:
        stats["entropy"] = entropy
    return loss, logps, stats
