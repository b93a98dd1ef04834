"""reward.py: built-in rewards on realistic answers, name lookup, and
compute_rewards' checks."""
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from reward import (
    REWARD_FUNCS,
    compute_rewards,
    exact_match_reward,
    get_reward_funcs,
    get_soft_overlong_punishment,
)
from rewards.math_answers import accuracy_reward, reasoning_accuracy_reward
from rewards.think_format import think_format_reward

GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
              "#### 72")


def chat(text):
    return [{"role": "assistant", "content": text}]


# (completion, gold, expected reward)
ACCURACY_CASES = [
    ("Natalia sold 48/2 = 24 clips in May, so 48 + 24 = 72 in total.\n#### 72",
     GSM8K_GOLD, 1.0),
    ("She sold 24 clips in May. The answer is 72.", GSM8K_GOLD, 1.0),
    ("In May she sold half, 24, so altogether \\boxed{72}.", GSM8K_GOLD, 1.0),
    ("In May she sold 24, so altogether she sold 48 - 24 = \\boxed{24}.",
     GSM8K_GOLD, 0.0),
    ("The answer is 27.", GSM8K_GOLD, 0.0),
    ("I think the total is 1,234 dollars.", "Step one...\n#### 1234", 1.0),
    ("\\boxed{1,234}", "#### 1,234", 1.0),
    ("The total is $1234$.", "#### 1,234", 1.0),
    ("1,000,000", "#### 1000000", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("The probability is 3/4.", "\\frac{3}{4}", 1.0),
    ("0.75", "3/4", 1.0),
    ("\\boxed{0.5}", "\\boxed{\\frac{1}{2}}", 1.0),
    ("\\boxed{\\dfrac{1}{3}}", "1/3", 1.0),
    # a rounded decimal is not the fraction
    ("0.333", "1/3", 0.0),
    ("\\boxed{\\frac{2}{3}}", "0.75", 0.0),
    ("It costs 2.50 dollars.", "#### 2.5", 1.0),
    ("72.0", "72", 1.0),
    ("The answer is -3.", "#### -3", 1.0),
    ("The answer is 3.", "#### -3", 0.0),
    # the boxed answer wins
    ("\\boxed{15} since 7 + 8 is what we need", "#### 15", 1.0),
    ("**Final answer:** 42 apples", "#### 42", 1.0),
    # an empty completion
    ("", "#### 42", 0.0),
    ("I don't know.", "#### 42", 0.0),
    # the conversational form
    (chat("Final answer: \\boxed{18}"), "#### 18", 1.0),
    (chat("Final answer: \\boxed{19}"), "#### 18", 0.0),
    (chat(""), "#### 18", 0.0),
    # the gold does not parse: no opinion
    ("The answer is 5.", "there is no number here", None),
    ("The answer is 5.", None, None),
]


@pytest.mark.parametrize("completion, gold, expected", ACCURACY_CASES)
def test_accuracy_reward(completion, gold, expected):
    assert accuracy_reward([completion], [gold]) == [expected]


def test_math_verify_quirk_number_glued_to_tag():
    """Documented in rewards/math_answers.py, simplification 3."""
    completions = ["<think>a</think>72", "<think>a</think> 72"]

    assert accuracy_reward(completions, ["72", "72"]) == [0.0, 1.0]
    assert reasoning_accuracy_reward(["<think>a</think>72"], ["72"]) == [1.0]


def test_accuracy_reward_gsm8k_marker_wins_over_later_text():
    # without the explicit "####" split math-verify would pick the last number, 5
    assert accuracy_reward(["10"], ["so 10 in total\n#### 10\nnote: 5 were red"]) == [1.0]


def test_reasoning_accuracy_reward():
    completions = [
        "<think>maybe 5? no: 48 + 24 = 72</think>The answer is 72.",
        # the right number only inside the reasoning
        "<think>48 + 24 = 72</think>The answer is 5.",
        # the reasoning never closes
        "<think>48 + 24 = 72, so the answer is 72",
        chat("<think>half of 48 is 24</think>\\boxed{72}"),
        # no reasoning block at all
        "The answer is 72.",
    ]

    rewards = reasoning_accuracy_reward(completions, [GSM8K_GOLD] * 5)
    assert rewards == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert accuracy_reward(completions[:2], [GSM8K_GOLD] * 2) == [1.0, 0.0]

    assert reasoning_accuracy_reward(["<think>x</think>72"], ["no gold"]) == [None]
    rewards = reasoning_accuracy_reward(["<reasoning>7</reasoning>72"], ["72"],
                                        reasoning_delimiters=("</reasoning>",))
    assert rewards == [1.0]


def test_think_format_reward():
    cases = {
        "<think>48 / 2 = 24</think>The answer is 72.": 1.0,
        "\n<think>\nstep\n</think>\n\\boxed{72}": 1.0,
        "<think>no answer after the block</think>": 0.0,
        "<think>never closed. 72": 0.0,
        "The answer is 72.": 0.0,
        "preamble <think>a</think>72": 0.0,
        "<think>a<think>nested</think>72": 0.0,
        "<think>a</think>72<think>again</think>": 0.0,
        # a stray closing tag (TRL: 1.0)
        "<think>a</think>72</think>": 0.0,
        # a blank answer (TRL: 1.0)
        "<think>a</think>  \n": 0.0,
        "": 0.0,
    }

    assert think_format_reward(list(cases)) == list(cases.values())
    assert think_format_reward([chat("<think>a</think>b")]) == [1.0]


def test_exact_match_reward():
    completions = [" 42\n", "42.0", chat("abc"), "x"]
    golds = [42, "42", "abc ", None]

    assert exact_match_reward(completions, golds) == [1.0, 0.0, 1.0, None]


def test_soft_overlong_punishment_by_hand():
    # free up to 6 tokens
    fn = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    ids = [[0] * n for n in (0, 6, 7, 8, 10, 11)]

    rewards = fn(completions=[""] * 6, completion_ids=ids)
    assert rewards == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]

    with pytest.raises(ValueError, match="soft_punish_cache"):
        get_soft_overlong_punishment(10, 0)


def test_get_reward_funcs():
    names = ["accuracy_reward", "think_format_reward"]
    assert get_reward_funcs(names) == [accuracy_reward, think_format_reward]
    names = "exact_match_reward, rewards.think_format.think_format_reward"
    assert get_reward_funcs(names) == [exact_match_reward, think_format_reward]
    assert get_reward_funcs([len]) == [len]
    assert set(REWARD_FUNCS) >= {"accuracy_reward", "reasoning_accuracy_reward",
                                 "think_format_reward", "exact_match_reward"}

    match = r"unknown reward function 'acc'.*accuracy_reward"
    with pytest.raises(ValueError, match=match):
        get_reward_funcs(["acc"])
    with pytest.raises(ValueError, match="cannot import"):
        get_reward_funcs(["no_such_pkg.rewards.fn"])
    with pytest.raises(ValueError, match="not a function"):
        get_reward_funcs(["math.pi"])


def test_compute_rewards_stacks_functions_with_nan_for_none():
    completions = ["<think>a</think> 72", "71", chat("\\boxed{72}")]
    funcs = [accuracy_reward, think_format_reward, get_soft_overlong_punishment(4, 2)]

    rewards = compute_rewards(funcs, ["q"] * 3, completions,
                              solution=["#### 72", "#### 72", "no gold"],
                              completion_ids=[[1, 2], [1, 2, 3], [1, 2, 3, 4]])

    nan = math.nan
    expected = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, -0.5], [nan, 0.0, -1.0]])
    assert rewards.dtype == torch.float32
    torch.testing.assert_close(rewards, expected, equal_nan=True)


def _const(values):
    def bad_reward(completions, **kw):
        return values

    return bad_reward


@pytest.mark.parametrize("values, match", [
    ([1.0], r"bad_reward must return a list of 2 .* returned 1 values"),
    ({"a": 1}, r"bad_reward must return a list of 2 .* returned \{'a': 1\}"),
    ([1.0, "1.0"], r"bad_reward returned '1.0' for completion 1 \('second'\)"),
    ([math.inf, 0.0], r"bad_reward returned inf for completion 0 \('first'\)"),
    ([torch.ones(2), 0.0], r"bad_reward returned tensor.*for completion 0"),
])
def test_compute_rewards_errors_name_function_and_value(values, match):
    with pytest.raises(ValueError, match=match):
        compute_rewards([_const(values)], ["p", "p"], ["first", "second"])


def test_compute_rewards_accepts_numbers_of_any_kind_and_reports_raising_functions():
    r = compute_rewards([_const([True, torch.tensor(0.5)])], ["p", "p"], ["a", "b"])
    torch.testing.assert_close(r, torch.tensor([[1.0], [0.5]]))

    # the dataset has no solution column
    match = "reward function accuracy_reward raised TypeError"
    with pytest.raises(RuntimeError, match=match):
        compute_rewards([accuracy_reward], ["p"], ["a"])

    # one gold for two completions
    with pytest.raises(RuntimeError, match="accuracy_reward raised ValueError.*zip"):
        compute_rewards([accuracy_reward], ["p", "p"], ["a", "b"], solution=["1"])


def test_math_rewards_from_worker_threads():
    """Off the main thread math-verify's SIGALRM timeouts cannot run (a reward
    server, a thread pool): the rewards switch them off and still score. The
    first gold is parsed (and cached) on the main thread first, the second only
    in the pool: both paths used to fail (None, or math-verify's ValueError)."""
    cases = [(["\\boxed{72}", "The answer is 5."], [GSM8K_GOLD] * 2, [1.0, 0.0]),
             (["so 19", "it is 18"], ["#### 19"] * 2, [1.0, 0.0])]

    # on the main thread: caches the first gold
    assert accuracy_reward(*cases[0][:2]) == cases[0][2]

    with ThreadPoolExecutor(2) as pool:
        results = [pool.submit(accuracy_reward, c, s).result() for c, s, _ in cases]
        assert results == [e for _, _, e in cases]
        reasoning = pool.submit(reasoning_accuracy_reward, ["<think>5</think>72"],
                                [GSM8K_GOLD])
        assert reasoning.result() == [1.0]


def _exits(exc):
    def exiting_reward(completions, **kw):
        raise exc

    return exiting_reward


@pytest.mark.parametrize(
    "exc", [SystemExit(0), SystemExit(3), KeyboardInterrupt(), GeneratorExit()],
    ids=["SystemExit(0)", "SystemExit(3)", "KeyboardInterrupt", "other BaseException"])
def test_compute_rewards_reports_a_function_that_exits(exc):
    """A reward that exits (any BaseException) is an error naming it, not the end
    of the run without a word."""
    match = f"reward function exiting_reward raised {type(exc).__name__}"
    with pytest.raises(RuntimeError, match=match):
        compute_rewards([_exits(exc)], ["p"], ["a"])


def test_compute_rewards_time_limit_names_a_function_that_never_returns():
    release = threading.Event()

    def stuck_reward(completions, **kw):
        # never set while the test waits: a reward that hangs
        release.wait()
        return [1.0] * len(completions)

    match = r"reward function stuck_reward did not return within 0.2 s.*--reward-timeout"
    with pytest.raises(RuntimeError, match=match):
        compute_rewards([stuck_reward], ["p"], ["a"], 0.2)
    release.set()

    # a prompt one is unaffected
    assert compute_rewards([_const([0.5])], ["p"], ["a"], 0.2).item() == 0.5


def test_compute_rewards_names_a_value_out_of_float32_range():
    match = r"bad_reward returned 1e\+39 for completion 1 \('second'\).*float32"
    with pytest.raises(ValueError, match=match):
        compute_rewards([_const([1.0, 1e39])], ["p", "p"], ["first", "second"])


def test_math_verify_rewards_work_in_compute_rewards_worker_thread():
    """compute_rewards runs each function off the main thread, where math-verify's
    SIGALRM timeout cannot run. reward.py turns it off there; else math-verify
    raises on every call, and every answer scores None."""
    completions = ["<think>so</think> \\boxed{72}", "<think>so</think> 71"]

    funcs = [accuracy_reward, reasoning_accuracy_reward]
    r = compute_rewards(funcs, ["q"] * 2, completions, 5.0, solution=[GSM8K_GOLD] * 2)


    torch.testing.assert_close(r, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
