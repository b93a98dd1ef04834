"""
Rollout: sample G completions for each prompt from the current policy, with the sampler's own log-probabilities.

    sampling_logps[i, t] = log softmax(process(logits_t) / temperature)[completion_ids[i, t]]
where process = repetition penalty, and the top-k / top-p / min-p filters after the temperature. With no filters
this is what the trainer recomputes (loss.selective_log_softmax); *raw* logprobs would break that (trl#4159).

Engines (generate -> Rollout, sync_weights(model) -> {seconds, bytes}, state_dict, load_state_dict, close):
    VLLMEngine(model_path, ...)  vLLM 0.32 in the training process; under torchrun one per rank (external_launcher)
    HFEngine(model, tokenizer)   transformers generate (KV cache) on the trainer's own model object
    RemoteEngine(url, tokenizer) in server.py: the client of a vLLM rollout server on other GPUs or nodes
    make_engine("auto" | "vllm" | "hf" | "server", ...) picks one; "auto" = vLLM when it imports.

Tests: python -m pytest -q tests/test_rollout*.py; benchmark: python bench.py rollout

Simplifications:
1. Weights are synced in-process, one parameter at a time, through vLLM's own `reload_weights` (the older
   `model.load_weights` recipe fails on CPU in 0.32: see shared/notes/vllm-cpu.md), cast to the engine's dtype
   (fp32 master weights into a bf16 engine: vLLM casts too, but warns for every tensor). FSDP2 parameters are
   gathered with DTensor.full_tensor() as vLLM pulls them, so peak extra memory is about one layer.
2. Engines sample from torch's global RNG (in-process vLLM too), so each generate call runs on a private
   stream seeded by (engine seed, call number: the engine's state_dict) and restores the trainer's RNG after:
   runs are reproducible, the trainer's randomness untouched. Never a per-request seed (SamplingParams(seed=)):
   all G completions of a prompt would share one stream and come out identical. Give each rank its own seed.
3. Under torchrun, tensor_parallel_size N groups N consecutive ranks (a shard each) into one engine: generate gathers
   the group's prompts into one call and hands each rank its own completions. A group's ranks pass the same seed.
4. vLLM applies min-p before top-k / top-p and HF after; the two agree when at most one filter is on.
5. HFEngine keeps every step's processed scores (N, V) until generate returns (HF's output_scores), so
   its memory grows with N * T * V: it is the fallback for small models, not the fast path.
6. VLLMEngine.close() tears down vLLM's process-wide state, including torch.distributed's default
   process group (vllm/distributed/parallel_state.py): close the last engine once, at the very end.
7. On CPU, VLLMEngine sizes the KV cache to the need (cpu_kv_cache_bytes) and runs the one op vLLM's sampler
   compiles (the sampled token's rank, unused here) eagerly, for the whole process: 6-7 s less start-up.
"""
import inspect
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import private_rng, sequence_batch
from lora import sync_parameters


@dataclass
class Rollout:
    prompt_ids: list[list[int]]     # (N,) the prompt of each completion: each prompt repeated G times
    completion_ids: torch.Tensor    # (N, T) long, right-padded with the pad id
    completion_mask: torch.Tensor   # (N, T) float, 1 up to and including EOS, 0 after
    sampling_logps: torch.Tensor    # (N, T) float32, the sampler's logprob of each token, 0 where masked
    is_finished: torch.Tensor       # (N,) bool, True if EOS was sampled, False if cut at max_new_tokens
    texts: list[str]                # (N,) completions decoded up to (excluding) EOS


def build_rollout(prompt_ids, G, completions, logps, finished, pad_id, tokenizer):
    """Lists per completion (token ids, their logprobs, EOS reached) -> a padded Rollout on CPU."""
    N, T = len(completions), max([1] + [len(c) for c in completions])
    completion_ids = torch.full((N, T), pad_id, dtype=torch.long)  # (N, T)
    completion_mask, sampling_logps = torch.zeros(N, T), torch.zeros(N, T)  # (N, T) x2: mask, sampler's logps
    for i, (ids, lps) in enumerate(zip(completions, logps)):
        completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[i, : len(ids)] = 1
        sampling_logps[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    texts = tokenizer.batch_decode([ids[:-1] if f else ids for ids, f in zip(completions, finished)],
                                   skip_special_tokens=True)
    return Rollout([p for p in prompt_ids for _ in range(G)], completion_ids, completion_mask, sampling_logps,
                   torch.tensor(finished, dtype=torch.bool), texts)


def pad_id(tokenizer):
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def call_seed(seed, call):
    return seed * 1_000_003 + call  # distinct for every (engine seed, call number) below a million calls


def unwrap(model):  # the module under a DDP wrapper (its parameter names lack the 'module.' prefix)
    return model.module if hasattr(model, "module") else model


def full_named_parameters(model, counter, dtype=None):
    """(name, full tensor in dtype, else its own) one parameter at a time, in module order (LoRA: the adapted
    modules only, merged: lora.sync_parameters). FSDP2 parameters are DTensors: full_tensor() all-gathers one
    when vLLM asks for it (a collective: every rank must call sync_weights). Tied weights go under both names, as
    in an HF state_dict: vLLM 0.32's layer-wise reload refreshes a layer once all its weights arrived, and with
    tie_word_embeddings the LM head is its own layer; sent only as embed_tokens, the logits kept the old ones."""
    for name, param in sync_parameters(unwrap(model)):
        tensor = param.detach()
        tensor = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).to(dtype or param.dtype)
        counter["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def cpu_kv_cache_bytes(config, max_model_len, dtype, ram_fraction, max_num_seqs=256, block=128):
    """What vLLM's CPU default batch (256 sequences) of max_model_len tokens needs, in its 128-token blocks, at most
    ram_fraction of the RAM: vLLM would zero all of that fraction (3.4 s of start-up; the tiny model needs 67 MB)."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    itemsize = torch.empty(0, dtype=getattr(torch, str(dtype).removeprefix("torch."))).element_size()
    tokens = max_num_seqs * -(-(max_model_len or text.max_position_embeddings) // block) * block
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(min(tokens * 2 * text.num_hidden_layers * heads * head_dim * itemsize, ram_fraction * ram))


# -----------------------------------------------------------------------------
# Engines: what they share, then vLLM and HF transformers (the server's client is in server.py)

class Engine:
    """What the engines share. Each implements sample(prompt_ids, n, max_new_tokens, rng_seed, **sampling) ->
    (token ids, their logprobs, EOS reached), n lists per prompt drawn from the stream rng_seed; generate picks
    the stream from (seed, call number), groups, pads and decodes. The call number is the whole state_dict."""
    tp_group, tp_rank = None, 0  # a tensor-parallel group of ranks sharing one engine (simplification 3)

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, **sampling):
        """G completions per prompt (consecutive in the Rollout), each until EOS or max_new_tokens. sampling: top_p,
        top_k (0, None = off), min_p, repetition_penalty. Temperature 0 = greedy: one completion per prompt, repeated
        G times (vLLM and HF refuse n > 1 there). Under tensor parallelism each rank passes its own prompts."""
        everyone = [prompt_ids]
        if self.tp_group is not None:  # the group's shards run every call together: sample all members' prompts
            everyone = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(everyone, prompt_ids, group=self.tp_group)
        prompts = sum(everyone, [])  # (B,) the group's prompts, rank after rank
        if not prompts or not all(isinstance(p, list) and p and isinstance(p[0], int) for p in prompts):
            raise ValueError("prompt_ids must be a non-empty list of non-empty lists of token ids, "
                             "e.g. tokenizer(prompts)['input_ids']")
        if G < 1 or max_new_tokens < 1:
            raise ValueError(f"G ({G}) and max_new_tokens ({max_new_tokens}) must be >= 1")
        n = 1 if temperature == 0 else G
        lists = self.sample(prompts, n, max_new_tokens, call_seed(self.seed, self.calls), temperature=temperature, **sampling)
        self.calls += 1
        start = sum(map(len, everyone[: self.tp_rank])) * n  # n completions per prompt, in rank order
        lists = [[x for x in xs[start : start + len(prompt_ids) * n] for _ in range(G // n)] for xs in lists]
        return build_rollout(prompt_ids, G, *lists, self.pad_id, self.tokenizer)

    def state_dict(self):
        return dict(calls=self.calls)  # the position in the sampling streams (simplification 2)

    def load_state_dict(self, state):
        self.calls = state["calls"]

    def close(self):
        pass


class VLLMEngine(Engine):
    def __init__(self, model_path, *, seed=0, dtype=None, max_model_len=None, gpu_memory_utilization=0.3,
                 tensor_parallel_size=1, distributed=None, **llm_kwargs):
        """model_path: a save_pretrained folder or a hub id; extra kwargs go to LLM(). On CPU, gpu_memory_utilization
        is the fraction of the NUMA node's RAM for the KV cache after this process's RSS (or kv_cache_memory_bytes=)."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        from transformers import AutoConfig
        from vllm import LLM

        config = AutoConfig.from_pretrained(model_path)
        if dtype in (None, "auto"):  # the checkpoint's (float32 if unsaid): vLLM's "auto" samples fp32 ones in bf16
            dtype = config.dtype or torch.float32
        if not torch.cuda.is_available():  # start-up on CPU: simplification 7
            llm_kwargs.setdefault("kv_cache_memory_bytes", cpu_kv_cache_bytes(config, max_model_len, dtype,
                                                                              gpu_memory_utilization))
            from vllm.v1.sample import sampler
            sampler.batched_count_greater_than = getattr(sampler.batched_count_greater_than,
                                                         "_torchdynamo_orig_callable", sampler.batched_count_greater_than)
        # Reloads warn for what they did not get: RotaryEmbedding's computed cos/sin cache; with LoRA, unchanged layers
        for reload in ("layerwise", "inplace"):  # "X: Failed to load weights", "Following weights were not loaded"
            logging.getLogger(f"vllm.model_executor.model_loader.reload.{reload}").addFilter(
                lambda record: not any(s in record.getMessage() for s in ("Failed to load weights", "were not loaded")))
        if distributed is None:  # vLLM alone also initialises a 1-process group, hence the size test
            distributed = dist.is_initialized() and dist.get_world_size() > 1
        if tensor_parallel_size > 1 and not distributed and llm_kwargs.get("distributed_executor_backend") != "mp":
            raise ValueError("tensor_parallel_size > 1 needs torchrun (one shard per rank, external_launcher)")
        if distributed and tensor_parallel_size > 1:  # groups of consecutive ranks, as vLLM's (simplification 3):
            tp, rank = tensor_parallel_size, dist.get_rank()  # every rank creates every group, then keeps its own
            groups = [dist.new_group(list(range(g, g + tp))) for g in range(0, dist.get_world_size(), tp)]
            self.tp_group, self.tp_rank = groups[rank // tp], rank % tp
        if distributed:
            llm_kwargs["distributed_executor_backend"] = "external_launcher"
        llm_kwargs.setdefault("enforce_eager", not torch.cuda.is_available())  # CPU: compiling only slows start-up
        llm_kwargs.setdefault("use_tqdm_on_load", False)  # a one-shard bar, before the trainer's first line
        self.seed, self.calls, threads, set_num_threads = seed, 0, torch.get_num_threads(), torch.set_num_threads
        with private_rng(seed):  # LLM(seed=...) reseeds the global RNGs (random, numpy, torch): keep ours
            self.llm = LLM(model=model_path, seed=seed, dtype=dtype, max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                           logprobs_mode="processed_logprobs", **llm_kwargs)  # after temperature, filters (trl#4159)
        # vLLM's CPU worker drops torch to 1 thread (unless OMP_NUM_THREADS is set) and makes torch.set_num_threads
        # a no-op for the whole process (vllm/v1/worker/cpu_worker.py). The trainer shares the process: undo both.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        self.tokenizer, self.pad_id = self.llm.get_tokenizer(), pad_id(self.llm.get_tokenizer())

    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
               repetition_penalty=1.0):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, min_p=min_p,
                                top_k=max(top_k or 0, 0), repetition_penalty=repetition_penalty,
                                logprobs=0, detokenize=False)  # only the sampled token's logprob; we decode later
        with private_rng(rng_seed):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        samples = [s for out in outputs for s in sorted(out.outputs, key=lambda s: s.index)]  # n per prompt
        return ([list(s.token_ids) for s in samples],
                [[step[tok].logprob for tok, step in zip(s.token_ids, s.logprobs)] for s in samples],
                [s.finish_reason == "stop" for s in samples])  # "stop" = EOS (no stop strings set), else "length"

    def sync_weights(self, model):
        """Copy the trainer's weights (plain, DDP or FSDP2 model) into the engine, then drop the prefix cache
        (its KV entries were computed with the old weights). Returns {seconds, bytes}."""
        start, counter = time.perf_counter(), {"bytes": 0}
        weights = full_named_parameters(model, counter, self.llm.llm_engine.model_config.dtype)  # streamed, in-process
        with torch.no_grad():
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.reset_prefix_cache()
        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def close(self):
        """Shut the engine down (also destroys torch.distributed's default group: see simplification 6)."""
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


class HFEngine(Engine):
    def __init__(self, model, tokenizer, *, seed=0, dtype="float32"):
        """Samples from the trainer's model object itself (no sync needed), autocast to the trainer's compute dtype."""
        self.model, self.tokenizer, self.seed, self.calls, self.pad_id = model, tokenizer, seed, 0, pad_id(tokenizer)
        self.dtype = getattr(torch, str(dtype).removeprefix("torch."))
        eos = unwrap(model).generation_config.eos_token_id
        self.eos_ids = sorted({tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos]) - {None})

    @torch.no_grad()
    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
               repetition_penalty=1.0):
        model, no_completions = unwrap(self.model), torch.zeros(len(prompt_ids), 0, dtype=torch.long)  # (B, 0)
        batch = sequence_batch(prompt_ids, no_completions, self.pad_id)  # the prompts, left-padded
        input_ids, attention_mask = batch[0].to(model.device), batch[1].to(model.device)  # (B, P)
        # Every filter explicitly (HF's top_k=50 or the checkpoint's generation_config would apply silently); logits of
        # diverged weights (inf, NaN) clamped, a no-op on sane ones: sampling goes on, as vLLM's, to the grad check.
        sampling = dict(do_sample=False) if temperature == 0 else dict(
            do_sample=True, temperature=temperature, top_p=top_p, top_k=max(top_k or 0, 0), min_p=min_p,
            logits_processor=[lambda ids, s: s.nan_to_num(0.0).clamp(-1e4, 1e4)])  # before the temperature
        # FSDP2 all-gathers in every forward: ranks must take the same number of steps (HF synced_gpus).
        synced = dist.is_initialized() and any(isinstance(p, DTensor) for p in model.parameters())
        was_training = model.training
        model.eval()
        try:
            with private_rng(rng_seed), torch.autocast(model.device.type, self.dtype, self.dtype != torch.float32):
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                                     num_return_sequences=n, repetition_penalty=repetition_penalty,
                                     eos_token_id=self.eos_ids, pad_token_id=self.pad_id, output_scores=True,
                                     return_dict_in_generate=True, synced_gpus=synced, **sampling)
        finally:
            model.train(was_training)
        new_ids = out.sequences[:, input_ids.shape[1] :]  # (N, T) tokens after EOS are padding
        # out.scores: T x (N, V) processed scores (after penalty, temperature, filters); -inf = filtered
        logps, new_ids = torch.stack([torch.log_softmax(s.float(), -1).gather(1, new_ids[:, t, None]).squeeze(1)
                                      for t, s in enumerate(out.scores)], 1).cpu(), new_ids.cpu()  # (N, T) x2
        is_eos = torch.isin(new_ids, torch.tensor(self.eos_ids))  # (N, T)
        finished = is_eos.any(1)  # (N,)
        lengths = torch.where(finished, is_eos.int().argmax(1) + 1, new_ids.shape[1]).tolist()  # (N,) to first EOS
        return ([ids[:k].tolist() for ids, k in zip(new_ids, lengths)],
                [lps[:k].tolist() for lps, k in zip(logps, lengths)], finished.tolist())

    def sync_weights(self, model):
        return dict(seconds=0.0, bytes=0)  # generates with the trainer's own parameters


def make_engine(kind="auto", *, model=None, tokenizer=None, model_path=None, url=None, **engine_kwargs):
    """"vllm": VLLMEngine(model_path, **engine_kwargs); "hf": HFEngine(model, tokenizer, seed=...);
    "server": server.RemoteEngine(url, tokenizer, ...); "auto": vLLM if it imports, else HF (printing why).
    HF and server ignore the kwargs they do not take (dtype, memory: the server sets those at start-up)."""
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm"
        except Exception as e:  # ImportError, or a broken install (e.g. CUDA torchvision next to CPU torch)
            print(f"rollout engine: vLLM unavailable ({type(e).__name__}: {e}); using HF generate")
            kind = "hf"
    if kind == "vllm":
        return VLLMEngine(model_path, **engine_kwargs)
    if kind not in ("hf", "server"):
        raise ValueError(f"engine kind must be 'auto', 'vllm', 'hf' or 'server', got {kind!r}")
    if kind == "server":
        from server import RemoteEngine  # imported here: server.py imports this module
    engine, args = (HFEngine, (model, tokenizer)) if kind == "hf" else (RemoteEngine, (url, tokenizer))
    takes = inspect.signature(engine).parameters  # callers pass one set of kwargs for every kind
    return engine(*args, **{k: v for k, v in engine_kwargs.items() if k in takes})
