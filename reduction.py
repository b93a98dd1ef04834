"""
How a step's per-token terms add up, over its micro-batches and ranks: each loss type's
normalisation, a micro-batch's share of its minibatch, the step's batch-wide masks (the entropy
quantile over every rank's tokens), and the step's metrics. loss.py computes the per-token terms.

    loss_type "grpo"    : mean over sequences of each sequence's token mean (DeepSeekMath eq. 3)
              "bnpo"    : sum over tokens / number of unmasked tokens
              "dr_grpo" : sum / (B * max_completion_length), no length bias (arXiv 2503.20783)
              "dapo"    : sum / num_items, the unmasked tokens of the whole batch (arXiv 2503.14476)
              "cispo" reduces like "dapo", "sapo" like "grpo" (as their papers and TRL do)

A micro-batch of a minibatch: train.py passes the minibatch's sequence count and its unmasked tokens
on all ranks / W (minibatch_tokens), and each micro-batch's loss is its share of the minibatch loss:
the shares add up to it at any --micro-batch-size, and with DDP averaging gradients over W ranks,
bnpo, dapo and the entropy bonus are token means over the whole minibatch of every rank.
Tests: python -m pytest -q tests/test_loss.py tests/test_loss_2ranks.py
"""
import torch
import torch.distributed as dist

from common import collective_device, ddp, world
from model import completion_logits, entropy_from_logits

# each loss type's normalisation: GRPO's family names its own, cispo and sapo borrow one
REDUCTION = {"grpo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo", "dapo": "dapo",
             "cispo": "dapo", "sapo": "grpo"}


def check_reduction(loss_type, num_items, max_completion_length):
    if loss_type not in REDUCTION:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {tuple(REDUCTION)}")
    if REDUCTION[loss_type] == "dapo" and num_items is None:
        raise ValueError(f"loss_type={loss_type!r} divides by num_items: pass the number of "
                         f"unmasked completion tokens of the whole minibatch (all ranks / W: "
                         f"see minibatch_tokens)")
    if loss_type == "dr_grpo" and max_completion_length is None:
        raise ValueError("loss_type='dr_grpo' divides by B * max_completion_length: "
                         "pass max_completion_length")


def kept_mask(mask, truncated=None):
    """(B, T) completion mask minus the sequences that leave the loss ((B,) bool truncated, or None:
    none leave) -> (B, T) in mask's dtype."""
    if truncated is None:
        return mask
    return mask * (~truncated).to(mask.dtype).unsqueeze(-1)  # (B, T)


def reduce_loss(per_token_loss, mask, loss_type="grpo", num_items=None,
                max_completion_length=None, num_sequences=None, counts=None):
    """(B, T) per-token loss and completion mask -> scalar, normalised as loss_type says.
    For a micro-batch of a minibatch pass the minibatch's num_sequences (grpo, dr_grpo) and
    num_items (bnpo, dapo: its unmasked tokens, all ranks / W, see minibatch_tokens): the
    micro-batches' results then add up to the minibatch's. Without them the batch is its own.
    counts (B,): the identical sequences each row stands for (unique_rows); None: 1 each."""
    check_reduction(loss_type, num_items, max_completion_length)
    reduction = REDUCTION[loss_type]
    mask = mask.to(per_token_loss.dtype)  # (B, T)
    w = row_weights(counts)  # (B, 1)
    masked = per_token_loss * mask * w  # (B, T)
    B = num_sequences or (per_token_loss.size(0) if counts is None else counts.sum())
    if reduction == "grpo":  # each sequence weighs the same, whatever its length
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / B
    if reduction == "dr_grpo":  # constant normaliser: no bias toward short or long answers
        return masked.sum() / (B * max_completion_length)
    # bnpo, dapo: each token of the minibatch weighs the same
    return masked.sum() / _tokens(mask * w, num_items)


def _tokens(mask, num_items):
    return num_items if num_items is not None else mask.sum().clamp(min=1.0)


def minibatch_tokens(mask, truncated=None):
    """The minibatch's unmasked completion tokens on all ranks / W: (N, T) this rank's mask (and
    its (N,) truncated sequences, which leave the loss) -> a scalar tensor, the same on every rank
    (a collective). DDP averages gradients over the W ranks, so a rank's token sum divided by this
    comes out, after the average, as the token mean over every rank's tokens (TRL's
    num_items_in_batch)."""
    tokens = kept_mask(mask, truncated).sum().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tokens)
        tokens = tokens / dist.get_world_size()
    return tokens


def unique_rows(prompt_row, completion_ids, completion_mask, advantages):
    """Identical completions of one prompt (the same tokens, mask and advantage) have the same loss
    terms: -> (keep (n,): the first row of each distinct one, in order; counts (n,): the rows each
    stands for). Trained on the n rows, each weighed by its count (policy_loss's counts), the loss
    and gradient are those of all N rows, to rounding; the default task's late steps are half
    duplicates. train.py applies it with one forward a step (with micro-batches, ranks could run
    unequal numbers of forwards, each a collective under DDP and FSDP2), and not where the sampler's
    per-row log-probs enter the loss (--async, --is-correction, --off-policy-mask)."""
    first = {}  # a distinct row -> its index in keep
    keep, counts = [], []
    columns = (prompt_row.tolist(), completion_ids.tolist(), completion_mask.tolist(),
               advantages.tolist())
    for i, (prompt, ids, mask, advantage) in enumerate(zip(*columns)):
        key = (prompt, tuple(ids), tuple(mask), advantage)
        if key not in first:
            first[key] = len(keep)
            keep.append(i)
            counts.append(0)
        counts[first[key]] += 1
    return (torch.tensor(keep, device=completion_ids.device),
            torch.tensor(counts, dtype=torch.float32, device=completion_ids.device))


def row_weights(counts):
    """unique_rows' counts (B,) -> (B, 1), what each row's terms are multiplied by; 1.0 for None."""
    return 1.0 if counts is None else counts.unsqueeze(-1)


def entropy_bonus(entropies, mask, entropy_coef, num_items=None):
    """entropy_coef * the mean per-token entropy (over num_items tokens when given, else this
    batch's): subtracted from the loss, the same for every loss type."""
    mask = mask.to(entropies.dtype)  # (B, T)
    return entropy_coef * (entropies * mask).sum() / _tokens(mask, num_items)


# -----------------------------------------------------------------------------
# the step's masks, over every rank's tokens

@torch.no_grad()
def quantile_over_ranks(values, mask, q):
    """The q-quantile (linear interpolation, as torch.quantile) of values (N, T) at mask's tokens on
    every rank together (a collective: the same on every rank); +inf when no rank has a token."""
    local = values[mask.bool()].float()  # (n,)
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = collective_device()
        count = torch.tensor([local.numel()], device=device)
        counts = [torch.zeros_like(count) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, count)
        longest = max(c.item() for c in counts)
        padded = torch.zeros(longest, device=device)  # (longest,) all_gather wants one shape
        padded[:local.numel()] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded)
        local = torch.cat([g[:c.item()] for g, c in zip(gathered, counts)]).to(values.device)
    if local.numel() == 0:
        return torch.tensor(float("inf"), device=values.device)
    # sort-based: torch.quantile refuses more than 2**24 elements
    ordered = local.sort().values  # (n,)
    position = q * (ordered.numel() - 1)
    low = int(position)
    high = min(low + 1, ordered.numel() - 1)
    return ordered[low] + (position - low) * (ordered[high] - ordered[low])


def high_entropy_mask(entropies, mask, quantile):
    """(N, T) entropies and mask -> (N, T) bool: the top `quantile` fraction of the unmasked tokens
    by entropy, of every rank together (a collective), as TRL's get_high_entropy_mask."""
    threshold = quantile_over_ranks(entropies, mask, 1 - quantile)
    return (entropies >= threshold) & mask.bool()


@torch.no_grad()
def step_masks(args, model, prompts, rollout, *, temperature, micro, dtype):
    """This step's masks for loss.policy_loss, (N, ...) tensors on the prompts' device, to slice per
    micro-batch: truncated (N,) with --mask-truncated (the completions not rollout.is_finished);
    high_entropy (N, T) with --top-entropy-quantile < 1, from the policy before this step's update
    (micro sequences a forward), over the kept tokens. {} when both are off: nothing runs."""
    masks = {}
    device = prompts[0].device
    if args.mask_truncated:
        masks["truncated"] = ~rollout.is_finished.to(device)  # (N,)
    if args.top_entropy_quantile < 1:
        completion_ids = rollout.completion_ids.to(device)  # (N, T)
        entropies = []
        for i in range(0, completion_ids.shape[0], micro):
            ids = completion_ids[i:i + micro]  # (micro, T)
            logits = completion_logits(model, prompts, slice(i, i + micro), ids, dtype)
            entropies.append(entropy_from_logits(logits, temperature))  # (micro, T)
        kept = kept_mask(rollout.completion_mask.to(device).float(), masks.get("truncated"))
        masks["high_entropy"] = high_entropy_mask(torch.cat(entropies), kept,
                                                  args.top_entropy_quantile)  # (N, T)
    return masks


# -----------------------------------------------------------------------------
# the metrics: a micro-batch's, then the step's over its micro-batches and the ranks


def token_stats(mask, stats):
    """{name: (B, T) tensor} -> {name: float}: masked token means over the micro-batch, or, for
    a name ending in "_max", the masked max (one sync). step_metrics reduces each the same way."""
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
    """The step's logged numbers, unchanged by --micro-batch-size and the same on every rank:
    "loss" is the minibatch loss (the sum of its micro-batches' shares) averaged over the step's
    optimizer steps and the ranks (as DDP averages gradients), grad_norm the mean over the optimizer
    steps, a metric named "..._max" the max over every micro-batch and rank, and every other metric
    a token mean over the whole step on every rank, each micro-batch weighted by its "tokens"."""
    keys = [k for k in micro_metrics[0] if k not in ("loss", "tokens") and not k.endswith("_max")]
    max_keys = [k for k in micro_metrics[0] if k.endswith("_max")]
    tokens = [m["tokens"] for m in micro_metrics]
    sums = [sum(m[k] * t for m, t in zip(micro_metrics, tokens)) for k in keys]
    loss = sum(m["loss"] for m in micro_metrics) / len(grad_norms)
    grad_norm = torch.stack(grad_norms).float().mean().item()
    values = torch.tensor(sums + [sum(tokens), loss, grad_norm], dtype=torch.float64)
    maxes = torch.tensor([max(m[k] for m in micro_metrics) for k in max_keys], dtype=torch.float64)
    if ddp:
        values = values.to(collective_device())
        dist.all_reduce(values)
        # token sums stay sums; the loss and grad norm become means over the ranks
        divisors = torch.tensor([1.0] * (len(keys) + 1) + [world, world], dtype=torch.float64)
        values = values.cpu() / divisors
        if max_keys:
            maxes = maxes.to(collective_device())
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
            maxes = maxes.cpu()
    result = {k: (v / values[-3]).item() for k, v in zip(keys, values)}
    result.update(zip(max_keys, maxes.tolist()))
    result["loss"] = values[-2].item()
    result["grad_norm"] = values[-1].item()
    return result
