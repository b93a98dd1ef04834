"""Two rewards whose weighted total (1 x odd + 0.5 x even_double) is 1 for every
completion, while each alone splits every group in half
(tests/test_reward_aggregation.py; imported by dotted path:
equal_total_rewards.NAME). A group's G completions are consecutive, and G is
even: each group holds both values of each reward."""


def odd(prompts, **kw):
    """1 for the odd completions of the batch, 0 for the even ones."""
    return [float(i % 2) for i in range(len(prompts))]


def even_double(prompts, **kw):
    """2 for the even completions of the batch, 0 for the odd ones."""
    return [2.0 * (1 - i % 2) for i in range(len(prompts))]
