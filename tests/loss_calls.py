"""loss.policy_loss called the way a test that is not about the loss writes
its case: the micro-batch's tensors as arguments and the settings as keywords.

    call_policy_loss(logits, ids, A, mask, old, ref, sampling, *,
                     minibatch_size, minibatch_tokens, truncated=None,
                     high_entropy=None, counts=None, **settings)

settings are LossSettings' fields. The helper builds the UpdateBatch and the
LossSettings and calls the real function: nothing is computed here. The loss's
own tests call policy_loss, grpo_loss and the kernel directly.
"""
from batch import UpdateBatch
from loss import LossSettings, policy_loss


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
