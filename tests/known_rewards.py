"""Rewards whose values follow from the prompts alone, so a test knows them in
advance (tests/test_dynamic_sampling.py, tests/test_pass_at_k.py; imported by
dotted path: known_rewards.NAME). Prompts are the built-in task's ("739>")."""

# the --eval-samples the pass@k tests use
EVAL_SAMPLES = 4


def informative(prompt):
    return int(prompt[0]) < 5


def spread_if_first_digit_low(prompts, **kw):
    """0 for every completion of a prompt whose first digit is >= 5: a group of
    zero spread. 0, 1, 0, 1, ... over the others: a group's G completions are
    consecutive, so each of those groups holds both values."""
    return [float(i % 2) if informative(p) else 0.0 for i, p in enumerate(prompts)]


def correct_samples(prompt):
    """How many of a held-out prompt's EVAL_SAMPLES sampled completions pass: its
    first digit mod 5 (0 to 4)."""
    return int(prompt[0]) % (EVAL_SAMPLES + 1)


def first_samples_pass(prompts, **kw):
    """1 for the first correct_samples(p) completions of each prompt p (its
    samples are consecutive), else 0. A greedy evaluation (one completion a
    prompt) passes the prompts with correct_samples(p) >= 1."""

    out = []
    # the sample's index within its prompt's run
    run = 0
    for i, p in enumerate(prompts):
        if i and prompts[i - 1] == p:
            run = run + 1
        else:
            run = 0
        out.append(float(run % EVAL_SAMPLES < correct_samples(p)))

    return out

