"""Broken reward functions for the bad-input tests (imported by dotted path: bad_rewards.NAME)."""


def wrong_count(completions, **kw):
    return [1.0] * (len(completions) - 1)


def non_number(completions, **kw):
    return ["yes"] * len(completions)


def raising(completions, **kw):
    raise KeyError("no column 'answer'")
