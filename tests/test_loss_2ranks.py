"""Loss bookkeeping over 2 ranks (torchrun, gloo on CPU): with DDP averaging the gradients, each loss type's
minibatch loss over every rank's completions is what one process would compute on all of them at once, whatever
each rank's token count, and so are the logged loss, kl and entropy (loss.step_metrics). This file is both the
pytest test and the script it launches:

    python -m pytest -q tests/test_loss_2ranks.py
    torchrun --standalone --nproc_per_node 2 tests/test_loss_2ranks.py   # what it runs
"""
import copy
import gc
import os
import sys

import torch

from helpers import run_two_rank_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_ranks_match_one_process():
    run_two_rank_script(__file__)


# -----------------------------------------------------------------------------
# the per-rank script

def main():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sys.path.insert(0, REPO)
    from loss import step_metrics
    from loss import LOSS_TYPES, minibatch_tokens, policy_loss

    H, V, T, n = 8, 32, 5, 4  # n completions per rank, micro-batches of 2
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layer = torch.nn.Linear(H, V)  # the "policy": hidden states -> logits (the same on both ranks)
    hidden = torch.randn(world, n, T, H, generator=g)  # (W, n, T, H): rank r trains on [r]
    ids = torch.randint(V, (world, n, T), generator=g)  # (W, n, T)
    lengths = torch.tensor([[5, 1, 2, 5], [1, 1, 3, 1]])  # rank 0 has 13 tokens, rank 1 has 6
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).float()  # (W, n, T)
    advantages = torch.randn(world, n, generator=g)  # (W, n)
    ref_logps = -3 + 0.5 * torch.randn(world, n, T, generator=g)  # (W, n, T)
    kw = dict(beta=0.04, entropy_coef=0.01, max_completion_length=T, temperature=0.7)
    for loss_type in LOSS_TYPES:
        model = DDP(copy.deepcopy(layer))
        tokens = minibatch_tokens(mask[rank])  # a collective: (13 + 6) / 2 on both ranks
        assert tokens.item() == mask.sum().item() / world
        micro_metrics = []
        for i in range(0, n, 2):
            model.require_backward_grad_sync = i + 2 == n  # reduce once per minibatch, as train.py does
            r = slice(i, i + 2)
            loss, metrics = policy_loss(model(hidden[rank, r]), ids[rank, r], advantages[rank, r], mask[rank, r],
                                        None, ref_logps[rank, r], minibatch_size=n, minibatch_tokens=tokens,
                                        loss_type=loss_type, **kw)
            loss.backward()
            micro_metrics.append(metrics)
        # as if 2 optimizer steps: the loss is their mean, so each minibatch counts half of its micro-batches' sum
        logged = step_metrics(micro_metrics * 2, [torch.tensor(1.0 + 2 * rank), torch.tensor(3.0 + 2 * rank)])

        one = copy.deepcopy(layer)  # one process, both ranks' completions as one minibatch
        flat = lambda x: x.reshape(world * n, *x.shape[2:])  # noqa: E731  (W, n, ...) -> (W * n, ...)
        loss, metrics = policy_loss(one(flat(hidden)), flat(ids), flat(advantages), flat(mask), None, flat(ref_logps),
                                    minibatch_size=world * n, minibatch_tokens=mask.sum(), loss_type=loss_type, **kw)
        loss.backward()
        torch.testing.assert_close(model.module.weight.grad, one.weight.grad, msg=lambda m: f"{loss_type}: {m}")
        for key in ("loss", "kl", "entropy", "ratio_mean"):
            assert abs(logged[key] - metrics[key]) < 1e-6, (loss_type, key, logged[key], metrics[key])
        assert logged["grad_norm"] == 3.0  # rank 0's steps 1 and 3, rank 1's 3 and 5
    print(f"rank {rank} PASS", flush=True)
    # free the DDP models (the earlier ones are cyclic garbage) while the group lives: one left for the exit hung
    # 15-25 % of warm runs (zygote.py) in gloo's teardown, ~ProcessGroupGloo joining a thread that needs the GIL
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
