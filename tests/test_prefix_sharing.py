"""fast.update.completion_logits shares each prompt's forward among its completions.

With prefix sharing, the logits and the gradients must be those of the plain
forward over whole (prompt + completion) sequences, whatever the prompt lengths
(left padding, a 1-token prompt), the micro-batch cut (through a group) and the
dtype. The same math: in fp64 to FP64_TOL, and in fp32 to its rounding (fp32_tol,
tests/helpers.py; the norms' backward by hand runs in fp32 only).
"""
import copy

import pytest
import torch

import fast.update
from fast.update import (RMS_NORMS, RMSNormFunction, completion_logits, completion_logps,
                         fusable_head, rms_norms_by_hand, selective_log_softmax)
from helpers import FP64_TOL, assert_close_rel, fast_forward, fp32_tol, fp64_norms, summed_terms
from model import Forward, prompt_batch, recompute_layers, sequence_batch, sequence_logps


def whole_sequence_logits(model, prompt_ids, completion_ids):
    """The plain way: one (P+T) sequence per completion."""
    ids, mask, positions = sequence_batch(prompt_ids, completion_ids, 0)
    T = completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                logits_to_keep=T + 1)
    return out.logits[:, :-1]


def in_fp32_and_fp64(run, model, n_summed):
    """run(model) on a copy of model in fp32, then in fp64 (its norms too)
    -> [(its result, the tolerance of two computations of the same math)]."""
    fp32 = run(copy.deepcopy(model).float())
    with fp64_norms():
        fp64 = run(copy.deepcopy(model).double())
    return [(fp32, fp32_tol(n_summed)), (fp64, FP64_TOL)]


def random_weights(*shape):
    """A seeded loss weight (the numbers do not depend on the tests before)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1))


def rollout_like(G=3, T=4, lengths=(3, 1, 5, 2)):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 15, (n,), generator=g).tolist() for n in lengths]

    # (N,) each prompt G times, consecutively
    prompt_ids = [p for p in prompts for _ in range(G)]
    completion_ids = torch.randint(3, 15, (len(prompt_ids), T), generator=g)  # (N, T)
    return prompt_ids, completion_ids


def test_prompt_batch_keeps_each_prompt_once():
    prompts = [[5, 6], [5, 6], [7], [7], [5, 6]]
    ids, mask, positions, row = prompt_batch(prompts, pad_id=0)

    # groups, not a set
    assert ids.tolist() == [[5, 6], [0, 7], [5, 6]]
    assert row.tolist() == [0, 0, 1, 1, 2]
    assert mask.tolist() == [[1, 1], [0, 1], [1, 1]]
    assert positions.tolist() == [[0, 1], [0, 0], [0, 1]]


# all, through groups, one completion
@pytest.mark.parametrize("micro", [12, 5, 1])
# a 1-token prompt; no prefix at all
@pytest.mark.parametrize("lengths", [(3, 1, 5, 2), (1, 1, 1, 1)])
@pytest.mark.same_math
def test_logits_and_gradients_match_whole_sequences(tiny, micro, lengths):
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like(lengths=lengths)
    N = len(prompt_ids)
    # a loss that touches every logit
    weights = random_weights(N, completion_ids.shape[1], model.config.vocab_size)

    def run(model):
        model.zero_grad()
        (whole_sequence_logits(model, prompt_ids, completion_ids) * weights).sum().backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters()}

        model.zero_grad()
        prompts = prompt_batch(prompt_ids, 0)
        got = []
        for i in range(0, N, micro):
            rows = slice(i, i + micro)
            logits = completion_logits(model, prompts, rows, completion_ids[rows])  # (n, T, V)
            (logits * weights[rows]).sum().backward()
            got.append(logits.detach())
        got_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

        whole = whole_sequence_logits(model, prompt_ids, completion_ids).detach()
        return torch.cat(got), whole, got_grads, want

    n_summed = summed_terms(model.config, max(lengths) + completion_ids.shape[1])
    for (got, whole, got_grads, want), tol in in_fp32_and_fp64(run, model, n_summed):
        assert_close_rel(got, whole, tol, msg="logits")
        for k, grad in want.items():
            assert_close_rel(got_grads[k], grad, tol, msg=k)


# the prefix shared (fast/update.py), and model.py's plain forward
@pytest.mark.parametrize("forward", [fast_forward(), Forward()], ids=["fast", "plain"])
@pytest.mark.same_math
def test_sequence_logps_bf16_matches_whole_sequences(tiny, forward):
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = whole_sequence_logits(model, prompt_ids, completion_ids)
        want = selective_log_softmax(logits, completion_ids, 1.0)
    prompts = prompt_batch(prompt_ids, 0)
    got = sequence_logps(forward, model, prompts, completion_ids, 1.0, micro=5,
                         dtype=torch.bfloat16)

    assert got.shape == completion_ids.shape
    # bf16 rounding differs with the batch shape
    torch.testing.assert_close(got, want.float(), atol=0.05, rtol=0.0)


def saved_bytes(fn):
    """fn() under autograd -> (its result, the bytes autograd saved for backward)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved)


# through groups; no prefix at all
@pytest.mark.parametrize("micro, lengths", [(5, (3, 1, 5, 2)), (12, (1, 1, 1, 1))])
@pytest.mark.same_math
def test_recomputed_layers_give_the_same_logits_and_gradients(tiny, micro, lengths,
                                                              monkeypatch):
    """--gradient-checkpointing: each layer replayed in backward, its cache update
    repeated (PrefixLayer, ExtendLayer), the same numbers with less saved. In eval
    mode, as train.py runs the policy (transformers' own switch acts only in
    train mode: the flag once did nothing there). transformers' RMSNorms on both
    sides (recompute turns rms_norms_by_hand off; it has its own test)."""
    monkeypatch.setattr(fast.update, "RMS_NORMS", ())
    _, model, _, _ = tiny
    model = copy.deepcopy(model).eval()
    prompt_ids, completion_ids = rollout_like(lengths=lengths)
    N = len(prompt_ids)
    weights = random_weights(N, completion_ids.shape[1], model.config.vocab_size)
    prompts = prompt_batch(prompt_ids, 0)

    def run(m):
        m.zero_grad()
        logits = []
        saved = 0
        for i in range(0, N, micro):
            rows = slice(i, i + micro)

            def forward():
                return completion_logits(m, prompts, rows, completion_ids[rows])  # (n, T, V)

            out, nbytes = saved_bytes(forward)
            saved = max(saved, nbytes)
            (out * weights[rows]).sum().backward()
            logits.append(out.detach())
        grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        return torch.cat(logits), grads, saved

    def both(m):
        # (a copy: in_fp32_and_fp64's) the plain model, then its layers recomputed
        plain = run(m)
        assert recompute_layers(m) == m.config.num_hidden_layers
        return plain, run(m)

    n_summed = summed_terms(model.config, max(lengths) + completion_ids.shape[1])
    for (want, got), tol in in_fp32_and_fp64(both, model, n_summed):
        (want, want_grads, plain_saved), (got, got_grads, recomputed_saved) = want, got
        assert_close_rel(got, want, tol, msg="logits")
        for k in want_grads:
            assert_close_rel(got_grads[k], want_grads[k], tol, msg=k)
        # each layer keeps its input and the prefix cache, not its activations
        assert recomputed_saved < plain_saved / 2, (recomputed_saved, plain_saved)


@pytest.mark.same_math
def test_sliding_window_layers_share_the_prefix_and_refuse_recompute():
    """A sliding-window model (Mistral, window 4 < the sequences) keeps
    transformers' own cache layers: the same logits as whole sequences; its
    layers cannot be replayed, so --gradient-checkpointing is refused."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=32, hidden_size=64, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=32, sliding_window=4, max_position_embeddings=64)
    model = MistralForCausalLM(config).eval()
    prompt_ids, completion_ids = rollout_like(lengths=(6, 1, 7, 2), T=5)

    def run(model):
        want = whole_sequence_logits(model, prompt_ids, completion_ids)
        want.square().sum().backward()
        want_grads = {k: p.grad.clone() for k, p in model.named_parameters()}

        model.zero_grad()
        got = completion_logits(model, prompt_batch(prompt_ids, 0), slice(0, len(prompt_ids)),
                                completion_ids)
        got.square().sum().backward()
        got_grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        return got.detach(), want.detach(), got_grads, want_grads

    n_summed = summed_terms(config, 7 + 5)
    for (got, want, got_grads, want_grads), tol in in_fp32_and_fp64(run, model, n_summed):
        assert_close_rel(got, want, tol, msg="logits")
        for k, grad in want_grads.items():
            assert_close_rel(got_grads[k], grad, tol, msg=k)

    with pytest.raises(ValueError, match="needs full-attention layers"):
        recompute_layers(model)


@pytest.mark.same_math
def test_prefix_gradients_reach_grad_apart(tiny):
    """The prefix's backward runs apart from the completions' (fast.update.backward_apart):
    each weight's .grad is added to twice, once per forward, instead of autograd
    holding the first gradient until the second arrives (a second copy of every
    gradient at the backward's peak). The sum is the whole sequences' gradient."""
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like()
    weights = random_weights(len(prompt_ids), completion_ids.shape[1], model.config.vocab_size)

    def run(model):
        model.zero_grad()
        (whole_sequence_logits(model, prompt_ids, completion_ids) * weights).sum().backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters()}

        model.zero_grad()
        added = {k: 0 for k, _ in model.named_parameters()}
        hooks = [p.register_post_accumulate_grad_hook(
                     lambda p, k=k: added.__setitem__(k, added[k] + 1))
                 for k, p in model.named_parameters()]
        rows = slice(0, len(prompt_ids))
        logits = completion_logits(model, prompt_batch(prompt_ids, 0), rows, completion_ids)
        (logits * weights).sum().backward()
        for h in hooks:
            h.remove()

        # the keys' and values' weights: once by the completions' backward, once by
        # the prefix's (the last layer's queries and MLP see no prefix position's loss)
        kv_weights = [k for k in added if "k_proj" in k or "v_proj" in k]
        assert kv_weights and all(added[k] == 2 for k in kv_weights), added
        assert all(1 <= n <= 2 for n in added.values()), added
        return {k: p.grad.clone() for k, p in model.named_parameters()}, want

    n_summed = summed_terms(model.config, 5 + completion_ids.shape[1])
    for (got, want), tol in in_fp32_and_fp64(run, model, n_summed):
        for k, grad in want.items():
            assert_close_rel(got[k], grad, tol, msg=k)


@pytest.mark.same_math
def test_a_tied_head_gradient_reaches_grad_at_once(tiny):
    """The tied LM head's gradient is added to .grad as soon as it is computed
    (fast.update.tied_head_apart), so it is there before any embedding backward runs:
    in one graph autograd would hold it in a buffer to the end. The sum is the
    whole sequences' gradient."""
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like()
    weights = random_weights(len(prompt_ids), completion_ids.shape[1], model.config.vocab_size)

    def run(model):
        embedding = model.get_input_embeddings()
        assert model.get_output_embeddings().weight is embedding.weight
        model.zero_grad()
        (whole_sequence_logits(model, prompt_ids, completion_ids) * weights).sum().backward()
        want = {k: p.grad.clone() for k, p in model.named_parameters()}

        # at each embedding backward: is the weight's .grad already there?
        seen = []

        def watch(module, inputs, output):
            output.register_hook(lambda grad: seen.append(module.weight.grad is not None))

        model.zero_grad()
        hook = embedding.register_forward_hook(watch)
        rows = slice(0, len(prompt_ids))
        logits = completion_logits(model, prompt_batch(prompt_ids, 0), rows, completion_ids)
        (logits * weights).sum().backward()
        hook.remove()

        # the prefix's lookup and the completions'
        assert seen == [True, True]
        return {k: p.grad.clone() for k, p in model.named_parameters()}, want

    n_summed = summed_terms(model.config, 5 + completion_ids.shape[1])
    for (got, want), tol in in_fp32_and_fp64(run, model, n_summed):
        for k, grad in want.items():
            assert_close_rel(got[k], grad, tol, msg=k)


def test_the_prefix_graph_is_freed_after_its_backward(tiny, monkeypatch):
    """backward_apart's hook must not keep the prefix's graph alive: its closure
    holds the leaves' AccumulateGrad nodes, which hold the hook, a cycle that
    Python's gc cannot collect. Uncut, every micro-batch leaked its prefix's
    activations (45 MB a step of SmolLM2-135M)."""
    import gc
    import weakref

    # the prefix's keys, as backward_apart gets them (its closure keeps them)
    keys = []
    backward_apart = fast.update.backward_apart

    def spy(layers):
        keys.extend(weakref.ref(layer.keys) for layer in layers)
        backward_apart(layers)

    monkeypatch.setattr(fast.update, "backward_apart", spy)
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like()

    rows = slice(0, len(prompt_ids))
    logits = completion_logits(model, prompt_batch(prompt_ids, 0), rows, completion_ids)
    logits.square().mean().backward()
    del logits
    gc.collect()

    assert keys
    assert all(ref() is None for ref in keys)


# all, through groups, one completion; the layers recomputed in the backward
@pytest.mark.parametrize("micro, recompute", [(12, False), (5, False), (1, False), (5, True)])
@pytest.mark.same_math
def test_fused_head_log_probs_and_gradients_match_the_logits(tiny, micro, recompute):
    """fast.update.completion_logps (the LM head and the log-prob fused, the tied
    head's gradient added to .grad in place, the MLPs and attention projections
    on the real tokens only)
    gives the log-probs and the gradients of selective_log_softmax over
    completion_logits's logits, and 0 at padding. Under recompute they run on
    every position (the backward's replay must repeat the forward)."""
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like(T=5)
    N, T = completion_ids.shape
    mask = torch.ones(N, T)
    mask[1, 3:] = 0  # padding, as the rollout leaves it
    mask[7, 1:] = 0
    weights = random_weights(N, T) * mask  # a loss over the kept tokens
    prompts = prompt_batch(prompt_ids, 0)

    def run(model, fused):
        model.zero_grad(set_to_none=True)
        out = []
        for i in range(0, N, micro):
            rows = slice(i, i + micro)
            ids = completion_ids[rows]
            if fused:
                logps = completion_logps(model, prompts, rows, ids, mask[rows], 0.7)
            else:
                logits = completion_logits(model, prompts, rows, ids)
                logps = selective_log_softmax(logits, ids, 0.7)
            (logps * weights[rows]).sum().backward()
            out.append(logps.detach())
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        return torch.cat(out), grads

    def both(model):
        if recompute:
            recompute_layers(model)
        return run(model, fused=False), run(model, fused=True)

    # (train.py fuses the head of an fp32 model only; the op itself runs in fp64)
    assert fusable_head(model)
    n_summed = summed_terms(model.config, 5 + T)
    for ((want, want_grads), (got, got_grads)), tol in in_fp32_and_fp64(both, model, n_summed):
        assert_close_rel(got, want * mask, tol, msg="log-probs")
        assert (got[mask == 0] == 0).all()
        for k, grad in want_grads.items():
            assert_close_rel(got_grads[k], grad, tol, msg=k)


@pytest.mark.same_math
def test_rms_norm_by_hand_is_transformers_forward_with_its_gradients(tiny):
    """RMSNormFunction: the forward's bits of transformers' RMSNorm, and the
    gradients of x and the weight autograd's: in fp64 to FP64_TOL against
    transformers' formula, in fp32 to its rounding (fp32_tol: a mean over the
    64 features, and the 15 positions the weight's gradient sums). Through
    completion_logits (rms_norms_by_hand on every norm of the model: fp32
    only), every weight's gradient that of transformers' norms to fp32
    rounding; under recompute the context is a no-op."""
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    _, model, _, _ = tiny
    gen = torch.Generator().manual_seed(0)
    norm = Qwen2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
    x = torch.randn(3, 5, 64, generator=gen, requires_grad=True)
    grad = torch.randn(3, 5, 64, generator=gen)

    want = norm(x)
    want_x, want_w = torch.autograd.grad(want, [x, norm.weight], grad)
    got = RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)
    got_x, got_w = torch.autograd.grad(got, [x, norm.weight], grad)
    assert torch.equal(got, want)
    for g, w, name in ((got_x, want_x, "x"), (got_w, want_w, "weight")):
        assert_close_rel(g, w, fp32_tol(64 + 15), msg=name)

    # fp64: the same math (transformers' forward would compute in fp32)
    x64 = x.detach().double().requires_grad_()
    grad64 = grad.double()
    norm.double()
    with fp64_norms():
        want = norm(x64)
    assert want.dtype == torch.float64
    want_x, want_w = torch.autograd.grad(want, [x64, norm.weight], grad64)
    got = RMSNormFunction.apply(x64, norm.weight, norm.variance_epsilon)
    got_x, got_w = torch.autograd.grad(got, [x64, norm.weight], grad64)
    for g, w, name in ((got, want, "y"), (got_x, want_x, "x"), (got_w, want_w, "weight")):
        assert_close_rel(g, w, FP64_TOL, msg=name)

    # the whole model, by hand against transformers' norms
    prompt_ids, completion_ids = rollout_like(lengths=(3, 1, 5, 2))
    prompts = prompt_batch(prompt_ids, 0)
    weights = random_weights(*completion_ids.shape, model.config.vocab_size)

    def grads(m):
        m.zero_grad(set_to_none=True)
        logits = completion_logits(m, prompts, slice(None), completion_ids)  # (N, T, V)
        (logits * weights).sum().backward()
        return {k: p.grad.clone() for k, p in m.named_parameters()}

    by_hand = copy.deepcopy(model)
    norms = [m for m in by_hand.modules() if type(m).__name__ in RMS_NORMS]
    assert len(norms) == 2 * by_hand.config.num_hidden_layers + 1
    with rms_norms_by_hand(by_hand):
        assert all("forward" in vars(m) for m in norms)
    plain = copy.deepcopy(model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fast.update, "RMS_NORMS", ())
        want_grads = grads(plain)
    got_grads = grads(by_hand)
    n_summed = summed_terms(model.config, 5 + completion_ids.shape[1])
    for k, w in want_grads.items():
        assert_close_rel(got_grads[k], w, fp32_tol(n_summed), msg=k)

    recompute_layers(by_hand)
    with rms_norms_by_hand(by_hand):
        assert not any("forward" in vars(m) for m in norms)


def test_fusable_head_only_for_a_plain_fp32_head(tiny):
    _, model, _, _ = tiny
    assert fusable_head(model)

    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    assert not fusable_head(bf16)

    biased = copy.deepcopy(model)
    head = biased.get_output_embeddings()
    biased.set_output_embeddings(torch.nn.Linear(head.in_features, head.out_features))
    assert not fusable_head(biased)
