"""The CPU fast paths of the HF engine and the update (fast/), each against
what it replaced.

- sdpa_gqa_attention (fast/attention.py): grouped KV heads passed to SDPA as
  they are, against transformers' "sdpa", which repeats them: the same logits
  and gradients, left-padded, prefix shared (fast/update.py).
- the preallocated KV cache (fast.decode.preallocated_cache), attention over
  its filled slots only, each prompt's keys and values once for its rows
  (fast.attention.SharedPrefix, against SDPA over each row's whole sequence):
  FastHFEngine's log-probs equal a full forward over each finished sequence,
  and greedy decoding picks each step's argmax of that forward.
- draw_tokens (fast/decode.py, inverse CDF): its frequencies match p, and a
  token of probability 0 is never drawn; its two-level CDF picks the tokens one
  cumulative sum over the vocabulary picks for the same uniforms, with the
  log-probs of a log-softmax.
- tiled_head (fast/decode.py): the LM head in weight tiles gives the plain
  head's logits, and the engine the same completions and log-probs.
- leave_batch (fast/decode.py): rows that have ended leave the decode batch,
  with the same completions and log-probs as a batch that keeps them.

The model is a tiny Qwen2 with 2 KV heads for 4 query heads (head_dim 32), as
SmolLM2 and Qwen2.5 group theirs, on the CPU's grouped-KV attention as
fast.install sets it.

Each comparison of two computations of the same math holds in fp64 to FP64_TOL
where the path runs in fp64, and in fp32 to its rounding (fp32_tol,
tests/helpers.py): the decode loop, its shared prompt and tiled head run in
fp32 only.
"""
import contextlib
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

import fast.decode
from fast.attention import GQA_ATTENTION, SharedPrefix, register_gqa_attention
from fast.decode import FastHFEngine, draw_tokens, tiled_head
from fast.update import completion_logits
from helpers import (EPS32, FP64_TOL, PROMPTS, assert_close_rel, fp32_tol, fp64_norms,
                     summed_terms)
from model import load_model, prompt_batch, selective_log_softmax
from task import build_tokenizer


def tiny_qwen2(path, tokenizer, **config):
    """A random tiny Qwen2 (tied head, seed 0) of this config, saved to path with
    the tokenizer -> the policy as load_model loads it, on the CPU's grouped-KV
    attention (as fast.install sets it)."""
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **config)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    policy = load_model(path, torch.float32, torch.device("cpu")).eval()
    policy.set_attn_implementation(register_gqa_attention())
    return policy


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    """(folder, the policy as load_model loads it, tokenizer, prompt ids)."""
    tokenizer = build_tokenizer()
    path = str(tmp_path_factory.mktemp("grouped"))
    policy = tiny_qwen2(path, tokenizer, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    # unequal lengths: left padding in every batch
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    return path, policy, tokenizer, prompt_ids


def test_the_grouped_attention_is_set_on_a_loaded_model(grouped):
    """load_model leaves transformers' default; register_gqa_attention's name
    switches a loaded model to the grouped attention (fast.install, the CPU)."""
    path, policy, _, _ = grouped
    assert policy.config._attn_implementation == GQA_ATTENTION == "tinygrpo_sdpa_gqa"
    plain = load_model(path, torch.float32, torch.device("cpu"))
    assert plain.config._attn_implementation == "sdpa"


@pytest.mark.same_math
def test_grouped_attention_equals_repeated_heads(grouped):
    """fast.update.completion_logits (prefix shared, left padded) and their
    gradients: in fp64 to FP64_TOL, in fp32 to its rounding."""
    path, policy, tokenizer, prompt_ids = grouped
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    assert reference.config._attn_implementation == "sdpa"
    policy = copy.deepcopy(policy)  # the module's: its .grad stays as it was

    # 2 completions per prompt, 6 tokens each
    G, T = 2, 6
    gen = torch.Generator().manual_seed(0)
    every_prompt = [p for p in prompt_ids for _ in range(G)]
    prompts = prompt_batch(every_prompt, tokenizer.pad_token_id)
    ids = torch.randint(0, len(tokenizer), (len(every_prompt), T), generator=gen)  # (N, T)
    rows = torch.arange(len(every_prompt))

    def run(model):
        model.zero_grad()
        logits = completion_logits(model, prompts, rows, ids)  # (N, T, V)
        selective_log_softmax(logits, ids).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return logits.detach(), grads

    n_summed = summed_terms(policy.config, prompts[0].shape[1] + T)
    fp32 = run(policy), run(reference)
    with fp64_norms():
        fp64 = run(policy.double()), run(reference.double())
    for tol, ((ours, our_grads), (theirs, their_grads)) in ((fp32_tol(n_summed), fp32),
                                                          (FP64_TOL, fp64)):
        assert_close_rel(ours, theirs, tol, msg="logits")
        for (name, _), a, b in zip(policy.named_parameters(), our_grads, their_grads,
                                   strict=True):
            assert_close_rel(a, b, tol, msg=name)


@pytest.mark.same_math
def test_shared_prefix_attends_as_each_rows_whole_sequence():
    """SharedPrefix.attend: 3 prompts (left-padded, 2 KV heads for 6 query
    heads), their rows' completions of 5 tokens; then with rows dropped, so
    that prompts have 3, 1 and 2 rows. In fp64: the same math, to FP64_TOL."""
    from types import SimpleNamespace

    gen = torch.Generator().manual_seed(0)
    B, H_kv, H, P, L, d = 3, 2, 6, 7, 5, 32
    f64 = dict(generator=gen, dtype=torch.float64)
    layer = SimpleNamespace(keys=torch.randn(B, H_kv, P, d, **f64),
                            values=torch.randn(B, H_kv, P, d, **f64))
    prompt_mask = torch.ones(B, P, dtype=torch.bool)
    prompt_mask[1, :3] = False  # left padding
    prompt_mask[2, :6] = False
    prompt_of = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2])  # (A,)
    prefix = SharedPrefix(SimpleNamespace(layers=[layer]), prompt_mask, prompt_of)

    def expected(rows, query, keys, values):
        # each row's prompt copied, the padding masked, one SDPA
        own = prompt_of[rows]
        whole_keys = torch.cat([layer.keys[own], keys], 2)  # (A, H_kv, P + L, d)
        whole_values = torch.cat([layer.values[own], values], 2)
        mask = torch.cat([prompt_mask[own], torch.ones(len(rows), L, dtype=torch.bool)], 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            query, whole_keys, whole_values, attn_mask=mask[:, None, None], scale=0.3,
            enable_gqa=True)  # (A, H, 1, d)
        return out.transpose(1, 2)  # (A, 1, H, d)

    rows = torch.arange(len(prompt_of))
    for keep in (None, torch.tensor([0, 2, 3, 5, 6, 7])):
        if keep is not None:
            prefix.keep(keep)
            rows = rows[keep]
        A = len(rows)
        query = torch.randn(A, H, 1, d, **f64)
        keys = torch.randn(A, H_kv, L, d, **f64)
        values = torch.randn(A, H_kv, L, d, **f64)
        got = prefix.attend(0, query, keys, values, 0.3)
        assert got.shape == (A, 1, H, d) and got.dtype == torch.float64
        assert_close_rel(got, expected(rows, query, keys, values), FP64_TOL, msg="attend")


def assert_decode_close(got, want, model, rollout):
    """Log-probs of the same tokens from two fp32 forwards of model: to fp32
    rounding, fp32_tol over the longest sequence's sums."""
    tokens = max(map(len, rollout.prompt_ids)) + rollout.completion_ids.shape[1]
    assert_close_rel(got, want, fp32_tol(summed_terms(model.config, tokens)),
                     msg="log-probs")


def full_forward_logps(model, rollout, temperature):
    """Each finished sequence in one forward, no cache -> ((N, T) log-probs of
    the sampled tokens, (N, T) argmax tokens), 0 where masked."""
    logps = torch.zeros_like(rollout.sampling_logps)  # (N, T)
    argmax = torch.zeros_like(rollout.completion_ids)  # (N, T)
    sequences = zip(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask)

    with torch.no_grad():
        for i, (prompt, ids, mask) in enumerate(sequences):
            n = int(mask.sum())
            seq = torch.tensor([prompt + ids[:n].tolist()])  # (1, P + n)
            logits = model(seq).logits[:, len(prompt) - 1 : -1]  # (1, n, V)
            logps[i, :n] = selective_log_softmax(logits, seq[:, len(prompt):],
                                                 temperature or 1.0)[0]
            argmax[i, :n] = logits[0].argmax(-1)
    return logps, argmax


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.same_math
def test_preallocated_cache_decodes_as_a_full_forward(grouped, temperature):
    _, policy, tokenizer, prompt_ids = grouped
    engine = FastHFEngine(policy, tokenizer, seed=0)
    # the decode steps attend through SharedPrefix
    attended = []
    attend = SharedPrefix.attend
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SharedPrefix, "attend",
                      lambda self, *args: attended.append(1) or attend(self, *args))
        rollout = engine.generate(prompt_ids, 1 if temperature == 0 else 3, 24,
                                  temperature=temperature)
    assert attended
    mask = rollout.completion_mask.bool()
    # long enough that the cache fills well past the prompts
    assert rollout.completion_mask.sum(1).max() >= 16

    logps, argmax = full_forward_logps(policy, rollout, temperature)
    assert_decode_close(rollout.sampling_logps[mask], logps[mask], policy, rollout)
    if temperature == 0:
        assert torch.equal(rollout.completion_ids[mask], argmax[mask])


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A model with a full-attention and a sliding-window layer (window 4, less
    than the sequences) -> (its sampled rollout, the policy)."""
    tokenizer = build_tokenizer()
    path = str(tmp_path_factory.mktemp("mixed"))
    policy = tiny_qwen2(path, tokenizer, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=32, use_sliding_window=True, sliding_window=4,
                        layer_types=["full_attention", "sliding_attention"])

    # prompts of 4, 3 and 2 tokens: the last two left-padded
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    assert [len(p) for p in prompt_ids] == [4, 3, 2]
    rollout = FastHFEngine(policy, tokenizer, seed=0).generate(prompt_ids, 3, 12,
                                                                temperature=1.0)
    assert rollout.completion_mask.sum(1).max() > 4  # past the window
    return rollout, policy


@pytest.mark.same_math
def test_a_sliding_window_layer_decodes_as_a_full_forward(mixed):
    """The cache keeps every slot there (not the filled ones only, nor
    SharedPrefix): the unpadded prompt's rows' log-probs equal a full forward's."""
    rollout, policy = mixed
    logps, _ = full_forward_logps(policy, rollout, 1.0)
    mask = rollout.completion_mask.bool()
    mask[3:] = False  # the first prompt's 3 rows
    assert_decode_close(rollout.sampling_logps[mask], logps[mask], policy, rollout)


@pytest.mark.xfail(strict=True, reason="known: with a sliding-window layer, FastHFEngine's "
                   "left-padded rows differ from a full forward (up to 0.08 here; so at "
                   "f8de745 too); rollout.HFEngine's plain loop matches (2e-7): the fast "
                   "loop's sliding-window cache, not traced yet; so fast.install keeps "
                   "the plain loop for such a model (tests/test_fast.py)")
@pytest.mark.same_math
def test_a_sliding_window_layer_decodes_left_padded_rows_as_a_full_forward(mixed):
    rollout, policy = mixed
    logps, _ = full_forward_logps(policy, rollout, 1.0)
    mask = rollout.completion_mask.bool()
    assert_decode_close(rollout.sampling_logps[mask], logps[mask], policy, rollout)


def test_draw_tokens_matches_the_distribution():
    """200,000 draws from 2 rows: a chi-square test per row at p = 0.001 (a
    fixed seed: the same draws each run), and never a filtered token."""
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0],
                          [0.0, 0.01, 0.09, 0.3, 0.0, 0.6]])
    logps = probs.log()  # -inf at the filtered tokens
    draws = 100_000
    torch.manual_seed(0)
    tokens = torch.stack([draw_tokens(logps.clone())[0] for _ in range(draws)])  # (draws, 2)

    # the 0.999 quantile of chi-square with 4 and 3 degrees of freedom
    critical = {4: 18.47, 3: 16.27}
    for row in range(2):
        counts = torch.bincount(tokens[:, row], minlength=6).double()
        kept = probs[row] > 0
        assert counts[~kept].sum() == 0, "a filtered token was drawn"
        expected = draws * probs[row][kept].double()
        chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
        assert chi2 < critical[int(kept.sum()) - 1], (row, chi2)

    # the test has power: a draw off by one token fails it
    shifted = torch.bincount((tokens[:, 0] + 1).clamp(max=5), minlength=6).double()[:5]
    expected = draws * probs[0][:5].double()
    assert ((shifted - expected) ** 2 / expected).sum().item() > 1000


def one_cumulative_sum(scores):
    """The sampler draw_tokens replaced: one fp64 cumulative sum over V."""
    cdf = scores.log_softmax(-1).exp().double().cumsum(-1)  # (N, V)
    u = torch.rand(cdf.shape[0], 1, dtype=cdf.dtype) * cdf[:, -1:]  # (N, 1)
    return torch.searchsorted(cdf, u, right=True)[:, 0].clamp(max=cdf.shape[1] - 1)


def draw_tol(exact):
    """draw_tokens' log-probs against fp64's: see the test below."""
    return fp32_tol(fast.decode.CDF_BLOCK) + EPS32 * exact.abs().max().item()


@pytest.mark.parametrize("V", [1000, 49152])
@pytest.mark.same_math
def test_two_level_cdf_draws_the_tokens_of_one_cumulative_sum(V):
    """The same uniforms pick the same tokens. A vocabulary of 1000 leaves a
    short last block (CDF_BLOCK 256); some tokens are filtered (-inf). The
    log-probs are fp64's to fp32 rounding: a block's fp32 sum (fp32_tol of
    CDF_BLOCK terms, relative to the total mass: the error of its log) and the
    log-prob's own rounding to fp32 (eps32 of it)."""
    gen = torch.Generator().manual_seed(0)
    scores = 4 * torch.randn(512, V, generator=gen)  # (N, V)
    scores[torch.rand(512, V, generator=gen) < 0.3] = -torch.inf
    # a row whose mass is all in the short last block
    scores[0, : V - 5] = -torch.inf

    torch.manual_seed(1)
    expected = one_cumulative_sum(scores)
    torch.manual_seed(1)
    tokens, logps = draw_tokens(scores.clone())

    assert torch.equal(tokens, expected)
    assert torch.isfinite(scores.gather(1, tokens[:, None])).all()
    exact = scores.double().log_softmax(-1).gather(1, tokens[:, None])[:, 0]  # (N,)
    assert_close_rel(logps, exact, 1.0, scale=draw_tol(exact), msg="drawn log-probs")

    # greedy: the argmax and its log-prob, no uniform drawn
    state = torch.get_rng_state()
    tokens, logps = draw_tokens(scores.clone(), greedy=True)
    assert torch.equal(tokens, scores.argmax(-1))
    exact = scores.double().log_softmax(-1).gather(1, tokens[:, None])[:, 0]  # (N,)
    assert_close_rel(logps, exact, 1.0, scale=draw_tol(exact), msg="greedy log-probs")
    assert torch.equal(torch.get_rng_state(), state)


def test_a_uniform_at_the_top_of_a_row_draws_its_last_token_of_mass():
    """u rounded up to the row's total mass (u < total in exact arithmetic):
    the last token with mass, never a filtered one after it."""
    from fast.decode import _block_sums, _inverse_cdf

    weights = torch.rand(2, 600, generator=torch.Generator().manual_seed(0))  # (N, V)
    weights[0, 400:] = 0  # filtered tokens after the last of mass
    weights[1, 597:] = 0
    block_cdf = _block_sums(weights).double().cumsum(-1)  # (N, blocks)
    u = block_cdf[:, -1:].clone()  # (N, 1) the total itself
    assert torch.equal(_inverse_cdf(weights, block_cdf, u), torch.tensor([399, 596]))


@pytest.mark.same_math
def test_tiled_head_gives_the_plain_heads_logits(grouped, monkeypatch):
    _, policy, _, _ = grouped
    head = policy.get_output_embeddings()
    V, d = head.weight.shape
    # 19 tokens in tiles of 4: the last tile is short
    monkeypatch.setattr(fast.decode, "HEAD_TILE_ROWS", 4)
    monkeypatch.setattr(fast.decode, "HEAD_TILE_MIN_ROWS", 4)
    assert V % 4 != 0
    hidden = torch.randn(6, 1, d, generator=torch.Generator().manual_seed(0))  # (N, 1, d)

    # the tiles are torch.mm's, the plain head F.linear's
    mm_calls = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: mm_calls.append(1) or mm(*a, **k))

    with torch.no_grad():
        plain = head(hidden)  # (N, 1, V)
        plain_few = head(hidden[:3])
        with tiled_head(policy, torch.float32):
            assert "forward" in vars(head)
            tiled = head(hidden)
            assert len(mm_calls) == 5

            # fewer rows than HEAD_TILE_MIN_ROWS: the plain head, bit for bit
            assert torch.equal(head(hidden[:3]), plain_few)
            assert len(mm_calls) == 5
        assert "forward" not in vars(head)
    assert tiled.shape == plain.shape
    # two fp32 orders of the same dot products over d: fp32_tol(d) of the
    # terms' magnitude, sum |h_i w_i|
    magnitude = (hidden.abs() @ head.weight.abs().t()).max().item()
    assert_close_rel(tiled, plain, fp32_tol(d), scale=magnitude, msg="tiled head")

    # with gradients (never in the sampler), the plain head
    with tiled_head(policy, torch.float32):
        head(hidden).sum().backward()
    assert head.weight.grad is not None
    policy.zero_grad(set_to_none=True)

    # under autocast the head is left as it is
    with tiled_head(policy, torch.bfloat16):
        assert "forward" not in vars(head)


@pytest.mark.same_math
def test_tiled_head_keeps_the_engines_samples(grouped, monkeypatch):
    _, policy, tokenizer, prompt_ids = grouped
    monkeypatch.setattr(fast.decode, "HEAD_TILE_ROWS", 4)
    # tiles at any number of rows, for the tiny batch
    monkeypatch.setattr(fast.decode, "HEAD_TILE_MIN_ROWS", 1)

    # a new engine each: the same seed for its first call
    tiled = FastHFEngine(policy, tokenizer, seed=0).generate(prompt_ids, 3, 24,
                                                         temperature=0.7)
    monkeypatch.setattr(fast.decode, "tiled_head", lambda model, dtype: contextlib.nullcontext())
    plain = FastHFEngine(policy, tokenizer, seed=0).generate(prompt_ids, 3, 24,
                                                         temperature=0.7)

    assert torch.equal(tiled.completion_ids, plain.completion_ids)
    mask = plain.completion_mask.bool()
    assert_decode_close(tiled.sampling_logps[mask], plain.sampling_logps[mask], policy, plain)


@pytest.mark.same_math
def test_ended_rows_leave_the_batch_with_the_same_samples(grouped, monkeypatch):
    _, policy, tokenizer, prompt_ids = grouped
    kept = []

    def leave_batch(ended):
        keep = rollout_leave_batch(ended)
        kept.append(len(ended) if keep is None else len(keep))
        return keep

    rollout_leave_batch = fast.decode.leave_batch
    monkeypatch.setattr(fast.decode, "leave_batch", leave_batch)
    # a high temperature: rows end at many lengths
    leaving = FastHFEngine(policy, tokenizer, seed=0).generate(prompt_ids, 4, 40,
                                                           temperature=1.5)
    # the check has power: the batch shrank, and some rows ran to the end
    assert min(kept) < 3 * 4 and not leaving.is_finished.all()

    monkeypatch.setattr(fast.decode, "leave_batch", lambda ended: None)
    staying = FastHFEngine(policy, tokenizer, seed=0).generate(prompt_ids, 4, 40,
                                                           temperature=1.5)

    assert torch.equal(leaving.completion_ids, staying.completion_ids)
    mask = staying.completion_mask.bool()
    assert_decode_close(leaving.sampling_logps[mask], staying.sampling_logps[mask], policy,
                        staying)
