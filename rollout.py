"""
Rollout: sample G completions for each prompt from the current policy, with the sampler's own log-probabilities.

    sampling_logps[i, t] = log softmax(process(logits_t) / temperature)[completion_ids[i, t]]
where process = repetition penalty, and the top-k / top-p / min-p filters after the temperature. With no
filters this is exactly what the trainer recomputes (loss.selective_log_softmax at the same temperature);
engines that return the *raw* logprobs instead break that (TRL bug trl#4159).

Three engines with one interface (generate -> Rollout, sync_weights(model) -> {seconds, bytes}, close):
    VLLMEngine(model_path, ...)  vLLM 0.32 colocated in the training process: the engine core runs
                                 in-process alone, and under torchrun each rank owns an engine
                                 (distributed_executor_backend="external_launcher").
    HFEngine(model, tokenizer)   transformers generate (KV cache) on the trainer's own model object.
    RemoteEngine(url, tokenizer) the client of a rollout server on other GPUs or nodes, started with
                                 python rollout.py serve --model DIR --host 0.0.0.0 --port 8000
    make_engine("auto" | "vllm" | "hf" | "server", ...) picks one; "auto" = vLLM when it imports.

Run the tests: python -m pytest -q tests/test_rollout.py tests/test_rollout_2ranks.py tests/test_rollout_tp.py \
                   tests/test_server.py
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
3. In the training process, tensor_parallel_size > 1 runs only under torchrun (one shard per rank); the ranks of
   one tensor-parallel group must then pass the same prompts and the same seed. A server with
   tensor_parallel_size > 1 runs vLLM's own worker processes, which sample from their own RNG (the client's
   seed then does not pick the stream; runs are reproducible only if requests arrive in the same order).
4. vLLM applies min-p before top-k / top-p and HF after; the two agree when at most one filter is on.
5. HFEngine keeps every step's processed scores (N, V) until generate returns (HF's output_scores), so
   its memory grows with N * T * V: it is the fallback for small models, not the fast path.
6. VLLMEngine.close() tears down vLLM's process-wide state, including torch.distributed's default
   process group (vllm/distributed/parallel_state.py): close the last engine once, at the very end.
7. The server answers one request at a time (the trainer ranks' batches are not merged into one vLLM call),
   has no authentication, and syncs weights as one safetensors snapshot per call (CPU, or any trainer without
   NCCL to the server: the whole model passes through rank 0's host memory) or with vLLM's NCCL weight
   transfer (GPU: packed buckets, a few HTTP calls per sync whatever the parameter count, trl#3557).
"""
import http.client
import json
import logging
import os
import random
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
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


def pad_id(tokenizer):
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


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


def reload_from_safetensors(worker, snapshot):
    """Runs inside a vLLM worker (a module-level function pickles to worker processes): load a safetensors
    snapshot, given as a file path or as the file's bytes, through vLLM's layer-wise reload."""
    from safetensors.torch import load, load_file

    tensors = load_file(snapshot) if isinstance(snapshot, str) else load(snapshot)
    worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)


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
        if tensor_parallel_size > 1 and not distributed and llm_kwargs.get("distributed_executor_backend") != "mp":
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
        self.pad_id = pad_id(self.tokenizer)

    def generate(self, prompt_ids, G, max_new_tokens, **sampling):
        """G completions per prompt (consecutive in the Rollout), each until EOS or max_new_tokens.
        sampling: temperature, top_p, top_k, min_p, repetition_penalty (see sample)."""
        return build_rollout(prompt_ids, G, *self.sample(prompt_ids, G, max_new_tokens, **sampling), self.pad_id,
                             self.tokenizer)

    def sample(self, prompt_ids, G, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
               repetition_penalty=1.0, rng_seed=None):
        """-> (token ids, their logprobs, EOS reached), one list entry per completion. top_k 0 (or None, -1) = off;
        temperature 0 = greedy. rng_seed: the sampling stream (default: from the engine seed and call number;
        the server takes its client's)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        _check_generate_args(prompt_ids, G, max_new_tokens)
        greedy = temperature == 0  # vLLM refuses n > 1 for greedy: sample once, repeat G times
        params = SamplingParams(n=1 if greedy else G, max_tokens=max_new_tokens, temperature=temperature,
                                top_p=top_p, top_k=top_k if top_k and top_k > 0 else 0, min_p=min_p,
                                repetition_penalty=repetition_penalty,
                                logprobs=0,  # 0 = only the sampled token's logprob
                                detokenize=False)  # we decode once, in build_rollout
        with private_rng(call_seed(self.seed, self.calls) if rng_seed is None else rng_seed):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params,
                                        use_tqdm=False)
        self.calls += 1
        samples = [s for out in outputs for s in sorted(out.outputs, key=lambda s: s.index)]
        samples = [s for s in samples for _ in range(G)] if greedy else samples  # (N,) G per prompt, in order
        completions = [list(s.token_ids) for s in samples]
        logps = [[step[tok].logprob for tok, step in zip(s.token_ids, s.logprobs)] for s in samples]
        finished = [s.finish_reason == "stop" for s in samples]  # "stop" = EOS (no stop strings set), else "length"
        return completions, logps, finished

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

    def load_snapshot(self, snapshot):
        """Load the weights of a safetensors snapshot (a file path, or the file's bytes) in every worker."""
        self.llm.collective_rpc(reload_from_safetensors, args=(snapshot,))
        self.llm.reset_prefix_cache()

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
        self.pad_id = pad_id(tokenizer)
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


# -----------------------------------------------------------------------------
# Server mode: vLLM on its own GPUs / nodes, behind a small JSON-over-HTTP API

def serve(model_path, host="127.0.0.1", port=8000, weight_transfer=None, **engine_kwargs):
    """Run one VLLMEngine behind HTTP until killed. Routes (JSON in, JSON out):
        GET  /health         -> {model, world_size (vLLM workers), weight_transfer ("nccl" | "file")}
        POST /generate       {prompt_ids, G, max_new_tokens, temperature, ..., rng_seed}
                             -> {completion_ids, sampling_logps, finished}: one list entry per completion
        POST /load_weights   a safetensors file's bytes, or {"path": a safetensors file this server can read}
        POST /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
             /shutdown_weight_transfer_engine: vLLM's own RL routes and bodies (vllm/entrypoints/rl/online/
             api_router.py), driven by vLLM's HTTPVLLMWeightSyncClient (weight_transfer="nccl" only).
    One request at a time (a plain HTTPServer): the engine is not thread-safe, and vLLM batches within a request."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    weight_transfer = weight_transfer or ("nccl" if torch.cuda.is_available() else "file")
    if weight_transfer == "nccl":  # the workers then build vLLM's NCCLWeightTransferEngine
        engine_kwargs["weight_transfer_config"] = dict(backend="nccl")
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:  # vLLM's own worker processes, one per GPU
        engine_kwargs["distributed_executor_backend"] = "mp"
    engine = VLLMEngine(model_path, distributed=False, **engine_kwargs)
    llm = engine.llm
    health = dict(model=model_path, world_size=llm.llm_engine.vllm_config.parallel_config.world_size,
                  weight_transfer=weight_transfer)

    def finish_weight_update(body):
        llm.finish_weight_update(body.get("weight_version"))
        llm.reset_prefix_cache()  # its KV entries were computed with the old weights

    routes = {
        "/generate": lambda body: dict(zip(("completion_ids", "sampling_logps", "finished"), engine.sample(**body))),
        "/load_weights": lambda body: engine.load_snapshot(body["path"]),
        "/init_weight_transfer_engine": llm.init_weight_transfer_engine,  # takes the body: {"init_info": {...}}
        "/start_weight_update": lambda body: llm.start_weight_update(),
        "/update_weights": llm.update_weights,  # {"update_info": {names, dtype_names, shapes}}
        "/finish_weight_update": finish_weight_update,
        "/shutdown_weight_transfer_engine": lambda body: llm.shutdown_weight_transfer_engine(),
    }

    class Handler(BaseHTTPRequestHandler):
        def reply(self, status, obj):
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(200, health) if self.path == "/health" else self.reply(404, dict(error=f"no route {self.path}"))

        def do_POST(self):
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path not in routes:
                return self.reply(404, dict(error=f"no route {self.path}"))
            raw = self.path == "/load_weights" and self.headers.get("Content-Type") == "application/octet-stream"
            try:
                result = engine.load_snapshot(data) if raw else routes[self.path](json.loads(data or b"{}"))
                self.reply(200, result or {})
            except Exception as e:  # the client shows this message; the server keeps serving
                logging.exception(f"rollout server: {self.path} failed")
                self.reply(500, dict(error=f"{type(e).__name__}: {e}"))

    server = HTTPServer((host, port), Handler)
    print(f"rollout server ready on http://{host}:{port} ({model_path}, weight transfer {weight_transfer})", flush=True)
    try:
        server.serve_forever()
    finally:
        engine.close()


class RemoteEngine:
    def __init__(self, url, tokenizer, *, seed=0, timeout=600.0, snapshot_dir=None, weight_transfer="auto",
                 wait_s=0.0, nccl_port=None):
        """The client of `python rollout.py serve` at url (http://host:port). timeout (s) bounds every request,
        a generate included; past it, or at once when the server is gone, calls raise ConnectionError naming
        the url. wait_s: how long the first contact retries while the server starts up.
        weight_transfer: "file" = one safetensors snapshot per sync, sent in the request body, or written to
        snapshot_dir (a folder the server reads under the same path: same node or a shared file system);
        "nccl" = vLLM's NCCL weight transfer (CUDA trainer, server started with --weight-transfer nccl);
        "auto" = nccl when both sides can. nccl_port: the rendezvous port on trainer rank 0 (default: free)."""
        self.url, self.tokenizer, self.seed, self.calls = url.rstrip("/"), tokenizer, seed, 0
        self.timeout, self.snapshot_dir, self.nccl_port, self.nccl = timeout, snapshot_dir, nccl_port, None
        self.pad_id = pad_id(tokenizer)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.server = self.request("/health", timeout=10)
                break
            except ConnectionError:  # not up (yet)
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        server_nccl = self.server["weight_transfer"] == "nccl"
        if weight_transfer == "auto":
            weight_transfer = "nccl" if server_nccl and torch.cuda.is_available() else "file"
        if weight_transfer not in ("nccl", "file") or weight_transfer == "nccl" and not server_nccl:
            raise ValueError(f"weight_transfer {weight_transfer!r}: use 'file', or 'nccl' with a server started "
                             f"with --weight-transfer nccl (the server at {self.url} has {self.server})")
        self.weight_transfer = weight_transfer

    def request(self, path, payload=None, data=None, timeout=None):
        """GET path (no payload) or POST a JSON payload (or raw bytes) -> the server's JSON reply."""
        body = data if data is not None else None if payload is None else json.dumps(payload).encode()
        kind = "application/octet-stream" if data is not None else "application/json"
        request = urllib.request.Request(self.url + path, data=body, headers={"Content-Type": kind})
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:  # the server answered with an error: show its message
            raise RuntimeError(f"rollout server {self.url}{path} failed: {e.read().decode()[-2000:]}") from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out: the server is gone or hung
            raise ConnectionError(f"rollout server {self.url} did not answer {path} ({e}). Is `python rollout.py "
                                  f"serve` running there and reachable from this node? Restart it (same --model "
                                  f"and --seed) and resume training from the last checkpoint.") from None

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                 repetition_penalty=1.0):
        """As VLLMEngine.generate; every trainer rank sends its own prompts."""
        _check_generate_args(prompt_ids, G, max_new_tokens)
        reply = self.request("/generate", dict(
            prompt_ids=prompt_ids, G=G, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
            rng_seed=call_seed(self.seed, self.calls)))  # reproducible whatever order the ranks' requests arrive in
        self.calls += 1
        return build_rollout(prompt_ids, G, reply["completion_ids"], reply["sampling_logps"], reply["finished"],
                             self.pad_id, self.tokenizer)

    def sync_weights(self, model):
        """Send the trainer's weights (plain, DDP or FSDP2 model) to the server. A collective: every trainer rank
        calls it, FSDP2 ranks all take part in the gathers, rank 0 sends, and all wait at a barrier so that no
        rank generates with stale weights. Returns {seconds, bytes}."""
        start, counter = time.perf_counter(), {"bytes": 0}
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        with torch.no_grad():
            (self.send_nccl if self.weight_transfer == "nccl" else self.send_file)(model, rank, counter)
        if distributed:
            dist.barrier()
        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def send_file(self, model, rank, counter):
        """One safetensors snapshot, one request: the server reloads it with vLLM's reload_weights."""
        from safetensors.torch import save, save_file

        tensors, seen = {}, set()
        for name, tensor in full_named_parameters(model, counter):  # on every rank: FSDP2 gathers are collectives
            if rank == 0:
                tensor = tensor.cpu()  # tied weights share storage, which safetensors refuses: copy the second
                tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
                seen.add(tensor.data_ptr())
        if rank == 0 and self.snapshot_dir:
            path = os.path.abspath(os.path.join(self.snapshot_dir, "weights.safetensors"))
            save_file(tensors, path + ".tmp")
            os.replace(path + ".tmp", path)  # the server never reads a half-written file
            self.request("/load_weights", dict(path=path))
        elif rank == 0:
            self.request("/load_weights", data=save(tensors))

    def send_nccl(self, model, rank, counter):
        """vLLM's trainer-side NCCL engine (vllm/distributed/weight_transfer/nccl_engine.py): rank 0 broadcasts
        packed buckets to every server worker, 4 HTTP calls per sync whatever the parameter count (trl#3557).
        UNTESTED in this repo's CI (needs CUDA on both sides); written against the vLLM 0.32 source."""
        from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ParamMeta, WeightSource,
                                                      WeightTransferTrainerFactory)
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        class Parameters(WeightSource):  # full_named_parameters: tied weights under both names (see there)
            def metadata(self):
                return [ParamMeta(name, p.dtype, tuple(p.shape))
                        for name, p in unwrap(model).named_parameters(remove_duplicate=False)]

            def __iter__(self):
                return full_named_parameters(model, counter)

        if self.nccl is None:  # once: one NCCL group of trainer rank 0 and every server worker
            url = urllib.parse.urlparse(self.url)
            with socket.create_connection((url.hostname, url.port or 80), timeout=10) as s:
                address = s.getsockname()[0]  # this node's address on the route to the server
            with socket.socket() as s:
                s.bind(("", 0))
                free_port = s.getsockname()[1]
            info = NCCLTrainerInitInfo(master_address=address, master_port=self.nccl_port or free_port,
                                       world_size=1 + self.server["world_size"], rank=rank)
            self.nccl = WeightTransferTrainerFactory.trainer_init(
                info, client=HTTPVLLMWeightSyncClient(self.url, timeout=self.timeout), source=Parameters())
        self.nccl.source = Parameters()  # this call's model
        self.nccl.send_weights()

    def close(self):
        if self.nccl is not None:  # release the NCCL group on both sides; the server keeps serving
            if self.nccl.is_sender:
                self.nccl.client.shutdown_weight_transfer_engine()
            self.nccl.shutdown()
            self.nccl = None


def make_engine(kind="auto", *, model=None, tokenizer=None, model_path=None, url=None, **engine_kwargs):
    """"vllm": VLLMEngine(model_path, **engine_kwargs); "hf": HFEngine(model, tokenizer, seed=...);
    "server": RemoteEngine(url, tokenizer, ...); "auto": vLLM if it imports, else HF (printing why).
    HF and server ignore the kwargs they do not take (dtype, memory: the server sets those at start-up)."""
    if kind not in ("auto", "vllm", "hf", "server"):
        raise ValueError(f"engine kind must be 'auto', 'vllm', 'hf' or 'server', got {kind!r}")
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
    if kind == "server":
        if url is None or tokenizer is None:
            raise ValueError("the server engine needs url= (http://host:port of `python rollout.py serve`) and "
                             "tokenizer=")
        remote_kwargs = ("seed", "timeout", "snapshot_dir", "weight_transfer", "wait_s", "nccl_port")
        return RemoteEngine(url, tokenizer, **{k: v for k, v in engine_kwargs.items() if k in remote_kwargs})
    if model is None or tokenizer is None:
        raise ValueError("the HF engine needs model= and tokenizer=")
    return HFEngine(model, tokenizer, seed=engine_kwargs.get("seed", 0))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="python rollout.py serve --model DIR: a vLLM rollout server "
                                                 "for train.py --vllm-mode server (see serve() for the routes)")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--model", required=True, help="a save_pretrained folder: config, weights, tokenizer")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface: trusted "
                        "networks only, the routes have no authentication")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9 if torch.cuda.is_available() else 0.3,
                        help="on CPU: the fraction of the NUMA node's RAM")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="a fixed KV cache size instead")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--weight-transfer", choices=["nccl", "file"], default=None,
                        help="default: nccl on CUDA, else file (the file route always works too)")
    args = parser.parse_args()
    serve(args.model, args.host, args.port, args.weight_transfer, seed=args.seed, dtype=args.dtype,
          tensor_parallel_size=args.tensor_parallel_size, gpu_memory_utilization=args.gpu_memory_utilization,
          kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len)
