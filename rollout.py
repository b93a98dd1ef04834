"""
Rollout: sample G completions per prompt from the policy, with the sampler's own logprobs

    sampling_logps[i, t] = log softmax(process(logits_t) / temperature)[c]
    where c = completion_ids[i, t], the token sampled at step t of completion i

process: the repetition penalty, then min-p, top-k, top-p after the
temperature (model.kept_tokens). This is what the trainer recomputes
(model.selective_log_softmax, on model.truncate_logits' logits when a filter
is on), but for the repetition penalty. Raw logprobs are not (trl#4159).

Tests: python -m pytest -q tests/test_rollout*.py; benchmark: python -m bench rollout

Simplifications:
1. Weights sync in-process, a parameter at a time, through vLLM's
   reload_weights (FSDP2: gathered).
2. Each generate call samples from torch's global RNG on a private stream
   seeded by (seed, call number), and the trainer's RNG is restored. Never a
   seed per request: a prompt's G completions would match.
3. Under torchrun, one engine per rank. tensor_parallel_size N groups N
   consecutive ranks in one engine.
4. Both engines filter in vLLM 0.32's order: the repetition penalty (on the
   prompt's and completion's tokens), the temperature, min-p, top-k, then top-p
   over what is left. Greedy applies the penalty only.
5. HFEngine is gpt-fast's decode loop, plainly: each completion prefills its
   own copy of the prompt, transformers' cache grows a token a step, and every
   row steps until the last one ends. No paging. --fast (the default) swaps in
   fast/decode.py's loop: the same completions for the same uniforms, faster.
6. VLLMEngine.close() tears down vLLM's global state and the default process
   group: close it last.
7. On CPU, VLLMEngine sizes the KV cache to the work: max_rows sequences of
   row_tokens (the rows of its largest generate call, the longest prompt plus
   the new tokens: train.py says), a quarter more for the prefix cache, capped at
   gpu_memory_utilization of RAM. vLLM allocates and zeroes all of it at
   start-up. It runs eagerly what vLLM's sampler compiles.
8. On CPU, VLLMEngine.sleep() (train.py --vllm-sleep) frees the engine's copy
   of the weights and its KV cache from the rollout to the next sync_weights,
   which refills both: nothing reads them during the update, whose peak they
   would add to. It needs a sync that sends every layer (not LoRA's).
"""
import gc
import itertools
import logging
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import all_ranks_ok, is_lora, private_rng, unwrap
from model import kept_tokens, pad_id, sequence_batch, truncates


@dataclass
class Rollout:
    # (N,) each completion's prompt: each prompt G times
    prompt_ids: list[list[int]]
    # (N, T) long, right-padded with the pad id
    completion_ids: torch.Tensor
    # (N, T) float, 1 up to and including EOS (0 at tool outputs)
    completion_mask: torch.Tensor
    # (N, T) float32, the sampler's logprobs, 0 where masked
    sampling_logps: torch.Tensor
    # (N,) bool, EOS sampled (False: cut at max_new_tokens)
    is_finished: torch.Tensor
    # (N,) completions decoded up to (excluding) EOS
    texts: list[str]


def build_rollout(prompt_ids, G, completions, logps, finished, pad_id, tokenizer):
    """Lists per completion -> a padded Rollout on CPU.

    The lists: each completion's token ids, their logprobs, and whether it
    reached EOS.
    """
    lengths = torch.tensor([len(c) for c in completions])  # (N,)
    mask = torch.arange(max([1] + lengths.tolist())) < lengths[:, None]  # (N, T)

    flat_ids = torch.tensor(list(itertools.chain(*completions)), dtype=torch.long)
    flat_logps = torch.tensor(list(itertools.chain(*logps)), dtype=torch.float32)
    completion_ids = torch.full(mask.shape, pad_id)  # (N, T)
    completion_ids.masked_scatter_(mask, flat_ids)
    sampling_logps = torch.zeros(mask.shape)  # (N, T)
    sampling_logps.masked_scatter_(mask, flat_logps)

    without_eos = [ids[:-1] if f else ids for ids, f in zip(completions, finished)]
    texts = tokenizer.batch_decode(without_eos, skip_special_tokens=True)

    every_prompt = [p for p in prompt_ids for _ in range(G)]
    is_finished = torch.tensor(finished, dtype=torch.bool)
    return Rollout(every_prompt, completion_ids, mask.float(), sampling_logps,
                   is_finished, texts)


def call_seed(seed, call):
    """The seed of generate call number `call`: distinct per (seed, call) below a
    million calls."""
    return seed * 1_000_003 + call


def process_logits(logits, seen, temperature, top_p=1.0, top_k=0, min_p=0.0,
                   repetition_penalty=1.0):
    """(N, V) fp32 logits -> scores to sample from, -inf where filtered.

    Greedy (temperature 0) leaves them unfiltered. seen (N, S): the tokens so far.
    Diverged logits are clamped: sampling goes on, as vLLM's does.
    """
    # a new tensor: the rest works on it in place
    scores = logits.nan_to_num(0.0).clamp_(-1e4, 1e4)  # (N, V)

    # CTRL (arXiv:1909.05858): a seen logit / penalty if > 0, else x penalty
    if repetition_penalty != 1.0:
        s = scores.gather(1, seen)
        penalized = torch.where(s < 0, s * repetition_penalty, s / repetition_penalty)
        scores = scores.scatter(1, seen, penalized)

    if temperature == 0:
        return scores
    scores = scores.div_(temperature)

    # min-p, top-k, top-p in vLLM's order: the trainer replays the same filter
    # (model.truncate_logits)
    if truncates(top_k, top_p, min_p):
        keep = kept_tokens(scores, top_k, top_p, min_p)  # (N, V)
        scores = scores.masked_fill(~keep, -torch.inf)
    return scores



def sample_tokens(scores, uniforms=None):
    """One token a row from p = softmax(scores) -> (N,) tokens and (N,) their
    log p. scores (N, V), -inf where filtered.

    uniforms (N, 1) fp64 in [0, 1): inverse transform sampling, the first token
    whose cumulative probability exceeds u
    (https://en.wikipedia.org/wiki/Inverse_transform_sampling). A token of
    probability 0 spans an empty interval: never drawn. None: the argmax
    (greedy).
    """
    logp = scores.log_softmax(-1)  # (N, V)
    if uniforms is None:
        token = scores.argmax(-1)  # (N,)
    else:
        cdf = logp.exp().double().cumsum(-1)  # (N, V)
        token = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True)[:, 0]  # (N,)
        # u rounded up to the total mass: the last token
        token = token.clamp(max=scores.shape[1] - 1)
    return token, logp.gather(1, token[:, None])[:, 0]


class Engine:
    """A rollout engine. generate samples through the subclass's sample.

    sample(prompts, n, max_new_tokens, rng_seed, ...) -> ids, logps, finished.
    """

    calls = 0  # generate calls so far: the position in the sampling streams
    tp_group = None  # the tensor-parallel group sharing this engine (simplification 3)
    tp_rank = 0

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, **sampling):
        """G completions per prompt, each until EOS or max_new_tokens.

        sampling: top_p, top_k, min_p, repetition_penalty. Temperature 0: one
        greedy completion, repeated G times.
        """
        # the group's shards sample all its ranks' prompts at once
        everyone = [prompt_ids]
        if self.tp_group is not None:
            everyone = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(everyone, prompt_ids, group=self.tp_group)
        prompts = sum(everyone, [])  # (B,) the group's prompts, rank after rank

        token_lists = all(isinstance(p, list) and p and isinstance(p[0], int)
                          for p in prompts)
        if not prompts or not token_lists:
            raise ValueError("prompt_ids must be a non-empty list of non-empty lists of "
                             "token ids, e.g. tokenizer(prompts)['input_ids']")
        if G < 1 or max_new_tokens < 1:
            raise ValueError(f"G ({G}) and max_new_tokens ({max_new_tokens}) "
                             f"must be >= 1")

        if temperature == 0:
            n = 1
        else:
            n = G
        seed = call_seed(self.seed, self.calls)
        lists = self.sample(prompts, n, max_new_tokens, seed, temperature=temperature,
                            **sampling)
        self.calls += 1

        # this rank's completions, each repeated G // n times
        start = sum(map(len, everyone[: self.tp_rank])) * n
        stop = start + len(prompt_ids) * n
        lists = [[x for x in xs[start:stop] for _ in range(G // n)] for xs in lists]
        return build_rollout(prompt_ids, G, *lists, self.pad_id, self.tokenizer)

    def sleep(self):
        """Free what the engine holds until the next sync_weights, if it can."""

    def state_dict(self):
        return dict(calls=self.calls)

    def load_state_dict(self, state):
        self.calls = state["calls"]

    def close(self):
        pass


# vLLM's default batch of sequences
VLLM_MAX_NUM_SEQS = 256
# the prefix cache keeps finished rows' blocks for the continuations that
# reread them (tools.py): room beyond the rows of one call
KV_MARGIN = 1.25


def cpu_kv_cache_bytes(config, max_model_len, dtype, ram_fraction, max_num_seqs=256,
                       block=128, row_tokens=None):
    """The KV cache of max_num_seqs sequences of row_tokens (default
    max_model_len) each, KV_MARGIN more, and at least one of max_model_len;
    capped at ram_fraction of RAM (simplification 7). vLLM's default CPU batch
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

        # start-up on CPU: simplification 7
        self.on_cpu = not torch.cuda.is_available()
        self.kv_cache_bytes = None
        self.asleep = False  # simplification 8
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

        Sets llm_kwargs' executor and this engine's group (simplification 3).
        """
        # vLLM alone also initialises a 1-process group
        if distributed is None:
            distributed = dist.is_initialized() and dist.get_world_size() > 1

        mp = llm_kwargs.get("distributed_executor_backend") == "mp"
        if tensor_parallel_size > 1 and not distributed and not mp:
            raise ValueError("tensor_parallel_size > 1 needs torchrun "
                             "(one shard per rank, external_launcher)")

        # every rank creates every group, then keeps its own
        if distributed and tensor_parallel_size > 1:
            tp = tensor_parallel_size
            firsts = range(0, dist.get_world_size(), tp)
            groups = [dist.new_group(list(range(g, g + tp))) for g in firsts]
            self.tp_group = groups[dist.get_rank() // tp]
            self.tp_rank = dist.get_rank() % tp

        if distributed:
            llm_kwargs["distributed_executor_backend"] = "external_launcher"

    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, top_p=1.0,
               top_k=0, min_p=0.0, repetition_penalty=1.0):
        from vllm import SamplingParams, TokensPrompt

        if self.asleep:
            raise RuntimeError("VLLMEngine.sample while asleep: sync_weights wakes it")
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

        if self.asleep:
            missing = sum(self.llm.collective_rpc(_layers_asleep), [])
            if missing:
                raise RuntimeError(f"VLLMEngine.sleep() freed layers this sync did not "
                                   f"send ({', '.join(missing[:3])}, ...): sleep needs a "
                                   f"sync of every layer, not LoRA's")
            # after the reload, whose layers pass through unpacked copies
            self.llm.collective_rpc(_restore_kv_cache)
            self.asleep = False

        self.llm.reset_prefix_cache()  # its KV entries came from the old weights
        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def sleep(self):
        """Free the weights and the KV cache until the next sync_weights (CPU only).

        vLLM's CPU linear layers hold their own packed copies of the weights
        (oneDNN), and the KV cache is one zeroed buffer: 0.8 GiB of a
        SmolLM2-135M run, idle from the rollout to the sync after the update.
        The layers' packed copies are dropped, and the buffer's storage is
        resized to 0 with its views kept (FSDP's way of freeing a parameter).
        sync_weights then repacks every layer it sends (reload_weights), and
        gives the buffer back zeroed, as vLLM starts it (simplification 8).

        A no-op on GPU (vLLM's own sleep mode needs enable_sleep_mode at start)
        and for tensor-parallel shards, whose reload refills only some layers.
        """
        if not self.on_cpu or self.tp_group is not None or self.asleep:
            return
        self.llm.collective_rpc(_free_weights_and_kv_cache)
        self.asleep = True

    def close(self):
        if getattr(self, "llm", None) is not None:
            # the default group too: simplification 6
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


def _asleep(*args, **kwargs):
    raise RuntimeError("this vLLM layer is asleep: VLLMEngine.sync_weights refills it")


def _free_weights_and_kv_cache(worker):
    """VLLMEngine.sleep, inside vLLM's worker."""
    runner = worker.model_runner

    # each linear layer's cpu_linear holds its packed weight
    for module in runner.get_model().modules():
        if hasattr(module, "cpu_linear"):
            module.cpu_linear = _asleep

    # every layer's KV cache is a view of one buffer (vLLM's allocate_kv_cache):
    # find the storages first, since a freed one's data_ptr is 0
    storages = {}
    for kv in runner.kv_caches:
        storages.setdefault(kv.untyped_storage().data_ptr(), kv)
    worker.tinygrpo_kv_sizes = [(kv, kv.untyped_storage().nbytes())
                                for kv in storages.values()]
    for kv, _ in worker.tinygrpo_kv_sizes:
        kv.untyped_storage().resize_(0)


def _restore_kv_cache(worker):
    """The KV buffer back at its size, zeroed as vLLM allocates it."""
    for kv, nbytes in worker.tinygrpo_kv_sizes:
        storage = kv.untyped_storage()
        storage.resize_(nbytes)
        storage.fill_(0)
    worker.tinygrpo_kv_sizes = []


def _layers_asleep(worker):
    """The names of the layers the last reload did not repack."""
    model = worker.model_runner.get_model()
    return [name for name, module in model.named_modules()
            if getattr(module, "cpu_linear", None) is _asleep]


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
    if is_lora(unwrap(model)):  # the merged weights (lora.py)
        from scale.lora import sync_parameters

        params = sync_parameters(unwrap(model))

    for name, param in params:
        tensor = param.detach()
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        tensor = tensor.to(dtype or param.dtype)

        counter["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor


def as_lists(tokens, logps, lengths, done):
    """A decode loop's steps -> (completions, their log-probs, finished), lists
    of N: tokens and logps a (N,) tensor a step, lengths (N,) each row's tokens
    up to its first EOS, done (N,) whether it ended on one."""
    lengths = lengths.tolist()
    tokens = torch.stack(tokens, 1).cpu()  # (N, steps)
    logps = torch.stack(logps, 1).float().cpu()  # (N, steps)
    completions = [x[:k].tolist() for x, k in zip(tokens, lengths)]
    logps = [x[:k].tolist() for x, k in zip(logps, lengths)]
    return completions, logps, done.tolist()


def most_on_any_rank(value, device):
    """The largest of an int across the ranks (FSDP2 ranks may ask for
    different max_new_tokens, and all decode until the last one ends)."""
    most = torch.tensor([value], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


class HFEngine(Engine):
    def __init__(self, model, tokenizer, *, seed=0, dtype="float32"):
        self.model = model
        self.tokenizer = tokenizer
        self.seed = seed
        self.pad_id = pad_id(tokenizer)
        self.dtype = getattr(torch, str(dtype).removeprefix("torch."))

        eos = unwrap(model).generation_config.eos_token_id
        if not isinstance(eos, list):
            eos = [eos]
        self.eos_ids = sorted({tokenizer.eos_token_id} | set(eos) - {None})

    @torch.no_grad()
    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, **filters):
        """gpt-fast's decode loop: prefill the prompts, then one token a step
        through the KV cache, until every row has ended or max_new_tokens."""
        model = unwrap(self.model)
        greedy = temperature == 0
        # each prompt n times, left-padded: (N, P) ids, mask and RoPE positions
        rows = [p for p in prompt_ids for _ in range(n)]
        no_completions = torch.zeros(len(rows), 0, dtype=torch.long)  # (N, 0)
        batch = sequence_batch(rows, no_completions, self.pad_id)
        ids, mask, positions = (x.to(model.device) for x in batch)
        N = len(rows)
        eos = torch.tensor(self.eos_ids, device=ids.device)

        # FSDP2 all-gathers every forward: the ranks step together until the last ends
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        synced = dist.is_initialized() and sharded
        steps = max_new_tokens
        agree = bool
        if synced:
            steps = most_on_any_rank(max_new_tokens, ids.device)
            agree = all_ranks_ok

        was_training = model.training
        model.eval()
        tokens = []  # (N,) a step
        logps = []  # (N,) a step
        done = torch.zeros(N, dtype=torch.bool, device=ids.device)  # (N,)
        lengths = torch.zeros(N, dtype=torch.long, device=ids.device)  # (N,) up to the first EOS
        # the tokens so far, for the repetition penalty: a real token in place of each pad
        seen = torch.where(mask.bool(), ids, ids[:, -1:])  # (N, P)
        autocast = torch.autocast(model.device.type, self.dtype,
                                  enabled=self.dtype != torch.float32)
        with private_rng(rng_seed), autocast:
            # 1) prefill: the prompts' KV cache and the first token's logits
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            logits = out.logits[:, -1]  # (N, V)

            for t in range(steps):
                # 2) sample a token a row (a rank past its own limit steps on: FSDP2)
                if t < max_new_tokens:
                    scores = process_logits(logits.float(), seen, temperature,
                                            **filters)  # (N, V)
                    uniforms = None
                    if not greedy:
                        uniforms = torch.rand(N, 1, dtype=torch.float64, device=ids.device)
                    token, logp = sample_tokens(scores, uniforms)  # (N,) each
                    token = token.masked_fill(done, self.pad_id)
                    tokens.append(token)
                    logps.append(logp)
                    lengths += ~done
                    done = done | torch.isin(token, eos)
                    seen = torch.cat([seen, token[:, None]], 1)  # (N, S+1)

                if agree(t + 1 >= max_new_tokens or bool(done.all())):
                    break

                # 3) one decode step: the new token through the cache
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)  # (N, P+t+1)
                logits = model(input_ids=token[:, None], attention_mask=mask,
                               past_key_values=cache, position_ids=positions[:, -1:] + t + 1,
                               use_cache=True).logits[:, -1]  # (N, V)
        model.train(was_training)

        return as_lists(tokens, logps, lengths, done)

    def sync_weights(self, model):
        # it samples with the trainer's own parameters
        return dict(seconds=0.0, bytes=0)


def pick_engine(kind, model, tensor_parallel_size=1):
    """--engine "auto" | "vllm" | "hf" -> ("vllm" or "hf", why in a few words).

    On a CPU, vLLM's per-step scheduling costs more than a small model's forward.
    The HF loop is faster below ~25M parameters, vLLM from there on with long
    completions (docs/benchmarks.md: Rollouts).
    """
    if kind != "auto":
        return kind, "--engine " + kind

    n = sum(p.numel() for p in model.parameters()) / 1e6
    if torch.cuda.is_available():
        why = "auto: a GPU"
    elif tensor_parallel_size > 1:
        why = "auto: --vllm-tp"
    elif n < 25:
        return "hf", (f"auto: a CPU and {n:.2f}M params, "
                      f"where the HF loop is faster (< 25M)")
    else:
        why = f"auto: a CPU and {n:.0f}M params, where vLLM is faster (>= 25M)"

    try:
        import vllm  # noqa: F401
    # ImportError, or a broken install (CUDA torchvision, CPU torch)
    except Exception as e:
        return "hf", f"auto: vLLM unavailable ({type(e).__name__}: {e})"
    return "vllm", why


def make_engine(kind, *, model, tokenizer, model_path, seed=0, dtype="float32",
                **vllm_kwargs):
    """"vllm": VLLMEngine(model_path, ...), "hf": HFEngine(model, tokenizer, ...).

    The client of a rollout server is server.RemoteEngine.
    """
    if kind == "vllm":
        return VLLMEngine(model_path, seed=seed, dtype=dtype, **vllm_kwargs)
    if kind != "hf":
        raise ValueError(f"engine kind must be 'vllm' or 'hf' (pick_engine), "
                         f"got {kind!r}")
    return HFEngine(model, tokenizer, seed=seed, dtype=dtype)
