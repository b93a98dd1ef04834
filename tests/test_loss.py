"""loss.py: hand-computed values, gradients (gradcheck in float64), input errors, and policy_loss's two paths."""
import itertools
import math

import pytest
import torch

from loss import (LOSS_TYPES, entropy_from_logits, grpo_loss, policy_loss, reduce_loss, resolve_impl,
                  selective_log_softmax, truncated_is_weight)

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
    weight = truncated_is_weight(old, sampling, 2.0)
    torch.testing.assert_close(weight, torch.tensor([[0.5, 2.0]]))
    loss, _ = grpo_loss(logps, old, None, torch.tensor([1.0]), torch.ones(1, 2), is_weight=weight)
    assert loss.item() == pytest.approx(-(0.5 + 2.0) / 2)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -1.0]]))
    assert not truncated_is_weight(logps, sampling, 2.0).requires_grad  # a constant, even from the current logps


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
                        entropy_coef=0.1, num_items=4 if loss_type == "dapo" else None, max_completion_length=8)
    assert loss.item() == pytest.approx(-0.25) and m["entropy"] == pytest.approx(2.5)
    loss.backward()
    torch.testing.assert_close(ent.grad, -0.1 / 4 * mask.float())


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batch_losses_add_up_to_the_minibatch_loss(loss_type):
    """policy_loss over micro-batches of 1, 2 or 4 sequences: the losses (and gradients) sum to the whole
    minibatch's, entropy bonus and KL included; the logged loss of the minibatch is that sum."""
    (logits, *rest), kw = _micro_batch(OPTIONS["all"])
    kw["minibatch_size"], kw["minibatch_tokens"] = 4, rest[2].sum()  # the 4 sequences are the whole minibatch
    totals = []
    for micro in (4, 2, 1):
        loss, grad = 0.0, torch.zeros_like(logits)
        for i in range(0, 4, micro):
            part = (logits[i:i + micro], *(x[i:i + micro] for x in rest))
            share, metrics = policy_loss(*part, loss_type=loss_type, **kw)
            assert metrics["loss"] == pytest.approx(share.item()) and metrics["tokens"] == part[3].sum().item()
            grad[i:i + micro] += torch.autograd.grad(share, logits)[0][i:i + micro]
            loss += share.item()
        totals.append((loss, grad))
    for loss, grad in totals[1:]:
        assert loss == pytest.approx(totals[0][0], rel=1e-6)
        torch.testing.assert_close(grad, totals[0][1])


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


@pytest.mark.parametrize("loss_type, level, beta", list(itertools.product(LOSS_TYPES, ("token", "sequence"), (0.0, 0.04))))
def test_grpo_loss_gradcheck(loss_type, level, beta):
    logps, old, ref, adv, mask, ent, log_ratio = _gradcheck_inputs()
    # the inputs hold clipped and unclipped tokens, none within 1e-2 of a clip boundary (finite differences)
    lr = log_ratio if level == "token" else ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand(-1, 5)
    for bound in (math.log(0.8), math.log(1.2)):
        assert (lr - bound).abs().min() > 1e-2
    kw = dict(loss_type=loss_type, beta=beta, importance_sampling_level=level, num_items=17, max_completion_length=6)
    _, metrics = grpo_loss(logps, old, ref, adv, mask, **kw)
    assert 0 < metrics["clip_region"] < 1
    assert torch.autograd.gradcheck(
        lambda lp, e: grpo_loss(lp, old, ref, adv, mask, entropies=e, entropy_coef=0.01, **kw)[0],
        (logps.clone().requires_grad_(), ent.clone().requires_grad_()))


def test_gradcheck_tis():
    # (old_logps=None is not gradcheck-able by design: logps.detach() is constant only to autograd;
    # test_on_policy_is_plain_policy_gradient checks that gradient by hand.)
    logps, old, ref, adv, mask, _, _ = _gradcheck_inputs()
    sampling = old + 0.2 * torch.randn(old.shape, **f64)
    assert torch.autograd.gradcheck(
        lambda lp: grpo_loss(lp, old, ref, adv, mask, beta=0.1, is_weight=truncated_is_weight(old, sampling, 1.1))[0],
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


def test_tis_without_sampling_logps():
    with pytest.raises(ValueError, match="sampling_logps"):
        truncated_is_weight(torch.zeros(1, 2), None, 2.0)


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
    "all": dict(temperature=0.7, epsilon_high=0.28, beta=0.04, entropy_coef=0.01, tis_cap=2.0),
    "on_policy_tis": dict(old=False, tis_cap=2.0),  # ref_logps given at beta = 0: kl is logged, not in the loss
    "gspo": dict(importance_sampling_level="sequence", beta=0.04),
}


def _micro_batch(options, n=4, T=3, V=64, device="cpu"):
    """A micro-batch of n sequences out of a minibatch of 2n, with padding, clipped tokens on both sides."""
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
    kw = {k: v for k, v in options.items() if k != "old"}
    return tensors, dict(kw, minibatch_size=2 * n, minibatch_tokens=mask.sum() + 5, max_completion_length=T + 2)


def _inline(logits, ids, advantages, mask, old, ref, sampling, *, minibatch_size, minibatch_tokens, loss_type,
            temperature=1.0, entropy_coef=0.0, tis_cap=0.0, **kw):
    """The micro-batch step spelled out with loss.py's reference pieces: what policy_loss must compute."""
    logps = selective_log_softmax(logits, ids, temperature)  # (n, T)
    entropies = entropy_from_logits(logits, temperature) if entropy_coef else None  # (n, T)
    w = torch.clamp(torch.exp((logps.detach() if old is None else old) - sampling), max=tis_cap).detach()
    loss, metrics = grpo_loss(logps, old, ref, advantages, mask, loss_type=loss_type, entropies=entropies,
                              entropy_coef=entropy_coef, is_weight=w if tis_cap else None,
                              num_sequences=minibatch_size, num_items=minibatch_tokens, **kw)
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
    assert (metrics["clip_region"] > 0) == (rest[3] is not None)  # off-policy inputs exercise clipping


@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")  # intended: see test_kernel.py
@pytest.mark.parametrize("loss_type, options", [("grpo", "plain"), ("bnpo", "all"), ("dr_grpo", "on_policy_tis"),
                                                ("dapo", "all")])
def test_policy_loss_triton_matches_torch(loss_type, options, monkeypatch):
    """The kernel path (under TRITON_INTERPRET=1 on CPU) reports the same metrics and the same gradient."""
    pytest.importorskip("triton")
    import kernels.grpo
    monkeypatch.setattr(kernels.grpo, "BLOCK_V", 32)  # two blocks per row, and few interpreted ops
    (logits, *rest), kw = _micro_batch(OPTIONS[options], device="cuda" if torch.cuda.is_available() else "cpu")
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


def test_resolve_impl_and_policy_loss_errors():
    assert resolve_impl("auto", "cpu") == "torch" and resolve_impl("triton", "cpu") == "triton"
    assert resolve_impl("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_impl("auto", "cuda:0", "sequence") == resolve_impl("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="loss_impl"):
        resolve_impl("fast", "cpu")
    (logits, *rest), kw = _micro_batch({})
    with pytest.raises(ValueError, match="resolve_impl"):
        policy_loss(logits, *rest, impl="auto", **kw)
    with pytest.raises(ValueError, match="sequence"):
        policy_loss(logits, *rest, impl="triton", **dict(kw, importance_sampling_level="sequence"))
