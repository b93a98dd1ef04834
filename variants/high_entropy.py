"""--top-entropy-quantile rho (arXiv 2506.01939, "Beyond the 80/20 rule"): the
policy gradient only on the top-rho share of the step's tokens by entropy, over
every rank's tokens (TRL's get_high_entropy_mask):

    h_t = 1 if H_t >= quantile(H over the step's kept tokens, 1 - rho) else 0

train.py draws the mask once a step, before the update (prepare_update), into
batch.UpdateBatch.high_entropy; loss.py's policy weight multiplies it in.

Simplifications:
1. The mask is drawn once a step, from the policy before the update. Every
   micro-batch and pass sees the same tokens (TRL redraws it per micro-batch).

Tests: python -m pytest -q tests/test_loss.py -k entropy tests/test_loss_2ranks.py
tests/test_truncated_sampling.py
"""
import torch
import torch.distributed as dist

from common import collective_device


@torch.no_grad()
def quantile_over_ranks(values, mask, q):
    """The q-quantile of values (N, T) at mask's tokens, on every rank together.

    Linear interpolation, as torch.quantile. A collective: the same result on
    every rank. +inf when no rank has a token.
    """
    local = values[mask.bool()].float()  # (n,)

    if dist.is_initialized() and dist.get_world_size() > 1:
        device = collective_device()
        count = torch.tensor([local.numel()], device=device)
        counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, count)

        # all_gather wants one shape: pad every rank's values to the longest
        longest = max(c.item() for c in counts)
        padded = torch.zeros(longest, device=device)  # (longest,)
        padded[:local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded)
        kept = [g[:c.item()] for g, c in zip(gathered, counts)]
        local = torch.cat(kept).to(values.device)

    if local.numel() == 0:
        return torch.tensor(float("inf"), device=values.device)

    # sort-based: torch.quantile refuses more than 2**24 elements
    ordered = local.sort().values  # (n,)
    position = q * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def high_entropy_mask(entropies, mask, quantile):
    """(N, T) entropies and mask -> (N, T) bool: the top `quantile` share.

    The share is of the unmasked tokens of every rank together (a collective),
    as TRL's get_high_entropy_mask.
    """
    threshold = quantile_over_ranks(entropies, mask, 1 - quantile)
    return (entropies >= threshold) & mask.bool()


def step_mask(forward, model, prompts, completion_ids, kept, quantile, **by_micro):
    """train.py's prepare_update: the step's (N, T) mask of its top-`quantile`
    tokens by the entropy of the policy before the update (kept: loss.kept_mask's
    tokens, the only ones ranked)."""
    entropies = policy_entropies(forward, model, prompts, completion_ids, **by_micro)  # (N, T)
    return high_entropy_mask(entropies, kept, quantile)


@torch.no_grad()
def policy_entropies(forward, model, prompts, completion_ids, *, temperature, micro, dtype):
    """Per-token entropies (N, T) of the completions under model, through
    forward (a model.Forward).

    micro sequences a forward, as in the update: the logits alive at once are
    (micro, T, V). A truncating forward (sampling/truncation.py) replays the
    sampler's filters, as for the loss: the mask ranks the tokens by the
    entropy the loss sees.
    """
    entropies = []
    for i in range(0, completion_ids.shape[0], micro):
        ids = completion_ids[i:i + micro]  # (micro, T)
        logits = forward.logits(model, prompts, slice(i, i + micro), ids, dtype)
        entropies.append(forward.entropies(logits, temperature))  # (micro, T)
    return torch.cat(entropies)  # (N, T)
