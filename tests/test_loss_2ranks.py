"""Loss bookkeeping over 2 ranks (torchrun, gloo on CPU): with DDP averaging the gradients, each loss type's
minibatch loss over every rank's completions is what one process would compute on all of them at once, whatever
each rank's token count, and so are the logged loss, kl and entropy (loss.step_metrics). The batch-level masks too:
the entropy quantile is over both ranks' tokens, truncated completions leave both ranks' normaliser, and the masks'
metrics (a max among them) are the one process's. This file is both the pytest test and the script it launches:

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
    from reduction import high_entropy_mask

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

    # the batch-level masks: the top 30% of both ranks' 19 tokens by entropy (6 of them)
    entropies = torch.rand(world, n, T, generator=g)  # (W, n, T)
    high = high_entropy_mask(entropies[rank], mask[rank], 0.3)  # (n, T) a collective
    flat = lambda x: x.reshape(world * n, *x.shape[2:])  # noqa: E731  (W, n, ...) -> (W * n, ...)
    threshold = torch.quantile(entropies[mask.bool()], 0.7)  # one process, all 19 tokens
    all_high = (entropies >= threshold) & mask.bool()  # (W, n, T)
    assert torch.equal(high, all_high[rank]) and all_high.sum() == 6, (high, all_high)
    old_logps = ref_logps + 0.3 * torch.randn(world, n, T, generator=g)  # (W, n, T)
    sampling_logps = old_logps + 0.3 * torch.randn(world, n, T, generator=g)  # (W, n, T)
    truncated = torch.tensor([[False, True, False, False], [False, False, False, True]])  # (W, n)
    knobs = dict(kw, loss_type="dapo", is_correction="sequence_mask", is_max=1.2, off_policy_mask=0.0,
                 kl_bias_correction=True)
    model = DDP(copy.deepcopy(layer))
    tokens = minibatch_tokens(mask[rank], truncated[rank])  # (13 - 1 + 6 - 1) / 2: a collective
    assert tokens.item() == 17 / 2
    micro_metrics = []
    for i in range(0, n, 2):
        model.require_backward_grad_sync = i + 2 == n
        r = slice(i, i + 2)
        loss, metrics = policy_loss(model(hidden[rank, r]), ids[rank, r], advantages[rank, r], mask[rank, r],
                                    old_logps[rank, r], ref_logps[rank, r], sampling_logps[rank, r],
                                    minibatch_size=n, minibatch_tokens=tokens, truncated=truncated[rank, r],
                                    high_entropy=high[r], **knobs)
        loss.backward()
        micro_metrics.append(metrics)
    logged = step_metrics(micro_metrics, [torch.tensor(1.0)])
    one = copy.deepcopy(layer)
    loss, metrics = policy_loss(one(flat(hidden)), flat(ids), flat(advantages), flat(mask), flat(old_logps),
                                flat(ref_logps), flat(sampling_logps), minibatch_size=world * n,
                                minibatch_tokens=flat(mask)[~flat(truncated)].sum(), truncated=flat(truncated),
                                high_entropy=flat(all_high), **knobs)
    loss.backward()
    torch.testing.assert_close(model.module.weight.grad, one.weight.grad)
    for key in ("frac_masked_truncated", "frac_is_masked", "frac_off_policy_masked", "frac_low_entropy"):
        assert 0 < metrics[key] < 1, (key, metrics[key])  # each mask drops some tokens, not all
    for key, value in metrics.items():
        if key != "tokens":  # is_ratio_max too: the max over both ranks
            assert abs(logged[key] - value) < 1e-6, (key, logged[key], value)
    print(f"rank {rank} PASS", flush=True)
    # free the DDP models (the earlier ones are cyclic garbage) while the group lives: one left for the exit hung
    # 15-25 % of warm runs (zygote.py) in gloo's teardown, ~ProcessGroupGloo joining a thread that needs the GIL
    del model
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
