"""TRL's reward-function extras (trl_compat/reward_extras.py): trainer_state,
log_metric, log_extra and `async def` rewards, written as TRL's docs write them.

In-process through reward.score with reward_extras' RewardLogs (the one path of
every reward), then end to end through train.py on 2 ranks (imported by dotted
path: test_reward_extras.NAME; tests/ is on PYTHONPATH). That a default run never
imports reward_extras is tests/test_fast.py's FEATURE_MODULES test; that a user's
**kw reward takes the built-ins' path, test_a_users_reward_takes_the_built_in_path.
"""
import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import reward
import task
import user_rewards
from helpers import ROOT, run_train
from rollout import Rollout
from trl_compat import reward_extras
from variants.dynamic_sampling import with_dynamic_sampling

# progress() -> (optimizer steps done, prompts drawn before the step): the step's
# first round is the 4 prompts after the first 12, of 48 training prompts
PROGRESS = dict(train_prompts=48, batch_prompts=4, max_steps=24)


# -----------------------------------------------------------------------------
# Reward functions in the forms of TRL's docs ("Using a custom reward function")

def curriculum_reward(completions, trainer_state, **kwargs):
    """Length matters more as training goes on."""
    progress = trainer_state.global_step / trainer_state.max_steps
    return [progress * len(c) for c in completions]


def boxed_reward(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """TRL's logging example: the boxed answer against the gold, the extracted
    answers as an extra column and the accuracy as a metric."""
    extracted = [c.split("\\boxed{")[-1].rstrip("}") if "\\boxed{" in c else None
                 for c in completions]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards


def plain_reward(prompts, completions, completion_ids, ground_truth):
    """Written before the extras: each keyword by name, no **kwargs, so it gets none
    (TRL would pass it all three, and it would raise)."""
    return [float(c == s) for c, s in zip(completions, ground_truth)]


async def judge(prompts, completions, log_metric, **kwargs):
    """An LLM judge's shape: slow I/O awaited; 1.0 for every completion."""
    await asyncio.sleep(0.01)
    log_metric("judge_calls", 1.0)
    return [1.0] * len(completions)


def progress_reward(completions, trainer_state, log_metric, **kwargs):
    """train.py's end-to-end probe: logs the trainer_state it got, values whose mean
    over the ranks weighs each value, not each rank (rank 0 logs one 0, rank 1 two
    1s: 2/3), and a metric only rank 1 logs. 0 for every completion."""
    log_metric("global_step", trainer_state.global_step)
    log_metric("epoch", trainer_state.epoch)
    log_metric("max_steps", trainer_state.max_steps)

    rank = int(os.environ.get("RANK", 0))
    for _ in range(rank + 1):
        log_metric("per_value", float(rank))
    if rank == 1:
        log_metric("rank_1_only", 1.0)

    return [0.0] * len(completions)


# -----------------------------------------------------------------------------
# In-process

def rollout_of(texts, G=1):
    """A Rollout of these completion texts, each prompt's G in a row."""
    N = len(texts)
    return Rollout(prompt_ids=[[1]] * N, completion_ids=torch.ones(N, 3, dtype=torch.long),
                   completion_mask=torch.ones(N, 3), sampling_logps=torch.zeros(N, 3),
                   is_finished=torch.ones(N, dtype=torch.bool), texts=list(texts))


def opened(progress=(6, 12)):
    """reward_extras.open_logs -> (training's RewardLogs, evaluation's); progress:
    what progress() gives, a list to change it."""
    return reward_extras.open_logs([], progress=lambda: tuple(progress), **PROGRESS)


def test_a_function_gets_the_extras_it_names_and_kw_gets_none():
    named = {fn: reward.extras_named(fn) for fn in (
        reward.final_number_reward, task.position_reward, user_rewards.users_position_reward,
        curriculum_reward, boxed_reward, plain_reward, judge, progress_reward,
        reward.get_soft_overlong_punishment(8, 2))}

    # ours and a user's alike: **kw gets none (reward.py, simplification 2)
    assert named[reward.final_number_reward] == ()
    assert named[task.position_reward] == ()
    assert named[user_rewards.users_position_reward] == ()
    assert [n for fn, n in named.items() if fn.__module__ == "reward"] == [()] * 2
    assert named[curriculum_reward] == ("trainer_state",)
    assert named[boxed_reward] == ("log_metric", "log_extra")
    assert named[plain_reward] == ()
    assert named[judge] == ("log_metric",)
    assert named[progress_reward] == ("trainer_state", "log_metric")
    assert [reward.is_async(fn) for fn in (judge, plain_reward)] == [True, False]
    assert reward.extras_named(len) == ()  # a signature inspect cannot read


def test_a_users_reward_takes_the_built_in_path(tmp_path):
    """A user's **kw reward beside a built-in one: train.py hands reward.score no
    RewardLogs, compute_rewards gets the functions themselves (no wrapper), and
    reward_extras is never imported: one scoring code for both."""
    report = tmp_path / "report.json"
    code = f"""
import json, runpy, sys
import reward
plain = reward.compute_rewards
calls = []
def spy(funcs, prompts, completions, timeout=None, extras=None, /, **columns):
    calls.append(dict(funcs=[f"{{f.__module__}}.{{f.__name__}}" for f in funcs],
                      extras=extras))
    return plain(funcs, prompts, completions, timeout, extras, **columns)
reward.compute_rewards = spy
sys.argv = ['train.py', '--steps', '1', '--eval-every', '0', '--eval-size', '8',
            '--engine', 'hf', '--out-dir', {str(tmp_path / 'out')!r}, '--rewards',
            'exact_match_reward', 'user_rewards.users_position_reward',
            '--eval-reward', 'user_rewards.users_position_reward']
runpy.run_path('train.py', run_name='__main__')
json.dump(dict(modules=sorted(sys.modules), calls=calls), open({str(report)!r}, 'w'))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "PYTHONPATH": f"{ROOT}:{os.path.join(ROOT, 'tests')}"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.load(open(report))

    assert "trl_compat.reward_extras" not in got["modules"]
    user = "user_rewards.users_position_reward"
    # the first evaluation, the step's round, the last evaluation (greedy, sampled)
    assert [c["funcs"] for c in got["calls"]] == [[user]] * 2 + [
        ["reward.exact_match_reward", user]] + [[user]] * 2
    assert all(c["extras"] is None for c in got["calls"])


def test_functions_get_trainer_state_and_their_logs_as_trl_passes_them():
    seen = {}

    def spy(completions, trainer_state, log_extra, **kwargs):
        seen.update(state=trainer_state, kwargs=sorted(kwargs))
        log_extra("length", [len(c) for c in completions])
        return [0.0] * len(completions)

    def kw_only(completions, **kwargs):
        seen.update(kw_only=sorted(kwargs))
        return [0.0] * len(completions)

    funcs = [curriculum_reward, boxed_reward, spy, plain_reward, kw_only]
    logs, _ = opened()
    rows = [{"prompt": "q", "ground_truth": "4"}] * 2
    rollout = rollout_of(["\\boxed{4}", "\\boxed{5}"])
    rewards = reward.score(funcs, rows, rollout, False, 5.0, logs)  # (2, 5)
    rows = logs.with_columns(rows)

    # 6 optimizer steps done; the 4 prompts scored were drawn after the first 12
    assert seen["state"] == reward_extras.TrainerState(global_step=6, epoch=12 / 48, max_steps=24)
    # the batch's columns, each once; no extra it did not name
    assert seen["kwargs"] == ["completion_ids", "ground_truth", "prompts"]
    assert seen["kw_only"] == ["completion_ids", "ground_truth", "prompts"]
    torch.testing.assert_close(rewards, torch.tensor([[2.25, 1.0, 0.0, 0.0, 0.0],
                                                      [2.25, 0.0, 0.0, 0.0, 0.0]]))
    assert logs.step_metrics({"reward_mean": 0.0}) == {"accuracy": 0.5}
    assert logs.columns_of(rows) == {"extracted_answer": ["4", "5"],
                                     "golden_answer": ["4", "4"], "length": [9, 9]}


def tagged_reward(completions, tag, informative, log_extra, log_metric, **kwargs):
    """The rows' own tags as an extra column; 0, 1 alternating in an informative
    group (G = 2), 0 elsewhere."""
    log_extra("tag", list(tag))
    log_metric("calls", len(completions))
    return [float(i % 2) if ok else 0.0 for i, ok in enumerate(informative)]


def test_extra_columns_follow_the_rows_dynamic_sampling_keeps():
    """Two rounds of 2 groups of 2: the first keeps its group 0, the second its
    group 1. The step's columns are the kept rows', in the kept order, and the
    metrics the mean over both calls. Each round's trainer_state counts the
    rounds before it."""
    epochs = []

    def epoch_reward(completions, trainer_state, **kwargs):
        epochs.append(trainer_state.epoch)
        return [0.0] * len(completions)

    def last_round_only(completions, trainer_state, log_extra, **kwargs):
        if trainer_state.epoch > 12 / 48:
            log_extra("late", ["x"] * len(completions))
        return [0.0] * len(completions)

    funcs = [tagged_reward, epoch_reward, last_round_only]
    progress = [6, 12]
    logs, _ = opened(progress)
    drawn = {}
    for name, informative in (("a", [True, False]), ("b", [False, True])):
        drawn[12 + 4 * len(drawn)] = [
            {"prompt": f"{name}{g}", "tag": f"{name}{g}.{i}", "informative": ok}
            for g, ok in enumerate(informative) for i in range(2)]

    def sample_and_score(consumed):
        """train.py's round: the rows drawn after consumed prompts, scored."""
        rows = drawn[consumed]
        rollout = rollout_of([r["tag"] for r in rows], G=2)
        rewards = reward.score(funcs, rows, rollout, False, 5.0, logs)
        return (logs.with_columns(rows), rollout, rewards), 4, {}

    sample = with_dynamic_sampling(sample_and_score, 2, 2, [1.0, 1.0, 1.0], 0,
                                   "sum_then_normalize")
    (rows, rollout, rewards), prompts, metrics = sample(12)

    assert metrics["ds_rounds"] == 2 and prompts == 8
    assert epochs == [12 / 48, 16 / 48]
    assert [r["tag"] for r in rows] == ["a0.0", "a0.1", "b1.0", "b1.1"]
    assert rollout.texts == [r["tag"] for r in rows]
    # a column a round did not log: None for its rows
    assert logs.columns_of(rows) == {"late": [None, None, "x", "x"],
                                     "tag": ["a0.0", "a0.1", "b1.0", "b1.1"]}
    assert logs.step_metrics({}) == {"calls": 4.0}

    # the next step starts empty
    assert logs.step_metrics({}) == {}
    progress[1] = 20
    rows = [{"prompt": "c0", "tag": "c0.0", "informative": True}] * 2
    reward.score([epoch_reward], rows, rollout_of(["c", "c"]), False, 5.0, logs)
    assert logs.columns_of(logs.with_columns(rows)) == {}
    assert epochs[-1] == 20 / 48


def test_evaluation_logs_eval_names_and_drops_its_columns():
    seen = []

    def eval_reward(completions, ground_truth, trainer_state, log_extra, log_metric, **kw):
        seen.append(trainer_state)
        return boxed_reward(completions, ground_truth, log_extra, log_metric)

    rows = [{"prompt": "q", "ground_truth": "4"}] * 2
    logs, eval_logs = opened(progress=(6, 16))
    reward.score([eval_reward], rows, rollout_of(["\\boxed{4}", "no"]), False, 5.0,
                 eval_logs)

    result = {"eval_greedy": 0.5}
    result.update(eval_logs.step_metrics(result))
    assert result == {"eval_greedy": 0.5, "eval_accuracy": 0.5}
    # after the 16 prompts drawn: none is being scored
    assert seen == [reward_extras.TrainerState(global_step=6, epoch=16 / 48, max_steps=24)]
    # its columns dropped; training's logs untouched
    assert eval_logs.columns == {} and logs.names == set()
    assert logs.step_metrics({}) == {} and eval_logs.step_metrics({}) == {}


def test_a_metric_named_like_a_record_key_stops_the_run(capsys):
    def logs_loss(completions, log_metric, **kwargs):
        log_metric("loss", 1.0)
        return [0.0] * len(completions)

    logs, _ = opened()
    reward.score([logs_loss], [{"prompt": "q"}], rollout_of(["a"]), False, 5.0, logs)

    with pytest.raises(SystemExit):
        logs.step_metrics({"step": 1, "loss": 0.5})
    assert capsys.readouterr().out == (
        "error: reward function logs_loss logged metric 'loss', which is the name of one of "
        "train.py's own numbers (loss in metrics.jsonl): rename it\n")


@pytest.mark.parametrize("call, line", [
    (lambda m, e: m("verdict", "good"),
     "reward function bad logged metric 'verdict' = 'good': log_metric takes a finite real "
     "number"),
    (lambda m, e: m("accuracy", math.nan),
     "reward function bad logged metric 'accuracy' = nan: log_metric takes a finite real number"),
    (lambda m, e: m("accuracy", torch.ones(2, 3)),
     "reward function bad logged metric 'accuracy' = tensor([[1., 1., 1.], [1., 1., 1.]]): "
     "log_metric takes a finite real number"),
    (lambda m, e: m("eval_accuracy", 1.0),
     "reward function bad logged metric 'eval_accuracy': eval_ is the prefix of evaluation's "
     "metrics (one logged while evaluating is recorded as eval_NAME); rename it"),
    (lambda m, e: m("", 1.0),
     "reward function bad logged a metric named '': name it with a non-empty string"),
    (lambda m, e: e("verdicts", ["ok"]),
     "reward function bad logged extra column 'verdicts' with 1 values: log_extra takes a list "
     "of 2 (one per completion)"),
    (lambda m, e: [e("c", [1, 2]), e("c", [3, 4])],
     "reward function bad logged extra column 'c' twice in a batch (or after another "
     "function): one list per column"),
], ids=["word", "nan", "tensor", "eval_", "no name", "column count", "column twice"])
def test_a_bad_log_call_stops_the_run_in_one_line_naming_the_function(call, line, capsys):
    def bad(completions, log_metric, log_extra, **kwargs):
        try:
            call(log_metric, log_extra)
        except Exception:  # caught or not: the run stops after the batch
            pass
        return [0.0] * len(completions)

    logs, _ = opened()
    with pytest.raises(SystemExit):
        reward.score([bad], [{"prompt": "q"}] * 2, rollout_of(["a", "b"]), False, 5.0, logs)
    assert capsys.readouterr().out == f"error (rank 0): {line}\n"


def sleeper(name, seconds, value):
    async def sleeper(prompts, completions, **kwargs):
        await asyncio.sleep(seconds)
        return [value] * len(completions)

    sleeper.__name__ = name
    return sleeper


def test_async_functions_run_together_and_keep_their_columns():
    """Two that each sleep 1 s take about 1 s, not 2; the sync one between them
    keeps its column. (1 s each: the first call's event loop and threads cost
    up to ~0.6 s on a loaded 2-core machine, still well apart from 2 s.)"""
    funcs = [sleeper("judge_a", 1.0, 1.0), plain_reward, sleeper("judge_b", 1.0, 2.0), judge]
    logs, _ = opened()

    t0 = time.perf_counter()
    rewards = reward.score(funcs, [{"prompt": "q", "ground_truth": "1"}], rollout_of(["1"]),
                           False, 10.0, logs)  # (1, 4)
    seconds = time.perf_counter() - t0

    assert seconds < 1.8, f"{seconds:.2f} s: the async rewards ran one after the other"
    torch.testing.assert_close(rewards, torch.tensor([[1.0, 1.0, 2.0, 1.0]]))
    assert logs.step_metrics({}) == {"judge_calls": 1.0}


def test_async_time_limit_and_errors_name_the_function(capsys):
    quick, slow = sleeper("quick_judge", 0.0, 1.0), sleeper("slow_judge", 30.0, 1.0)

    async def broken_judge(completions, **kwargs):
        raise KeyError("no column 'answer'")

    async def exiting_judge(completions, **kwargs):
        raise SystemExit(0)

    async def wrong_count(completions, **kwargs):
        return [1.0, 2.0]

    t0 = time.perf_counter()
    for funcs, line in [
        ([quick, slow], "reward function slow_judge did not return within 0.3 s: make it "
                        "faster, or raise --reward-timeout"),
        ([quick, broken_judge], "reward function broken_judge raised KeyError: \"no column "
                                "'answer'\""),
        ([exiting_judge], "reward function exiting_judge raised SystemExit: 0"),
        ([wrong_count], "reward function wrong_count must return a list of 1 floats or None "
                        "(one per completion), returned 2 values"),
    ]:
        with pytest.raises(SystemExit):
            reward.score(funcs, [{"prompt": "q"}], rollout_of(["a"]), False, 0.3)
        assert capsys.readouterr().out == f"error (rank 0): {line}\n"
    assert time.perf_counter() - t0 < 2.0

    # the event loop survived them; no RewardLogs needed for an async function
    assert reward.score([quick], [{"prompt": "q"}], rollout_of(["a"]), False,
                        5.0).tolist() == [[1.0]]
    assert [t.name for t in threading.enumerate()].count("reward event loop") == 1


# -----------------------------------------------------------------------------
# End to end: train.py on 2 ranks, 2 steps of 2 rounds (every group has zero
# spread, so --dynamic-sampling 2 draws both) and 2 optimizer steps each

def test_logged_metrics_reach_metrics_jsonl_averaged_over_calls_and_ranks(tmp_path):
    args = ["--engine", "hf", "--steps", 2, "--prompts-per-step", 4, "--G", 2,
            "--minibatch-size", 2, "--dynamic-sampling", 2, "--eval-every", 2,
            "--eval-size", 8, "--rewards", "test_reward_extras.progress_reward",
            "test_reward_extras.judge", "--eval-reward", "test_reward_extras.progress_reward"]
    _, _, records = run_train(args, tmp_path / "out", nproc=2)
    first, steps = records[0], records[1:]

    assert [r["ds_rounds"] for r in steps] == [2, 2]
    # optimizer steps: 2 a step
    assert [r["global_step"] for r in steps] == [0, 2]
    assert {r["max_steps"] for r in steps} == {4}
    # epoch: the prompts drawn before each round / the train prompts, averaged over
    # the step's two rounds: (0 + 4) / 2, then (8 + 12) / 2, in units of 1 / train prompts
    unit = steps[0]["epoch"] / 2
    assert unit > 0
    assert steps[1]["epoch"] == pytest.approx(10 * unit)
    for r in steps:
        assert r["per_value"] == pytest.approx(2 / 3)
        assert r["rank_1_only"] == 1.0
        # the async judge's metric, and its rewards
        assert r["judge_calls"] == 1.0 and r["reward/judge"] == 1.0

    # the evaluations' as eval_NAME, with the state after the steps before
    assert first["eval_global_step"] == 0 and first["eval_epoch"] == 0
    assert steps[1]["eval_global_step"] == 4 and steps[1]["eval_epoch"] == pytest.approx(16 * unit)
    assert steps[1]["eval_per_value"] == pytest.approx(2 / 3)
    assert "eval_judge_calls" not in steps[1] and "eval_global_step" not in steps[0]
