"""--fsdp: the policy sharded over the ranks with FSDP2, each decoder layer a unit
(https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html). model.load_model
applies it once, at load: the weights load on the CPU in full, then each rank moves only
its shard to the device (model.py, simplification 1).

Tests: python -m pytest -q tests/test_train.py -k fsdp
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def shard(model, dtype):
    """Shard model in place: compute in dtype, reduce gradients in fp32."""
    mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mixed)
    fully_shard(model, mp_policy=mixed)


def most_on_any_rank(value, device):
    """The largest of an int across the ranks (FSDP2 ranks may ask for
    different max_new_tokens, and all decode until the last one ends)."""
    most = torch.tensor([value], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())
