"""
TRL's reward-function extras: trainer_state, log_metric, log_extra, `async def` rewards.

TRL 1.16 (GRPOTrainer._calculate_rewards) calls a reward function with three keywords
beyond the batch's columns:
- trainer_state: how far training is, for a curriculum (TrainerState: global_step, epoch,
  max_steps);
- log_metric(name, value): a number for the step's record in metrics.jsonl, the mean of
  the step's values over its calls and the ranks (TRL's _pending_metrics); eval_NAME while
  evaluating, as TRL's log names them;
- log_extra(column, values): one value per completion, for the completions log (TRL's
  _pending_extra_logs). After a step's scoring, reward_logs.extra_columns holds {column:
  one value per completion of this rank's batch, in the rollout's row order};
and it awaits the `async def` ones together on one event loop (asyncio.gather), after the
sync ones.

A run whose reward functions are all ours (reward.py's, task.py's) never imports this
file. train.py imports it when one is not, and install decides, once, which functions get
which extras. Where one does, install hands train.py three replacements, as fast.install
does: score (reward.score with the extras passed and the async functions awaited),
evaluate (plus its rewards' metrics, eval_NAME) and dynamic_sampling (the extra columns
follow the rows it keeps). Otherwise it hands back the three it got.

Run: python train.py --rewards my_module.my_reward ...   (my_reward takes log_metric, say)
Tests: python -m pytest -q tests/test_reward_extras.py

Simplifications:
1. TRL passes all three to every function (its docs ask for **kwargs). Here a function
   gets those it names, or all three with **kwargs, and ours none: one that names its
   columns and has no **kwargs keeps working.
2. trainer_state holds 3 of transformers' TrainerState fields. global_step counts
   optimizer steps done, as there (a GRPO step takes --num-iterations x minibatches of
   them), and max_steps the run's; epoch is the training prompts drawn before the batch
   over their number (fractional).
3. A log call that is refused does not raise in the function: it returns, and the run
   stops once the batch is scored, with one line that names the function.
4. The async functions run after the sync ones, together, all under one --reward-timeout
   (each sync one has its own, as without extras). The extra columns logged while
   evaluating are checked, then dropped: the completions log is the training steps'.
"""
import asyncio
import concurrent.futures
import dataclasses
import functools
import inspect
import math
import numbers
import threading

import torch
import torch.distributed as dist

import reward
from common import all_ranks_ok, collective_device, ddp, fail, world

# the keywords TRL adds to the batch's columns (GRPOTrainer._calculate_rewards)
EXTRAS = ("trainer_state", "log_metric", "log_extra")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as trainer_state: the fields of TRL's (a
    transformers TrainerState) that say how far training is. global_step /
    max_steps is the progress."""
    global_step: int
    epoch: float
    max_steps: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a reward function is called: the EXTRAS it gets, and whether it is awaited."""
    extras: tuple
    is_async: bool


def takes(fn, keyword):
    """Whether fn can be called with keyword=...: a parameter of that name, or
    **kwargs. A signature inspect cannot read (some builtins) takes none."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False

    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.kind == p.VAR_KEYWORD or (p.name == keyword and p.kind in named)
               for p in params)


def is_async(fn):
    """Whether fn(...) returns a coroutine, as TRL's is_async_callable: an
    `async def` function, a partial of one, or an object whose __call__ is one."""
    while isinstance(fn, functools.partial):
        fn = fn.func

    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None))


def plan(fn):
    """fn's Plan: ours get nothing; a user's function the EXTRAS it takes,
    awaited if async."""
    if getattr(fn, "__module__", None) in reward.OUR_MODULES:
        return Plan((), False)

    return Plan(tuple(k for k in EXTRAS if takes(fn, k)), is_async(fn))


def install(reward_funcs, eval_func, score, evaluate, dynamic_sampling, *, progress,
            train_prompts, batch_prompts, max_steps):
    """Once at load -> (reward_logs, score, evaluate, dynamic_sampling).

    Where no function takes an extra or is async: (None, and the three given,
    unchanged). Otherwise a RewardLogs and its replacements for the three.
    progress() -> (optimizer steps done, prompts drawn so far) when called;
    train_prompts: their number; batch_prompts: a batch's (--prompts-per-step);
    max_steps: the run's optimizer steps.
    """
    plans = {id(fn): plan(fn) for fn in [*reward_funcs, eval_func]}
    if not any(p.extras or p.is_async for p in plans.values()):
        return None, score, evaluate, dynamic_sampling

    logs = RewardLogs(plans, score, evaluate, dynamic_sampling, progress, train_prompts,
                      batch_prompts, max_steps)
    return logs, logs.score, logs.evaluate, logs.dynamic_sampling


def _name(fn):
    """A reward function's name, as reward.compute_rewards gives it."""
    return getattr(fn, "__name__", repr(fn))


def _short(x):
    """x's repr on one line, at most 80 characters: for an error line."""
    return " ".join(repr(x).split())[:80]


class Call:
    """One batch's log_metric and log_extra calls (one score call).

    metrics: {name: [values]}; loggers: {name: the function that logged it
    first}; columns: {column: N values}; problem: the first call refused, one line
    (None: none).
    """

    def __init__(self, N):
        self.N = N
        self.metrics = {}
        self.loggers = {}
        self.columns = {}
        self.problem = None

    def refuse(self, line):
        """Keep the first refusal: the run stops on it once the batch is scored."""
        if self.problem is None:
            self.problem = line

    def log_metric(self, fn_name, name, value):
        """fn_name's log_metric(name, value): a finite real number."""
        one = isinstance(value, torch.Tensor) and value.numel() == 1
        real = isinstance(value, numbers.Real) or one

        if not isinstance(name, str) or not name:
            return self.refuse(f"reward function {fn_name} logged a metric named "
                               f"{_short(name)}: name it with a non-empty string")
        if name.startswith("eval_"):
            return self.refuse(f"reward function {fn_name} logged metric {name!r}: eval_ "
                               f"is the prefix of evaluation's metrics (one logged while "
                               f"evaluating is recorded as eval_NAME); rename it")
        if not real or not math.isfinite(float(value)):
            return self.refuse(f"reward function {fn_name} logged metric {name!r} = "
                               f"{_short(value)}: log_metric takes a finite real number")

        self.metrics.setdefault(name, []).append(float(value))
        self.loggers.setdefault(name, fn_name)

    def log_extra(self, fn_name, column, values):
        """fn_name's log_extra(column, values): N values, one per completion."""
        if not isinstance(column, str) or not column:
            return self.refuse(f"reward function {fn_name} logged an extra column named "
                               f"{_short(column)}: name it with a non-empty string")
        if not isinstance(values, (list, tuple)) or len(values) != self.N:
            got = (f"{len(values)} values" if isinstance(values, (list, tuple))
                   else _short(values))
            return self.refuse(
                f"reward function {fn_name} logged extra column {column!r} with {got}: "
                f"log_extra takes a list of {self.N} (one per completion)")
        if column in self.columns:
            return self.refuse(
                f"reward function {fn_name} logged extra column {column!r} twice in a "
                f"batch (or after another function): one list per column")

        self.columns[column] = list(values)

    def extras(self, fn_name, state, keywords):
        """The keywords of EXTRAS a function takes -> their values for this batch."""
        every = dict(trainer_state=state,
                     log_metric=functools.partial(self.log_metric, fn_name),
                     log_extra=functools.partial(self.log_extra, fn_name))
        return {k: every[k] for k in keywords}


class RewardLogs:
    """What the reward functions logged, and install's replacements for train.py's
    score, evaluate and dynamic_sampling, which pass the extras and collect the logs.

    extra_columns: the last step's log_extra columns, {column: one value per
    completion of this rank's batch, in the rollout's row order} (a completions log
    reads it).
    """

    def __init__(self, plans, score, evaluate, dynamic_sampling, progress, train_prompts,
                 batch_prompts, max_steps):
        self.extra_columns = {}
        self.plans = plans
        self._score = score
        self._evaluate = evaluate
        self._dynamic_sampling = dynamic_sampling

        self.progress = progress
        self.train_prompts = train_prompts
        self.batch_prompts = batch_prompts
        self.max_steps = max_steps

        self.mode = "train"  # "eval" inside evaluate
        # per mode, {name: [values]} and {name: function}, until the record takes them
        self.metrics = dict(train={}, eval={})
        self.loggers = {}
        # the step's training calls' columns, one {column: N values} per round
        self.rounds = []

    def trainer_state(self):
        """TRL's trainer_state now: the loop's batch was drawn before it is scored."""
        opt_step, consumed = self.progress()
        if self.mode == "train":
            consumed -= self.batch_prompts

        return TrainerState(global_step=opt_step, epoch=consumed / self.train_prompts,
                            max_steps=self.max_steps)

    def score(self, funcs, rows, rollout, conversational, timeout):
        """reward.score's rewards (N, F), with the extras passed to the functions that
        take them, and the async ones awaited together after the sync ones. A refused
        log call, or an async function that fails, stops every rank alike."""
        N = len(rows)
        call = Call(N)
        state = self.trainer_state()

        # reward.score calls the sync ones (with their extras bound) and, in place of
        # each async one, a stand-in that keeps the batch's keywords and says None
        batch = {}
        as_plain = [self._as_plain(fn, call, state, batch) for fn in funcs]
        rewards = self._score(as_plain, rows, rollout, conversational, timeout)  # (N, F)

        error = None
        waited = [f for f, fn in enumerate(funcs) if self._plan(fn).is_async]
        if waited:
            try:
                self._await_async([funcs[f] for f in waited], waited, batch, call, state,
                                  timeout, rewards)
            except BaseException as e:
                # raised, exited or hung (named)
                error = e

        problem = str(error) if error else call.problem
        if not all_ranks_ok(problem is None):
            fail(problem or "another rank's reward function failed (see its message)",
                 everywhere=False)

        self._keep(call)
        return rewards

    def _plan(self, fn):
        """fn's Plan, as install decided it (or now, for a function it did
        not see)."""
        return self.plans.get(id(fn)) or plan(fn)

    def _as_plain(self, fn, call, state, batch):
        """fn as reward.score calls it: its extras bound in; a stand-in if async."""
        p = self._plan(fn)
        name = _name(fn)

        if p.is_async:
            def stand_in(**keywords):
                batch.update(keywords)
                return [None] * call.N

            stand_in.__name__ = name
            return stand_in

        if not p.extras:
            return fn

        extras = call.extras(name, state, p.extras)

        def with_extras(**keywords):
            return fn(**keywords, **extras)

        with_extras.__name__ = name
        return with_extras

    def _await_async(self, funcs, columns, batch, call, state, timeout, rewards):
        """Await funcs together on the batch's keywords -> their values in
        columns of rewards."""
        calls = []
        for fn in funcs:
            name = _name(fn)
            extras = call.extras(name, state, self._plan(fn).extras)
            calls.append((fn, name, {**batch, **extras}))

        for f, (_, name, _), values in zip(columns, calls, _gather(calls, timeout)):
            reward._check_values(values, name, call.N, batch["completions"])
            rewards[:, f] = torch.tensor([math.nan if v is None else float(v)
                                          for v in values])

    def _keep(self, call):
        """A scored batch's logs: its metrics for the record, its columns for
        the step's."""
        for name, values in call.metrics.items():
            self.metrics[self.mode].setdefault(name, []).extend(values)
        for name, fn_name in call.loggers.items():
            self.loggers.setdefault(name, fn_name)

        if self.mode == "train":
            self.rounds.append(call.columns)

    def dynamic_sampling(self, rounds, *args, **kwargs):
        """advantage.dynamic_sampling, and extra_columns for the rows it keeps, in its
        order.

        Each round's rows go in as (round, index, row): the kept ones say where they
        came from.
        """
        assert len(rounds) == len(self.rounds), "a training score call per round"
        tagged = [([(r, i, row) for i, row in enumerate(rows)], *rest)
                  for r, (rows, *rest) in enumerate(rounds)]
        sampled = self._dynamic_sampling(tagged, *args, **kwargs)
        if sampled is None:
            return None

        (tags, *rest), metrics = sampled
        names = sorted(set().union(*self.rounds))
        # a column a round did not log: None for its rows, as TRL's is for a rank
        # that did not log it
        self.extra_columns = {c: [self.rounds[r][c][i] if c in self.rounds[r] else None
                                  for r, i, _ in tags]
                              for c in names}

        self.rounds = []
        return ([row for _, _, row in tags], *rest), metrics

    def evaluate(self):
        """train.py's evaluate, and what its reward logged: eval_NAME, as TRL logs
        evaluation's metrics."""
        self.mode = "eval"
        result = self._evaluate()
        self.mode = "train"

        result.update(self._means("eval", result, prefix="eval_"))
        return result

    def step_metrics(self, record):
        """The step's log_metric values, each the mean over its calls and the
        ranks -> {name: mean}, by the names given (as TRL's). A collective: call it
        on every rank."""
        return self._means("train", record)

    def _means(self, mode, record, prefix=""):
        """{prefix + name: mean} of mode's metrics over the ranks, then forgotten.
        Every rank reduces the names any rank logged, in one (sorted) order; a name
        among record's keys (train.py's own) stops the run."""
        metrics = self.metrics[mode]
        self.metrics[mode] = {}

        names = sorted(metrics)
        if ddp:
            every = [None] * world
            dist.all_gather_object(every, names)
            names = sorted(set().union(*every))
        if not names:
            return {}

        taken = [name for name in names if prefix + name in record]
        if taken:
            name = taken[0]
            who = "a reward function on another rank"
            if name in self.loggers:
                who = f"reward function {self.loggers[name]}"
            fail(f"{who} logged metric {name!r}, which is the name of one of train.py's "
                 f"own numbers ({prefix + name} in metrics.jsonl): rename it")

        # (names, 2): this rank's sum and count of each, then every rank's
        sums = [[sum(metrics.get(n, [])), len(metrics.get(n, []))] for n in names]
        sums = torch.tensor(sums, dtype=torch.float64)  # (names, 2)
        if ddp:
            sums = sums.to(collective_device())
            dist.all_reduce(sums)
            sums = sums.cpu()

        return {prefix + n: total / count
                for n, (total, count) in zip(names, sums.tolist())}


@functools.cache
def _event_loop():
    """The event loop the async functions run on: one for the process, on a daemon
    thread (as TRL's), so that an async client a function keeps stays on the loop it
    was made on."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="reward event loop",
                     daemon=True).start()
    return loop


def _gather(calls, timeout):
    """Await every (fn, name, keywords) of calls together on the event loop, for at
    most timeout seconds in all (None: forever) -> their values, in order.

    RuntimeError naming the first that raised or exited, or those still running at the
    timeout (then cancelled).
    """
    running = [name for _, name, _ in calls]

    async def one(fn, name, keywords):
        try:
            return await fn(**keywords), None
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            # SystemExit would stop the loop itself
            return None, e
        finally:
            running.remove(name)

    async def together():
        return await asyncio.gather(*(one(*c) for c in calls))

    future = asyncio.run_coroutine_threadsafe(together(), _event_loop())
    try:
        results = future.result(timeout)
    except concurrent.futures.TimeoutError:
        # named before the cancel ends them (or all, had they just ended)
        late = ", ".join(running) or ", ".join(name for _, name, _ in calls)
        future.cancel()
        raise RuntimeError(f"reward function {late} did not return within {timeout:g} s: "
                           f"make it faster, or raise --reward-timeout") from None

    for (_, name, _), (values, e) in zip(calls, results):
        if e is not None:
            raise RuntimeError(f"reward function {name} raised {type(e).__name__}: "
                               f"{e}") from e

    return [values for values, _ in results]
