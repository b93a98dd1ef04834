"""The loss's entry points called the way the tests write their cases: the
micro-batch's tensors as arguments and the settings as keywords.

    call_policy_loss(logits, ids, A, mask, old, ref, sampling, *,
                     minibatch_size, minibatch_tokens, truncated=None,
                     high_entropy=None, counts=None, **settings)
    call_grpo_loss(logps, old, ref, A, mask, *, entropies=None, ..., **settings)
    call_fused(logits, ids, A, mask, old=None, ref=None, *, token_weight=None,
               **options)

settings are LossSettings' fields, options FusedLossOptions'. Each helper
builds the dataclasses and calls the real function: nothing is computed here.
"""
from batch import UpdateBatch
from loss import LossSettings, grpo_loss, policy_loss


def call_policy_loss(logits, ids, advantages, mask, old_logps=None, ref_logps=None,
                     sampling_logps=None, *, minibatch_size, minibatch_tokens,
                     truncated=None, high_entropy=None, counts=None, **settings):
    """loss.policy_loss on an UpdateBatch of these tensors -> (loss, metrics)."""
    batch = UpdateBatch(
        completion_ids=ids,
        completion_mask=mask,
        advantages=advantages,
        sampling_logps=sampling_logps,
        old_logps=old_logps,
        ref_logps=ref_logps,
        truncated=truncated,
        high_entropy=high_entropy,
        counts=counts,
    )

    return policy_loss(logits, batch, LossSettings(**settings),
                       minibatch_size=minibatch_size, minibatch_tokens=minibatch_tokens)


def call_grpo_loss(logps, old_logps, ref_logps, advantages, mask, *, entropies=None,
                   token_weight=None, truncated=None, counts=None, num_items=None,
                   num_sequences=None, **settings):
    """loss.grpo_loss with LossSettings(**settings) -> (loss, metrics)."""
    settings = LossSettings(**settings)

    return grpo_loss(logps, old_logps, ref_logps, advantages, mask, settings,
                     entropies=entropies, token_weight=token_weight, truncated=truncated,
                     counts=counts, num_items=num_items, num_sequences=num_sequences)


def call_fused(logits, ids, advantages, mask, old_logps=None, ref_logps=None, *,
               token_weight=None, **options):
    """kernels.fused_grpo_token_loss with FusedLossOptions(**options).

    -> (per-token loss, logps, stats), as the kernel returns them.
    """
    from kernels import FusedLossOptions, fused_grpo_token_loss  # imports Triton

    options = FusedLossOptions(**options)

    return fused_grpo_token_loss(logits, ids, advantages, mask, old_logps, ref_logps,
                                 token_weight=token_weight, options=options)
