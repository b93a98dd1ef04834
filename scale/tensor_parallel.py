"""--vllm-tp N: N consecutive ranks sample as one vLLM engine, its weights
sharded over them (engines/vllm_engine.py, simplification 3); each rank still
trains on its own share of the batch. The group's ranks gather their prompts
for each generate call and each takes back its own rows (rollout.Engine).

    torchrun --nproc_per_node 2 train.py --engine vllm --vllm-tp 2

Tests: python -m pytest -q tests/test_rollout_tp.py
"""
import torch.distributed as dist


def tensor_parallel_group(size):
    """-> (this rank's group of `size` consecutive ranks, its rank in it).

    Every rank creates every group, as new_group requires, then keeps its own.
    """
    firsts = range(0, dist.get_world_size(), size)
    groups = [dist.new_group(list(range(g, g + size))) for g in firsts]
    return groups[dist.get_rank() // size], dist.get_rank() % size
