"""Broken reward functions for the bad-input tests (imported by dotted path:
bad_rewards.NAME)."""


def wrong_count(completions, **kw):
    return [1.0] * (len(completions) - 1)


def non_number(completions, **kw):
    return ["yes"] * len(completions)


def raising(completions, **kw):
    raise KeyError("no column 'answer'")


_calls = [0]


def huge_from_step_2(completions, **kw):
    """0 at the first step, then rewards of 0 and 1e38 (finite in fp32). With
    --scale-rewards none the advantages are ~5e37 and the gradient norm
    overflows to inf, deterministically, whatever the weights."""
    _calls[0] += 1

    if _calls[0] == 1:
        return [0.0] * len(completions)
    return [1e38 * (i % 2) for i in range(len(completions))]


def exiting(completions, **kw):
    # today's trap: the run would end with exit code 0, no model and no message
    raise SystemExit(0)


def stuck_on_rank_1(completions, **kw):
    """Never returns on rank 1 (a reward that hangs on one rank):
    --reward-timeout must end the job."""
    import os
    import time

    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return [0.0] * len(completions)
