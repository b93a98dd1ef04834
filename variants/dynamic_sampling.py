"""DAPO's dynamic sampling (arXiv 2503.14476, sec. 3.2): --dynamic-sampling N.

A group whose G rewards are all equal has zero spread: r_i - mean_g(r) = 0, so
A_i = 0 for each of its completions and it adds no gradient (advantage.py). DAPO
over-samples and keeps only the groups with signal:

    keep group g  iff  not no_signal(g)        (advantage.no_signal_groups: equal
                                                weighted totals; GDPO: every
                                                function flat, variants/gdpo.py)
    draw rounds of --prompts-per-step prompts until this rank holds
        quota = --prompts-per-step / ranks  informative groups, at most N rounds

so that each step trains on a full batch of groups that rank their completions.

train.py attaches it once at set-up, around the function that draws and scores one
round (with_dynamic_sampling); without the flag a step draws one round. A step's
record gains ds_rounds, ds_groups_generated and ds_groups_informative.

Tests: python -m pytest -q tests/test_dynamic_sampling.py tests/test_reward_aggregation.py
"""
import dataclasses

import torch
import torch.distributed as dist

from advantage import no_signal_groups
from common import all_ranks_ok, collective_device, ddp, world


def with_dynamic_sampling(sample_and_score, max_rounds, G, weights, pad_id, aggregation):
    """sample_and_score, which draws and scores one round, -> a function of the same
    contract that draws rounds until this rank holds its quota of informative
    groups, or max_rounds (dynamic_sampling decides, on every rank alike).

    sample_and_score(consumed) -> ((rows, Rollout, rewards (N, F)), prompts drawn,
    stats), consumed: the prompts drawn before the round. The rounds follow one
    another in the prompt stream: each starts where the last one's prompts end.
    The result: ((rows, Rollout, rewards) of the kept groups, the prompts all the
    rounds drew, the last round's stats and ds_rounds, ds_groups_generated,
    ds_groups_informative).
    """
    def sample_informative(consumed):
        rounds = []  # [(rows, Rollout, rewards)]
        drawn = 0
        sampled = None
        while sampled is None:
            batch, prompts, stats = sample_and_score(consumed + drawn)
            drawn += prompts
            rounds.append(batch)
            sampled = dynamic_sampling(rounds, max_rounds, G, weights, pad_id, aggregation)

        batch, metrics = sampled
        return batch, drawn, {**stats, **metrics}

    return sample_informative


def dynamic_sampling(rounds, max_rounds, G, weights, pad_id, aggregation="sum_then_normalize"):
    """Which groups a step keeps from its rounds so far, or None: draw another.

    It is called after each round of a step's rollouts. A group whose G weighted
    total rewards are all equal (GDPO: each function's) has advantage 0 and no
    gradient, so it is dropped.
    More rounds of prompts are drawn until this rank holds its quota of the other
    groups. The quota is this rank's share of --prompts-per-step.

    rounds: this rank's rounds so far, [(rows, Rollout, rewards (quota*G, F))].
    max_rounds: the bound (0: off). aggregation: which groups have no signal
    (no_signal_groups: with GDPO's, equal totals can still rank completions).
    Returns None when another round is due, on every rank alike. Otherwise it
    returns ((rows, Rollout, rewards) of quota groups, the step's metrics). The
    metrics are the rounds drawn, the groups generated and the informative groups
    kept, over all ranks; {} when off.

    1. Each rank fills its own quota from its own rounds. The G completions of a
       prompt never leave their rank, and every rank ends with quota groups. The
       shapes stay static: the rewards all-gather and DDP stay matched.
    2. A round is drawn on every rank while any rank is short (a MIN all-reduce).
       So a rank that is full still samples a round, and wastes it: the engines'
       call numbers and the prompt stream stay in step on every rank.
    3. At the bound, a rank still short tops up with zero-spread groups of its last
       round. They add no gradient: the step trains on what there is, and
       ds_groups_informative < --prompts-per-step says so.
    4. Informative groups beyond the quota are dropped, not kept for the next step.
       There they would be off-policy, and a checkpoint would have to hold them.
    """
    if max_rounds == 0:
        return rounds[0], {}

    quota = len(rounds[0][0]) // G
    # per round, (quota,) bool: its groups with zero spread
    no_signal = [no_signal_groups(part[2], weights, G, aggregation) for part in rounds]
    # (round, group index) of every informative group, in the order drawn
    informative = []
    for part, flat in zip(rounds, no_signal):
        for g in (~flat).nonzero().flatten().tolist():
            informative.append((part, g))

    if len(rounds) < max_rounds and not all_ranks_ok(len(informative) >= quota):
        return None

    # point 3: what a rank still short at the bound tops up with
    top_up = [(rounds[-1], g) for g in no_signal[-1].nonzero().flatten().tolist()]

    if ddp:
        device = collective_device()
    else:
        device = "cpu"
    kept = torch.tensor([min(len(informative), quota)], device=device)
    if ddp:
        dist.all_reduce(kept)

    batch = take_groups((informative + top_up)[:quota], G, pad_id)
    metrics = dict(ds_rounds=len(rounds),
                   ds_groups_generated=len(rounds) * quota * world,
                   ds_groups_informative=int(kept))
    return batch, metrics


def take_groups(picks, G, pad_id):
    """[((rows, Rollout, rewards), group index)] -> (rows, Rollout, rewards).

    The result holds those groups, in that order. Rounds differ in their longest
    completion: the (N, T) tensors are right-padded to the longest (pad id, mask 0).
    """
    T = max(part[1].completion_ids.shape[1] for part, _ in picks)

    rows = []
    rewards = []
    fields = {}
    for (part_rows, rollout, part_rewards), g in picks:
        s = slice(g * G, (g + 1) * G)  # the group's G completions
        rows += part_rows[s]
        rewards.append(part_rewards[s])  # (G, F)

        for f in dataclasses.fields(rollout):
            x = getattr(rollout, f.name)[s]
            # a (G, T of its round) tensor -> (G, T)
            if isinstance(x, torch.Tensor) and x.dim() == 2:
                pad = pad_id if f.name == "completion_ids" else 0
                x = torch.nn.functional.pad(x, (0, T - x.shape[1]), value=pad)  # (G, T)
            fields.setdefault(f.name, []).append(x)

    joined = {}
    for name, parts in fields.items():
        if isinstance(parts[0], torch.Tensor):
            joined[name] = torch.cat(parts)
        else:
            joined[name] = sum(parts, [])

    return rows, type(rollout)(**joined), torch.cat(rewards)  # (N,), Rollout of N, (N, F)
