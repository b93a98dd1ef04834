"""Loss bookkeeping over 2 ranks (torchrun, gloo on CPU).

With DDP averaging the gradients, each loss type's minibatch loss over every
rank's completions is what one process would compute on all of them at once,
whatever each rank's token count. So are the logged loss, kl and entropy
(metrics.step_metrics).

The batch-level masks too: the entropy quantile is over both ranks' tokens,
truncated completions leave both ranks' normaliser, and the masks' metrics (a
max among them) are the one process's. The same math in another order (gloo's
all-reduce, the micro-batches' sums): the policy, the log-probs and the masks
are fp64, and the gradients and metrics agree to FP64_TOL. This file is both the
pytest test and the script it launches:

    python -m pytest -q tests/test_loss_2ranks.py
    torchrun --standalone --nproc_per_node 2 tests/test_loss_2ranks.py   # what it runs
"""
import copy
import gc
import os
import sys
import types

import pytest
import torch

from helpers import FP64_TOL, assert_close_rel, run_two_rank_script

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H = 8  # the policy's hidden size
V = 32
T = 5
N = 4  # completions per rank, in micro-batches of 2
# the settings of every run below
SETTINGS = dict(beta=0.04, entropy_coef=0.01, max_new_tokens=T, temperature=0.7)


@pytest.mark.same_math
def test_two_ranks_match_one_process():
    run_two_rank_script(__file__)


# -----------------------------------------------------------------------------
# the per-rank script

def flat(x):
    """(W, n, ...) -> (W * n, ...): every rank's rows as one process's."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def make_inputs(world):
    """The policy and every rank's completions, the same on every rank.

    Rank r trains on [r] of each (W, n, ...) tensor. The policy, its inputs,
    the log-probs and the masks (the metrics' token means) in fp64; the
    entropies, which only rank the tokens, in fp32.
    """
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x = types.SimpleNamespace()
    # the "policy": hidden states -> logits (the same on both ranks)
    x.layer = torch.nn.Linear(H, V).double()

    x.hidden = torch.randn(world, N, T, H, generator=g).double()  # (W, n, T, H)
    x.ids = torch.randint(V, (world, N, T), generator=g)  # (W, n, T)
    # rank 0 has 13 tokens, rank 1 has 6
    lengths = torch.tensor([[5, 1, 2, 5], [1, 1, 3, 1]])
    x.mask = (torch.arange(T) < lengths.unsqueeze(-1)).double()  # (W, n, T)
    x.advantages = torch.randn(world, N, generator=g).double()  # (W, n)
    x.ref_logps = -3 + 0.5 * torch.randn(world, N, T, generator=g).double()  # (W, n, T)

    # for the batch-level masks: (W, n, T) each
    x.entropies = torch.rand(world, N, T, generator=g)
    x.old_logps = x.ref_logps + 0.3 * torch.randn(world, N, T, generator=g).double()
    x.sampling_logps = x.old_logps + 0.3 * torch.randn(world, N, T, generator=g).double()
    x.truncated = torch.tensor([[False, True, False, False], [False, False, False, True]])
    return x


def train_micro_batches(model, x, local, settings, tokens):
    """This rank's minibatch in micro-batches of 2 -> their metrics.

    local: this rank's UpdateBatch. The gradients are reduced once, after the
    last micro-batch, as train.py does.
    """
    from loss import policy_loss

    rank = torch.distributed.get_rank()
    micro_metrics = []
    for i in range(0, N, 2):
        model.require_backward_grad_sync = i + 2 == N
        r = slice(i, i + 2)
        loss, metrics = policy_loss(model(x.hidden[rank, r]), local.select(r), settings,
                                    minibatch_size=N, minibatch_tokens=tokens)
        loss.backward()
        micro_metrics.append(metrics)
    return micro_metrics


def check_loss_type(loss_type, x):
    """One loss type on 2 ranks against one process on both ranks' rows."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from batch import UpdateBatch
    from loss import LossSettings, minibatch_tokens, policy_loss
    from runlog.metrics import step_metrics

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    level = "sequence" if loss_type == "luspo" else "token"  # luspo is GSPO's
    settings = LossSettings(loss_type=loss_type, importance_sampling_level=level, **SETTINGS)

    # 2 ranks
    model = DDP(copy.deepcopy(x.layer))
    tokens = minibatch_tokens(x.mask[rank])  # a collective: (13 + 6) / 2 on both ranks
    assert tokens.item() == x.mask.sum().item() / world
    local = UpdateBatch(completion_ids=x.ids[rank], completion_mask=x.mask[rank],
                        advantages=x.advantages[rank], sampling_logps=None,
                        ref_logps=x.ref_logps[rank])
    micro_metrics = train_micro_batches(model, x, local, settings, tokens)
    # as if 2 optimizer steps: the loss is their mean, so each minibatch counts
    # half of its micro-batches' sum
    grad_norms = [torch.tensor(1.0 + 2 * rank), torch.tensor(3.0 + 2 * rank)]
    logged = step_metrics(micro_metrics * 2, grad_norms)

    # one process, both ranks' completions as one minibatch
    one = copy.deepcopy(x.layer)
    everything = UpdateBatch(completion_ids=flat(x.ids), completion_mask=flat(x.mask),
                             advantages=flat(x.advantages), sampling_logps=None,
                             ref_logps=flat(x.ref_logps))
    loss, metrics = policy_loss(one(flat(x.hidden)), everything, settings,
                                minibatch_size=world * N, minibatch_tokens=x.mask.sum())
    loss.backward()

    assert_close_rel(model.module.weight.grad, one.weight.grad, FP64_TOL, msg=loss_type)
    for key in ("loss", "kl", "entropy", "ratio_mean"):
        # relative to the terms' order 1 (the loss's may cancel)
        assert_close_rel(logged[key], metrics[key], FP64_TOL, scale=max(1, abs(metrics[key])),
                         msg=f"{loss_type} {key}")
    # rank 0's steps 1 and 3, rank 1's 3 and 5
    assert logged["grad_norm"] == 3.0


def check_batch_masks(x):
    """The top 30% of both ranks' 19 tokens by entropy (6 of them), truncated
    completions, and the sampler's knobs: 2 ranks against one process."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from batch import UpdateBatch
    from loss import LossSettings, minibatch_tokens, policy_loss
    from variants.high_entropy import high_entropy_mask
    from runlog.metrics import step_metrics

    rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()

    # the entropy mask: a collective, against one process's, over all 19 tokens
    high = high_entropy_mask(x.entropies[rank], x.mask[rank], 0.3)  # (n, T)
    threshold = torch.quantile(x.entropies[x.mask.bool()], 0.7)
    all_high = (x.entropies >= threshold) & x.mask.bool()  # (W, n, T)
    assert torch.equal(high, all_high[rank]) and all_high.sum() == 6, (high, all_high)

    settings = LossSettings(loss_type="dapo", is_correction="sequence_mask", is_max=1.2,
                            off_policy_mask=0.0, kl_bias_correction=True, **SETTINGS)

    # 2 ranks
    model = DDP(copy.deepcopy(x.layer))
    # (13 - 1 + 6 - 1) / 2: a collective
    tokens = minibatch_tokens(x.mask[rank], x.truncated[rank])
    assert tokens.item() == 17 / 2
    local = UpdateBatch(completion_ids=x.ids[rank], completion_mask=x.mask[rank],
                        advantages=x.advantages[rank],
                        sampling_logps=x.sampling_logps[rank],
                        old_logps=x.old_logps[rank], ref_logps=x.ref_logps[rank],
                        truncated=x.truncated[rank], high_entropy=high)
    micro_metrics = train_micro_batches(model, x, local, settings, tokens)
    logged = step_metrics(micro_metrics, [torch.tensor(1.0)])

    # one process
    one = copy.deepcopy(x.layer)
    everything = UpdateBatch(completion_ids=flat(x.ids), completion_mask=flat(x.mask),
                             advantages=flat(x.advantages),
                             sampling_logps=flat(x.sampling_logps),
                             old_logps=flat(x.old_logps), ref_logps=flat(x.ref_logps),
                             truncated=flat(x.truncated), high_entropy=flat(all_high))
    all_tokens = flat(x.mask)[~flat(x.truncated)].sum()
    loss, metrics = policy_loss(one(flat(x.hidden)), everything, settings,
                                minibatch_size=world * N, minibatch_tokens=all_tokens)
    loss.backward()

    assert_close_rel(model.module.weight.grad, one.weight.grad, FP64_TOL, msg="grad")
    knobs = ("frac_masked_truncated", "frac_is_masked", "frac_off_policy_masked",
             "frac_low_entropy")
    for key in knobs:
        # each mask drops some tokens, not all
        assert 0 < metrics[key] < 1, (key, metrics[key])
    for key, value in metrics.items():
        if key != "tokens":  # is_ratio_max too: the max over both ranks
            assert_close_rel(logged[key], value, FP64_TOL, scale=max(1, abs(value)), msg=key)


def main():
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    sys.path.insert(0, REPO)
    from config import LOSS_TYPES

    x = make_inputs(dist.get_world_size())
    for loss_type in LOSS_TYPES:
        check_loss_type(loss_type, x)
    check_batch_masks(x)
    print(f"rank {rank} PASS", flush=True)

    # Free the DDP models (the earlier ones are cyclic garbage) while the group
    # lives: one left for the exit hung 15-25 % of warm runs (zygote.py) in
    # gloo's teardown, ~ProcessGroupGloo joining a thread that needs the GIL.
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
