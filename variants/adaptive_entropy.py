"""--adaptive-entropy (Skywork-OR1, arXiv 2505.22312; TRL 1.16's rule): the
entropy bonus's coefficient, steered by the policy's entropy.

    during an optimizer step:  c_applied = c if H_last <= target else 0
    after it, measuring H:     c <- min(c + delta, high)   if H <= target (collapsing: push harder)
                               c <- max(c - delta, low)    otherwise

H is the token mean of the policy's entropy over the tokens the policy loss
trains on, over the optimizer step's micro-batches and every rank. Before the
first step H_last is inf: no bonus until one is measured, as in TRL. train.py
imports this file only with the flag, and holds one Controller; its state (c,
H_last) is checkpointed.

Tests: python -m pytest -q tests/test_adaptive_entropy.py
"""
import dataclasses
import math

import torch
import torch.distributed as dist

from common import collective_device, ddp
from runlog.metrics import token_stats
from loss import kept_mask, row_weights


def applied_coef(coef, last_entropy, target):
    """The bonus's coefficient during an optimizer step: coef, the controller's
    after the previous step, while that step's entropy was at most target."""
    if last_entropy <= target:
        return coef
    return 0.0


def next_coef(coef, entropy, target, delta, low, high):
    """The controller's coefficient after an optimizer step that measured
    `entropy`. TRL's: one bound a branch, a clamp to [low, high] since coef
    starts inside (config.check_flags)."""
    if entropy <= target:
        return min(coef + delta, high)
    return max(coef - delta, low)


def measure(entropies, micro_batch):
    """A micro-batch's entropies (n, T) -> ((their sum, their tokens) over the
    tokens the policy loss trains on, the logged token mean over all of its
    tokens)."""
    counted = micro_batch.completion_mask * row_weights(micro_batch.counts)  # (n, T)
    logged = token_stats(counted, {"entropy": entropies})["entropy"]

    # TRL's controller: over the tokens the policy loss trains on
    tokens = kept_mask(counted, micro_batch.truncated)  # (n, T)
    if micro_batch.high_entropy is not None:
        tokens = tokens * micro_batch.high_entropy  # (n, T)
    return ((entropies * tokens).sum().item(), tokens.sum().item()), logged


def window_entropy(sums):
    """[(sum of H, tokens)] of this rank's micro-batches of one optimizer step ->
    the token mean over all of them and all ranks. A collective under DDP.

    As TRL's controller: sums and counts are reduced together, so ranks of
    different lengths weigh by their tokens.
    """
    totals = torch.tensor(sums, dtype=torch.float64).sum(0)  # (2,)
    if ddp:
        totals = totals.to(collective_device())
        dist.all_reduce(totals)
    return (totals[0] / totals[1].clamp(min=1.0)).item()


def attach(args, saved, after_optimizer_step, step_loggers):
    """train.py's set-up for --adaptive-entropy -> the Controller, which steps
    after each optimizer step and logs each step's coefficient (saved: a resumed
    checkpoint's trainer state, else None)."""
    controller = Controller(args, saved)
    after_optimizer_step.append(controller.step)
    step_loggers.append(controller.log)
    return controller


class Controller:
    """The controller's state across a run's optimizer steps: train.py calls
    settings() before an optimizer step, measure() in each of its micro-batches,
    step() after it."""

    def __init__(self, args, saved=None):
        """args: train.py's flags; saved: a checkpoint's trainer state, whose
        entropy_coef and last_entropy it resumes from."""
        self.args = args
        self.coef = args.entropy_coef
        self.last_entropy = math.inf  # none measured yet: no bonus (as TRL)
        if saved:
            self.coef = saved["entropy_coef"]
            self.last_entropy = saved["last_entropy"]
        self.measured = []  # (sum of H, tokens) of the optimizer step's micro-batches

    def settings(self, loss_settings):
        """The loss's settings for the next optimizer step: its applied coefficient."""
        coef = applied_coef(self.coef, self.last_entropy, self.args.entropy_target)
        self.measured = []
        return dataclasses.replace(loss_settings, entropy_coef=coef)

    @torch.no_grad()
    def measure(self, forward, logits, micro_batch, temperature):
        """Keep a micro-batch's entropy sums -> the logged token mean of its entropy."""
        entropies = forward.entropies(logits, temperature)  # (n, T)
        sums, logged = measure(entropies, micro_batch)
        self.measured.append(sums)
        return logged

    def step(self, opt_step=None):
        """After an optimizer step: the next step's coefficient. A collective."""
        self.last_entropy = window_entropy(self.measured)
        a = self.args
        self.coef = next_coef(self.coef, self.last_entropy, a.entropy_target,
                              a.entropy_coef_delta, a.entropy_coef_min, a.entropy_coef_max)

    def log(self, step, record, *_):
        """The coefficient as the step's last optimizer step left it."""
        record["entropy_coef"] = self.coef

