"""
Rollout: sample G completions for each prompt from the current policy, with the sampler's own log-probabilities.

    sampling_logps[i, t] = log softmax(process(logits_t) / temperature)[completion_ids[i, t]]
where process = repetition penalty, and the top-k / top-p / min-p filters after the temperature. With no filters
this is what the trainer recomputes (loss.selective_log_softmax); *raw* logprobs would break that (trl#4159).

Engines (generate -> Rollout, sync_weights(model) -> {seconds, bytes}, state_dict, load_state_dict, close):
    VLLMEngine(model_path, ...)  vLLM 0.32 in the training process; under torchrun one per rank (external_launcher)
    HFEngine(model, tokenizer)   a decode loop (KV cache) on the trainer's own model object
    RemoteEngine(url, tokenizer) in server.py: the client of a vLLM rollout server on other GPUs or nodes
    make_engine("auto" | "vllm" | "hf" | "server", ...) picks one; "auto" = vLLM when it imports.
Tests: python -m pytest -q tests/test_rollout*.py; benchmark: python bench.py rollout

Simplifications:
1. Weights are synced in-process, one parameter at a time, through vLLM's `reload_weights` (`model.load_weights`
   fails on CPU in 0.32: shared/notes/vllm-cpu.md), cast to the engine's dtype (vLLM would too, warning for each
   tensor). FSDP2 parameters are gathered (DTensor.full_tensor()) as vLLM pulls them: about one layer extra.
2. Engines sample from torch's global RNG (in-process vLLM too): each generate call on a private stream seeded by
   (engine seed, call number: the state_dict), restoring the trainer's RNG after: reproducible, the trainer's RNG
   untouched. Never a per-request seed (SamplingParams(seed=)): a prompt's G completions would all be the same.
3. Under torchrun, tensor_parallel_size N groups N consecutive ranks (a shard each) into one engine: generate gathers
   the group's prompts into one call and hands each rank its own completions. A group's ranks pass the same seed.
4. vLLM applies min-p before top-k / top-p and HFEngine after; the two agree when at most one filter is on.
5. HFEngine is gpt-fast's decode loop on the trainer's model, a prompt's forward shared by its G completions: the
   fallback, and on a CPU the faster engine for tiny models (README: Benchmarks); no paging, no continuous batching.
6. VLLMEngine.close() tears down vLLM's process-wide state, including torch.distributed's default
   process group (vllm/distributed/parallel_state.py): close the last engine once, at the very end.
7. On CPU, VLLMEngine sizes the KV cache to the need (cpu_kv_cache_bytes) and runs the one op vLLM's sampler
   compiles (the sampled token's rank, unused here) eagerly, for the whole process: 6-7 s less start-up.
"""
import gc
import inspect
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import all_ranks_ok, private_rng, sequence_batch, unwrap
from lora import full_named_parameters


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
    lengths = torch.tensor([len(c) for c in completions])  # (N,)
    mask = torch.arange(max([1] + lengths.tolist())) < lengths[:, None]  # (N, T) True up to the length
    flat = lambda lists, dtype: torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=dtype)  # row by row
    completion_ids = torch.full(mask.shape, pad_id).masked_scatter_(mask, flat(completions, torch.long))  # (N, T)
    sampling_logps = torch.zeros(mask.shape).masked_scatter_(mask, flat(logps, torch.float32))  # (N, T) 0 after
    texts = tokenizer.batch_decode([ids[:-1] if f else ids for ids, f in zip(completions, finished)],
                                   skip_special_tokens=True)
    return Rollout([p for p in prompt_ids for _ in range(G)], completion_ids, mask.float(), sampling_logps,
                   torch.tensor(finished, dtype=torch.bool), texts)


def pad_id(tokenizer):
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def call_seed(seed, call):
    return seed * 1_000_003 + call  # distinct for every (engine seed, call number) below a million calls


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


def process_logits(logits, seen, temperature, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0):
    """(N, V) fp32 logits -> the scores HFEngine samples from (the module docstring), -inf where filtered; greedy
    (temperature 0): unfiltered, at temperature 1. seen (N, S): the tokens so far, for the repetition penalty. Logits
    of diverged weights (inf, NaN) are clamped, a no-op on sane ones: sampling goes on, as vLLM's, to the grad check."""
    scores = logits.nan_to_num(0.0).clamp(-1e4, 1e4)  # (N, V)
    if repetition_penalty != 1.0:  # CTRL's (arXiv:1909.05858): each seen token's logit divided (> 0) or multiplied
        s = scores.gather(1, seen)
        scores = scores.scatter(1, seen, torch.where(s < 0, s * repetition_penalty, s / repetition_penalty))
    if temperature == 0:
        return scores
    scores, inf = scores / temperature, float("-inf")
    if (top_k or 0) > 0:
        scores = scores.masked_fill(scores < scores.topk(min(top_k, scores.shape[1])).values[:, -1:], inf)
    if top_p < 1.0:  # drop a token when the more likely ones already hold top_p of the mass (the first stays)
        ordered, order = scores.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        scores = scores.scatter(1, order, ordered.masked_fill(probs.cumsum(-1) - probs > top_p, inf))
    if min_p > 0:  # drop a token less likely than min_p x the likeliest one
        scores = scores.masked_fill((p := scores.softmax(-1)) < min_p * p.max(-1, keepdim=True).values, inf)
    return scores


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
        gc.freeze()  # vLLM freezes the GC heap after its start-up anyway: first, spare its 5 full collections our heap
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
        from vllm import SamplingParams, TokensPrompt
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
    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, **filters):
        """gpt-fast's decode loop with prefix sharing: each prompt's forward runs once and its KV cache is copied to
        its n completions (HF generate runs every prompt n times), then one forward a token for all of them."""
        model, B = unwrap(self.model), len(prompt_ids)
        ids, mask, positions = (x.to(model.device) for x in sequence_batch(  # (B, P) x3, the prompts left-padded
            prompt_ids, torch.zeros(B, 0, dtype=torch.long), self.pad_id))
        rows = torch.arange(B, device=ids.device).repeat_interleave(n)  # (N,) each completion's prompt
        eos = torch.tensor(self.eos_ids, device=ids.device)
        # FSDP2 all-gathers in every forward: ranks take the same number of steps (HF generate's synced_gpus)
        synced = dist.is_initialized() and any(isinstance(p, DTensor) for p in model.parameters())
        was_training, tokens, logps = model.training, [], []
        model.eval()
        with private_rng(rng_seed), torch.autocast(model.device.type, self.dtype, self.dtype != torch.float32):
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[rows, -1]  # (N, V) the next token's
            cache.batch_select_indices(rows)  # (B, ...) -> (N, ...) per layer
            seen = torch.where(mask.bool(), ids, ids[:, -1:])[rows]  # (N, P) prompt tokens (pads: a real one)
            mask, position, done = mask[rows], positions[rows, -1:], torch.zeros_like(rows, dtype=torch.bool)
            lengths = torch.zeros_like(rows)  # (N,) tokens up to the first EOS
            for t in itertools.count():
                if t < max_new_tokens:  # (FSDP2: a rank past its own last token steps on with the others)
                    scores = process_logits(logits.float(), seen, temperature, **filters)  # (N, V)
                    token = (scores.argmax(-1) if temperature == 0 else
                             torch.multinomial(scores.softmax(-1), 1)[:, 0]).masked_fill(done, self.pad_id)  # (N,)
                    tokens.append(token)
                    logps.append(scores.log_softmax(-1).gather(1, token[:, None])[:, 0])  # (N,)
                    done, lengths = done | torch.isin(token, eos), lengths + ~done  # (N,) x2
                    seen = torch.cat([seen, token[:, None]], 1) if filters.get("repetition_penalty", 1) != 1 else seen
                finished_here = t + 1 >= max_new_tokens or bool(done.all())
                if all_ranks_ok(finished_here) if synced else finished_here:  # FSDP2: once every rank is done
                    break
                mask, position = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), position + 1  # (N, P+t+1)
                logits = model(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                               past_key_values=cache, use_cache=True).logits[:, -1]  # (N, V)
        model.train(was_training)
        new_ids, logps, lengths = torch.stack(tokens, 1).cpu(), torch.stack(logps, 1).float().cpu(), lengths.tolist()
        return ([ids[:k].tolist() for ids, k in zip(new_ids, lengths)],
                [lps[:k].tolist() for lps, k in zip(logps, lengths)], done.tolist())

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
            print(f"rollout engine: vLLM unavailable ({type(e).__name__}: {e}); using the HF engine")
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
