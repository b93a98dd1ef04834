"""Rule rewards: score each completion, one float (or None) per completion per function.

Contract (the same as TRL's GRPOTrainer): a reward function is
    fn(completions, **columns) -> list[float | None]
called once per batch with keywords: completions (N strings, or N conversations
[{"role": "assistant", "content": ...}]), prompts, completion_ids (N lists of token ids) and every
other dataset column (e.g. solution), each a list of N. None means "no opinion on this sample"
(e.g. the gold answer does not parse): advantage.py skips it instead of counting it as 0.
compute_rewards stacks the F functions into an (N, F) tensor, NaN where a function said None. It calls each
function in a worker thread with a time limit (train.py --reward-timeout): a function that hangs, raises, or exits
(SystemExit, KeyboardInterrupt) ends the run with its name, on every rank, instead of a hang or a silent exit.

Built-ins (REWARD_FUNCS, picked by name on the command line):
    accuracy_reward            1 if math-verify finds the answer equal to the gold, else 0
    reasoning_accuracy_reward  the same on the text after the reasoning block; 0 if it never closes
    think_format_reward        1 if the completion is "<think>...</think>answer", else 0
    exact_match_reward         1 if the stripped completion equals the stripped gold (the synthetic task)
    code_reward                fraction of the sample's unit tests (column `tests`) that its last ```python
                               block passes, run in a sandbox (sandbox.py)
and the factory get_soft_overlong_punishment(L_max, L_cache), DAPO (arXiv 2503.14476) eq. 13:
    R(y) = 0 if |y| <= L_max - L_cache;  (L_max - L_cache - |y|) / L_cache if |y| <= L_max;  -1 beyond.

pass_at_k(n, c, k) is the evaluation's unbiased pass@k estimate (train.py --eval-samples, --eval-k).

A learned reward model is a reward function too: get_reward_model_func(path) scores prompt + completion
with an AutoModelForSequenceClassification of one label (its logit is the reward).

Run the tests: python -m pytest -q tests/test_reward.py tests/test_data.py

Simplifications:
1. A conversation is scored by the content of its last message.
2. math-verify parses with its default extraction (LaTeX, \\boxed{} first, then plain expressions),
   so "The answer is 1,234." counts like \\boxed{1234}; TRL's accuracy_reward accepts only LaTeX.
3. math-verify's timeouts use SIGALRM, which only the main thread can set: off the main thread (compute_rewards
   runs every reward in a worker thread) math-verify runs without its own timeouts, as TRL's does off the main
   thread, and the reward's time limit (--reward-timeout) bounds the whole call instead.
4. math-verify extracts no number glued to ">" ("</think>72" reads like "x>72"): for thinking models
   use reasoning_accuracy_reward, which scores only the text after "</think>".
5. A reward model sees the dataset's prompt (the question, as in TRL), not the policy's rendered text,
   and scores are not truncated: prompt + completion must fit its context.
"""
import functools
import importlib
import logging
import math
import numbers
import os
import re
import threading

import torch

from sandbox import code_reward


def _text(completion):
    """A completion as plain text: a string, or the content of a conversation's last message."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict):
        return completion[-1].get("content") or ""
    raise TypeError(f"a completion must be a string or a list of {{'role', 'content'}} messages, got {completion!r:.80}")


def _timeouts():
    """math-verify's timeouts: its defaults on the main thread, none elsewhere (signal.alarm raises off the main
    thread, inside parse, or inside verify where _score would turn it into a silent None)."""
    main = threading.current_thread() is threading.main_thread()
    if not main:  # else math-verify warns on every call that its timeout is off: intended (simplification 3)
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).setLevel(logging.ERROR)
    return (dict(), dict()) if main else (dict(parsing_timeout=None), dict(timeout_seconds=None))


@functools.lru_cache(maxsize=4096)  # each gold repeats G times in a batch (parsed objects are thread-safe to share)
def _parse_gold(solution):
    # GSM8K golds are "<worked solution with <<48/2=24>> calculator notes>\n#### 1,234". math-verify
    # knows no "####": on the whole text it picks a number by its own ranking (for "#### 10\nnote: 5
    # were red" it picks 5) after parsing every step. Keep only the rest of the marker's line, as
    # math-verify's own GSM8K task does (math_verify/tasks.py splits on "####").
    if "####" in solution:
        solution = solution.split("####")[-1].strip().split("\n")[0]
    from math_verify import parse  # here, not at the top: sympy costs every run ~1 s of start-up
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
    except Exception:  # a comparison math-verify cannot do (timeout, sympy error): no opinion
        return None


def accuracy_reward(completions, solution, **kw):
    return [_score(sol, _text(c)) for c, sol in zip(completions, solution, strict=True)]


def reasoning_accuracy_reward(completions, solution, reasoning_delimiters=("</think>",), **kw):
    """accuracy_reward on the text after the last reasoning delimiter: numbers in the reasoning
    do not count, and a completion whose reasoning never closes scores 0."""
    rewards = []
    for c, sol in zip(completions, solution, strict=True):
        text = _text(c)
        ends = [text.rfind(d) + len(d) for d in reasoning_delimiters if d in text]
        if sol is None or not _parse_gold(str(sol)):
            rewards.append(None)
        else:
            rewards.append(_score(sol, text[max(ends):]) if ends else 0.0)
    return rewards


_THINK = re.compile(r"\s*<think>(.*?)</think>(.*)", re.DOTALL)


def think_format_reward(completions, **kw):
    """1.0 iff the completion is one complete <think>...</think> block, then a non-empty answer
    with no further think tags.

    Against TRL's think_format_reward (re.match of r"^<think>(?!.*<think>)(.*?)</think>.*$", DOTALL):
    - leading whitespace before <think> passes here (chat templates and models often open with a newline);
      TRL wants <think> as the very first characters: looser here.
    - an empty answer ("<think>...</think>" and nothing, or only whitespace) scores 0 here, 1 in TRL: the R1
      format is reasoning *then* an answer, and rewarding the bare block pays for never answering. Stricter.
    - a stray "</think>" after the block scores 0 here, 1 in TRL (its lazy (.*?) stops at the first
      "</think>" and ".*" takes the rest): the answer would start mid-reasoning. Stricter.
    - a second "<think>" anywhere after the first scores 0 in both."""
    rewards = []
    for c in completions:
        m = _THINK.fullmatch(_text(c))
        ok = m is not None and "<think>" not in m[1] and re.search(r"</?think>", m[2]) is None and m[2].strip() != ""
        rewards.append(float(ok))
    return rewards


def exact_match_reward(completions, solution, **kw):
    return [None if sol is None else float(_text(c).strip() == str(sol).strip())
            for c, sol in zip(completions, solution, strict=True)]


def get_soft_overlong_punishment(max_completion_len, soft_punish_cache):
    """DAPO's soft overlong punishment (eq. 13) on completion token counts: 0 up to
    L_max - L_cache tokens, then a linear ramp down to -1 at L_max, -1 beyond."""
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"need 0 < soft_punish_cache <= max_completion_len, got {soft_punish_cache} "
                         f"and {max_completion_len}")
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(completions, completion_ids, **kw):
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > max_completion_len
                else (free - len(ids)) / soft_punish_cache for ids in completion_ids]
    return soft_overlong_punishment


REWARD_FUNCS = {fn.__name__: fn for fn in (accuracy_reward, reasoning_accuracy_reward, think_format_reward,
                                           exact_match_reward, code_reward)}


def get_reward_model_func(path, *, batch_size=16, device=None):
    """A sequence-classification model with one label (hub id or local folder) -> a reward function
    that scores prompt + completion: through the model's chat template when its tokenizer has one (the
    prompt as user turn, the completion as assistant turn), else their plain concatenation."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).to(device).eval().requires_grad_(False)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path!r} has {model.config.num_labels} labels; a reward model needs 1")
    if tokenizer.pad_token is None:  # batching needs one; HF pools the last non-pad token (modeling_layers.py)
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"  # real tokens keep positions 0..L-1, for absolute position embeddings too

    def render(prompt, completion):
        if not tokenizer.chat_template:
            return _text(prompt) + _text(completion)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages = messages + [{"role": "assistant", "content": _text(completion)}]
        return tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.no_grad()
    def reward_model(completions, prompts, **kw):
        texts = [render(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores = []
        for i in range(0, len(texts), batch_size):
            # a rendered template holds its own BOS: add no second one (see task.encode_prompts)
            batch = tokenizer(texts[i:i + batch_size], padding=True, return_tensors="pt",
                              add_special_tokens=not tokenizer.chat_template).to(device)
            scores += model(**batch).logits[:, 0].float().tolist()  # (b,)
        return scores
    reward_model.__name__ = f"reward_model_{os.path.basename(os.path.normpath(path))}"
    return reward_model


def get_reward_funcs(names):
    """Names (a list, or one comma-separated string) -> functions. Each name is, checked in this order:
    a built-in; an existing local folder, or any name with a "/" (a hub id like org/name): a reward
    model; a dotted import path like my_pkg.rewards.fn. A function passes through unchanged."""
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
            except OSError as e:  # transformers: not a local model folder, and not found on the hub
                raise ValueError(f"reward model {name!r}: cannot load it as a sequence-classification model "
                                 f"from a local folder or the hub ({e})") from e
        elif fn is None and "." in name:
            module, _, attr = name.rpartition(".")
            try:
                fn = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"reward function {name!r}: cannot import it ({e})") from e
        if fn is None:
            raise ValueError(f"unknown reward function {name!r}: use one of {sorted(REWARD_FUNCS)}, a dotted "
                             f"import path like my_pkg.rewards.fn, or a reward model folder or hub id (org/name)")
        if not callable(fn):
            raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a function")
        funcs.append(fn)
    return funcs


def _call(fn, name, timeout, kwargs):
    """fn(**kwargs) in a daemon thread, waited on for timeout seconds (None: forever): a function that hangs can
    neither hold the run nor block its exit, and one that exits (SystemExit, KeyboardInterrupt: any BaseException)
    is reported by name instead of ending the run without a word."""
    result = {}

    def run():
        try:
            result["values"] = fn(**kwargs)
        except BaseException as e:  # SystemExit in a thread would end only the thread, silently
            result["error"] = e
    worker = threading.Thread(target=run, name=f"reward {name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RuntimeError(f"reward function {name} did not return within {timeout:g} s: make it faster, or raise "
                           f"--reward-timeout")
    if "error" in result:
        e = result["error"]
        raise RuntimeError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    return result["values"]


FLOAT32_MAX = torch.finfo(torch.float32).max  # a larger reward would be inf in the (N, F) tensor


def compute_rewards(funcs, prompts, completions, timeout=None, /, **columns):
    """Call each function once on the batch, in a thread, for at most timeout seconds each -> rewards (N, F)
    float32, NaN where it returned None. RuntimeError / ValueError naming the function when it fails."""
    N = len(completions)
    rewards = torch.full((N, len(funcs)), math.nan)  # (N, F)
    for f, fn in enumerate(funcs):
        name = getattr(fn, "__name__", repr(fn))
        values = _call(fn, name, timeout, dict(prompts=prompts, completions=completions, **columns))
        if not isinstance(values, (list, tuple)) or len(values) != N:
            got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"{values!r:.80}"
            raise ValueError(f"reward function {name} must return a list of {N} floats or None "
                             f"(one per completion), returned {got}")
        for i, v in enumerate(values):
            is_number = isinstance(v, numbers.Real) or (isinstance(v, torch.Tensor) and v.numel() == 1)
            if v is not None and (not is_number or not abs(float(v)) <= FLOAT32_MAX):  # NaN, inf, 1e39 (float32)
                raise ValueError(f"reward function {name} returned {v!r:.80} for completion {i} "
                                 f"({_text(completions[i])!r:.80}): return a finite float32, or None for no opinion")
        rewards[:, f] = torch.tensor([math.nan if v is None else float(v) for v in values])
    return rewards


def pass_at_k(n, c, k):
    """The probability that at least one of k completions passes, estimated without bias from n >= k samples of which
    c passed (Chen et al. 2021, arXiv 2107.03374, eq. 1): 1 - C(n-c, k) / C(n, k), as their numpy snippet computes it,
    a product instead of binomials that overflow: 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
