"""One row of each set of identical completions, weighed by its count: the same
loss and gradient as all the rows, to rounding, for fewer rows' forwards and
backwards. The default task's late steps are half duplicates. fast.install puts
it in the update's model.Forward (distinct_rows); train.py's prepare_update uses
it where one forward covers the step (a rank's forward count is then the same
whatever it finds: under DDP and FSDP2 each forward is a collective).

Simplifications:
1. unique_rows compares token lists in Python: a few milliseconds a step at the
   default size, and no hashing of tensors.

Tests: python -m pytest -q tests/test_loss.py -k unique_rows tests/test_train.py
"""
import torch


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
