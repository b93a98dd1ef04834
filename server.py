"""
Rollout server: one vLLM engine (rollout.VLLMEngine) on its own GPUs or nodes behind a small JSON-over-HTTP API,
and RemoteEngine, its client, with rollout.py's engine interface. train.py --vllm-mode server samples from it and
pushes the new weights to it after every step, so that generation and training run on different devices.

    python server.py --model DIR                          # loopback, CPU or one GPU (what the tests run)
    A$ python server.py --model Qwen/Qwen2.5-1.5B-Instruct --host 0.0.0.0 --port 8000 \
           --tensor-parallel-size 8 --dtype bfloat16 --max-model-len 2048 --weight-transfer nccl
    B$ torchrun --nproc_per_node 8 train.py --model Qwen/Qwen2.5-1.5B-Instruct --vllm-mode server \
           --vllm-url http://A:8000 ...
On CPU a tensor-parallel server needs one core per worker: VLLM_CPU_OMP_THREADS_BIND="0|1" for 2 workers.
A server that dies loses nothing: start it again (same --model and --seed) and resume training from the last
checkpoint; the trainer syncs its weights at start-up, so it never samples from stale ones.

Run the tests: python -m pytest -q tests/test_server.py

Simplifications:
1. One request at a time (a plain HTTPServer: the engine is not thread-safe, and vLLM batches within a request):
   the trainer ranks' batches are not merged into one vLLM call, and a weight load never runs during a generation
   (it waits in the queue). No authentication: trusted networks only.
2. The client picks the sampling stream (its seed and call number, rollout.py simplification 2), so samples do
   not depend on the order in which the ranks' requests arrive. A server with tensor_parallel_size > 1 runs
   vLLM's own worker processes, which sample from their own RNG: the client's seed then does not pick the
   stream, and runs are reproducible only if requests arrive in the same order.
3. Weights are synced as one safetensors snapshot per call (CPU, or any trainer without NCCL to the server: the
   whole model passes through rank 0's host memory), or with vLLM's NCCL weight transfer (GPU: packed buckets,
   a few HTTP calls per sync whatever the parameter count, trl#3557; untested here, it needs CUDA on both sides).
4. train.py --async generates the next batch on a background thread while it trains: sync_weights opens with a
   barrier, so every rank's generation in flight is done before rank 0 sends (no batch mixes two weight versions).
   The version the client names at a sync is what /generate reports (None after a load that named none).
"""
import http.client
import json
import logging
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import torch
import torch.distributed as dist

from common import unwrap
from lora import full_named_parameters, sync_parameters
from rollout import Engine, VLLMEngine, pad_id


def reload_from_safetensors(worker, snapshot):
    """Runs inside a vLLM worker (a module-level function pickles to worker processes): load a safetensors
    snapshot, given as a file path or as the file's bytes, through vLLM's layer-wise reload."""
    from safetensors.torch import load, load_file

    tensors = load_file(snapshot) if isinstance(snapshot, str) else load(snapshot)
    worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)


def serve(model_path, host="127.0.0.1", port=8000, weight_transfer=None, **engine_kwargs):
    """Run one VLLMEngine behind HTTP until killed. Routes (JSON in, JSON out):
        GET  /health         -> {model, world_size (vLLM workers), weight_transfer ("nccl" | "file")}
        POST /generate       {prompt_ids, n, max_new_tokens, rng_seed, temperature, top_p, ...} (VLLMEngine.sample)
                             -> {completion_ids, sampling_logps, finished}: one list entry per completion, and
                                weight_version: the version the last sync named (simplification 4)
        POST /load_weights   a safetensors file's bytes, or {"path": a safetensors file this server can read}
        POST /weight_version {version}: names the weights just loaded
        POST /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update,
             /shutdown_weight_transfer_engine: vLLM's own RL routes and bodies (vllm/entrypoints/rl/online/
             api_router.py), driven by vLLM's HTTPVLLMWeightSyncClient (weight_transfer="nccl" only)."""
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
    loaded = dict(version=None)  # which weights the engine holds, as the client named them

    def load_snapshot(snapshot):  # a safetensors file's path or bytes, into every worker
        llm.collective_rpc(reload_from_safetensors, args=(snapshot,))
        llm.reset_prefix_cache()  # its KV entries were computed with the old weights
        loaded["version"] = None  # until the client names them

    def finish_weight_update(body):
        llm.finish_weight_update(body.get("weight_version"))
        llm.reset_prefix_cache()
        loaded["version"] = None

    routes = {
        "/generate": lambda body: dict(zip(("completion_ids", "sampling_logps", "finished"), engine.sample(**body)),
                                       weight_version=loaded["version"]),
        "/load_weights": lambda body: load_snapshot(body["path"]),
        "/weight_version": lambda body: loaded.update(version=body["version"]),
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
                result = load_snapshot(data) if raw else routes[self.path](json.loads(data or b"{}"))
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


class RemoteEngine(Engine):
    def __init__(self, url, tokenizer, *, seed=0, timeout=600.0, snapshot_dir=None, weight_transfer="auto",
                 wait_s=0.0, nccl_port=None):
        """The client of `python server.py` at url (http://host:port). timeout (s) bounds every request,
        a generate included; past it, or at once when the server is gone, calls raise ConnectionError naming
        the url. wait_s: how long the first contact retries while the server starts up.
        weight_transfer: "file" = one safetensors snapshot per sync, sent in the request body, or written to
        snapshot_dir (a folder the server reads under the same path: same node or a shared file system);
        "nccl" = vLLM's NCCL weight transfer (CUDA trainer, server started with --weight-transfer nccl);
        "auto" = nccl when both sides can. nccl_port: the rendezvous port on trainer rank 0 (default: free)."""
        self.url, self.tokenizer, self.seed, self.calls = url.rstrip("/"), tokenizer, seed, 0
        self.version = self.weight_version = None  # the last sync's version; the server's for the last generate
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
            raise ConnectionError(f"rollout server {self.url} did not answer {path} ({e}). Is `python server.py` "
                                  f"running there and reachable from this node? Restart it (same --model and "
                                  f"--seed) and resume training from the last checkpoint.") from None

    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, **sampling):
        """Every trainer rank sends its own prompts, with its own stream (simplification 2). weight_version: the
        server's word for the weights that sampled them (simplification 4)."""
        reply = self.request("/generate", dict(prompt_ids=prompt_ids, n=n, max_new_tokens=max_new_tokens,
                                               rng_seed=rng_seed, **sampling))
        self.weight_version = reply.get("weight_version")
        return reply["completion_ids"], reply["sampling_logps"], reply["finished"]

    def sync_weights(self, model, version=None):
        """Send the trainer's weights (plain, DDP or FSDP2 model) to the server, named `version` (default: one more
        than the last sync's, if it named one), which /generate then reports. A collective that every trainer rank
        calls between its generations: a barrier first (every rank's generation is done: simplification 4), FSDP2
        ranks all take part in the gathers, rank 0 sends, and all wait for its verdict, so that no rank generates
        with stale weights and a failed send is the same exception on every rank. Returns {seconds, bytes}."""
        start, counter = time.perf_counter(), {"bytes": 0}
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        rank, error = dist.get_rank() if distributed else 0, [None]
        if version is None and self.version is not None:
            version = self.version + 1  # one more update since the last sync
        self.version = version
        if distributed:
            dist.barrier()
        try:
            with torch.no_grad():
                (self.send_nccl if self.weight_transfer == "nccl" else self.send_file)(model, rank, counter)
            if rank == 0 and self.version is not None:
                self.request("/weight_version", dict(version=self.version))
        except Exception as e:  # ConnectionError: the server is gone; RuntimeError: it answered with an error
            error = [e]
        if distributed:  # rank 0's verdict, to every rank (and the closing barrier)
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise error[0]
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
                return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in sync_parameters(unwrap(model))]

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


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="python server.py --model DIR: a vLLM rollout server for "
                                                 "train.py --vllm-mode server (see serve() for the routes)")
    parser.add_argument("--model", required=True, help="a save_pretrained folder (config, weights, tokenizer) or a "
                        "hub id")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface: trusted "
                        "networks only, the routes have no authentication")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", help="auto: the checkpoint's (float32 if its config says none)")
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
