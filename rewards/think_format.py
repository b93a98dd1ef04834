"""think_format_reward: 1.0 iff the completion is one <think>...</think> block,
then a non-empty answer with no more think tags (DeepSeek-R1's format reward).

    python train.py ... --rewards think_format_reward accuracy_reward --reward-weights 0.1 1

Run the tests: python -m pytest -q tests/test_reward.py
"""
import re

from reward import completion_text

_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


def think_format_reward(completions, **kw):
    """1.0 iff the completion is one <think>...</think> block, then a non-empty
    answer with no more think tags.

    Unlike TRL's r"^<think>(?!.*<think>)(.*?)</think>.*$", leading whitespace
    passes (templates often open with a newline). An empty answer scores 0: the
    bare block would pay for never answering. So does a stray "</think>" after
    the block (mid-reasoning).
    """
    rewards = []
    for c in completions:
        m = _THINK.fullmatch(completion_text(c))
        ok = m is not None
        if ok:
            reasoning = m[1]
            answer = m[2]
            ok = ("<think>" not in reasoning and re.search(r"</?think>", answer) is None
                  and answer.strip() != "")
        rewards.append(float(ok))
    return rewards
