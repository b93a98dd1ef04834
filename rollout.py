"""
Rollout: sample G completions for each prompt from the current policy, with the sampler's own log-probabilities.

    sampling_logps[i, t] = log softmax(process(logits_t) / temperature)[completion_ids[i, t]]
where process = repetition penalty, and the top-k / top-p / min-p filters after the temperature. With no
filters this is exactly what the trainer recomputes (loss.selective_log_softmax at the same temperature);
engines that return the *raw* logprobs instead break that (TRL bug trl#4159).

Two engines with one interface (generate -> Rollout, sync_weights(model) -> {seconds, bytes}, close):
    VLLMEngine(model_path, ...)  vLLM 0.32 colocated in the training process: the engine core runs
                                 in-process alone, and under torchrun each rank owns an engine
                                 (distributed_executor_backend="external_launcher").
    HFEngine(model, tokenizer)   transformers generate (KV cache) on the trainer's own model object.
    make_engine("auto" | "vllm" | "hf", ...) picks one; "auto" = vLLM when it imports.

Run the tests: python -m pytest -q tests/test_rollout.py tests/test_rollout_2ranks.py
Benchmark:     python bench.py rollout

Simplifications:
1. Weights are synced in-process, one parameter at a time, through vLLM's own `reload_weights` (the older
   `model.load_weights` recipe fails on CPU in 0.32: see shared/notes/vllm-cpu.md). FSDP2 parameters are
   gathered with DTensor.full_tensor() as vLLM pulls them, so peak extra memory is about one layer.
2. Both engines sample from torch's global RNG (in-process vLLM too), so each generate call runs on a
   private stream seeded by (engine seed, call number) and restores the trainer's RNG after: runs are
   reproducible and the trainer's own randomness is untouched. Never a per-request seed
   (SamplingParams(seed=...)): then all G completions of a prompt share one stream and come out identical.
   Pass a different seed per rank.
3. tensor_parallel_size > 1 is supported only under torchrun (one shard per rank); the ranks of one
   tensor-parallel group must then pass the same prompts and the same seed.
4. vLLM applies min-p before top-k / top-p and HF after; the two agree when at most one filter is on.
5. HFEngine keeps every step's processed scores (N, V) until generate returns (HF's output_scores), so
   its memory grows with N * T * V: it is the fallback for small models, not the fast path.
6. VLLMEngine.close() tears down vLLM's process-wide state, including torch.distributed's default
   process group (vllm/distributed/parallel_state.py): close the last engine once, at the very end.
"""
import logging
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


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
    completion_mask = torch.zeros(N, T)  # (N, T)
    sampling_logps = torch.zeros(N, T)  # (N, T)
    for i, (ids, lps) in enumerate(zip(completions, logps)):
        completion_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        completion_mask[i, : len(ids)] = 1
        sampling_logps[i, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    texts = tokenizer.batch_decode([ids[:-1] if f else ids for ids, f in zip(completions, finished)],
                                   skip_special_tokens=True)
    return Rollout(prompt_ids=[p for p in prompt_ids for _ in range(G)], completion_ids=completion_ids,
                   completion_mask=completion_mask, sampling_logps=sampling_logps,
                   is_finished=torch.tensor(finished, dtype=torch.bool), texts=texts)


def _check_generate_args(prompt_ids, G, max_new_tokens):
    if not prompt_ids or not all(isinstance(p, list) and p and isinstance(p[0], int) for p in prompt_ids):
        raise ValueError("prompt_ids must be a non-empty list of non-empty lists of token ids, "
                         "e.g. tokenizer(prompts)['input_ids']")
    if G < 1 or max_new_tokens < 1:
        raise ValueError(f"G ({G}) and max_new_tokens ({max_new_tokens}) must be >= 1")


@contextmanager
def private_rng(seed):
    """Run the body on the global RNGs (torch CPU and current CUDA device, random, numpy) seeded with seed,
    then give the caller back its own RNG states."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def call_seed(seed, call):
    return seed * 1_000_003 + call  # distinct for every (engine seed, call number) below a million calls


def unwrap(model):
    """The module under a DDP wrapper (its parameter names lack the 'module.' prefix)."""
    return model.module if hasattr(model, "module") else model


def full_named_parameters(model, counter):
    """(name, full tensor) one parameter at a time, in module order (layer by layer). FSDP2 parameters are
    DTensors: full_tensor() all-gathers one of them when vLLM asks for it (a collective: every rank must
    call sync_weights). Tied weights are sent under both names, as in an HF state_dict: vLLM's layer-wise
    reload refreshes a layer only once all its weights arrived, and with tie_word_embeddings the LM head is
    its own layer; sent only as embed_tokens, the logits kept the old weights (found on vLLM 0.32 CPU)."""
    for name, param in unwrap(model).named_parameters(remove_duplicate=False):
        tensor = param.detach()
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        counter["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


# -----------------------------------------------------------------------------
# vLLM

class VLLMEngine:
    def __init__(self, model_path, *, seed=0, dtype="auto", max_model_len=None, gpu_memory_utilization=0.3,
                 tensor_parallel_size=1, enforce_eager=None, distributed=None, **llm_kwargs):
        """model_path: a folder with config, weights and tokenizer (save_pretrained). On CPU,
        gpu_memory_utilization is the fraction of the NUMA node's RAM for the KV cache, counted after this
        process's RSS; pass kv_cache_memory_bytes=... instead for a fixed size. Extra kwargs go to LLM()."""
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
        from vllm import LLM

        # Every reload warns "RotaryEmbedding: Failed to load weights": its cos/sin cache is computed, not a
        # checkpoint weight, and vLLM keeps it. Drop that line only; other layers' failures stay visible.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: "RotaryEmbedding: Failed" not in record.getMessage())
        if distributed is None:  # vLLM alone also initialises a 1-process group, hence the size test
            distributed = dist.is_initialized() and dist.get_world_size() > 1
        if tensor_parallel_size > 1 and not distributed:
            raise ValueError("tensor_parallel_size > 1 needs torchrun (one shard per rank, external_launcher); "
                             "alone, use tensor_parallel_size=1")
        if enforce_eager is None:  # CUDA graphs pay off on GPUs; on CPU compiling only slows start-up
            enforce_eager = not torch.cuda.is_available()
        if distributed:
            llm_kwargs["distributed_executor_backend"] = "external_launcher"
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        self.seed, self.calls = seed, 0
        with private_rng(seed):  # LLM(seed=...) reseeds the global RNGs (random, numpy, torch): keep ours
            self.llm = LLM(model=model_path, seed=seed, dtype=dtype, max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization,
                           tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager,
                           logprobs_mode="processed_logprobs",  # after temperature and filters (trl#4159)
                           **llm_kwargs)
        # vLLM's CPU worker drops torch to 1 thread (unless OMP_NUM_THREADS is set) and replaces
        # torch.set_num_threads with a no-op for the whole process (vllm/v1/worker/cpu_worker.py).
        # The trainer shares this process, so undo both.
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        self.tokenizer = self.llm.get_tokenizer()
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.tokenizer.eos_token_id

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                 repetition_penalty=1.0):
        """G completions per prompt (consecutive in the Rollout), each until EOS or max_new_tokens.
        top_k 0 (or None, -1) = off; temperature 0 = greedy."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        _check_generate_args(prompt_ids, G, max_new_tokens)
        greedy = temperature == 0  # vLLM refuses n > 1 for greedy: sample once, repeat G times
        params = SamplingParams(n=1 if greedy else G, max_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k if top_k and top_k > 0 else 0, min_p=min_p,
                                repetition_penalty=repetition_penalty,
                                logprobs=0,  # 0 = only the sampled token's logprob
                                detokenize=False)  # we decode once, in build_rollout
        with private_rng(call_seed(self.seed, self.calls)):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                        use_tqdm=False)
        self.calls += 1
        samples = [s for out in outputs for s in sorted(out.outputs, key=lambda s: s.index)]
        samples = [s for s in samples for _ in range(G)] if greedy else samples  # (N,) G per prompt, in order
        completions = [list(s.token_ids) for s in samples]
        logps = [[step[tok].logprob for tok, step in zip(s.token_ids, s.logprobs)] for s in samples]
        finished = [s.finish_reason == "stop" for s in samples]  # "stop" = EOS (no stop strings set), else "length"
        return build_rollout(prompt_ids, G, completions, logps, finished, self.pad_id, self.tokenizer)

    def sync_weights(self, model):
        """Copy the trainer's weights (plain, DDP or FSDP2 model) into the engine, then drop the prefix cache
        (its KV entries were computed with the old weights). Returns {seconds, bytes}."""
        start, counter = time.perf_counter(), {"bytes": 0}
        with torch.no_grad():
            # The in-process executor calls the worker directly, so the generator streams (no pickling).
            self.llm.collective_rpc("reload_weights", kwargs=dict(
                weights_iterator=full_named_parameters(model, counter), is_checkpoint_format=True))
        self.llm.reset_prefix_cache()
        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def close(self):
        """Shut the engine down (also destroys torch.distributed's default group: see simplification 6)."""
        if getattr(self, "llm", None) is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


# -----------------------------------------------------------------------------
# HF transformers

class HFEngine:
    def __init__(self, model, tokenizer, *, seed=0):
        """Generates with the trainer's model object itself (so sync_weights has nothing to do)."""
        self.model, self.tokenizer, self.seed, self.calls = model, tokenizer, seed, 0
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = unwrap(model).generation_config.eos_token_id
        self.eos_ids = sorted({tokenizer.eos_token_id} | set(eos if isinstance(eos, list) else [eos]) - {None})

    @torch.no_grad()
    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                 repetition_penalty=1.0):
        _check_generate_args(prompt_ids, G, max_new_tokens)
        model = unwrap(self.model)
        device = next(model.parameters()).device
        P = max(len(p) for p in prompt_ids)
        input_ids = torch.tensor([[self.pad_id] * (P - len(p)) + p for p in prompt_ids], device=device)  # (B, P)
        attention_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids], device=device)
        # Pass every filter explicitly: HF's defaults (top_k=50) or the checkpoint's generation_config
        # would otherwise apply silently and the logprobs would not be what the trainer expects.
        greedy = temperature == 0  # HF refuses num_return_sequences > 1 for greedy: once, then repeat G times
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p,
                                                             top_k=top_k if top_k and top_k > 0 else 0, min_p=min_p)
        # FSDP2 all-gathers in every forward: ranks must take the same number of steps (HF synced_gpus).
        synced = dist.is_initialized() and any(isinstance(p, DTensor) for p in model.parameters())
        was_training = model.training
        model.eval()
        try:
            with private_rng(call_seed(self.seed, self.calls)):
                out = model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=max_new_tokens, num_return_sequences=1 if greedy else G,
                                     repetition_penalty=repetition_penalty, eos_token_id=self.eos_ids,
                                     pad_token_id=self.pad_id, output_scores=True, return_dict_in_generate=True,
                                     synced_gpus=synced, **sampling)
        finally:
            model.train(was_training)
        self.calls += 1
        new_ids = out.sequences[:, P:]  # (N, T) tokens after EOS are padding
        # out.scores: T x (N, V) processed scores (after penalty, temperature, filters); -inf = filtered
        logps = torch.stack([torch.log_softmax(s.float(), -1).gather(1, new_ids[:, t, None]).squeeze(1)
                             for t, s in enumerate(out.scores)], 1).cpu()  # (N, T)
        new_ids = new_ids.cpu()
        is_eos = torch.isin(new_ids, torch.tensor(self.eos_ids))  # (N, T)
        finished = is_eos.any(1)  # (N,)
        lengths = torch.where(finished, is_eos.int().argmax(1) + 1, new_ids.shape[1])  # (N,) up to first EOS
        rows = range(len(new_ids)) if not greedy else [i for i in range(len(new_ids)) for _ in range(G)]
        completions = [new_ids[i, : lengths[i]].tolist() for i in rows]  # G consecutive per prompt
        logps = [logps[i, : lengths[i]].tolist() for i in rows]
        return build_rollout(prompt_ids, G, completions, logps, [bool(finished[i]) for i in rows], self.pad_id,
                             self.tokenizer)

    def sync_weights(self, model):
        return dict(seconds=0.0, bytes=0)  # generates with the trainer's own parameters

    def close(self):
        pass


def make_engine(kind="auto", *, model=None, tokenizer=None, model_path=None, **engine_kwargs):
    """"vllm": VLLMEngine(model_path, **engine_kwargs); "hf": HFEngine(model, tokenizer, seed=...);
    "auto": vLLM if it imports, else HF (printing why). HF ignores the vLLM-only kwargs (dtype, memory)."""
    if kind not in ("auto", "vllm", "hf"):
        raise ValueError(f"engine kind must be 'auto', 'vllm' or 'hf', got {kind!r}")
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm"
        except Exception as e:  # ImportError, or a broken install (e.g. CUDA torchvision next to CPU torch)
            print(f"rollout engine: vLLM unavailable ({type(e).__name__}: {e}); using HF generate")
            kind = "hf"
    if kind == "vllm":
        if model_path is None:
            raise ValueError("the vLLM engine needs model_path (a save_pretrained folder with the tokenizer)")
        return VLLMEngine(model_path, **engine_kwargs)
    if model is None or tokenizer is None:
        raise ValueError("the HF engine needs model= and tokenizer=")
    return HFEngine(model, tokenizer, seed=engine_kwargs.get("seed", 0))
