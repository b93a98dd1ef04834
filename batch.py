"""
The update's batch: what the loss needs of each completion of a step. train.py
builds it once a step, before the update, and slices it per micro-batch.

    UpdateBatch          the step's (N, ...) tensors; batch.select(r) a micro-batch's

What it holds beside the rollout (each None when its flag is off):
    old_logps     (N, T) the ratio's denominator; None: on-policy, the ratio is 1
    ref_logps     (N, T) the reference's log-probs, for the KL term (beta > 0)
    truncated     (N,)   completions cut at --max-new-tokens (--mask-truncated)
    high_entropy  (N, T) the step's top-rho tokens (--top-entropy-quantile:
                         variants/high_entropy.py)
    counts        (N,)   how many identical rows each trained row stands for
                         (--fast: fast/dedup.py)

Tests: python -m pytest -q tests/test_loss.py tests/test_loss_2ranks.py
"""
import dataclasses

import torch


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

    def select(self, r):
        """The rows r (an index tensor or a slice) of every tensor."""
        picked = {}
        for field in dataclasses.fields(self):
            x = getattr(self, field.name)
            picked[field.name] = None if x is None else x[r]
        return UpdateBatch(**picked)
