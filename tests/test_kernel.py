"""kernels/grpo.py against loss.py: values, gradients w.r.t. the logits, stats,
and input errors.

On CPU the kernel runs under TRITON_INTERPRET=1, which conftest.py sets before
triton is imported. The shapes are small and BLOCK_V = 64, so every row takes
several blocks and a ragged last one. The kernel computes in fp32 only: fp32
cases must agree with loss.py in fp64 on the same logits (the exact math) to the
kernel's fp32 rounding (kernel_tol); bf16 ones within the error of loss.py's own
bf16 path. The GPU test reruns the comparison at real shapes (and N * V > 2**31)
and under torch.compile.
"""
import dataclasses
import itertools
import os

import pytest
import torch

import kernels.grpo as grpo
from helpers import assert_close_rel, fp32_tol
from kernels import fused_grpo_token_loss
from loss import LossSettings, grpo_loss, importance_weight
from model import entropy_from_logits, selective_log_softmax
from reduction import reduce_loss

# numpy (the interpreter) warns on inf/NaN in the branch tl.where discards, and
# on the running max's lowest-fp32 start overflowing to -inf when scaled by
# 1 / T > 1: both intended, see kernels/grpo.py
INTERPRETER_WARNINGS = "ignore::RuntimeWarning:triton.runtime.interpreter"
pytestmark = pytest.mark.filterwarnings(INTERPRETER_WARNINGS)
# the kernel's fp32 rounding against the exact math (loss.py in fp64), relative
# to the largest entry: a row's sums over its V = 150 logits, then the loss's
# over make_batch's 3 x 5 tokens (fp32_tol, tests/helpers.py). compare's own
# adds the log-probs' magnitude (kernel_tol)
KERNEL_TOL = fp32_tol(150 + 3 * 5)
# the GPU test's, at real shapes (not run on a CPU)
GPU_TOL = dict(atol=1e-5, rtol=1e-5)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GPU_BLOCK_V = grpo.BLOCK_V
# each loss type's normaliser: reduce_loss's keywords
REDUCE = {
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {"max_new_tokens": 8},
    "dapo": {"num_items": 11},
    "cispo": {"num_items": 11},
    "sapo": {},
}
# the clipped surrogate (cispo and sapo: their own tests)
CLIP_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Several V blocks per row, and few interpreted ops per block."""
    monkeypatch.setattr(grpo, "BLOCK_V", 64)


def make_batch(T=5, V=150, scale=3.0, seed=0, dtype=torch.float32, temperature=1.0):
    """Three sequences of logits as the trainer has them: a (B, T + 1, V) base
    whose last position a view drops.

    Sequence 1 is half masked, sequence 2 fully; advantages of both signs.
    -> (base, ids, advantages, mask, old_logps, ref_logps, sampling_logps).
    """
    g = torch.Generator().manual_seed(seed)
    base = (scale * torch.randn(3, T + 1, V, generator=g)).to(dtype)  # (B, T + 1, V)
    ids = torch.randint(V, (3, T), generator=g)  # (B, T)
    mask = torch.ones(3, T)  # (B, T)
    mask[1, T // 2:] = 0
    mask[2] = 0
    advantages = torch.tensor([1.0, -0.7, 0.4])  # (B,)

    logps = selective_log_softmax(base[:, :-1].float(), ids, temperature)  # (B, T)
    old_logps = logps + 0.3 * torch.randn(3, T, generator=g)
    old_logps[0, 0] = logps[0, 0] - 1  # clipped above (A > 0)
    old_logps[1, 0] = logps[1, 0] + 1  # clipped below (A < 0)
    ref_logps = logps + 0.3 * torch.randn(3, T, generator=g)
    sampling_logps = old_logps + 0.2 * torch.randn(3, T, generator=g)

    batch = (base, ids, advantages, mask, old_logps, ref_logps, sampling_logps)
    return tuple(x.to(DEVICE) for x in batch)


def tis_weight(logps, old_logps, sampling_logps, mask, tis_cap):
    """The IS weight from old (or, on-policy, the current) and sampling logps, as
    loss.policy_loss builds it."""
    old = logps.detach() if old_logps is None else old_logps
    weight, _, _ = importance_weight(old, sampling_logps, mask, "token_truncate",
                                     is_max=tis_cap)
    return weight


def run_reference(logits, ids, advantages, mask, old_logps, ref_logps, *,
                  loss_type="grpo", sampling_logps=None, tis_cap=None, **settings):
    """loss.py on logits -> (loss, detached logps, metrics).

    settings: LossSettings' fields, the ones the kernel shares with loss.py.
    """
    normaliser = REDUCE[loss_type]
    s = LossSettings(loss_type=loss_type, max_new_tokens=normaliser.get("max_new_tokens"),
                     **settings)
    logps = selective_log_softmax(logits, ids, s.temperature)  # (B, T)
    entropies = None
    if s.entropy_coef:
        entropies = entropy_from_logits(logits, s.temperature)  # (B, T)
    weight = None
    if tis_cap is not None:
        weight = tis_weight(logps, old_logps, sampling_logps, mask, tis_cap)

    # grpo_loss gets the entropies for their metric only: no bonus of its own
    no_bonus = dataclasses.replace(s, entropy_coef=0.0)
    loss, metrics = grpo_loss(logps, old_logps, ref_logps, advantages, mask, no_bonus,
                              entropies=entropies, token_weight=weight,
                              num_items=normaliser.get("num_items"))

    # The kernel folds -entropy_coef * H_t into its per-token loss, so the loss
    # type reduces it too. (loss.policy_loss runs the kernel without it, and adds
    # grpo_loss's mean-entropy bonus instead.)
    if s.entropy_coef:
        bonus = reduce_loss(entropies, mask, loss_type, **normaliser)
        loss = loss - s.entropy_coef * bonus
    return loss, logps.detach(), metrics


def run_fused(logits, ids, advantages, mask, old_logps, ref_logps, *, loss_type="grpo",
              token_weight=None, entropy_coef=0.0, **settings):
    """The kernel on logits -> (reduced loss, per-token loss, logps, stats).

    settings: LossSettings' fields; entropy_coef: the kernel's own per-token
    entropy term.
    """
    s = LossSettings(loss_type=loss_type, **settings)
    per_token, logps, stats = fused_grpo_token_loss(
        logits, ids, advantages, mask, old_logps, ref_logps, token_weight=token_weight,
        settings=s, entropy_coef=entropy_coef)

    loss = reduce_loss(per_token, mask, loss_type, **REDUCE[loss_type])
    return loss, per_token, logps, stats


def masked_mean(x, mask):
    return ((x.float() * mask).sum() / mask.sum().clamp(min=1)).item()


def kernel_tol(V, tokens, logps):
    """KERNEL_TOL for these shapes: fp32_tol of the sums over V and the tokens,
    plus the largest |log-prob|. A log-prob rounds by eps of its magnitude (-100
    at logits of scale 30 / T), and its error scales the ratio exp(logp - old),
    and with it the token's loss and whole gradient row."""
    return fp32_tol(V + tokens + logps.abs().max().item())


def compare(base, ids, advantages, mask, old_logps, ref_logps, sampling_logps=None,
            tis_cap=None, view=None, loss_type="grpo", ref_dtype=None, **kwargs):
    """Run both on the same leaf `base`, and compare loss, d loss / d base,
    logps and stats.

    kwargs: the settings both take (temperature, epsilon_low, epsilon_high,
    beta, entropy_coef, kl_bias_correction, sapo_tau, delta).
    """
    view = view or (lambda x: x[:, :-1])

    # fp32 logits: the judge computes in fp64 (the kernel in fp32 only)
    if ref_dtype is None:
        ref_dtype = torch.float64 if base.dtype == torch.float32 else base.dtype
    ref_base = base.detach().to(ref_dtype).requires_grad_()
    ref_loss, ref_logps_out, metrics = run_reference(
        view(ref_base), ids, advantages, mask, old_logps, ref_logps, loss_type=loss_type,
        sampling_logps=sampling_logps, tis_cap=tis_cap, **kwargs)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_base)

    weight = None
    if tis_cap is not None:  # the same constant weight as the reference's
        weight = tis_weight(ref_logps_out, old_logps, sampling_logps, mask, tis_cap)
    fused_base = base.detach().clone().requires_grad_()
    loss, per_token, logps, stats = run_fused(view(fused_base), ids, advantages, mask,
                                              old_logps, ref_logps, loss_type=loss_type,
                                              token_weight=weight, **kwargs)
    (grad,) = torch.autograd.grad(loss, fused_base)

    assert (per_token[mask == 0] == 0).all() and (logps[mask == 0] == 0).all()
    assert not logps.requires_grad and all(not s.requires_grad for s in stats.values())
    tol = kernel_tol(base.shape[-1], mask.numel(), ref_logps_out * mask)
    return dict(loss=(loss, ref_loss), grad=(grad, ref_grad),
                logps=(logps * mask, ref_logps_out * mask), metrics=(stats, metrics), tol=tol)


def loss_scale(loss):
    """The magnitude of a reduced loss's terms: per-token |A| x ratio, beta x kl
    and the entropy bonus are of order 1, and their mean may cancel to less."""
    return max(1.0, abs(loss.item()))


def assert_matches(out, mask):
    for name in ("loss", "grad", "logps"):
        ours, ref = out[name]
        scale = loss_scale(ref) if name == "loss" else None
        assert_close_rel(ours, ref, out["tol"], scale=scale, msg=name)

    stats, metrics = out["metrics"]
    # the clip fractions of the loss type (cispo: high only; sapo: none): counts
    # over the tokens, each mean one fp32 sum of them
    tokens = mask.numel()
    for side in ("low", "high"):
        if f"clip_{side}" in metrics:
            ours = masked_mean(stats[f"is_clipped_{side}"], mask)
            assert_close_rel(ours, metrics[f"clip_{side}"], fp32_tol(tokens), scale=1.0,
                             msg=f"clip_{side}")

    # means over the tokens of terms of order 1 (kl) or of the row's logits (entropy)
    for key in ("kl", "entropy"):
        if key in stats:
            ours = masked_mean(stats[key], mask)
            assert_close_rel(ours, metrics[key], out["tol"], scale=max(1.0, abs(metrics[key])),
                             msg=key)


# ---- the option grid, fp32 -----------------------------------------------------

# temperature, has_old, beta, entropy_coef, tis_cap
GRID = list(itertools.product([1.0, 0.7], [False, True], [0.0, 0.04], [0.0, 0.01],
                              [None, 2.0]))


@pytest.mark.parametrize("temperature, has_old, beta, entropy_coef, tis_cap", GRID)
@pytest.mark.same_math
def test_matches_loss_py_fp32(temperature, has_old, beta, entropy_coef, tis_cap):
    case = GRID.index((temperature, has_old, beta, entropy_coef, tis_cap))
    loss_type = CLIP_TYPES[case % len(CLIP_TYPES)]  # every reduction, across the grid
    batch = make_batch(seed=case, temperature=temperature)
    base, ids, advantages, mask, old_logps, ref_logps, sampling_logps = batch

    out = compare(base, ids, advantages, mask, old_logps if has_old else None, ref_logps,
                  sampling_logps=sampling_logps, tis_cap=tis_cap, loss_type=loss_type,
                  temperature=temperature, epsilon_low=0.2, epsilon_high=0.28, beta=beta,
                  entropy_coef=entropy_coef)
    assert_matches(out, mask)

    # the batch must exercise clipping on both sides, or this grid proves little
    if has_old:
        stats, _ = out["metrics"]
        assert stats["is_clipped_high"][0, 0] and stats["is_clipped_low"][1, 0]


@pytest.mark.same_math
def test_without_ref_logps_and_stats_keys():
    base, ids, advantages, mask, old_logps, *_ = make_batch()
    _, _, stats = fused_grpo_token_loss(base[:, :-1], ids, advantages, mask, old_logps,
                                       settings=LossSettings())
    assert set(stats) == {"is_clipped_low", "is_clipped_high"}
    assert stats["is_clipped_low"].dtype == torch.bool

    out = compare(base, ids, advantages, mask, old_logps, None)
    assert_matches(out, mask)


@pytest.mark.same_math
def test_masked_tokens_get_zero_gradient():
    base, ids, advantages, mask, old_logps, ref_logps, _ = make_batch()
    out = compare(base, ids, advantages, mask, old_logps, ref_logps, beta=0.04,
                  entropy_coef=0.01)

    grad = out["grad"][0]  # (B, T + 1, V)
    assert (grad[:, :-1][mask == 0] == 0).all() and (grad[:, -1] == 0).all()
    assert (grad[:, :-1][mask == 1] != 0).any(dim=-1).all()


# ---- cispo, sapo and the KL bias correction ------------------------------------

OBJECTIVE_GRID = list(itertools.product(["cispo", "sapo"], [False, True], [False, True]))


@pytest.mark.parametrize("loss_type, has_old, kl_bias_correction", OBJECTIVE_GRID)
@pytest.mark.same_math
def test_objectives_match_loss_py_fp32(loss_type, has_old, kl_bias_correction):
    """Every objective the kernel shares with loss.py, forward and backward.

    With the IS weight, the KL (and its bias correction) and the entropy term.
    cispo's cap 1.3 holds some ratios and not others.
    """
    case = OBJECTIVE_GRID.index((loss_type, has_old, kl_bias_correction))
    batch = make_batch(seed=case, temperature=0.7)
    base, ids, advantages, mask, old_logps, ref_logps, sampling_logps = batch
    epsilon_high = 1.3 if loss_type == "cispo" else 0.2

    out = compare(base, ids, advantages, mask, old_logps if has_old else None, ref_logps,
                  sampling_logps=sampling_logps, tis_cap=2.0, loss_type=loss_type,
                  temperature=0.7, epsilon_high=epsilon_high, beta=0.04,
                  entropy_coef=0.01, kl_bias_correction=kl_bias_correction,
                  sapo_tau=(0.8, 1.3))
    assert_matches(out, mask)

    stats, metrics = out["metrics"]
    if loss_type == "cispo" and has_old:
        assert 0 < metrics["clip_high"] < 1
    if loss_type == "sapo":
        assert "clip_high" not in metrics and not stats["is_clipped_high"].any()


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
@pytest.mark.same_math
def test_objectives_bf16_within_the_error_of_pytorch_bf16(loss_type):
    """bf16 logits, as test_bf16_within_the_error_of_pytorch_bf16.

    Loss and logps are within the kernel's fp32 rounding (kernel_tol) of fp32
    loss.py, and the bf16 gradient within the error of loss.py's own bf16 path
    (+ the interpreter's truncating cast).
    """
    batch = make_batch(dtype=torch.bfloat16, temperature=0.7)
    base, ids, advantages, mask, old_logps, ref_logps, _ = batch
    epsilon_high = 1.3 if loss_type == "cispo" else 0.2
    kwargs = dict(temperature=0.7, beta=0.04, entropy_coef=0.01, loss_type=loss_type,
                  kl_bias_correction=True, epsilon_high=epsilon_high)

    ours = compare(base, ids, advantages, mask, old_logps, ref_logps,
                   ref_dtype=torch.float32, **kwargs)
    torch_bf16 = compare(base, ids, advantages, mask, old_logps, ref_logps, **kwargs)
    assert_within_bf16_error(ours, torch_bf16)


# ---- delta: INTELLECT-2's two-sided clip ---------------------------------------

# loss type, the IS weight, beta
DELTA_GRID = list(itertools.product(["grpo", "dapo"], [None, 2.0], [0.0, 0.04]))


@pytest.mark.parametrize("loss_type, tis_cap, beta", DELTA_GRID)
@pytest.mark.same_math
def test_delta_matches_loss_py_fp32(loss_type, tis_cap, beta):
    """ratio -> min(ratio, delta) in the clipped surrogate, forward and backward.

    Sequence 1 (A < 0) has ratios e^0.5 > delta = 1.3, which the cap holds (no
    policy gradient), and e^0.25 between 1 + eps_high and delta, which it lets
    through; sequence 0 (A > 0) is clipped above as usual.
    """
    case = DELTA_GRID.index((loss_type, tis_cap, beta))
    batch = make_batch(seed=case, temperature=0.7)
    base, ids, advantages, mask, old_logps, ref_logps, sampling_logps = batch
    logps = selective_log_softmax(base[:, :-1], ids, 0.7)  # (B, T)
    old_logps[1, 0] = logps[1, 0] - 0.5
    old_logps[1, 1] = logps[1, 1] - 0.25

    out = compare(base, ids, advantages, mask, old_logps, ref_logps,
                  sampling_logps=sampling_logps, tis_cap=tis_cap, loss_type=loss_type,
                  temperature=0.7, epsilon_high=0.2, beta=beta, delta=1.3)
    assert_matches(out, mask)

    grad = out["grad"][0][:, :-1]  # (B, T, V)
    if beta == 0:
        assert grad[1, 0].abs().max() == 0 and grad[1, 1].abs().max() > 0
    stats, _ = out["metrics"]
    assert stats["is_clipped_high"][0, 0] and not stats["is_clipped_low"][1, :2].any()


@pytest.mark.parametrize("delta", [1.0, 0.9])
@pytest.mark.same_math
def test_delta_at_a_tie_and_below_one(delta):
    """On-policy the ratio is exactly 1.

    delta = 1 ties the two sides of the min (torch splits the gradient, and
    both clamps pass it); delta = 0.9 makes the min pick the capped side where
    A > 0 (no gradient) and the clipped one, inside its bounds, where A < 0.
    The judge is TRL's formula in torch; loss.check_settings refuses
    delta <= 1 + eps_high.
    """
    base, ids, advantages, mask, *_ = make_batch()
    logits = base[:, :-1].detach().double().requires_grad_()  # the formula in fp64

    logps = selective_log_softmax(logits, ids)  # (B, T)
    coef_1 = torch.exp(logps - logps.detach())  # (B, T)
    coef_2 = torch.clamp(coef_1, 0.8, 1.2)
    coef_1 = torch.clamp(coef_1, max=delta)
    A = advantages.unsqueeze(-1)  # (B, 1)
    expected = -torch.min(coef_1 * A, coef_2 * A) * mask  # (B, T)
    (expected_grad,) = torch.autograd.grad(expected.sum(), logits)

    fused = base[:, :-1].detach().clone().requires_grad_()
    per_token, _, _ = fused_grpo_token_loss(fused, ids, advantages, mask,
                                            settings=LossSettings(delta=delta))
    (grad,) = torch.autograd.grad(per_token.sum(), fused)

    tol = kernel_tol(logits.shape[-1], mask.numel(), logps.detach())
    assert_close_rel(per_token, expected.detach(), tol, msg="loss")
    assert_close_rel(grad, expected_grad, tol, msg="grad")
    if delta < 1:  # sequence 0 (A > 0): capped, no gradient
        assert grad[0].abs().max() == 0 and grad[1][mask[1] == 1].abs().max() > 0


# ---- clip boundaries and ties --------------------------------------------------

@pytest.mark.parametrize("epsilon_low, epsilon_high",
                         [(0.0, 0.0), (0.0, 0.2), (0.2, 0.0)])
@pytest.mark.same_math
def test_ratio_exactly_on_the_clip_boundary(epsilon_low, epsilon_high):
    """On-policy the ratio is exactly 1.0 in both implementations.

    eps = 0 puts it on a clip bound, where torch.minimum splits a tie and clamp
    passes its bounds: the full gradient flows.
    """
    base, ids, advantages, mask, *_ = make_batch()
    advantages[0] = 0.0  # a tie at any ratio

    out = compare(base, ids, advantages, mask, None, None, epsilon_low=epsilon_low,
                  epsilon_high=epsilon_high)
    assert_matches(out, mask)

    stats, _ = out["metrics"]
    # strict inequalities
    assert not stats["is_clipped_low"].any() and not stats["is_clipped_high"].any()


@pytest.mark.same_math
def test_clipped_side_gets_no_policy_gradient():
    """ratio = e^0.5 > 1 + eps with A > 0, and ratio = e^-0.5 < 1 - eps with
    A < 0: the min picks the clipped (constant) side, so only the KL term moves
    the logits."""
    base, ids, advantages, mask, _, ref_logps, _ = make_batch()
    logps = selective_log_softmax(base[:, :-1], ids).detach()  # (B, T)
    old_logps = logps - 0.5 * torch.sign(advantages).unsqueeze(-1)  # (B, T)

    out = compare(base, ids, advantages, mask, old_logps, ref_logps)
    assert_matches(out, mask)
    assert out["grad"][0].abs().max() == 0

    stats, _ = out["metrics"]
    assert stats["is_clipped_high"][0][mask[0] == 1].all()
    assert stats["is_clipped_low"][1][mask[1] == 1].all()


# ---- extreme logits ------------------------------------------------------------

@pytest.mark.same_math
def test_very_negative_logits():
    """-inf (a banned token) and the lowest finite value in the same rows as
    normal logits.

    loss.py's entropy is NaN at -inf (0 * -inf), so it gets the lowest finite
    value there: the same distribution.
    """
    base, ids, advantages, mask, old_logps, ref_logps, _ = make_batch()
    V = base.shape[-1]
    lowest = torch.finfo(torch.float32).min
    base[:, :, ::3] = -float("inf")
    base[:, :, 1::7] = lowest
    normal = [v for v in range(V) if v % 3 != 0 and v % 7 != 1]
    normal = torch.tensor(normal, device=DEVICE)
    ids = normal[ids % len(normal)]  # chosen tokens have normal logits
    kwargs = dict(beta=0.04, entropy_coef=0.01)

    out = compare(base, ids, advantages, mask, old_logps, ref_logps, **kwargs)
    finite = compare(base.clamp(min=lowest), ids, advantages, mask, old_logps, ref_logps,
                     **kwargs)
    # -inf in ours == the lowest finite value in loss.py
    for name in ("loss", "grad", "logps"):
        assert torch.isfinite(out[name][0]).all()
        scale = loss_scale(finite[name][1]) if name == "loss" else None
        assert_close_rel(out[name][0], finite[name][1], finite["tol"], scale=scale, msg=name)


@pytest.mark.same_math
def test_row_of_lowest_logits_is_uniform():
    """All V logits at the lowest fp32 value: softmax is uniform.

    (loss.py's logsumexp gives logp = 0 here: lowest + log V rounds back to
    lowest, in fp64 as well.)
    """
    V = 150
    logits = torch.full((1, 2, V), torch.finfo(torch.float32).min, device=DEVICE,
                        requires_grad=True)
    ids = torch.tensor([[0, 7]], device=DEVICE)
    ones = torch.ones(1, 2, device=DEVICE)

    settings = LossSettings(temperature=0.7, beta=0.5)
    per_token, logps, stats = fused_grpo_token_loss(logits, ids, ones[0, :1], ones, ones, ones,
                                                    settings=settings, entropy_coef=0.1)
    log_v = torch.log(torch.tensor(float(V), device=DEVICE, dtype=torch.float64))
    assert_close_rel(logps, -log_v.expand(1, 2), KERNEL_TOL, msg="logps")
    assert_close_rel(stats["entropy"], log_v.expand(1, 2), KERNEL_TOL, msg="entropy")

    # uniform p: the entropy term vanishes
    (grad,) = torch.autograd.grad(per_token.sum(), logits)
    # ratio = exp(logp - 1), ref = 1
    dloss_dlogp = -torch.exp(-log_v - 1) + 0.5 * (1 - torch.exp(1 + log_v))
    chosen = (torch.arange(V, device=DEVICE) == ids.unsqueeze(-1)).double()  # (1, 2, V)
    expected = dloss_dlogp / 0.7 * (chosen - 1 / V)  # (1, 2, V)
    assert_close_rel(grad, expected, KERNEL_TOL, msg="grad")


@pytest.mark.parametrize("shift, scale", [(1e4, 3.0), (-1e4, 30.0), (0.0, 300.0)])
@pytest.mark.same_math
def test_very_large_logits(shift, scale):
    """Large offsets and peaked distributions.

    At scale 300 the chosen tokens are the argmax, as sampling would pick them;
    a random one would have logp ~ -1000, below fp32's resolution of 1e-5.
    fp32 loss.py is off by ~ulp(1e4 / T) = 1e-3 at shift 1e4, so the judge is
    loss.py in fp64 on the same fp32 logits.
    """
    base, ids, advantages, mask, *_ = make_batch(scale=scale)
    base = base + shift
    if scale > 100:
        ids = base[:, :-1].argmax(-1)
    logps = selective_log_softmax(base[:, :-1].double(), ids, 0.7).float()
    g = torch.Generator().manual_seed(1)
    old_logps = logps + 0.3 * torch.randn(logps.shape, generator=g).to(DEVICE)
    ref_logps = logps + 0.3 * torch.randn(logps.shape, generator=g).to(DEVICE)

    out = compare(base, ids, advantages, mask, old_logps, ref_logps,
                  ref_dtype=torch.float64, temperature=0.7, beta=0.04, entropy_coef=0.01)
    assert_matches(out, mask)


# ---- layouts, dtypes, memory ---------------------------------------------------

@pytest.mark.same_math
def test_arbitrary_strides():
    """(T, B, V) storage seen as (B, T, V), plus a slice along V's neighbours:
    only stride(-1) == 1 matters."""
    base, ids, advantages, mask, old_logps, ref_logps, _ = make_batch(temperature=0.7)
    base_tbv = base.transpose(0, 1).contiguous()  # (T + 1, B, V)

    out = compare(base_tbv, ids, advantages, mask, old_logps, ref_logps,
                  view=lambda x: x[1:].transpose(0, 1), temperature=0.7, beta=0.04,
                  entropy_coef=0.01)
    assert_matches(out, mask)


@pytest.mark.same_math
def test_inplace_backward_reuses_the_logits_storage():
    base, ids, advantages, mask, old_logps, ref_logps, _ = make_batch()
    out = compare(base, ids, advantages, mask, old_logps, ref_logps, beta=0.04)
    expected = out["grad"][1][:, :-1]

    # contiguous (B, T, V): the trainer's best case
    logits = base[:, :-1].clone().requires_grad_()
    per_token, _, _ = fused_grpo_token_loss(logits, ids, advantages, mask, old_logps,
                                            ref_logps, settings=LossSettings(beta=0.04),
                                            inplace_backward=True)
    reduce_loss(per_token, mask, "grpo").backward()

    assert logits.grad.data_ptr() == logits.data_ptr()
    assert_close_rel(logits.grad, expected, out["tol"], msg="grad")


@pytest.mark.same_math
def test_bf16_within_the_error_of_pytorch_bf16():
    """bf16 logits. The judge: fp32 loss.py on the same (upcast) logits.

    Loss and logps are fp32 in both paths: within kernel_tol. The bf16 gradient:
    ours rounds it once (fp32 -> bf16). loss.py's bf16 path rounds it too, and
    adds the log-prob and entropy gradients in bf16.

    The tolerance, in bf16 ulps of each entry: the largest error of loss.py's
    bf16 path, measured here, + 0.5 ulp under the interpreter (its fp32 -> bf16
    cast truncates; the GPU rounds to nearest even like PyTorch), + fp32 noise
    (1e-6 of the row's largest).
    """
    batch = make_batch(dtype=torch.bfloat16, temperature=0.7)
    base, ids, advantages, mask, old_logps, ref_logps, _ = batch
    kwargs = dict(temperature=0.7, beta=0.04, entropy_coef=0.01)

    ours = compare(base, ids, advantages, mask, old_logps, ref_logps,
                   ref_dtype=torch.float32, **kwargs)
    torch_bf16 = compare(base, ids, advantages, mask, old_logps, ref_logps, **kwargs)
    assert_within_bf16_error(ours, torch_bf16)


def assert_within_bf16_error(ours, torch_bf16):
    """ours: the kernel on bf16 logits vs fp32 loss.py (the judge).

    torch_bf16: loss.py's bf16 path vs itself.
    """
    for name in ("loss", "logps"):
        scale = loss_scale(ours[name][1]) if name == "loss" else None
        assert_close_rel(ours[name][0], ours[name][1], ours["tol"], scale=scale, msg=name)
        assert_close_rel(torch_bf16[name][1], ours[name][1], ours["tol"], scale=scale,
                         msg=name)

    grad = ours["grad"][0]
    judge = ours["grad"][1]
    torch_grad = torch_bf16["grad"][1]
    assert grad.dtype == torch_grad.dtype == torch.bfloat16

    # judge = mantissa * 2**exponent, mantissa in [0.5, 1)
    _, exponent = torch.frexp(judge)
    # bf16: 8 significant bits
    ulp = torch.ldexp(torch.ones_like(judge), exponent - 8) * (judge != 0)
    noise = 1e-6 * judge.abs().amax(-1, keepdim=True)
    err_ours = (grad.float() - judge).abs()
    err_torch = (torch_grad.float() - judge).abs()

    torch_ulps = ((err_torch - noise).clamp(min=0) / ulp)[ulp > 0].max().item()
    ours_ulps = ((err_ours - noise).clamp(min=0) / ulp)[ulp > 0].max().item()
    print(f"bf16 grad max error in ulps: ours {ours_ulps:.3f}, "
          f"loss.py's bf16 path {torch_ulps:.3f}")

    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    assert (err_ours <= (torch_ulps + 0.5 * interpreted) * ulp + noise).all()


def test_bad_inputs_say_what_to_change():
    base, ids, advantages, mask, old_logps, ref_logps, _ = make_batch()
    logits = base[:, :-1]
    plain = LossSettings()

    with pytest.raises(ValueError, match="contiguous"):
        fused_grpo_token_loss(base.transpose(1, 2), ids, advantages, mask, settings=plain)
    with pytest.raises(ValueError, match="ref_logps"):
        fused_grpo_token_loss(logits, ids, advantages, mask, settings=LossSettings(beta=0.1))
    with pytest.raises(ValueError, match="expected ids and mask"):
        fused_grpo_token_loss(base, ids, advantages, mask, settings=plain)
    with pytest.raises(ValueError, match="float64"):
        fused_grpo_token_loss(logits.double(), ids, advantages, mask, settings=plain)
    with pytest.raises(ValueError, match="old_logps"):
        fused_grpo_token_loss(logits, ids, advantages, mask, old_logps[:, :2], settings=plain)
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        fused_grpo_token_loss(logits, ids, advantages, mask,
                              settings=LossSettings(temperature=0))


@pytest.mark.same_math
def test_torch_compile_around_the_op_cpu():
    """Dynamo (eager backend: no C++ toolchain needed) traces the code around
    the op and graph-breaks at it."""
    base, ids, advantages, mask, old_logps, ref_logps, _ = make_batch()
    V = base.shape[-1]
    weight = torch.randn(V, V, generator=torch.Generator().manual_seed(0)).to(DEVICE) / 10
    settings = LossSettings(beta=0.04)

    def step(hidden):
        logits = (hidden @ weight)[:, :-1]
        per_token, _, _ = fused_grpo_token_loss(logits, ids, advantages, mask, old_logps,
                                                ref_logps, settings=settings)
        return reduce_loss(per_token, mask, "bnpo")

    grads = []
    for fn in (step, torch.compile(step, backend="eager")):
        hidden = base.detach().clone().requires_grad_()
        loss = fn(hidden)
        grads.append((loss, *torch.autograd.grad(loss, hidden)))
    assert_close_rel(grads[0][0], grads[1][0], KERNEL_TOL, scale=loss_scale(grads[1][0]),
                     msg="loss")
    assert_close_rel(grads[0][1], grads[1][1], KERNEL_TOL, msg="grad")


# ---- GPU: real shapes ----------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA; the interpreter tests above are the CPU twin")
# N * V = 2.5e9 > 2**31 in the second
@pytest.mark.parametrize("B, T, V", [(8, 512, 151936), (16, 1024, 151936)])
def test_real_shapes_gpu(B, T, V, monkeypatch):
    monkeypatch.setattr(grpo, "BLOCK_V", GPU_BLOCK_V)
    torch.manual_seed(0)
    base = (3 * torch.randn(B, T + 1, V, device="cuda")).bfloat16()  # (B, T + 1, V)
    ids = torch.randint(V, (B, T), device="cuda")
    mask = (torch.rand(B, T, device="cuda") < 0.9).float()
    advantages = torch.randn(B, device="cuda")
    logps = selective_log_softmax(base[:, :-1], ids, 0.7)
    old_logps = logps + 0.3 * torch.randn_like(logps)
    ref_logps = logps + 0.3 * torch.randn_like(logps)
    kwargs = dict(temperature=0.7, epsilon_low=0.2, epsilon_high=0.28, beta=0.04)
    settings = LossSettings(**kwargs)

    ours_base = base.clone().requires_grad_()
    per_token, ours_logps, _ = fused_grpo_token_loss(ours_base[:, :-1], ids, advantages, mask,
                                                     old_logps, ref_logps, settings=settings)
    # unnormalised: gradient entries of order p, so tolerances bite
    (per_token * mask).sum().backward()

    # the last rows hold the largest offsets; loss.py on them only (memory)
    rows = slice(B - 2, B)
    ref_base = base[rows].clone().requires_grad_()
    ref_loss, ref_logps_out, _ = run_reference(
        ref_base[:, :-1], ids[rows], advantages[rows], mask[rows], old_logps[rows],
        ref_logps[rows], loss_type="dr_grpo", **kwargs)
    # dr_grpo's loss times its normaliser B * L = the sum
    normaliser = 2 * REDUCE["dr_grpo"]["max_new_tokens"]
    (ref_grad,) = torch.autograd.grad(ref_loss * normaliser, ref_base)

    torch.testing.assert_close(ours_logps[rows] * mask[rows], ref_logps_out * mask[rows],
                               **GPU_TOL)
    # each side within half a bf16 ulp of the fp32 value
    bf16_tol = dict(atol=1e-6, rtol=2 ** -7)
    torch.testing.assert_close(ours_base.grad[rows].float(), ref_grad.float(), **bf16_tol)

    def step(logits):
        """The code around the op, compiled by inductor."""
        logits = (logits.float() * 1.0).bfloat16()
        per_token, _, _ = fused_grpo_token_loss(logits[:, :-1], ids, advantages, mask,
                                                old_logps, ref_logps, settings=settings)
        return (per_token * mask).sum()

    compiled_base = base.clone().requires_grad_()
    torch.compile(step)(compiled_base).backward()
    torch.testing.assert_close(compiled_base.grad.float(), ours_base.grad.float(),
                               **bf16_tol)
