"""loss.py: hand-computed values, gradients (gradcheck in float64, and autograd through a naive implementation),
input errors, micro-batch invariance, and policy_loss's two paths."""
import itertools
import math

import pytest
import torch

from loss import (LOSS_TYPES, choose_impl, entropy_from_logits, grpo_loss, importance_weight, off_policy_keep,
                  policy_loss, policy_weight, reduce_loss, resolve_impl, selective_log_softmax, step_metrics)
from reduction import (REDUCTION, high_entropy_mask, minibatch_tokens, quantile_over_ranks, token_stats,
                       unique_rows)

f64 = dict(dtype=torch.float64)


# ---- selective_log_softmax / entropy_from_logits ------------------------------------------------

def test_selective_log_softmax_by_hand():
    logits = torch.tensor([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # (1, 2, 2)
    ids = torch.tensor([[1, 0]])
    out = selective_log_softmax(logits, ids)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[math.log(0.75), math.log(0.5)]]))
    # temperature 2 turns logits (0, 2 ln 3) into (0, ln 3)
    out_t = selective_log_softmax(torch.tensor([[[0.0, 2 * math.log(3.0)]]]), torch.tensor([[1]]), 2.0)
    torch.testing.assert_close(out_t, torch.tensor([[math.log(0.75)]]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selective_log_softmax_matches_full_log_softmax_in_chunks(dtype):
    torch.manual_seed(0)
    model_logits = (3 * torch.randn(3, 8, 50)).to(dtype).requires_grad_()
    logits = model_logits[:, :-1]  # (3, 7, 50), not contiguous, as in a trainer
    ids = torch.randint(50, (3, 7))
    full = (logits.float() / 0.7).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (3, 7)
    (grad_full,) = torch.autograd.grad(full.square().sum(), model_logits)
    for chunk_rows in (None, 1, 4, 7, 14):  # all at once, positions, ragged pieces, one sequence, 2 (ragged)
        out = selective_log_softmax(logits, ids, 0.7, chunk_rows=chunk_rows)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, full, rtol=1e-6, atol=1e-6)
        (grad,) = torch.autograd.grad(out.square().sum(), model_logits)
        if dtype == torch.float32:
            torch.testing.assert_close(grad, grad_full, rtol=1e-5, atol=1e-5)
        else:  # the gradient is stored in bf16: equal up to one bf16 rounding
            torch.testing.assert_close(grad.float(), grad_full.float(), rtol=1e-2, atol=1e-3)


def test_chunks_are_checkpointed_only_when_there_are_several(monkeypatch):
    """One chunk runs plainly (the default run's tiny logits: checkpointing each row cost 500x); several chunks are
    each checkpointed, so no fp32 copy of more than one chunk is kept for backward (the bound at V = 151,936)."""
    import model
    calls = []
    monkeypatch.setattr(model, "checkpoint", lambda fn, *a, **kw: calls.append(1) or fn(*a))
    logits = torch.randn(3, 7, 50, requires_grad=True)
    ids = torch.randint(50, (3, 7))
    for chunk_rows, expected in ((None, 0), (21, 0), (14, 2), (7, 3), (4, 6)):
        calls.clear()
        selective_log_softmax(logits, ids, chunk_rows=chunk_rows).sum().backward()
        assert len(calls) == expected, (chunk_rows, len(calls))
    monkeypatch.setattr(model, "CHUNK_ELEMENTS", 7 * 50)  # the default bound: one sequence of V = 50 per chunk
    calls.clear()
    entropy_from_logits(logits).sum().backward()
    assert len(calls) == 3


def test_entropy_by_hand():
    uniform = torch.zeros(2, 3, 8)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2, 3), math.log(8)))
    two = torch.tensor([[[0.0, math.log(3.0)]]])  # p = (1/4, 3/4)
    expected = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(entropy_from_logits(two), torch.tensor([[expected]]))
    # temperature -> infinity flattens any distribution to uniform
    torch.testing.assert_close(entropy_from_logits(torch.tensor([[[0.0, 5.0]]]), 1e6), torch.tensor([[math.log(2)]]))


def test_chunked_functions_gradcheck_float64():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, **f64, requires_grad=True)
    ids = torch.randint(5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: selective_log_softmax(x, ids, 0.8, chunk_rows=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 1.3, chunk_rows=4), (logits,))


# ---- reduce_loss ------------------------------------------------------------------------------

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)


@pytest.mark.parametrize("loss_type, kwargs, expected", [
    ("grpo", {}, (1.5 + 4.0) / 2),                                   # mean of per-sequence means
    ("bnpo", {}, 7.0 / 3),                                           # 1+2+4 over 3 tokens
    ("dr_grpo", {"max_completion_length": 4}, 7.0 / (2 * 4)),        # over B * L
    ("dapo", {"num_items": 14}, 7.0 / 14),                           # over the generation batch
])
def test_reduce_loss_by_hand(loss_type, kwargs, expected):
    assert reduce_loss(PER_TOKEN, MASK, loss_type, **kwargs).item() == pytest.approx(expected)


def test_reduce_loss_empty_sequence_counts_as_zero():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert reduce_loss(PER_TOKEN, mask, "grpo").item() == pytest.approx(1.5 / 2)


# ---- grpo_loss: values by hand ----------------------------------------------------------------

def test_on_policy_is_plain_policy_gradient():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = grpo_loss(logps, None, None, adv, mask)
    assert loss.item() == pytest.approx(-(1.0 + -2.0) / 2)  # ratio is 1: -mean_i A_i
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_region"] == 0.0 and "kl" not in metrics
    loss.backward()  # d/dlogp = -A_i / len_i / B
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -0.25], [1.0, 0.0]]))


def test_clipping_by_hand():
    # ratios 1.5 (A=+1, clipped high), 0.5 (A=-1, clipped low), 1.5 (A=-1, not clipped: pessimistic bound)
    logps = torch.log(torch.tensor([[1.5], [0.5], [1.5]])).requires_grad_()
    old = torch.zeros(3, 1)
    adv = torch.tensor([1.0, -1.0, -1.0])
    loss, metrics = grpo_loss(logps, old, None, adv, torch.ones(3, 1), loss_type="bnpo")
    assert loss.item() == pytest.approx((-1.2 + 0.8 + 1.5) / 3)
    loss.backward()  # clipped tokens get no gradient; d(ratio)/d(logp) = ratio
    torch.testing.assert_close(logps.grad, torch.tensor([[0.0], [0.0], [1.5 / 3]]))
    assert metrics["clip_high"] == pytest.approx(1 / 3) and metrics["clip_low"] == pytest.approx(1 / 3)
    assert metrics["clip_region"] == pytest.approx(2 / 3) and metrics["ratio_mean"] == pytest.approx(3.5 / 3)


def test_asymmetric_clip_higher():  # DAPO's clip-higher: eps_high 0.28 lets ratio 1.25 through
    logps, old, adv = torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1), torch.tensor([1.0])
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(1, 1), epsilon_high=0.28)
    assert loss.item() == pytest.approx(-1.25) and m["clip_high"] == 0.0
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(1, 1))
    assert loss.item() == pytest.approx(-1.2) and m["clip_high"] == 1.0


def test_k3_kl_by_hand():
    logps = torch.tensor([[-1.0, -1.0]])
    ref = logps + torch.tensor([[math.log(2.0), 0.0]])  # ref - logp = ln 2 -> kl = 2 - ln 2 - 1; equal -> 0
    kl = 1 - math.log(2.0)
    loss, m = grpo_loss(logps, None, ref, torch.tensor([0.0]), torch.ones(1, 2), beta=0.5)
    assert loss.item() == pytest.approx(0.5 * kl / 2) and m["kl"] == pytest.approx(kl / 2)
    _, m0 = grpo_loss(logps, None, ref, torch.tensor([0.0]), torch.ones(1, 2), beta=0.0)
    assert m0["kl"] == pytest.approx(kl / 2)  # logged even when it is not in the loss


def test_sequence_level_ratio_is_geometric_mean():
    logps = torch.zeros(1, 3)
    old = torch.tensor([[-0.1, -0.3, 9.0]])  # token log-ratios 0.1, 0.3; the third token is padding
    mask = torch.tensor([[1, 1, 0]])
    loss, m = grpo_loss(logps, old, None, torch.tensor([1.0]), mask, importance_sampling_level="sequence",
                        epsilon_high=0.5)
    assert loss.item() == pytest.approx(-math.exp(0.2)) and m["ratio_mean"] == pytest.approx(math.exp(0.2))
    loss, m = grpo_loss(logps, old, None, torch.tensor([1.0]), mask, importance_sampling_level="token",
                        epsilon_high=0.5)
    assert loss.item() == pytest.approx(-(math.exp(0.1) + math.exp(0.3)) / 2)


def test_truncated_importance_sampling_weight():
    logps = torch.zeros(1, 2, requires_grad=True)
    old = torch.zeros(1, 2)
    sampling = torch.tensor([[math.log(2.0), -math.log(4.0)]])  # weights exp(old - sampling) = 0.5 and 4 -> cap 2
    weight, ratio, outside = importance_weight(old, sampling, torch.ones(1, 2), "token_truncate", is_max=2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0]]))
    torch.testing.assert_close(ratio, torch.tensor([[0.5, 4.0]]))
    assert outside is None  # truncate modes drop no token
    loss, _ = grpo_loss(logps, old, None, torch.tensor([1.0]), torch.ones(1, 2), token_weight=weight)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -1.0]]))
    # a constant, even from the current logps
    assert not importance_weight(logps, sampling, torch.ones(1, 2), "token_truncate")[0].requires_grad


def test_entropy_bonus():
    logps = torch.zeros(1, 2)
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    loss, m = grpo_loss(logps, None, None, torch.tensor([1.0]), torch.ones(1, 2), entropies=ent, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 2.0) and m["entropy"] == pytest.approx(2.0)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.05, -0.05]]))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_entropy_bonus_is_the_mean_token_entropy_whatever_the_loss_type(loss_type):
    """Sequences of 1 and 3 tokens, entropies 1 and (2, 3, 4): the bonus is 0.1 x the token mean 2.5 for every loss
    type (inside the per-token loss, dr_grpo would give 0.1 x 10 / (2 x 8) and grpo 0.1 x mean(1, 3) = 0.2)."""
    ent = torch.tensor([[1.0, 0.0, 0.0], [2.0, 3.0, 4.0]], requires_grad=True)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]])
    loss, m = grpo_loss(torch.zeros(2, 3), None, None, torch.zeros(2), mask, loss_type=loss_type, entropies=ent,
                        entropy_coef=0.1, num_items=4 if REDUCTION[loss_type] == "dapo" else None,
                        max_completion_length=8)
    assert loss.item() == pytest.approx(-0.25) and m["entropy"] == pytest.approx(2.5)
    loss.backward()
    torch.testing.assert_close(ent.grad, -0.1 / 4 * mask.float())


ROW_KW = ("truncated", "high_entropy")  # policy_loss's per-row keyword tensors: sliced with the micro-batch


@pytest.mark.parametrize("loss_type, options", list(itertools.product(LOSS_TYPES, ("all", "knobs", "token_mask"))))
def test_micro_batch_losses_add_up_to_the_minibatch_loss(loss_type, options):
    """policy_loss over micro-batches of 1, 2 or 4 sequences: the losses (and gradients) sum to the whole
    minibatch's, entropy bonus, KL and every mask included; the logged loss of the minibatch is that sum, and the
    step's metrics (step_metrics) are the same at every micro-batch size."""
    (logits, *rest), kw = _micro_batch(OPTIONS[options])
    kw["minibatch_size"] = 4  # the 4 sequences are the whole minibatch
    kw["minibatch_tokens"] = minibatch_tokens(rest[2], kw.get("truncated"))
    totals = []
    for micro in (4, 2, 1):
        loss, grad, micro_metrics = 0.0, torch.zeros_like(logits), []
        for i in range(0, 4, micro):
            part = (logits[i:i + micro], *(None if x is None else x[i:i + micro] for x in rest))
            part_kw = {k: v[i:i + micro] if k in ROW_KW else v for k, v in kw.items()}
            share, metrics = policy_loss(*part, loss_type=loss_type, **part_kw)
            assert metrics["loss"] == pytest.approx(share.item()) and metrics["tokens"] == part[3].sum().item()
            grad[i:i + micro] += torch.autograd.grad(share, logits)[0][i:i + micro]
            loss += share.item()
            micro_metrics.append(metrics)
        totals.append((loss, grad, step_metrics(micro_metrics, [torch.tensor(1.0)])))
    for loss, grad, logged in totals[1:]:
        assert loss == pytest.approx(totals[0][0], rel=1e-6)
        torch.testing.assert_close(grad, totals[0][1])
        assert list(logged) == list(totals[0][2])
        for key, value in totals[0][2].items():
            assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


# ---- grpo_loss: gradients ---------------------------------------------------------------------

def _gradcheck_inputs():
    torch.manual_seed(0)
    B, T = 4, 5
    log_ratio = torch.tensor([[0.5, -0.05, 0.3, -0.6, 0.1], [-0.4, 0.05, 0.4, 0.0, 0.2],
                              [0.02, -0.5, 0.6, 0.1, -0.1], [0.3, 0.4, -0.1, 0.35, 0.25]], **f64)
    logps = -torch.rand(B, T, **f64) - 0.1
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    adv = torch.tensor([1.0, -0.7, -1.3, 0.8], **f64)
    ref = logps + 0.3 * torch.randn(B, T, **f64)
    return logps, logps - log_ratio, ref, adv, mask, torch.rand(B, T, **f64) + 0.5, log_ratio


# cispo is not gradcheck-able by design: its weight sg(min(ratio, eps_high)) is constant only to autograd
# (test_cispo_by_hand and the naive implementation below check its gradient)
SMOOTH_TYPES = [t for t in LOSS_TYPES if t != "cispo"]
KL_OPTIONS = [(0.0, False), (0.04, False), (0.04, True)]  # (beta, kl_bias_correction)


@pytest.mark.parametrize("loss_type, level, kl", list(itertools.product(SMOOTH_TYPES, ("token", "sequence"), KL_OPTIONS)))
def test_grpo_loss_gradcheck(loss_type, level, kl):
    logps, old, ref, adv, mask, ent, log_ratio = _gradcheck_inputs()
    # the inputs hold clipped and unclipped tokens, none within 1e-2 of a clip boundary (finite differences)
    lr = log_ratio if level == "token" else ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand(-1, 5)
    for bound in (math.log(0.8), math.log(1.2)):
        assert (lr - bound).abs().min() > 1e-2
    beta, kl_bias_correction = kl
    kw = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level, num_items=17, max_completion_length=6,
              kl_bias_correction=kl_bias_correction)
    _, metrics = grpo_loss(logps, old, ref, adv, mask, **kw)
    assert loss_type == "sapo" or 0 < metrics["clip_region"] < 1
    assert torch.autograd.gradcheck(
        lambda lp, e: grpo_loss(lp, old, ref, adv, mask, entropies=e, entropy_coef=0.01, **kw)[0],
        (logps.clone().requires_grad_(), ent.clone().requires_grad_()))


def test_gradcheck_tis():
    # (old_logps=None is not gradcheck-able by design: logps.detach() is constant only to autograd;
    # test_on_policy_is_plain_policy_gradient checks that gradient by hand.)
    logps, old, ref, adv, mask, _, _ = _gradcheck_inputs()
    sampling = old + 0.2 * torch.randn(old.shape, **f64)
    weight = importance_weight(old, sampling, mask, "token_truncate", is_max=1.1)[0]
    assert torch.autograd.gradcheck(lambda lp: grpo_loss(lp, old, ref, adv, mask, beta=0.1, token_weight=weight)[0],
                                    (logps.clone().requires_grad_(),))


# ---- errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(loss_type="ppo"), "loss_type='ppo'"),
    (dict(importance_sampling_level="tokens"), "importance_sampling_level"),
    (dict(loss_type="dapo"), "num_items"),
    (dict(loss_type="dr_grpo"), "max_completion_length"),
    (dict(beta=0.1), "ref_logps"),
    (dict(entropy_coef=0.1), "entropies"),
])
def test_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        grpo_loss(torch.zeros(1, 2), None, None, torch.ones(1), torch.ones(1, 2), **kwargs)


def test_knobs_without_sampling_logps():
    with pytest.raises(ValueError, match="sampling_logps"):
        importance_weight(torch.zeros(1, 2), None, torch.ones(1, 2), "token_truncate", is_max=2.0)
    with pytest.raises(ValueError, match="sampling_logps"):
        off_policy_keep(torch.ones(1), torch.zeros(1, 2), None, torch.ones(1, 2), 0.5)
    with pytest.raises(ValueError, match="is_correction"):
        policy_loss(torch.zeros(1, 2, 4), torch.zeros(1, 2, dtype=torch.long), torch.ones(1), torch.ones(1, 2),
                    minibatch_size=1, minibatch_tokens=torch.tensor(2.0), is_correction="sequence")


def test_reduce_loss_errors():
    with pytest.raises(ValueError, match="loss_type"):
        reduce_loss(PER_TOKEN, MASK, "mean")
    with pytest.raises(ValueError, match="num_items"):
        reduce_loss(PER_TOKEN, MASK, "dapo")


def test_entropy_with_banned_tokens_is_finite():
    """-inf logits (banned tokens) have p = 0 and add nothing: entropy over the rest, and a finite gradient."""
    logits = torch.tensor([[[0.0, 0.0, -float("inf"), 0.0]]], requires_grad=True)  # (1, 1, 4)
    h = entropy_from_logits(logits)
    torch.testing.assert_close(h, torch.log(torch.tensor([[3.0]])))
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


# ---- policy_loss: a micro-batch from logits, either path -----------------------------------------

OPTIONS = {  # what train.py can pass; every set runs with every loss type on the torch path
    "plain": dict(),
    "all": dict(temperature=0.7, epsilon_high=0.28, beta=0.04, entropy_coef=0.01, is_correction="token_truncate",
                is_max=2.0),
    # ref_logps given at beta = 0: kl is logged, not in the loss
    "on_policy_tis": dict(old=False, is_correction="token_truncate", is_max=2.0),
    "gspo": dict(importance_sampling_level="sequence", beta=0.04),
    # every mask at once, each removing some tokens and keeping others (test_knobs_fire)
    "knobs": dict(temperature=0.7, beta=0.04, kl_bias_correction=True, entropy_coef=0.01,
                  is_correction="sequence_mask", is_max=1.2, off_policy_mask=0.0, masks=True),
    "token_mask": dict(old=False, beta=0.04, kl_bias_correction=True, is_correction="token_mask", is_min=0.9,
                       is_max=1.1, sapo_tau_pos=0.5, sapo_tau_neg=2.0),
}


def _micro_batch(options, n=4, T=3, V=64, device="cpu"):
    """A micro-batch of n sequences out of a minibatch of 2n, with padding, clipped tokens on both sides; with
    options["masks"], also a truncated sequence (the third) and a high-entropy mask."""
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(n, T, V, generator=g)).requires_grad_()  # (n, T, V)
    ids = torch.randint(V, (n, T), generator=g)  # (n, T)
    mask = torch.ones(n, T)  # (n, T)
    mask[1, 1:] = 0
    mask[3, 2] = 0
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.2])  # (n,)
    logps = selective_log_softmax(logits.detach(), ids, options.get("temperature", 1.0))  # (n, T)
    old = logps + 0.3 * torch.randn(n, T, generator=g)
    old[0, 0], old[3, 0] = logps[0, 0] - 1, logps[3, 0] + 1  # clipped above (A > 0) and below (A < 0)
    ref, sampling = old + 0.3 * torch.randn(n, T, generator=g), old + 0.2 * torch.randn(n, T, generator=g)
    logits = logits.detach().to(device).requires_grad_()
    ids, advantages, mask, old, ref, sampling = (x.to(device) for x in (ids, advantages, mask, old, ref, sampling))
    tensors = (logits, ids, advantages, mask, old if options.get("old", True) else None, ref, sampling)
    kw = {k: v for k, v in options.items() if k not in ("old", "masks")}
    if options.get("masks"):
        kw["truncated"] = torch.tensor([False, False, True, False], device=device)  # (n,)
        high = torch.tensor([[1, 0, 1], [1, 1, 1], [0, 1, 1], [0, 1, 0]], dtype=torch.bool)  # (n, T)
        kw["high_entropy"] = high.to(device) & (mask > 0)
    return tensors, dict(kw, minibatch_size=2 * n, minibatch_tokens=mask.sum() + 5, max_completion_length=T + 2)


def _inline(logits, ids, advantages, mask, old, ref, sampling, *, minibatch_size, minibatch_tokens, loss_type,
            temperature=1.0, entropy_coef=0.0, truncated=None, high_entropy=None, is_correction="off",
            is_min=0.0, is_max=3.0, off_policy_mask=None, **kw):
    """The micro-batch step spelled out with loss.py's reference pieces: what policy_loss must compute."""
    logps = selective_log_softmax(logits, ids, temperature)  # (n, T)
    entropies = entropy_from_logits(logits, temperature) if entropy_coef else None  # (n, T)
    current = logps.detach()  # (n, T)
    weight, stats = policy_weight(advantages, mask, current if old is None else old, current, sampling,
                                  truncated=truncated, high_entropy=high_entropy, is_correction=is_correction,
                                  is_min=is_min, is_max=is_max, off_policy_mask=off_policy_mask)
    loss, metrics = grpo_loss(logps, old, ref, advantages, mask, loss_type=loss_type, entropies=entropies,
                              entropy_coef=entropy_coef, token_weight=weight, truncated=truncated,
                              num_sequences=minibatch_size, num_items=minibatch_tokens, **kw)
    if stats:
        metrics.update(token_stats(mask, stats))
    return loss, dict(metrics, loss=loss.item(), tokens=mask.sum().item())


@pytest.mark.parametrize("loss_type, options", list(itertools.product(LOSS_TYPES, OPTIONS)))
def test_policy_loss_torch_is_the_inline_step_bit_for_bit(loss_type, options):
    (logits, *rest), kw = _micro_batch(OPTIONS[options])
    expected, expected_metrics = _inline(logits, *rest, loss_type=loss_type, **kw)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    scaled, metrics = policy_loss(logits, *rest, loss_type=loss_type, impl="torch", **kw)
    (grad,) = torch.autograd.grad(scaled, logits)
    assert torch.equal(scaled, expected) and torch.equal(grad, expected_grad)
    assert list(metrics.items()) == list(expected_metrics.items())  # names, order and values
    if loss_type not in ("cispo", "sapo"):  # off-policy inputs exercise clipping
        assert (metrics["clip_region"] > 0) == (rest[3] is not None)


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")  # intended: see test_kernel.py
@pytest.mark.parametrize("loss_type, options", [("grpo", "plain"), ("bnpo", "all"), ("dr_grpo", "on_policy_tis"),
                                                ("dapo", "all"), ("cispo", "knobs"), ("sapo", "knobs"),
                                                ("grpo", "token_mask"), ("cispo", "token_mask")])
def test_policy_loss_triton_matches_torch(loss_type, options, monkeypatch):
    """The kernel path (under TRITON_INTERPRET=1 on CPU) reports the same metrics and the same gradient."""
    pytest.importorskip("triton")
    import kernels.grpo
    monkeypatch.setattr(kernels.grpo, "BLOCK_V", 32)  # two blocks per row, and few interpreted ops
    (logits, *rest), kw = _micro_batch(OPTIONS[options], device="cuda" if torch.cuda.is_available() else "cpu")
    if loss_type == "cispo":
        kw["epsilon_high"] = 1.3  # the cap: some weights capped, others not
    out = {}
    for impl in ("torch", "triton"):
        scaled, metrics = policy_loss(logits, *rest, loss_type=loss_type, impl=impl, **kw)
        out[impl] = (scaled, *torch.autograd.grad(scaled, logits), metrics)
    (ref_loss, ref_grad, ref_metrics), (loss, grad, metrics) = out["torch"], out["triton"]
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)
    assert list(metrics) == list(ref_metrics)
    for key, value in ref_metrics.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6 if key.startswith("clip") else 1e-5, rel=1e-5), key


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")  # intended: see test_kernel.py
@pytest.mark.parametrize("loss_type, options, impl", [*itertools.product(LOSS_TYPES, OPTIONS, ["torch"]),
                                                      ("grpo", "all", "triton"), ("dapo", "knobs", "triton")])
def test_unique_rows_with_counts_are_the_whole_batch(loss_type, options, impl, monkeypatch):
    """train.py trains one row of each set of identical completions, weighed by its count (reduction.unique_rows):
    the loss, the gradient of every distinct row's logits and the step's metrics are those of the whole batch, for
    every loss type and knob, on both paths; in two parts (as two ranks), the token counts that weigh the metrics."""
    if impl == "triton":
        pytest.importorskip("triton")
        import kernels.grpo
        monkeypatch.setattr(kernels.grpo, "BLOCK_V", 32)
    (logits, *rest), kw = _micro_batch(OPTIONS[options])
    index = torch.tensor([0, 0, 1, 2, 2, 2, 3])  # (N,) the whole batch: rows 0 and 2 repeat
    keep, counts = unique_rows(index, rest[0][index], rest[2][index], rest[1][index])
    assert keep.tolist() == [0, 2, 3, 6] and counts.tolist() == [2, 1, 3, 1]
    truncated = kw["truncated"][index] if "truncated" in kw else None  # (N,)
    shared = dict(kw, minibatch_size=7, minibatch_tokens=minibatch_tokens(rest[2][index], truncated))
    out = {}
    for name, parts in (("whole", [index[:3], index[3:]]), ("unique", [torch.arange(2), torch.arange(2, 4)])):
        loss, grad, micro_metrics = 0.0, 0.0, []
        for rows in parts:  # indices of the 4 distinct rows
            part = [None if x is None else x[rows] for x in rest]
            part_kw = {k: v[rows] if k in ROW_KW else v for k, v in shared.items()}
            share, metrics = policy_loss(logits[rows], *part, loss_type=loss_type, impl=impl,
                                         counts=None if name == "whole" else counts[rows], **part_kw)
            loss, grad = loss + share, grad + torch.autograd.grad(share, logits)[0]
            micro_metrics.append(metrics)
        out[name] = (loss, grad, step_metrics(micro_metrics, [torch.tensor(1.0)]))
    (loss, grad, logged), (ref_loss, ref_grad, ref_logged) = out["unique"], out["whole"]
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=1e-6)
    assert list(logged) == list(ref_logged)
    for key, value in ref_logged.items():
        assert logged[key] == pytest.approx(value, abs=1e-6, rel=1e-6), key


def test_unique_rows_tell_apart_prompts_masks_and_advantages():
    """Equal tokens under another prompt, another mask (a tool output) or another advantage (a reward that is not a
    function of the text) are other rows."""
    ids = torch.tensor([[5, 6], [5, 6], [5, 6], [5, 6], [5, 6]])
    prompt_row = torch.tensor([0, 0, 1, 1, 1])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    advantages = torch.tensor([0.5, 0.5, 0.5, 0.5, -0.5])
    keep, counts = unique_rows(prompt_row, ids, mask, advantages)
    assert keep.tolist() == [0, 2, 3, 4] and counts.tolist() == [2, 1, 1, 1]


def test_choose_impl_says_why_and_policy_loss_errors():
    assert resolve_impl("auto", "cpu") == "torch" and resolve_impl("triton", "cpu") == "triton"
    assert resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_impl("auto", "cuda:0", "sequence") == resolve_impl("torch", "cuda") == "torch"
    assert choose_impl("auto", "cpu") == ("torch", "auto: no CUDA, where Triton would only interpret")
    assert choose_impl("auto", "cuda", "sequence") == ("torch", "auto: the kernel has no sequence-level ratio")
    assert choose_impl("auto", "cuda") == ("triton", "auto: the fused kernel on CUDA")
    assert choose_impl("torch", "cuda") == ("torch", "--loss-impl torch")
    with pytest.raises(ValueError, match="loss_impl"):
        resolve_impl("fast", "cpu")
    (logits, *rest), kw = _micro_batch({})
    with pytest.raises(ValueError, match="choose_impl"):
        policy_loss(logits, *rest, impl="auto", **kw)
    with pytest.raises(ValueError, match="sequence"):
        policy_loss(logits, *rest, impl="triton", **dict(kw, importance_sampling_level="sequence"))


# ---- the knobs: each objective and mask by hand ---------------------------------------------------

def test_cispo_by_hand():
    """ratios 1.5, 6 and 0.5: the weight is min(ratio, eps_high = 5), a constant, times -A logp; every token keeps a
    gradient (-w A), the capped one too (the clipped surrogate would give it none)."""
    logps = torch.tensor([[-1.0], [-2.0], [-0.5]], requires_grad=True)
    old = logps.detach() - torch.log(torch.tensor([[1.5], [6.0], [0.5]]))
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(3, 1), loss_type="cispo", epsilon_high=5.0, num_items=3)
    assert loss.item() == pytest.approx(-(1.5 * -1.0 + 5.0 * -2.0 - 0.5 * -0.5) / 3)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.5], [-5.0], [0.5]]) / 3)
    assert list(m) == ["clip_high", "ratio_mean"] and m["clip_high"] == pytest.approx(1 / 3)


def test_sapo_by_hand():
    """-sigmoid(tau (ratio - 1)) 4 / tau A, tau 1 for A > 0 and 1.05 otherwise; reduced like grpo; gradient
    -4 A sigma (1 - sigma) ratio, which at ratio 1 is -A: grpo's."""
    ratio = torch.tensor([[1.5, 1.0], [0.5, 1.0]])
    logps = torch.zeros(2, 2, requires_grad=True)
    old = -torch.log(ratio)
    adv = torch.tensor([2.0, -1.0])
    tau = torch.tensor([[1.0], [1.05]])
    sigma = torch.sigmoid(tau * (ratio - 1))
    loss, m = grpo_loss(logps, old, None, adv, torch.ones(2, 2), loss_type="sapo")
    expected = (-(sigma * 4 / tau) * adv.unsqueeze(-1)).mean()
    assert loss.item() == pytest.approx(expected.item()) and "clip_region" not in m
    loss.backward()
    grad = -4 * adv.unsqueeze(-1) * sigma * (1 - sigma) * ratio / 4  # 2 sequences x 2 tokens
    torch.testing.assert_close(logps.grad, grad)
    torch.testing.assert_close(logps.grad[:, 1], -adv / 4)  # ratio 1: the plain policy gradient


def test_kl_bias_correction_by_hand():
    """kl * ratio: the value at ratio 1 is k3's, the gradient gains kl (d ratio / d logp = ratio): ratio (1 - e^d + kl)
    with d = ref - logp."""
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    old = torch.tensor([[-1.2, -2.0]])  # ratios e^0.2 and 1
    delta = ref - logps.detach()
    kl = torch.exp(delta) - delta - 1
    ratio = torch.exp(logps.detach() - old)
    zero = torch.zeros(1)
    loss, m = grpo_loss(logps, old, ref, zero, torch.ones(1, 2), beta=0.5, kl_bias_correction=True)
    assert loss.item() == pytest.approx((0.5 * kl * ratio).mean().item()) and m["kl"] == pytest.approx(kl.mean().item())
    loss.backward()
    torch.testing.assert_close(logps.grad, 0.5 * ratio * (1 - torch.exp(delta) + kl) / 2)
    on_policy = logps.detach().clone().requires_grad_()
    loss, _ = grpo_loss(on_policy, None, ref, zero, torch.ones(1, 2), beta=0.5, kl_bias_correction=True)
    assert loss.item() == pytest.approx((0.5 * kl).mean().item())
    loss.backward()
    torch.testing.assert_close(on_policy.grad, 0.5 * (1 - torch.exp(delta) + kl) / 2)


def test_importance_weight_modes_by_hand():
    """Token ratios exp(old - sampling) = 0.5, 2, 4 (and a masked token whose sampling log-prob is nonsense); the
    sequence ratio is their product over the unmasked tokens, 4, for every token of the sequence."""
    old = torch.zeros(1, 4)
    sampling = torch.tensor([[math.log(2.0), -math.log(2.0), -math.log(4.0), -50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    cases = {  # mode, is_min, is_max -> weight at the 3 unmasked tokens, dropped tokens
        ("token_truncate", 0.0, 3.0): ([0.5, 2.0, 3.0], None),
        ("token_truncate", 1.0, 3.0): ([1.0, 2.0, 3.0], None),
        ("token_mask", 0.0, 3.0): ([0.5, 2.0, 0.0], [False, False, True]),
        ("token_mask", 1.0, 3.0): ([0.0, 2.0, 0.0], [True, False, True]),
        ("sequence_truncate", 0.0, 3.0): ([3.0, 3.0, 3.0], None),
        ("sequence_mask", 0.0, 3.0): ([0.0, 0.0, 0.0], [True, True, True]),
        ("sequence_mask", 0.0, 5.0): ([4.0, 4.0, 4.0], [False, False, False]),
    }
    for (mode, is_min, is_max), (weight, dropped) in cases.items():
        w, ratio, outside = importance_weight(old, sampling, mask, mode, is_min, is_max)
        torch.testing.assert_close(w[0, :3], torch.tensor(weight), msg=mode)
        expected_ratio = [4.0] * 3 if mode.startswith("sequence") else [0.5, 2.0, 4.0]
        torch.testing.assert_close(ratio[0, :3], torch.tensor(expected_ratio), msg=mode)
        assert (outside is None) == (dropped is None)
        if dropped is not None:
            assert outside[0, :3].tolist() == dropped, mode


def test_off_policy_keep_by_hand():
    """Drop a sequence only when A < 0 and its mean sampled KL(sampler || policy) exceeds delta (eq. 9)."""
    logps = torch.zeros(4, 2)
    sampling = torch.tensor([[0.5, 0.5], [0.5, 0.5], [0.1, 0.1], [0.5, 9.0]])  # KL 0.5, 0.5, 0.1 and 0.5 (masked 9)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    keep = off_policy_keep(torch.tensor([1.0, -1.0, -1.0, -1.0]), logps, sampling, mask, 0.3)
    assert keep.tolist() == [True, False, True, False]
    assert off_policy_keep(torch.tensor([0.0, -1.0, -1.0, -1.0]), logps, sampling, mask, 0.5).all()


def test_truncated_completions_leave_the_loss():
    """A truncated sequence drops out of the loss, its KL, the entropy bonus and the normaliser: the loss is what
    the other sequences give alone, over the same minibatch count (grpo) or its kept tokens (dapo)."""
    logps, old, ref, adv, mask, ent, _ = _gradcheck_inputs()
    truncated = torch.tensor([False, True, False, False])
    keep = ~truncated
    kw = dict(beta=0.04, entropies=ent, entropy_coef=0.01)
    for loss_type, extra, extra_kept in (("grpo", dict(num_sequences=4), dict(num_sequences=4)),
                                         ("dapo", dict(num_items=minibatch_tokens(mask, truncated)),
                                          dict(num_items=mask[keep].sum()))):
        loss, _ = grpo_loss(logps, old, ref, adv, mask, loss_type=loss_type, truncated=truncated, **kw, **extra)
        alone, _ = grpo_loss(logps[keep], old[keep], ref[keep], adv[keep], mask[keep], loss_type=loss_type,
                             **dict(kw, entropies=ent[keep]), **extra_kept)
        torch.testing.assert_close(loss, alone)
    assert minibatch_tokens(mask, truncated).item() == mask.sum().item() - 3


def test_high_entropy_mask_keeps_the_top_quantile():
    """Entropies 0..9 at 10 unmasked tokens (and masked ones higher still): rho = 0.2 keeps the two highest, as
    TRL's get_high_entropy_mask (quantile 1 - rho, tokens >= it); rho = 1 keeps all; the quantile is torch's."""
    entropies = torch.tensor([[0.0, 1, 2, 3, 100], [4, 5, 6, 7, 100], [8, 9, 100, 100, 100]])
    mask = entropies < 100
    high = high_entropy_mask(entropies, mask, 0.2)
    assert high.sum() == 2 and high[2, :2].all()
    assert torch.equal(high_entropy_mask(entropies, mask, 1.0), mask)
    values = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    for q in (0.0, 0.3, 0.8, 1.0):
        ours = quantile_over_ranks(values.view(10, 100), torch.ones(10, 100), q)
        assert ours.item() == pytest.approx(torch.quantile(values, q).item(), abs=1e-7)
    assert quantile_over_ranks(values.view(10, 100), torch.zeros(10, 100), 0.5) == float("inf")  # no token


def test_knobs_fire_and_their_metrics():
    """The "knobs" option set removes some tokens with every mask and keeps others (or the tests above prove
    little), and logs each knob's metric; with every knob off, no new metric appears."""
    (logits, *rest), kw = _micro_batch(OPTIONS["knobs"])
    _, metrics = policy_loss(logits, *rest, loss_type="grpo", **kw)
    for key in ("frac_masked_truncated", "frac_is_masked", "frac_off_policy_masked", "frac_low_entropy"):
        assert 0 < metrics[key] < 1, (key, metrics[key])
    assert metrics["frac_masked_truncated"] == pytest.approx(3 / 9)  # the third sequence: 3 of the 9 tokens
    assert metrics["frac_low_entropy"] == pytest.approx(2 / 9)  # of the 6 kept tokens, 2 are not in the top
    assert 0 < metrics["is_ratio_mean"] < metrics["is_ratio_max"]
    _, plain = policy_loss(logits, *rest, loss_type="grpo", **_micro_batch(OPTIONS["plain"])[1])
    assert list(plain) == ["clip_low", "clip_high", "clip_region", "ratio_mean", "kl", "loss", "tokens"]


def test_step_metrics_takes_the_max_of_a_max():
    micro = [dict(clip_low=0.5, is_ratio_max=2.0, loss=1.0, tokens=1.0), dict(clip_low=0.0, is_ratio_max=3.0,
                                                                                loss=2.0, tokens=3.0)]
    logged = step_metrics(micro, [torch.tensor(1.0)])
    assert logged == dict(clip_low=0.125, is_ratio_max=3.0, loss=3.0, grad_norm=1.0)


# ---- the knobs: autograd through a naive implementation --------------------------------------------

def _naive_policy_loss(logits, ids, A, mask, old, ref, sampling, *, minibatch_size, minibatch_tokens, loss_type,
                       temperature=1.0, epsilon_low=0.2, epsilon_high=0.2, beta=0.0, entropy_coef=0.0,
                       importance_sampling_level="token", is_correction="off", is_min=0.0, is_max=3.0,
                       off_policy_mask=None, kl_bias_correction=False, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                       truncated=None, high_entropy=None, max_completion_length=None):
    """The loss of every option, token by token in plain Python over each sequence: no loss.py code."""
    logp_all = torch.log_softmax(logits / temperature, -1)  # (n, T, V)
    p_all = logp_all.exp()
    total, bonus = 0.0, 0.0
    for i in range(logits.shape[0]):
        tokens = [t for t in range(logits.shape[1]) if mask[i, t] and not (truncated is not None and truncated[i])]
        lp = [logp_all[i, t, ids[i, t]] for t in tokens]
        o = [old[i, t] if old is not None else lp[k].detach() for k, t in enumerate(tokens)]
        ratios = [torch.exp(lp[k] - o[k]) for k in range(len(tokens))]
        if importance_sampling_level == "sequence" and tokens:
            seq = torch.exp(sum(lp[k] - o[k] for k in range(len(tokens))) / len(tokens))
            ratios = [seq] * len(tokens)
        # IS weights, from every unmasked token of the sequence
        all_tokens = [t for t in range(logits.shape[1]) if mask[i, t]]
        o_all = {t: old[i, t] if old is not None else logp_all[i, t, ids[i, t]].detach() for t in all_tokens}
        diffs = {t: float(o_all[t] - sampling[i, t]) for t in all_tokens}
        weights = {t: 1.0 for t in all_tokens}
        if is_correction != "off":
            for t in all_tokens:
                r = math.exp(sum(diffs.values())) if is_correction.startswith("sequence") else math.exp(diffs[t])
                if is_correction.endswith("truncate"):
                    weights[t] = min(max(r, is_min), is_max)
                else:
                    weights[t] = r if is_min <= r <= is_max else 0.0
        if off_policy_mask is not None and all_tokens:
            seq_kl = sum(float(sampling[i, t] - logp_all[i, t, ids[i, t]].detach()) for t in all_tokens) / len(all_tokens)
            if A[i] < 0 and seq_kl > off_policy_mask:
                weights = {t: 0.0 for t in all_tokens}
        losses = []
        for k, t in enumerate(tokens):
            r = ratios[k]
            if loss_type == "cispo":
                pg = -min(float(r.detach()), epsilon_high) * A[i] * lp[k]
            elif loss_type == "sapo":
                tau = sapo_tau_pos if A[i] > 0 else sapo_tau_neg
                pg = -torch.sigmoid(tau * (r - 1)) * 4 / tau * A[i]
            else:
                pg = -torch.minimum(r * A[i], torch.clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A[i])
            w = weights[t] * (1.0 if high_entropy is None else float(high_entropy[i, t]))
            d = ref[i, t] - lp[k]
            kl = torch.exp(d) - d - 1
            losses.append(pg * w + beta * (kl * r if kl_bias_correction else kl))
            bonus = bonus + entropy_coef * -(p_all[i, t] * logp_all[i, t]).sum() / minibatch_tokens
        if losses and loss_type in ("grpo", "sapo"):
            total = total + sum(losses) / len(losses) / minibatch_size
        elif losses and loss_type == "dr_grpo":
            total = total + sum(losses) / (minibatch_size * max_completion_length)
        elif losses:
            total = total + sum(losses) / minibatch_tokens
    return total - bonus


@pytest.mark.parametrize("loss_type, options", list(itertools.product(
    LOSS_TYPES, ("all", "on_policy_tis", "gspo", "knobs", "token_mask"))))
def test_policy_loss_matches_a_naive_implementation(loss_type, options):
    """Loss and gradient w.r.t. the logits (float64), for every loss type with every knob."""
    (logits, *rest), kw = _micro_batch(OPTIONS[options])
    logits = logits.detach().double().requires_grad_()
    rest = [x.double() if x is not None and x.is_floating_point() else x for x in rest]
    kw["minibatch_tokens"] = minibatch_tokens(rest[2], kw.get("truncated"))
    loss, _ = policy_loss(logits, *rest, loss_type=loss_type, **kw)
    (grad,) = torch.autograd.grad(loss, logits)
    naive = _naive_policy_loss(logits, *rest, loss_type=loss_type, **kw)
    (naive_grad,) = torch.autograd.grad(naive, logits)
    torch.testing.assert_close(loss, naive, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, naive_grad, rtol=1e-10, atol=1e-12)
