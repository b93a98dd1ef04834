"""
TRL's reward-function extras: trainer_state, log_metric, log_extra; the event loop
that awaits `async def` rewards.

TRL 1.16 (GRPOTrainer._calculate_rewards) calls a reward function with three keywords
beyond the batch's columns (reward.EXTRAS):
- trainer_state: how far training is, for a curriculum (TrainerState: global_step, epoch,
  max_steps);
- log_metric(name, value): a number for the step's record in metrics.jsonl, the mean of
  the step's values over its calls and the ranks (TRL's _pending_metrics); eval_NAME while
  evaluating, as TRL's log names them;
- log_extra(column, values): one value per completion, for the completions log (TRL's
  _pending_extra_logs);
and it awaits the `async def` ones together on one event loop (asyncio.gather), after the
sync ones.

Rewards take one path, built-in or not: reward.score. A function gets the extras it
names (reward.extras_named; reward.py's simplification 2). train.py makes a training
and an evaluation RewardLogs (open_logs) only when some function names one, and passes
them to reward.score, which asks begin() for each function's keywords and end() for the
verdict on its log calls. A run whose functions name none never imports this file;
reward.compute_rewards imports await_together for an `async def` function.

The extra columns go with the rows they describe (with_columns: each row holds its
values under COLUMNS), so that the rows dynamic sampling keeps bring theirs; columns_of
reads them back for the completions log.

Run: python train.py --rewards my_module.my_reward ...   (my_reward takes log_metric, say)
Tests: python -m pytest -q tests/test_reward_extras.py

Simplifications:
1. trainer_state holds 3 of transformers' TrainerState fields. global_step counts
   optimizer steps done, as there (a GRPO step takes --num-iterations x minibatches of
   them), and max_steps the run's; epoch is the training prompts drawn before the batch
   over their number (fractional).
2. A log call that is refused does not raise in the function: it returns, and the run
   stops once the batch is scored, with one line that names the function.
3. The extra columns logged while evaluating are checked, then dropped: the completions
   log is the training steps'.
"""
import asyncio
import concurrent.futures
import dataclasses
import functools
import math
import numbers
import threading

import torch
import torch.distributed as dist

from common import collective_device, ddp, fail, world
from reward import extras_named

# the row key under which a row holds its completion's log_extra values
COLUMNS = "log_extra"


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What a reward function gets as trainer_state: the fields of TRL's (a
    transformers TrainerState) that say how far training is. global_step /
    max_steps is the progress."""
    global_step: int
    epoch: float
    max_steps: int


def open_logs(step_loggers, *, progress, train_prompts, batch_prompts, max_steps):
    """Once at set-up -> (training's RewardLogs, evaluation's). Training's
    log_metric values join each step's record: the mean over the step's calls and
    the ranks (a collective), by the name given, as TRL's (a step logger).

    progress() -> (optimizer steps done, prompts drawn before the step's first round)
    when called; train_prompts: their number; batch_prompts: a round's
    (--prompts-per-step); max_steps: the run's optimizer steps.
    """
    shared = dict(progress=progress, train_prompts=train_prompts,
                  batch_prompts=batch_prompts, max_steps=max_steps)
    training = RewardLogs(evaluating=False, **shared)
    step_loggers.append(lambda step, record, *_: record.update(training.step_metrics(record)))
    return training, RewardLogs(evaluating=True, **shared)


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
        """The reward.EXTRAS a function names -> their values for this batch."""
        every = dict(trainer_state=state,
                     log_metric=functools.partial(self.log_metric, fn_name),
                     log_extra=functools.partial(self.log_extra, fn_name))
        return {k: every[k] for k in keywords}


class RewardLogs:
    """What the reward functions logged, training's or evaluation's (open_logs).

    reward.score calls begin(funcs, N) for each function's extras, then end() once
    they returned. step_metrics gives the step's log_metric means; with_columns and
    columns_of carry training's log_extra columns with their rows.
    """

    def __init__(self, *, evaluating, progress, train_prompts, batch_prompts, max_steps):
        self.evaluating = evaluating
        self.progress = progress
        self.train_prompts = train_prompts
        self.batch_prompts = batch_prompts
        self.max_steps = max_steps

        self.call = None  # the batch being scored
        self.metrics = {}  # {name: [values]}, until the record takes them
        self.loggers = {}  # {name: the function that logged it first}
        # training: the step (prompts drawn before its first round), its rounds scored
        # so far, the columns they logged, and the last round's {column: N values}
        self.step = None
        self.rounds = 0
        self.names = set()
        self.columns = {}

    def trainer_state(self):
        """TRL's trainer_state now. Training: the round being scored was drawn after
        the step's earlier rounds; evaluating: after the steps before."""
        opt_step, consumed = self.progress()
        if not self.evaluating:
            if consumed != self.step:  # the step's first round
                self.step, self.rounds, self.names = consumed, 0, set()
            consumed += self.rounds * self.batch_prompts

        return TrainerState(global_step=opt_step, epoch=consumed / self.train_prompts,
                            max_steps=self.max_steps)

    def begin(self, funcs, N):
        """A batch of N completions is about to be scored -> each function's
        keywords: {extra: value} of the reward.EXTRAS it names."""
        self.call = Call(N)
        state = self.trainer_state()
        return [self.call.extras(_name(fn), state, extras_named(fn)) for fn in funcs]

    def end(self):
        """The batch is scored: RuntimeError on the first log call refused, else its
        metrics kept for the record and (training) its columns for with_columns."""
        call, self.call = self.call, None
        if call.problem:
            raise RuntimeError(call.problem)

        for name, values in call.metrics.items():
            self.metrics.setdefault(name, []).extend(values)
        for name, fn_name in call.loggers.items():
            self.loggers.setdefault(name, fn_name)
        if not self.evaluating:
            self.rounds += 1
            self.names.update(call.columns)
            self.columns = call.columns

    def with_columns(self, rows):
        """The rows just scored, each a copy that holds its completion's log_extra
        values under COLUMNS: they go wherever the row goes (dynamic sampling)."""
        return [{**row, COLUMNS: {c: values[i] for c, values in self.columns.items()}}
                for i, row in enumerate(rows)]

    def columns_of(self, rows):
        """The step's extra columns for these rows (with_columns'), in their order:
        {column: one value per row}. A column their round did not log: None for
        them, as TRL's is for a rank that did not log it."""
        return {c: [row[COLUMNS].get(c) for row in rows] for c in sorted(self.names)}

    def step_metrics(self, record):
        """The step's log_metric values, each the mean over its calls and the
        ranks -> {name: mean}, by the names given (as TRL's; eval_NAME while
        evaluating). A name among record's keys (train.py's own) stops the run. A
        collective: call it on every rank."""
        metrics = self.metrics
        self.metrics = {}
        prefix = "eval_" if self.evaluating else ""

        # every rank reduces the names any rank logged, in one (sorted) order
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


def await_together(calls, timeout):
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
