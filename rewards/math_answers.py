"""Math answers checked by math-verify: accuracy_reward and
reasoning_accuracy_reward, 1.0 when the answer equals the gold, else 0.0 (None:
the gold does not parse).

    python train.py --dataset openai/gsm8k --dataset-config main \\
        --prompt-column question --solution-column answer --rewards accuracy_reward

Run the tests: python -m pytest -q tests/test_reward.py tests/test_data.py

Simplifications:
1. math-verify's default extraction (LaTeX, \\boxed{} first, then plain
   expressions): "The answer is 1,234." counts like \\boxed{1234}; TRL accepts
   only LaTeX.
2. math-verify's timeouts use SIGALRM, main thread only. The worker thread runs
   it without them (as TRL's does), and --reward-timeout bounds the whole call
   instead.
3. math-verify extracts no number glued to ">" ("</think>72" reads like "x>72"):
   for thinking models use reasoning_accuracy_reward.
"""
import functools
import logging
import threading

from reward import completion_text


def _timeouts():
    """math-verify's (parse, verify) keywords: its own timeouts on the main thread
    only (simplification 2)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        return dict(), dict()

    # else math-verify warns on every call that its timeouts are off
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return dict(parsing_timeout=None), dict(timeout_seconds=None)


# each gold repeats G times in a batch
@functools.lru_cache(maxsize=4096)
def _parse_gold(solution):
    # GSM8K: only the line after "####", as math_verify/tasks.py does (else it
    # picks its own number)
    if "####" in solution:
        solution = solution.split("####")[-1].strip().split("\n")[0]

    # here, not at the top: sympy costs ~1 s of start-up
    from math_verify import parse

    return parse(solution.strip(), **_timeouts()[0])


def _score(solution, answer_text):
    """1.0 / 0.0 by math-verify, None when the gold does not parse."""
    if solution is None:
        return None
    gold = _parse_gold(str(solution))
    if not gold:
        return None

    parse_kw, verify_kw = _timeouts()
    from math_verify import parse, verify

    try:
        return float(verify(gold, parse(answer_text, **parse_kw), **verify_kw))
    except Exception:
        # a timeout, a sympy error: no opinion
        return None


def accuracy_reward(completions, solution, **kw):
    """math-verify: 1.0 if the answer equals the gold, else 0.0; None if the gold
    does not parse."""
    return [_score(sol, completion_text(c)) for c, sol in zip(completions, solution, strict=True)]


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=("</think>",),
                              **kw):
    """accuracy_reward on the text after the last reasoning delimiter: numbers in
    the reasoning do not count, and a completion whose reasoning never closes
    scores 0."""
    rewards = []
    for c, sol in zip(completions, solution, strict=True):
        text = completion_text(c)
        ends = [text.rfind(d) + len(d) for d in reasoning_delimiters if d in text]
        if sol is None or not _parse_gold(str(sol)):
            rewards.append(None)
        elif ends:
            rewards.append(_score(sol, text[max(ends):]))
        else:
            rewards.append(0.0)
    return rewards
