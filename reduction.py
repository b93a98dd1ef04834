"""
How a micro-batch's per-token loss adds up to a number: each loss type's
normalisation, and a micro-batch's share of its minibatch. loss.py computes
the per-token terms.

    loss_type "grpo"     mean over sequences of each one's token mean
                         (DeepSeekMath eq. 3)
              "bnpo"     sum over tokens / the unmasked tokens
              "dr_grpo"  sum / (B * max_new_tokens), the completion
                         limit: no length bias (arXiv 2503.20783)
              "dapo"     sum / num_items, the unmasked tokens of the whole
                         batch (arXiv 2503.14476)
              "luspo"    mean over sequences of each one's token sum: each
                         sequence weighs as much as it is long (arXiv
                         2602.05261)
              "cispo" and "vespo" reduce like "dapo", "sapo" like "grpo" (as
              their papers and TRL do)

A micro-batch of a minibatch: train.py passes the minibatch's sequence count
and its unmasked tokens on all ranks / W (minibatch_tokens). Each micro-batch's
loss is then its share of the minibatch loss, and the shares add up to it at
any --micro-batch-size. With DDP averaging gradients over W ranks, bnpo, dapo
and the entropy bonus are token means over the minibatch of every rank.

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_2ranks.py
"""
import torch.distributed as dist

# each loss type's normalisation: GRPO's family names its own, cispo, sapo and
# vespo borrow one
REDUCTION = {
    "grpo": "grpo",
    "bnpo": "bnpo",
    "dr_grpo": "dr_grpo",
    "dapo": "dapo",
    "cispo": "dapo",
    "sapo": "grpo",
    "luspo": "luspo",
    "vespo": "dapo",
}


def check_reduction(loss_type, num_items, max_new_tokens):
    """ValueError when loss_type is unknown or its normaliser is missing.

    reduce_loss runs it: once a micro-batch, whichever path computed the loss.
    """
    if loss_type not in REDUCTION:
        raise ValueError(f"loss_type={loss_type!r}: choose one of {tuple(REDUCTION)}")

    if REDUCTION[loss_type] == "dapo" and num_items is None:
        raise ValueError(f"loss_type={loss_type!r} divides by num_items: pass the number of "
                         f"unmasked completion tokens of the whole minibatch (all ranks / W: "
                         f"see minibatch_tokens)")

    if loss_type == "dr_grpo" and max_new_tokens is None:
        raise ValueError("loss_type='dr_grpo' divides by B * max_new_tokens: "
                         "pass max_new_tokens (--max-new-tokens)")


def kept_mask(mask, truncated=None):
    """(B, T) completion mask minus the sequences that leave the loss.

    truncated: (B,) bool, or None when none leave. -> (B, T) in mask's dtype.
    """
    if truncated is None:
        return mask
    return mask * (~truncated).to(mask.dtype).unsqueeze(-1)  # (B, T)


def row_weights(counts):
    """unique_rows' counts (B,) -> (B, 1), what each row's terms are multiplied by.

    1.0 for None: every row stands for itself.
    """
    if counts is None:
        return 1.0
    return counts.unsqueeze(-1)


def reduce_loss(per_token_loss, mask, loss_type="grpo", num_items=None,
                max_new_tokens=None, num_sequences=None, counts=None):
    """(B, T) per-token loss and completion mask -> a scalar, as loss_type says.

    For a micro-batch of a minibatch, pass the minibatch's num_sequences (grpo,
    dr_grpo, luspo) and num_items (bnpo, dapo: its unmasked tokens, all ranks / W, see
    minibatch_tokens). The micro-batches' results then add up to the minibatch's.
    Without them the batch is its own minibatch. max_new_tokens: dr_grpo's
    completion limit. counts (B,): the identical sequences each row stands for
    (unique_rows).
    """
    check_reduction(loss_type, num_items, max_new_tokens)
    reduction = REDUCTION[loss_type]

    mask = mask.to(per_token_loss.dtype)  # (B, T)
    w = row_weights(counts)  # (B, 1)
    masked = per_token_loss * mask * w  # (B, T)
    if num_sequences:
        B = num_sequences
    elif counts is None:
        B = per_token_loss.size(0)
    else:
        B = counts.sum()

    if reduction == "grpo":  # each sequence weighs the same, whatever its length
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / B
    if reduction == "dr_grpo":  # a constant normaliser: no bias toward short or long answers
        return masked.sum() / (B * max_new_tokens)
    if reduction == "luspo":  # TRL: (per_token_loss * mask).sum(-1).mean()
        return masked.sum() / B
    # bnpo, dapo: each token of the minibatch weighs the same
    return masked.sum() / _tokens(mask * w, num_items)


def _tokens(mask, num_items):
    if num_items is not None:
        return num_items
    return mask.sum().clamp(min=1.0)


def minibatch_tokens(mask, truncated=None):
    """The minibatch's unmasked completion tokens on all ranks / W.

    (N, T) this rank's mask, and its (N,) truncated sequences, which leave the
    loss -> a scalar tensor, the same on every rank (a collective). DDP averages
    gradients over the W ranks, so a rank's token sum divided by this comes out,
    after the average, as the token mean over every rank's tokens (TRL's
    num_items_in_batch).
    """
    tokens = kept_mask(mask, truncated).sum().float()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tokens)

    # --mask-truncated can leave a minibatch with no kept token. Its loss is
    # then 0, not 0 / 0 = NaN.
    tokens = tokens.clamp(min=1.0)
    if dist.is_initialized() and dist.get_world_size() > 1:
        tokens = tokens / dist.get_world_size()
    return tokens


def entropy_bonus(entropies, mask, entropy_coef, num_items=None):
    """entropy_coef * the mean per-token entropy, subtracted from the loss.

    The mean is over num_items tokens when given, else this batch's; the same
    for every loss type.
    """
    mask = mask.to(entropies.dtype)  # (B, T)
    return entropy_coef * (entropies * mask).sum() / _tokens(mask, num_items)
