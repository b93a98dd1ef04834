"""
VLLMEngine: vLLM in the training process (colocated), one engine per rank, its
weights synced in-process after every update. rollout.py holds the Engine
interface it implements, and make_engine, which builds it for --engine vllm.

    sampling_logps = vLLM's processed_logprobs: the log-probs after the
    repetition penalty, temperature, min-p, top-k and top-p (rollout.py)

Tests: python -m pytest -q tests/test_rollout.py tests/test_rollout_2ranks.py
tests/test_rollout_tp.py

Simplifications:
1. Weights sync in-process, a parameter at a time, through vLLM's
   reload_weights (FSDP2: gathered).
2. Each generate call samples on a private stream seeded by (seed, call
   number): rollout.py's simplification 1.
3. Under torchrun, one engine per rank. tensor_parallel_size N groups N
   consecutive ranks in one engine.
4. VLLMEngine.close() tears down vLLM's global state and the default process
   group: close it last.
5. On CPU, VLLMEngine sizes the KV cache to the work: max_rows sequences of
   row_tokens (the rows of its largest generate call, the longest prompt plus
   the new tokens: train.py says), a quarter more for the prefix cache, capped at
   gpu_memory_utilization of RAM. vLLM allocates and zeroes all of it at
   start-up. It runs eagerly what vLLM's sampler compiles.
6. On CPU, --vllm-sleep (engines/vllm_sleep.py) frees the engine's copy of the
   weights and its KV cache from the rollout to the next sync, which refills
   both (self.asleep says it is so).
"""
import gc
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import is_lora, private_rng, unwrap
from model import pad_id
from rollout import Engine

# vLLM's default batch of sequences
VLLM_MAX_NUM_SEQS = 256
# the prefix cache keeps finished rows' blocks for the continuations that
# reread them (tools.py): room beyond the rows of one call
KV_MARGIN = 1.25


def cpu_kv_cache_bytes(config, max_model_len, dtype, ram_fraction, max_num_seqs=256,
                       block=128, row_tokens=None):
    """The KV cache of max_num_seqs sequences of row_tokens (default
    max_model_len) each, KV_MARGIN more, and at least one of max_model_len;
    capped at ram_fraction of RAM (engines/vllm_engine.py, simplification 5). vLLM's default CPU batch
    is 256 sequences."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None)
    head_dim = head_dim or text.hidden_size // text.num_attention_heads
    itemsize = getattr(torch, str(dtype).removeprefix("torch.")).itemsize

    length = max_model_len or text.max_position_embeddings
    row = min(row_tokens or length, length)
    # whole blocks: a sequence holds its own
    tokens = math.ceil(KV_MARGIN * max_num_seqs) * -(-row // block) * block
    tokens = max(tokens, -(-length // block) * block)
    # and one more: vLLM's block pool keeps its first block as the null block,
    # which holds no tokens (without it a cache of exactly one max_model_len row
    # is refused at start-up)
    tokens += block
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = tokens * 2 * text.num_hidden_layers * heads * head_dim * itemsize  # K and V
    return int(min(need, ram_fraction * ram))


class VLLMEngine(Engine):
    def __init__(self, model_path, *, seed=0, dtype=None, max_model_len=None,
                 gpu_memory_utilization=0.3, tensor_parallel_size=1, distributed=None,
                 max_rows=None, row_tokens=None, **llm_kwargs):
        """model_path: a save_pretrained folder or hub id.

        gpu_memory_utilization: the fraction of GPU memory, or of RAM on CPU.
        max_rows, row_tokens: the most sequences one generate call samples
        (None: vLLM's default batch), and the longest prompt plus new tokens
        (None: max_model_len), which size the KV cache on CPU.
        """
        # the engine core in-process
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from transformers import AutoConfig
        from vllm import LLM

        # the checkpoint's dtype: vLLM's "auto" samples fp32 ones in bf16
        config = AutoConfig.from_pretrained(model_path)
        if dtype in (None, "auto"):
            dtype = config.dtype or torch.float32

        # start-up on CPU: engines/vllm_engine.py, simplification 5
        self.on_cpu = not torch.cuda.is_available()
        self.kv_cache_bytes = None
        self.asleep = False  # engines/vllm_engine.py, simplification 6
        # vLLM schedules at most its max_num_seqs (256 by default) at once
        self.kv_rows = min(max_rows or VLLM_MAX_NUM_SEQS,
                           llm_kwargs.get("max_num_seqs", VLLM_MAX_NUM_SEQS))
        if self.on_cpu:
            kv_bytes = cpu_kv_cache_bytes(config, max_model_len, dtype,
                                          gpu_memory_utilization,
                                          max_num_seqs=self.kv_rows,
                                          row_tokens=row_tokens)
            llm_kwargs.setdefault("kv_cache_memory_bytes", kv_bytes)
            self.kv_cache_bytes = llm_kwargs["kv_cache_memory_bytes"]

            from vllm.v1.sample import sampler
            f = sampler.batched_count_greater_than
            eager = getattr(f, "_torchdynamo_orig_callable", f)
            sampler.batched_count_greater_than = eager

        # reloads warn for what they did not get (RoPE's cos/sin cache; with LoRA,
        # the unchanged layers)
        noise = ("Failed to load weights", "were not loaded")
        for reload in ("layerwise", "inplace"):
            name = f"vllm.model_executor.model_loader.reload.{reload}"
            logger = logging.getLogger(name)
            logger.addFilter(lambda r: not any(s in r.getMessage() for s in noise))

        self._join_ranks(distributed, tensor_parallel_size, llm_kwargs)
        # faster start-up
        llm_kwargs.setdefault("enforce_eager", self.on_cpu)
        llm_kwargs.setdefault("use_tqdm_on_load", False)
        self.seed = seed

        threads = torch.get_num_threads()
        set_num_threads = torch.set_num_threads
        # spares our heap vLLM's start-up collections (it freezes its own after)
        gc.freeze()
        # LLM(seed=) reseeds the global RNGs: keep ours
        with private_rng(seed):
            self.llm = LLM(model=model_path, seed=seed, dtype=dtype,
                           max_model_len=max_model_len,
                           gpu_memory_utilization=gpu_memory_utilization,
                           tensor_parallel_size=tensor_parallel_size,
                           logprobs_mode="processed_logprobs", **llm_kwargs)
        # vLLM's CPU worker sets 1 torch thread and no-ops torch.set_num_threads:
        # undo both
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)

        self.tokenizer = self.llm.get_tokenizer()
        self.pad_id = pad_id(self.tokenizer)
        if self.on_cpu:
            self.llm.collective_rpc(_drop_lookup_packing)

    def _join_ranks(self, distributed, tensor_parallel_size, llm_kwargs):
        """Under torchrun: one engine per rank, or per tensor-parallel group of ranks.

        Sets llm_kwargs' executor and this engine's group (engines/vllm_engine.py, simplification 3).
        """
        # vLLM alone also initialises a 1-process group
        if distributed is None:
            distributed = dist.is_initialized() and dist.get_world_size() > 1

        mp = llm_kwargs.get("distributed_executor_backend") == "mp"
        if tensor_parallel_size > 1 and not distributed and not mp:
            raise ValueError("tensor_parallel_size > 1 needs torchrun "
                             "(one shard per rank, external_launcher)")

        if distributed and tensor_parallel_size > 1:  # --vllm-tp (scale/tensor_parallel.py)
            from scale.tensor_parallel import tensor_parallel_group

            self.tp_group, self.tp_rank = tensor_parallel_group(tensor_parallel_size)

        if distributed:
            llm_kwargs["distributed_executor_backend"] = "external_launcher"

    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, top_p=1.0,
               top_k=0, min_p=0.0, repetition_penalty=1.0):
        from vllm import SamplingParams, TokensPrompt

        if self.asleep:
            raise RuntimeError("VLLMEngine.sample while asleep: the next sync wakes it "
                               "(engines/vllm_sleep.py)")
        params = SamplingParams(n=n, max_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, min_p=min_p, top_k=max(top_k or 0, 0),
                                repetition_penalty=repetition_penalty, logprobs=0,
                                detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        with private_rng(rng_seed):
            outputs = self.llm.generate(prompts, params, use_tqdm=False)

        samples = [s for out in outputs
                   for s in sorted(out.outputs, key=lambda s: s.index)]
        ids = [list(s.token_ids) for s in samples]
        logps = [[step[tok].logprob for tok, step in zip(s.token_ids, s.logprobs)]
                 for s in samples]
        # "stop": EOS, not length
        finished = [s.finish_reason == "stop" for s in samples]
        return ids, logps, finished

    def sync_weights(self, model):
        start = time.perf_counter()

        counter = {"bytes": 0}
        dtype = self.llm.llm_engine.model_config.dtype
        weights = full_named_parameters(model, counter, dtype)
        with torch.no_grad():
            reload = dict(weights_iterator=weights, is_checkpoint_format=True)
            self.llm.collective_rpc("reload_weights", kwargs=reload)
        if self.on_cpu:  # the reload packed it again
            self.llm.collective_rpc(_drop_lookup_packing)

        self.llm.reset_prefix_cache()  # its KV entries came from the old weights
        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def close(self):
        if getattr(self, "llm", None) is not None:
            # the default group too: engines/vllm_engine.py, simplification 4
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None


def _lookup_only(*args, **kwargs):
    raise RuntimeError("an input embedding only looks rows up: its packed copy was dropped")


def _drop_lookup_packing(worker):
    """Free the packed copy vLLM 0.32 makes of an input embedding on CPU.

    Every VocabParallelEmbedding gets one for a matmul (dispatch_cpu_unquantized_gemm),
    but only the LM head (a ParallelLMHead, the same weight when tied) multiplies:
    the input embedding looks rows up. 113 MB for SmolLM2-135M.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, VocabParallelEmbedding)

    for module in worker.model_runner.get_model().modules():
        lookup = isinstance(module, VocabParallelEmbedding)
        lookup = lookup and not isinstance(module, ParallelLMHead)
        if lookup and hasattr(module, "cpu_linear"):
            module.cpu_linear = _lookup_only


def full_named_parameters(model, counter, dtype=None):
    """(name, full tensor in dtype, else its own dtype), one parameter at a time.

    In module order (LoRA: the adapted modules only, merged: lora.sync_parameters).
    counter["bytes"] adds up their sizes. FSDP2 parameters are DTensors:
    full_tensor() all-gathers one when vLLM asks for it. That is a collective:
    every rank must call sync_weights.

    Tied weights go under both names, as in an HF state_dict. vLLM 0.32's
    layer-wise reload refreshes a layer once all its weights arrived, and with
    tie_word_embeddings the LM head is its own layer. Sent only as embed_tokens,
    the logits kept the old ones.
    """
    params = unwrap(model).named_parameters(remove_duplicate=False)
    if is_lora(unwrap(model)):  # the merged weights (scale/lora.py)
        from scale.lora import sync_parameters

        params = sync_parameters(unwrap(model))

    for name, param in params:
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.to(dtype or param.dtype)

        counter["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor
