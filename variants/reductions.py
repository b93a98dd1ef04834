"""How the per-token loss adds up for the loss types other than grpo (whose
normalisation, each sequence's token mean, is loss.grpo_reduction): one
function each, listed by loss type in REDUCTIONS. loss.reduce_loss imports this
file only for those loss types.

    loss_type "bnpo"     sum over tokens / the unmasked tokens
              "dr_grpo"  sum / (B * max_new_tokens), the completion
                         limit: no length bias (arXiv 2503.20783)
              "dapo"     sum / num_items, the unmasked tokens of the whole
                         minibatch (arXiv 2503.14476)
              "luspo"    mean over sequences of each one's token sum: each
                         sequence weighs as much as it is long (arXiv
                         2602.05261)
              "cispo" and "vespo" reduce like "dapo", "sapo" like "grpo" (as
              their papers and TRL do)

Each takes what loss.grpo_reduction takes: masked (B, T), the per-token loss *
mask * w; mask (B, T); w (B, 1), the rows' counts; B, the minibatch's
sequences; num_items, the minibatch's unmasked tokens on all ranks / W
(loss.minibatch_tokens); max_new_tokens. With DDP averaging gradients over W
ranks, bnpo and dapo are token means over the minibatch of every rank.

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_2ranks.py
"""
from loss import grpo_reduction, token_count


def bnpo(masked, mask, w, B, num_items=None, max_new_tokens=None):
    """Each token weighs the same: the sum over the tokens of the minibatch
    (num_items) when given, else of this batch."""
    return masked.sum() / token_count(mask * w, num_items)


def dapo(masked, mask, w, B, num_items=None, max_new_tokens=None):
    """bnpo's token mean, always over the whole minibatch's tokens: num_items
    (reduction_of refuses None)."""
    return bnpo(masked, mask, w, B, num_items, max_new_tokens)


def dr_grpo(masked, mask, w, B, num_items=None, max_new_tokens=None):
    """A constant normaliser, B * max_new_tokens: no bias toward short or long answers."""
    return masked.sum() / (B * max_new_tokens)


def luspo(masked, mask, w, B, num_items=None, max_new_tokens=None):
    """Each sequence's token sum, averaged: TRL's (per_token_loss * mask).sum(-1).mean()."""
    return masked.sum() / B


# each loss type's normalisation but grpo's: GRPO's family names its own,
# cispo, sapo and vespo borrow one
REDUCTIONS = {
    "bnpo": bnpo,
    "dr_grpo": dr_grpo,
    "dapo": dapo,
    "cispo": dapo,
    "sapo": grpo_reduction,
    "luspo": luspo,
    "vespo": dapo,
}


def reduction_of(loss_type, num_items, max_new_tokens):
    """loss_type's reduction (REDUCTIONS); ValueError when its normaliser is missing.

    loss.reduce_loss runs it: once a micro-batch, whichever path computed the loss.
    """
    reduction = REDUCTIONS[loss_type]
    if reduction is dapo and num_items is None:
        raise ValueError(f"loss_type={loss_type!r} divides by num_items: pass the number of "
                         f"unmasked completion tokens of the whole minibatch (all ranks / W: "
                         f"see minibatch_tokens)")

    if loss_type == "dr_grpo" and max_new_tokens is None:
        raise ValueError("loss_type='dr_grpo' divides by B * max_new_tokens: "
                         "pass max_new_tokens (--max-new-tokens)")
    return reduction
