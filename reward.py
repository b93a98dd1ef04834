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
file's event loop (simplifications 6 and 7).

Built-ins, by name (REWARD_FUNCS): accuracy_reward and reasoning_accuracy_reward
(math-verify), think_format_reward, exact_match_reward, final_number_reward
(the tools' default) and code_reward (sandbox.py). Factories: get_soft_overlong_punishment (DAPO) and
get_reward_model_func (a learned reward model).

Run the tests: python -m pytest -q tests/test_reward.py tests/test_data.py

Simplifications:
1. A conversation is scored by the content of its last message.
2. math-verify's default extraction (LaTeX, \\boxed{} first, then plain
   expressions): "The answer is 1,234." counts like \\boxed{1234}; TRL accepts
   only LaTeX.
3. math-verify's timeouts use SIGALRM, main thread only. The worker thread runs
   it without them (as TRL's does), and --reward-timeout bounds the whole call
   instead.
4. math-verify extracts no number glued to ">" ("</think>72" reads like "x>72"):
   for thinking models use reasoning_accuracy_reward.
5. A reward model sees the dataset's prompt (as in TRL), not the policy's
   rendered text, and nothing is truncated: prompt + completion must fit its
   context.
6. TRL passes trainer_state, log_metric and log_extra to every function (its
   docs ask for **kwargs). Here a function gets those it names as parameters; a
   bare **kw gets none, so that one that names its columns and has no **kw keeps
   working, and a run whose functions name none (and none async) never loads
   reward_extras.py.
7. `async def` functions run after the sync ones, awaited together on one event
   loop (asyncio.gather, as TRL), all under one --reward-timeout; each sync one
   has its own.
"""
import functools
import importlib
import inspect
import logging
import math
import numbers
import os
import re
import threading

import torch

from common import all_ranks_ok, fail


def _text(completion):
    """A completion as plain text: a string, or the content of a conversation's
    last message."""
    if isinstance(completion, str):
        return completion

    messages = isinstance(completion, (list, tuple)) and completion
    if messages and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""

    raise TypeError("a completion must be a string or a list of {'role', 'content'} "
                    f"messages, got {completion!r:.80}")


def _timeouts():
    """math-verify's (parse, verify) keywords: its own timeouts on the main thread
    only."""
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
    return [_score(sol, _text(c)) for c, sol in zip(completions, solution, strict=True)]


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=("</think>",),
                              **kw):
    """accuracy_reward on the text after the last reasoning delimiter: numbers in
    the reasoning do not count, and a completion whose reasoning never closes
    scores 0."""
    rewards = []
    for c, sol in zip(completions, solution, strict=True):
        text = _text(c)
        ends = [text.rfind(d) + len(d) for d in reasoning_delimiters if d in text]
        if sol is None or not _parse_gold(str(sol)):
            rewards.append(None)
        elif ends:
            rewards.append(_score(sol, text[max(ends):]))
        else:
            rewards.append(0.0)
    return rewards


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
        m = _THINK.fullmatch(_text(c))
        ok = m is not None
        if ok:
            reasoning = m[1]
            answer = m[2]
            ok = ("<think>" not in reasoning and re.search(r"</?think>", answer) is None
                  and answer.strip() != "")
        rewards.append(float(ok))
    return rewards


def exact_match_reward(completions, solution, **kw):
    """1.0 if the stripped completion equals the stripped gold (the synthetic
    task), else 0.0."""
    rewards = []
    for c, sol in zip(completions, solution, strict=True):
        if sol is None:
            rewards.append(None)
        else:
            rewards.append(float(_text(c).strip() == str(sol).strip()))
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

        text = _text(c)
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


def code_reward(completions, tests, **kw):
    """The fraction of each sample's `tests` that its last ```python block
    passes, run in the sandbox (sandbox.code_reward; imported at the first call)."""
    from tools.sandbox import code_reward as run_in_sandbox

    return run_in_sandbox(completions, tests, **kw)


def environment_reward_func(name):
    """An environment's get_reward as a reward function, named after its class
    (TRL's column): the rollout's environment_rewards, None for the rows of
    another class."""
    def reward(completions, environment_rewards, **kw):
        return [pair[1] if pair is not None and pair[0] == name else None
                for pair in environment_rewards]

    reward.__name__ = name
    return reward


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


REWARD_FUNCS = {
    fn.__name__: fn
    for fn in (accuracy_reward, reasoning_accuracy_reward, think_format_reward,
               exact_match_reward, final_number_reward, code_reward)
}


def get_reward_model_func(path, *, batch_size=16, device=None):
    """A one-label sequence-classification model (hub id or folder) -> a reward
    function on prompt + completion: as user and assistant turns of its chat
    template, else concatenated."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    model = model.to(device).eval().requires_grad_(False)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path!r} has {model.config.num_labels} labels; "
                         f"a reward model needs 1")

    # batching needs a pad token; HF pools the last non-pad token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    # real tokens keep positions 0..L-1
    tokenizer.padding_side = "right"

    def render(prompt, completion):
        if not tokenizer.chat_template:
            return _text(prompt) + _text(completion)

        if isinstance(prompt, str):
            turns = [{"role": "user", "content": prompt}]
        else:
            turns = list(prompt)
        turns = turns + [{"role": "assistant", "content": _text(completion)}]
        return tokenizer.apply_chat_template(turns, tokenize=False)

    @torch.no_grad()
    def reward_model(completions, prompts, **kw):
        texts = [render(p, c) for p, c in zip(prompts, completions, strict=True)]

        scores = []
        for i in range(0, len(texts), batch_size):
            # a rendered template holds its own BOS: add no second one (see
            # data.encode_prompts)
            batch = tokenizer(texts[i:i + batch_size], padding=True, return_tensors="pt",
                              add_special_tokens=not tokenizer.chat_template).to(device)
            scores += model(**batch).logits[:, 0].float().tolist()  # (b,)
        return scores

    reward_model.__name__ = f"reward_model_{os.path.basename(os.path.normpath(path))}"
    return reward_model


def get_reward_funcs(names):
    """Names (a list, or one comma-separated string) -> functions.

    Each name is a built-in, else a reward model (a folder, or a hub id: any
    name with "/"), else a dotted import path. Functions pass as they are.
    """
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]

    funcs = []
    for name in names:
        if callable(name):
            funcs.append(name)
            continue

        fn = REWARD_FUNCS.get(name)
        if fn is None and (os.path.isdir(name) or "/" in name):
            try:
                fn = get_reward_model_func(name)
            except OSError as e:
                # not a local model folder, and not found on the hub
                raise ValueError(f"reward model {name!r}: cannot load it as a sequence-"
                                 f"classification model from a local folder or the hub "
                                 f"({e})") from e
        elif fn is None and "." in name:
            module, _, attr = name.rpartition(".")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"reward function {name!r}: cannot import it "
                                 f"({e})") from e

        if fn is None:
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
    """The EXTRAS fn names as parameters (simplification 6: **kw gets none). A
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
    (simplification 7). extras: each function's extra keywords (F dicts: the
    EXTRAS it names, reward_extras.RewardLogs.begin), or None.
    """
    N = len(completions)
    rewards = torch.full((N, len(funcs)), math.nan)  # (N, F)

    waiting = []  # the async ones: (f, fn, name, keywords)
    for f, fn in enumerate(funcs):
        name = getattr(fn, "__name__", repr(fn))
        kwargs = dict(prompts=prompts, completions=completions, **columns)
        if extras is not None:
            kwargs.update(extras[f])
        if is_async(fn):
            waiting.append((f, fn, name, kwargs))
            continue
        values = _call(fn, name, timeout, kwargs)
        _check_values(values, name, N, completions)
        floats = [math.nan if v is None else float(v) for v in values]
        rewards[:, f] = torch.tensor(floats)

    if waiting:
        # here, not at the top: a run of sync functions starts no event loop
        from trl_compat.reward_extras import await_together

        results = await_together([call[1:] for call in waiting], timeout)
        for (f, _, name, _), values in zip(waiting, results):
            _check_values(values, name, N, completions)
            rewards[:, f] = torch.tensor([math.nan if v is None else float(v)
                                          for v in values])

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
                             f"{i} ({_text(completions[i])!r:.80}): return a finite "
                             f"float32, or None for no opinion")


def pass_at_k(n, c, k):
    """P(at least one of k completions passes), unbiased from n >= k samples of
    which c passed (Chen et al. 2021, arXiv 2107.03374, eq. 1):
    1 - C(n-c, k) / C(n, k). Computed as their numpy snippet does, since the
    binomials overflow: 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, "
                         f"k={k}")


    # every k-subset holds a passing sample
    if n - c < k:
        return 1.0

    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def score(funcs, rows, rollout, conversational, timeout, reward_logs=None):
    """Rewards (N, F) of a rollout (rows: its dataset row per completion), NaN for
    no opinion. A reward that raised, exited or took over timeout seconds stops
    every rank alike.

    reward_logs: None, or trl_compat/reward_extras.py's RewardLogs, which hands
    each function the EXTRAS it names and keeps what they log (a refused log call
    stops every rank alike too).
    """
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    if hasattr(rollout, "tool_calls"):
        # tools: each completion's calls, its environment's score
        # (tools.ToolRollout)
        columns["tool_calls"] = rollout.tool_calls
        columns["environment_rewards"] = rollout.environment_rewards

    # (N,) every token: the policy's and, with --tools, the tool outputs'
    every = rollout.completion_mask + getattr(rollout, "tool_mask", 0)
    lengths = every.sum(1).int().tolist()
    ids = [c[:k] for c, k in zip(rollout.completion_ids.tolist(), lengths)]
    texts = rollout.texts
    if conversational and hasattr(rollout, "messages"):
        # the assistant and tool turns, as TRL gives them
        texts = rollout.messages
    elif conversational:
        texts = [[{"role": "assistant", "content": t}] for t in rollout.texts]

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
