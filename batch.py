"""
The update's batch: what the loss needs of each completion of a step. train.py
builds it once a step, before the update, and slices it per micro-batch.

    UpdateBatch          the step's (N, ...) tensors; batch.rows(r) a micro-batch's
    high_entropy_mask    the top-rho tokens by entropy, over every rank's tokens
    unique_rows          one row of each set of identical completions, with counts

What it holds beside the rollout (each None when its flag is off):
    old_logps     (N, T) the ratio's denominator; None: on-policy, the ratio is 1
    ref_logps     (N, T) the reference's log-probs, for the KL term (beta > 0)
    truncated     (N,)   completions cut at --max-new-tokens (--mask-truncated)
    high_entropy  (N, T) the step's top-rho tokens (--top-entropy-quantile)
    counts        (N,)   how many identical rows each trained row stands for

Simplifications:
1. The entropy mask is drawn once a step, from the policy before the update.
   Every micro-batch and pass sees the same tokens (TRL redraws it per
   micro-batch).
2. unique_rows compares token lists in Python: a few milliseconds a step at
   the default size, and no hashing of tensors.

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_2ranks.py
"""
import dataclasses

import torch
import torch.distributed as dist

from common import collective_device
from model import truncate_logits


@dataclasses.dataclass(frozen=True)
class UpdateBatch:
    """The step's completions as the loss sees them: (N, ...) tensors."""

    completion_ids: torch.Tensor  # (N, T)
    completion_mask: torch.Tensor  # (N, T) float
    advantages: torch.Tensor  # (N,)
    sampling_logps: torch.Tensor  # (N, T) the rollout engine's
    old_logps: torch.Tensor | None = None  # (N, T)
    ref_logps: torch.Tensor | None = None  # (N, T)
    truncated: torch.Tensor | None = None  # (N,) bool
    high_entropy: torch.Tensor | None = None  # (N, T) bool
    counts: torch.Tensor | None = None  # (N,) float

    def rows(self, r):
        """The rows r (an index tensor or a slice) of every tensor."""
        picked = {}
        for field in dataclasses.fields(self):
            x = getattr(self, field.name)
            picked[field.name] = None if x is None else x[r]
        return UpdateBatch(**picked)


# -----------------------------------------------------------------------------
# The entropy mask, over every rank's tokens

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


@torch.no_grad()
def policy_entropies(forward, model, prompts, completion_ids, *, temperature, micro, dtype,
                     top_k=0, top_p=1.0, min_p=0.0):
    """Per-token entropies (N, T) of the completions under model, through
    forward (a model.Forward).

    micro sequences a forward, as in the update: the logits alive at once are
    (micro, T, V). top_k, top_p, min_p: the sampler's filters, replayed as the
    loss replays them (model.truncate_logits), so the mask ranks the tokens by
    the entropy the loss sees.
    """
    entropies = []
    for i in range(0, completion_ids.shape[0], micro):
        ids = completion_ids[i:i + micro]  # (micro, T)
        logits = forward.logits(model, prompts, slice(i, i + micro), ids, dtype)
        logits = truncate_logits(logits, ids, temperature, top_k, top_p, min_p)
        entropies.append(forward.entropies(logits, temperature))  # (micro, T)
    return torch.cat(entropies)  # (N, T)


# -----------------------------------------------------------------------------
# The distinct rows

def unique_rows(prompt_row, completion_ids, completion_mask, advantages):
    """One row of each set of identical completions of a prompt, and its count.

    Identical completions (the same prompt, tokens, mask and advantage) have the
    same loss terms. Trained on the n distinct rows, each weighed by its count,
    the loss and gradient are those of all N rows, to rounding. The default
    task's late steps are half duplicates.

    -> keep (n,): the first row of each distinct one, in order;
       counts (n,): the rows each one stands for.
    """
    first = {}  # a distinct row -> its index in keep
    keep = []
    counts = []
    columns = zip(prompt_row.tolist(), completion_ids.tolist(), completion_mask.tolist(),
                  advantages.tolist())

    for i, (prompt, ids, mask, advantage) in enumerate(columns):
        key = (prompt, tuple(ids), tuple(mask), advantage)
        if key not in first:
            first[key] = len(keep)
            keep.append(i)
            counts.append(0)
        counts[first[key]] += 1

    device = completion_ids.device
    keep = torch.tensor(keep, device=device)
    counts = torch.tensor(counts, dtype=torch.float32, device=device)
    return keep, counts
