"""A user's reward as the README's "Add a reward" writes one, in a module of its
own that imports nothing of the trainer's features (tests/test_reward_extras.py;
imported by dotted path: user_rewards.NAME)."""
import task


def users_position_reward(completions, solution, **kw):
    """**kw, no extra named: the default task's shaping reward."""
    return task.position_reward(completions, solution)
