"""Reward functions: one float, or None (no opinion), per completion and function.

The contract is TRL GRPOTrainer's: fn(completions, **columns) -> list[float |
None], called once per batch. It gets the completions (N strings, or N
conversations [{"role": "assistant", "content": ...}]), the prompts,
completion_ids (N lists of token ids) and every other dataset column, each a
list of N. With tools it gets tool_calls and environment_rewards too
(tools.py), and the texts and ids then hold the tool results; chat completions
are then the conversation of assistant and tool turns.

compute_rewards stacks F of them into (N, F), NaN for None (advantage.py skips
it), each run in a thread under --reward-timeout. score does it for a rollout,
and stops every rank if one fails. Built-in and user functions take this one
path. TRL's extras (trainer_state, log_metric, log_extra) go to the functions
that name them, collected by trl_compat/reward_extras.py's RewardLogs, which
train.py opens only when one does; `async def` functions are awaited on that
file's event loop (simplifications 2 and 3).

Built-ins, by name (REWARD_FUNCS): exact_match_reward (the built-in task's),
final_number_reward (the default for a dataset), and those of rewards/
(math-verify's accuracy, the think format, a reward model) and of
tools/sandbox.py (code_reward), imported when named. A factory:
get_soft_overlong_punishment (DAPO).

Run the tests: python -m pytest -q tests/test_reward.py tests/test_data.py

Simplifications:
1. A conversation is scored by the content of its last message.
2. TRL passes trainer_state, log_metric and log_extra to every function (its
   docs ask for **kwargs). Here a function gets those it names as parameters; a
   bare **kw gets none, so that one that names its columns and has no **kw keeps
   working, and a run whose functions name none (and none async) never loads
   reward_extras.py.
3. `async def` functions run after the sync ones, awaited together on one event
   loop (asyncio.gather, as TRL), all under one --reward-timeout; each sync one
   has its own.
"""
import functools
import importlib
import inspect
import math
import numbers
import os
import re
import threading

import torch

from common import all_ranks_ok, fail


def completion_text(completion):
    """A completion as plain text: a string, or the content of a conversation's
    last message."""
    if isinstance(completion, str):
        return completion

    messages = isinstance(completion, (list, tuple)) and completion
    if messages and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""

    raise TypeError("a completion must be a string or a list of {'role', 'content'} "
                    f"messages, got {completion!r:.80}")


def exact_match_reward(completions, solution, **kw):
    """1.0 if the stripped completion equals the stripped gold (the synthetic
    task), else 0.0."""
    rewards = []
    for c, sol in zip(completions, solution, strict=True):
        if sol is None:
            rewards.append(None)
        else:
            rewards.append(float(completion_text(c).strip() == str(sol).strip()))
    return rewards


# a number as the policy writes a final answer: 1,234 or -7 or 2.50
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number_reward(completions, solution, **kw):
    """1.0 when the last number of the final answer equals the gold number, else
    0.0 (None: no gold). The final answer is a conversation's last message, or
    a ToRL transcript's text after its last ```output block: the policy must
    write the number itself. Not accuracy_reward, which scores an unevaluated
    "123 * 509" as its value, a reward a tool recipe earns without the tool."""
    rewards = []
    for c, sol in zip(completions, solution, strict=True):
        if sol is None:
            rewards.append(None)
            continue

        text = completion_text(c)
        if not isinstance(c, str) and c[-1].get("role") != "assistant":
            # it ended on a tool's result: the policy wrote no answer after it
            text = ""
        if "```output" in text:
            after = text.rsplit("```output", 1)[1]
            # the output block's closing fence, then the policy's words
            text = after.split("```", 1)[1] if "```" in after else ""
        numbers = NUMBER.findall(text)
        rewards.append(float(bool(numbers) and _same_number(numbers[-1], sol)))
    return rewards


def _same_number(written, gold):
    try:
        return float(written.replace(",", "")) == float(str(gold).replace(",", ""))
    except ValueError:
        return False


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """DAPO's soft overlong punishment (eq. 13) on completion token counts: 0 up
    to L_max - L_cache tokens, then a linear ramp down to -1 at L_max, -1
    beyond."""
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"need 0 < soft_punish_cache <= max_completion_len, got "
                         f"{soft_punish_cache} and {max_completion_len}")

    free = max_completion_len - soft_punish_cache

    def punishment(n):
        """0 up to free, then down to -1 at max_completion_len, and -1 beyond."""
        return min(0.0, max(-1.0, (free - n) / soft_punish_cache))

    def soft_overlong_punishment(completions, completion_ids, **kw):
        return [punishment(len(ids)) for ids in completion_ids]

    return soft_overlong_punishment


# the built-in rewards by name: where each lives, imported at first use as a
# dotted path is (the others' folder: rewards/)
REWARD_FUNCS = {
    "exact_match_reward": "reward.exact_match_reward",
    "final_number_reward": "reward.final_number_reward",
    "accuracy_reward": "rewards.math_answers.accuracy_reward",
    "reasoning_accuracy_reward": "rewards.math_answers.reasoning_accuracy_reward",
    "think_format_reward": "rewards.think_format.think_format_reward",
    "code_reward": "tools.sandbox.code_reward",
}


def get_reward_funcs(names):
    """Names (a list, or one comma-separated string) -> functions.

    Each name is a built-in (REWARD_FUNCS), else a reward model (a folder, or a
    hub id: any name with "/"), else a dotted import path. Functions pass as
    they are.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]

    funcs = []
    for name in names:
        if callable(name):
            funcs.append(name)
            continue

        path = REWARD_FUNCS.get(name, name)
        if "/" in path or os.path.isdir(path):  # rewards/reward_model.py
            from rewards.reward_model import get_reward_model_func

            fn = get_reward_model_func(path)
        elif "." in path:
            module, _, attr = path.rpartition(".")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"reward function {name!r}: cannot import it "
                                 f"({e})") from e
        else:
            raise ValueError(f"unknown reward function {name!r}: use one of "
                             f"{sorted(REWARD_FUNCS)}, a dotted import path like "
                             f"my_pkg.rewards.fn, or a reward model folder or hub id "
                             f"(org/name)")

        if not callable(fn):
            raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a "
                             f"function")
        funcs.append(fn)
    return funcs


# the keywords TRL adds to the batch's columns (GRPOTrainer._calculate_rewards)
EXTRAS = ("trainer_state", "log_metric", "log_extra")


def extras_named(fn):
    """The EXTRAS fn names as parameters (simplification 2: **kw gets none). A
    signature inspect cannot read (some builtins) names none."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return ()

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(k for k in EXTRAS if k in params and params[k].kind in named)


def is_async(fn):
    """Whether fn(...) returns a coroutine, as TRL's is_async_callable: an
    `async def` function, a partial of one, or an object whose __call__ is one."""
    while isinstance(fn, functools.partial):
        fn = fn.func

    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def _call(fn, name, timeout, kwargs):
    """fn(**kwargs) in a daemon thread, for at most timeout seconds (None:
    forever). A hang cannot block the exit, and an exit (SystemExit: any
    BaseException) is reported with fn's name."""
    result = {}

    def run():
        try:
            result["values"] = fn(**kwargs)
        except BaseException as e:
            # SystemExit would end only the thread, silently
            result["error"] = e

    worker = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    worker.start()
    worker.join(timeout)

    if worker.is_alive():
        raise RuntimeError(f"reward function {name} did not return within {timeout:g} s: "
                           f"make it faster, or raise --reward-timeout")
    if "error" in result:
        e = result["error"]
        raise RuntimeError(f"reward function {name} raised {type(e).__name__}: "
                           f"{e}") from e
    return result["values"]


# a larger reward is inf in float32
FLOAT32_MAX = torch.finfo(torch.float32).max


def compute_rewards(funcs, prompts, completions, timeout=None, extras=None, /, **columns):
    """Each function once on the batch -> rewards (N, F) float32, NaN where it said
    None. RuntimeError or ValueError naming a function that fails.

    A sync function runs in a thread, for at most timeout seconds; the `async def`
    ones are awaited together after them, for at most timeout seconds in all
    (simplification 3). extras: each function's extra keywords (F dicts: the
    EXTRAS it names, reward_extras.RewardLogs.begin), or None.
    """
    N = len(completions)
    names = [getattr(fn, "__name__", repr(fn)) for fn in funcs]
    values = {}  # f -> function f's N values
    waiting = []  # the async ones: (f, fn, name, keywords)
    for f, fn in enumerate(funcs):
        kwargs = dict(prompts=prompts, completions=completions, **columns)
        if extras is not None:
            kwargs.update(extras[f])
        if is_async(fn):
            waiting.append((f, fn, names[f], kwargs))
        else:
            values[f] = _call(fn, names[f], timeout, kwargs)

    if waiting:
        # here, not at the top: a run of sync functions starts no event loop
        from trl_compat.reward_extras import await_together

        results = await_together([call[1:] for call in waiting], timeout)
        values.update(zip([call[0] for call in waiting], results))

    rewards = torch.full((N, len(funcs)), math.nan)  # (N, F)
    for f, name in enumerate(names):
        _check_values(values[f], name, N, completions)
        rewards[:, f] = torch.tensor([math.nan if v is None else float(v) for v in values[f]])
    return rewards


def _check_values(values, name, N, completions):
    """ValueError unless values holds N finite float32 numbers or None."""
    if not isinstance(values, (list, tuple)) or len(values) != N:
        if isinstance(values, (list, tuple)):
            got = f"{len(values)} values"
        else:
            got = f"{values!r:.80}"
        raise ValueError(f"reward function {name} must return a list of {N} floats or "
                         f"None (one per completion), returned {got}")

    for i, v in enumerate(values):
        tensor = isinstance(v, torch.Tensor) and v.numel() == 1
        scalar = isinstance(v, numbers.Real) or tensor
        # refuses NaN, inf and 1e39 (inf in float32)
        if v is not None and (not scalar or not abs(float(v)) <= FLOAT32_MAX):
            raise ValueError(f"reward function {name} returned {v!r:.80} for completion "
                             f"{i} ({completion_text(completions[i])!r:.80}): return a finite "
                             f"float32, or None for no opinion")


def score(funcs, rows, rollout, conversational, timeout, reward_logs=None):
    """Rewards (N, F) of a rollout (rows: its dataset row per completion), NaN for
    no opinion. A reward that raised, exited or took over timeout seconds stops
    every rank alike.

    reward_logs: None, or trl_compat/reward_extras.py's RewardLogs, which hands
    each function the EXTRAS it names and keeps what they log (a refused log call
    stops every rank alike too).
    """
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    # tools: each completion's calls, its environment's score (tools/multiturn.py)
    columns.update(rollout.reward_columns())

    # (N,) every token: the policy's and, with --tools, the tool outputs'
    every = rollout.completion_mask + getattr(rollout, "tool_mask", 0)
    lengths = every.sum(1).int().tolist()
    ids = [c[:k] for c, k in zip(rollout.completion_ids.tolist(), lengths)]
    texts = rollout.texts
    if conversational:
        texts = rollout.conversations()

    extras = None  # each function's extra keywords
    if reward_logs is not None:
        extras = reward_logs.begin(funcs, len(rows))

    error = None
    try:
        rewards = compute_rewards(funcs, [r["prompt"] for r in rows], texts, timeout,
                                  extras, completion_ids=ids, **columns)
        if reward_logs is not None:
            reward_logs.end()  # RuntimeError: a log call it refused
    except BaseException as e:
        # raised, exited or hung (compute_rewards names it)
        rewards = None
        error = e

    if not all_ranks_ok(error is None):
        if error:
            message = str(error)
        else:
            message = "another rank's reward function failed (see its message)"
        fail(message, everywhere=False)
    return rewards
