"""
Rollout server: rollout.VLLMEngine on its own GPUs or nodes, behind a
JSON-over-HTTP API, and its client RemoteEngine. train.py --vllm-mode server
samples from the client and sends the new weights through it.

    python server.py --model DIR       # loopback, CPU or one GPU (the tests)

    A$ python server.py --model Qwen/Qwen2.5-1.5B-Instruct --host 0.0.0.0 \
           --port 8000 --tensor-parallel-size 8 --dtype bfloat16 \
           --max-model-len 2048 --weight-transfer nccl
    B$ torchrun --nproc_per_node 8 train.py --model Qwen/Qwen2.5-1.5B-Instruct \
           --vllm-mode server --vllm-url http://A:8000 ...

Tests: python -m pytest -q tests/test_server.py. On CPU, a core per
tensor-parallel worker (VLLM_CPU_OMP_THREADS_BIND="0|1" for 2).

A server that dies loses nothing: restart it (same --model and --seed) and
resume from the last checkpoint. The trainer syncs its weights at start-up.

Simplifications:
1. One request at a time (a plain HTTPServer; vLLM batches within a request):
   the ranks' batches are not merged, and a weight load waits for a generation.
   No authentication: trusted networks only.
2. The client picks the sampling stream (rollout.py simplification 2), whatever
   the order of the ranks' requests. Except on a tensor-parallel server, whose
   workers sample from their own RNG.
3. Weights sync as one safetensors snapshot per call, through rank 0's host
   memory. Or with vLLM's NCCL weight transfer (GPU: packed buckets, a few HTTP
   calls per sync, trl#3557; untested here).
4. sync_weights opens with a barrier: every rank's generation in flight
   (train.py --async) is done before rank 0 sends. /generate reports the version
   named at the last sync, or None.
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
from lora import sync_parameters
from model import pad_id
from rollout import Engine, VLLMEngine, full_named_parameters



def reload_from_safetensors(worker, snapshot):
    """In a vLLM worker (module-level: it pickles), reload a safetensors file path
    or bytes."""
    from safetensors.torch import load, load_file

    if isinstance(snapshot, str):
        tensors = load_file(snapshot)
    else:
        tensors = load(snapshot)

    weights = iter(tensors.items())
    worker.model_runner.reload_weights(weights_iterator=weights,
                                       is_checkpoint_format=True)


def serve(model_path, host="127.0.0.1", port=8000, weight_transfer=None, **engine_kwargs):
    """Run one VLLMEngine behind HTTP until killed. Routes (JSON in, JSON out):

        GET  /health         -> {model, world_size, weight_transfer}
                                (world_size: vLLM's workers;
                                weight_transfer: nccl | file)
        POST /generate       {prompt_ids, n, max_new_tokens, rng_seed, temperature,
                              top_p, top_k, min_p, repetition_penalty}
                             -> {completion_ids, sampling_logps, finished,
                                 weight_version}
        POST /load_weights   a safetensors file's bytes, or {"path": a file}
        POST /weight_version {version}: names the weights just loaded
        POST /init_weight_transfer_engine ... /shutdown_weight_transfer_engine
             (nccl only): vLLM's own RL routes and bodies
             (vllm/entrypoints/rl/online/api_router.py)
    """
    from http.server import BaseHTTPRequestHandler, HTTPServer

    if not weight_transfer:
        weight_transfer = "nccl" if torch.cuda.is_available() else "file"
    if weight_transfer == "nccl":
        # the workers then build vLLM's NCCLWeightTransferEngine
        engine_kwargs["weight_transfer_config"] = dict(backend="nccl")
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:
        # vLLM's own worker processes, one per GPU
        engine_kwargs["distributed_executor_backend"] = "mp"

    engine = VLLMEngine(model_path, distributed=False, **engine_kwargs)
    llm = engine.llm
    world_size = llm.llm_engine.vllm_config.parallel_config.world_size
    health = dict(model=model_path, world_size=world_size,
                  weight_transfer=weight_transfer)
    # which weights the engine holds, as the client named them
    loaded = dict(version=None)

    def generate(body):
        completion_ids, sampling_logps, finished = engine.sample(**body)
        return dict(completion_ids=completion_ids, sampling_logps=sampling_logps,
                    finished=finished, weight_version=loaded["version"])

    def load_snapshot(snapshot):
        """A safetensors file's path or bytes, into every worker."""
        llm.collective_rpc(reload_from_safetensors, args=(snapshot,))
        # its KV entries were computed with the old weights
        llm.reset_prefix_cache()
        # until the client names them
        loaded["version"] = None

    def finish_weight_update(body):
        llm.finish_weight_update(body.get("weight_version"))
        llm.reset_prefix_cache()
        loaded["version"] = None

    def load_weights(body):
        return load_snapshot(body["path"])

    def name_weights(body):
        return loaded.update(version=body["version"])

    def start_weight_update(body):
        return llm.start_weight_update()

    def shutdown_weight_transfer_engine(body):
        return llm.shutdown_weight_transfer_engine()

    routes = {
        "/generate": generate,
        "/load_weights": load_weights,
        "/weight_version": name_weights,
        # body: {"init_info": ...}
        "/init_weight_transfer_engine": llm.init_weight_transfer_engine,
        "/start_weight_update": start_weight_update,
        # body: {"update_info": {names, dtype_names, shapes}}
        "/update_weights": llm.update_weights,
        "/finish_weight_update": finish_weight_update,
        "/shutdown_weight_transfer_engine": shutdown_weight_transfer_engine,
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
            if self.path != "/health":
                return self.reply(404, dict(error=f"no route {self.path}"))
            self.reply(200, health)

        def do_POST(self):
            data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path not in routes:
                return self.reply(404, dict(error=f"no route {self.path}"))

            content_type = self.headers.get("Content-Type")
            raw = (self.path == "/load_weights"
                   and content_type == "application/octet-stream")
            try:
                if raw:
                    result = load_snapshot(data)
                else:
                    result = routes[self.path](json.loads(data or "{}"))
                self.reply(200, result or {})
            except Exception as e:
                # the client shows this message; the server keeps serving
                logging.exception(f"rollout server: {self.path} failed")
                self.reply(500, dict(error=f"{type(e).__name__}: {e}"))

    server = HTTPServer((host, port), Handler)
    print(f"rollout server ready on http://{host}:{port} ({model_path}, "
          f"weight transfer {weight_transfer})", flush=True)
    try:
        server.serve_forever()
    finally:
        engine.close()


class RemoteEngine(Engine):
    def __init__(self, url, tokenizer, *, seed=0, timeout=600.0, snapshot_dir=None,
                 weight_transfer="auto", wait_s=0.0, nccl_port=None):
        """The client of `python server.py` at url (http://host:port).

        ConnectionError past timeout (s), or when the server is gone. wait_s: how
        long the first contact retries. weight_transfer: "file" (in the request,
        or via snapshot_dir: a folder the server reads), "nccl" or "auto".
        """
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.seed = seed
        self.pad_id = pad_id(tokenizer)
        # the version the last sync named
        self.version = None
        # the server's version for the last generate
        self.weight_version = None
        self.timeout = timeout
        self.snapshot_dir = snapshot_dir
        self.nccl_port = nccl_port
        self.nccl = None

        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.server = self.request("/health", timeout=10)
                break
            except ConnectionError:
                # not up, or not yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)

        server_nccl = self.server["weight_transfer"] == "nccl"
        if weight_transfer == "auto":
            nccl = server_nccl and torch.cuda.is_available()
            weight_transfer = "nccl" if nccl else "file"

        known = weight_transfer in ("nccl", "file")
        if not known or weight_transfer == "nccl" and not server_nccl:
            raise ValueError(f"weight_transfer {weight_transfer!r}: use 'file', or "
                             f"'nccl' with a server started with --weight-transfer nccl "
                             f"(the server at {self.url} has {self.server})")

        self.weight_transfer = weight_transfer

    def request(self, path, payload=None, data=None, timeout=None):
        """GET path (no payload), or POST a JSON payload (or raw data) -> the
        server's JSON reply."""
        body = data
        if data is None and payload is not None:
            body = json.dumps(payload).encode()
        kind = "application/json" if data is None else "application/octet-stream"
        request = urllib.request.Request(self.url + path, data=body,
                                         headers={"Content-Type": kind})

        timeout = timeout or self.timeout
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            # the server answered with an error: show its message
            message = e.read().decode()[-2000:]
            raise RuntimeError(f"rollout server {self.url}{path} failed: "
                               f"{message}") from None
        except (OSError, http.client.HTTPException) as e:
            # refused, reset, timed out: the server is gone or hung
            raise ConnectionError(f"rollout server {self.url} did not answer {path} "
                                  f"({e}). Is `python server.py` running there and "
                                  f"reachable from this node? Restart it (same --model "
                                  f"and --seed) and resume training from the last "
                                  f"checkpoint.") from None

    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, **sampling):
        """Each trainer rank sends its own prompts, with its own stream
        (simplification 2)."""
        payload = dict(prompt_ids=prompt_ids, n=n, max_new_tokens=max_new_tokens,
                       rng_seed=rng_seed, **sampling)
        reply = self.request("/generate", payload)

        # the weights that sampled them
        self.weight_version = reply.get("weight_version")
        return reply["completion_ids"], reply["sampling_logps"], reply["finished"]

    def sync_weights(self, model, version=None):
        """Send the weights (plain, DDP or FSDP2 model) as `version`, by default
        the last + 1. A collective: every rank gathers (FSDP2) and takes rank 0's
        verdict (a failed send raises)."""

        start = time.perf_counter()
        counter = {"bytes": 0}
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        error = [None]

        if version is None and self.version is not None:
            # one more update since the last sync
            version = self.version + 1
        self.version = version

        if distributed:
            dist.barrier()
        try:
            send = self.send_file
            if self.weight_transfer == "nccl":
                send = self.send_nccl
            with torch.no_grad():
                send(model, rank, counter)
            if rank == 0 and self.version is not None:
                self.request("/weight_version", dict(version=self.version))
        except Exception as e:
            # ConnectionError: the server is gone; RuntimeError: it refused
            error = [e]

        if distributed:
            # rank 0's verdict, to every rank (and the closing barrier)
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise error[0]

        return dict(seconds=time.perf_counter() - start, bytes=counter["bytes"])

    def send_file(self, model, rank, counter):
        from safetensors.torch import save, save_file

        tensors = {}
        seen = set()
        # FSDP2: a collective
        for name, tensor in full_named_parameters(model, counter):
            if rank == 0:
                # tied weights share storage, which safetensors refuses: copy the
                # second
                tensor = tensor.cpu()
                tensors[name] = tensor.clone() if tensor.data_ptr() in seen else tensor
                seen.add(tensor.data_ptr())

        if rank == 0 and self.snapshot_dir:
            path = os.path.abspath(os.path.join(self.snapshot_dir, "weights.safetensors"))
            save_file(tensors, path + ".tmp")
            # the server never reads a half-written file
            os.replace(path + ".tmp", path)
            self.request("/load_weights", dict(path=path))
        elif rank == 0:
            self.request("/load_weights", data=save(tensors))

    def send_nccl(self, model, rank, counter):
        """vLLM's trainer-side NCCL engine (vllm/distributed/weight_transfer/
        nccl_engine.py): rank 0 broadcasts packed buckets to the server's workers.
        UNTESTED here (CUDA on both sides)."""
        from vllm.distributed.weight_transfer import (
            HTTPVLLMWeightSyncClient,
            ParamMeta,
            WeightSource,
            WeightTransferTrainerFactory,
        )
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        class Parameters(WeightSource):
            """As full_named_parameters: tied weights under both names."""

            def metadata(self):
                params = sync_parameters(unwrap(model))
                return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in params]

            def __iter__(self):
                return full_named_parameters(model, counter)

        if self.nccl is None:
            # once: one NCCL group of trainer rank 0 and every server worker
            url = urllib.parse.urlparse(self.url)
            server_address = (url.hostname, url.port or 80)
            with socket.create_connection(server_address, timeout=10) as s:
                # this node's address on the route to the server
                address = s.getsockname()[0]
            with socket.socket() as s:
                s.bind(("", 0))
                # default: a free one
                port = self.nccl_port or s.getsockname()[1]

            world_size = 1 + self.server["world_size"]
            info = NCCLTrainerInitInfo(master_address=address, master_port=port,
                                       world_size=world_size, rank=rank)
            client = HTTPVLLMWeightSyncClient(self.url, timeout=self.timeout)
            factory = WeightTransferTrainerFactory
            self.nccl = factory.trainer_init(info, client=client, source=Parameters())

        # this call's model
        self.nccl.source = Parameters()
        self.nccl.send_weights()

    def close(self):
        if self.nccl is not None:
            # release the NCCL group on both sides; the server keeps serving
            if self.nccl.is_sender:
                self.nccl.client.shutdown_weight_transfer_engine()
            self.nccl.shutdown()
            self.nccl = None


def parse_args():
    import argparse

    parser = argparse.ArgumentParser(
        description="python server.py --model DIR: a vLLM rollout server for train.py "
                    "--vllm-mode server (see serve() for the routes)")
    parser.add_argument("--model", required=True,
                        help="a save_pretrained folder (config, weights, tokenizer) or a "
                             "hub id")
    parser.add_argument("--host", default="127.0.0.1",
                        help="0.0.0.0 to listen on every interface: trusted networks "
                             "only, the routes have no authentication")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto",
                        help="auto: the checkpoint's (float32 if its config says none)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--gpu-memory-utilization", type=float,
                        default=0.9 if torch.cuda.is_available() else 0.3,
                        help="on CPU: the fraction of the NUMA node's RAM")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="a fixed KV cache size instead")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--weight-transfer", choices=["nccl", "file"], default=None,
                        help="default: nccl on CUDA, else file (the file route always "
                             "works too)")
    return parser.parse_args()


if __name__ == "__main__":
    args = parse_args()
    serve(args.model, args.host, args.port, args.weight_transfer, seed=args.seed,
          dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
          gpu_memory_utilization=args.gpu_memory_utilization,
          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
          max_model_len=args.max_model_len)

