"""
The numbers a step logs: a micro-batch's (token_stats, which loss.policy_loss
returns), then the step's over its micro-batches and the ranks (step_metrics,
which train.py logs).

    a metric named "..._max"   the max over every token, micro-batch and rank
    "loss"                     the minibatch loss, averaged over optimizer steps
                               and ranks (as DDP averages gradients)
    "grad_norm"                the mean over the step's optimizer steps
    every other metric         a token mean over the whole step on every rank

Each is the same whatever --micro-batch-size, and the same on every rank.
Tests: python -m pytest -q tests/test_loss.py tests/test_loss_2ranks.py
"""
import torch
import torch.distributed as dist

from common import collective_device, ddp, world


def token_stats(mask, stats):
    """{name: (B, T) tensor} -> {name: float}, over the mask's tokens.

    A masked token mean, or for a name ending in "_max" the masked max.
    One sync for all of them.
    """
    with torch.no_grad():
        mask = mask.to(torch.promote_types(mask.dtype, torch.float32))  # (B, T)
        tokens = mask.sum().clamp(min=1.0)

        values = []
        for name, x in stats.items():
            x = x.to(mask.dtype)  # (B, T)
            if name.endswith("_max"):
                values.append(x.masked_fill(mask == 0, -float("inf")).max())
            else:
                values.append((x * mask).sum() / tokens)

        return dict(zip(stats, torch.stack(values).tolist()))


def step_metrics(micro_metrics, grad_norms):
    """The step's logged numbers from its micro-batches' metrics and grad norms.

    Each micro-batch's means are weighted by its "tokens". A collective under
    DDP: every rank gets the same numbers.
    """
    first = micro_metrics[0]
    keys = [k for k in first if k not in ("loss", "tokens") and not k.endswith("_max")]
    max_keys = [k for k in first if k.endswith("_max")]

    # this rank's sums: token-weighted means, the minibatch losses, the grad norm
    tokens = [m["tokens"] for m in micro_metrics]
    sums = [sum(m[k] * t for m, t in zip(micro_metrics, tokens)) for k in keys]
    loss = sum(m["loss"] for m in micro_metrics) / len(grad_norms)
    grad_norm = torch.stack(grad_norms).float().mean().item()
    values = torch.tensor(sums + [sum(tokens), loss, grad_norm], dtype=torch.float64)
    maxes = [max(m[k] for m in micro_metrics) for k in max_keys]
    maxes = torch.tensor(maxes, dtype=torch.float64)

    if ddp:
        values = values.to(collective_device())
        dist.all_reduce(values)
        # token sums stay sums; the loss and grad norm become means over the ranks
        divisors = [1.0] * (len(keys) + 1) + [world, world]
        values = values.cpu() / torch.tensor(divisors, dtype=torch.float64)
        if max_keys:
            maxes = maxes.to(collective_device())
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            maxes = maxes.cpu()

    all_tokens = values[-3]
    result = {k: (v / all_tokens).item() for k, v in zip(keys, values)}
    result.update(zip(max_keys, maxes.tolist()))
    result["loss"] = values[-2].item()
    result["grad_norm"] = values[-1].item()
    return result
