"""Reward functions as TRL calls them (reward.py): trainer_state, log_metric,
log_extra and `async def` functions, written as TRL's docs write them.

In-process through compute_rewards and score, then end to end through train.py
(imported by dotted path: test_reward_extras.NAME; tests/ is on PYTHONPATH).
"""
import asyncio
import math
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from helpers import run_train
from reward import (
    RewardLogs,
    TrainerState,
    accuracy_reward,
    compute_rewards,
    logged_metrics,
    score,
)

STATE = TrainerState(global_step=6, epoch=0.25, max_steps=24)


# -----------------------------------------------------------------------------
# Reward functions in the forms of TRL's docs

def curriculum_reward(completions, trainer_state, log_metric, **kwargs):
    """Length matters more as training goes on; logs how far it is."""
    progress = trainer_state.global_step / trainer_state.max_steps
    log_metric("progress", progress)
    return [progress * len(c) for c in completions]


def boxed_reward(completions, ground_truth, log_extra=None, log_metric=None, **kwargs):
    """TRL's logging example: the boxed answer against the gold, with the
    extracted answers as an extra column and the accuracy as a metric."""
    extracted = [c.split("\\boxed{")[-1].rstrip("}") if "\\boxed{" in c else None
                 for c in completions]
    rewards = [1.0 if e == gt else 0.0 for e, gt in zip(extracted, ground_truth)]

    if log_extra:
        log_extra("golden_answer", list(ground_truth))
        log_extra("extracted_answer", [e or "[none]" for e in extracted])
    if log_metric:
        log_metric("accuracy", sum(rewards) / len(rewards))

    return rewards


def plain_reward(prompts, completions, solution):
    """Written before these keywords: each column by name, no **kwargs, so it
    gets none of them."""
    return [float(c == s) for c, s in zip(completions, solution)]


async def judge(prompts, completions, **kwargs):
    """An LLM judge's shape: slow I/O awaited; 1.0 for a non-empty completion."""
    await asyncio.sleep(0.01)
    kwargs["log_metric"]("judge_calls", 1.0)
    return [1.0 if c else 0.0 for c in completions]


def progress_reward(completions, trainer_state, log_metric, **kwargs):
    """train.py's end-to-end probe: logs the trainer_state it got, and values
    whose mean over the ranks weighs each value, not each rank (rank 0 logs one
    0, rank 1 two 1s: 2/3), and a metric only rank 1 logs."""
    log_metric("global_step", trainer_state.global_step)
    log_metric("epoch", trainer_state.epoch)
    log_metric("max_steps", trainer_state.max_steps)

    rank = int(os.environ.get("RANK", 0))
    for _ in range(rank + 1):
        log_metric("per_value", float(rank))
    if rank == 1:
        log_metric("rank_1_only", 1.0)

    return [0.0] * len(completions)


def logs_a_word(completions, log_metric, **kwargs):
    """Logs a string where a number goes."""
    log_metric("verdict", "good")
    return [0.0] * len(completions)


# -----------------------------------------------------------------------------
# In-process

def test_functions_get_trainer_state_and_their_logs_as_trl_passes_them():
    seen = {}

    def spy(completions, trainer_state, log_metric, log_extra, **kwargs):
        seen.update(state=trainer_state, kwargs=sorted(kwargs))
        log_extra("length", [len(c) for c in completions])
        return [0.0] * len(completions)

    logs = RewardLogs()
    funcs = [curriculum_reward, boxed_reward, spy]
    rewards = compute_rewards(funcs, ["q", "q"], ["\\boxed{4}", "\\boxed{5}"], 5.0, logs,
                              STATE, ground_truth=["4", "4"])  # (2, 3)

    assert seen["state"] is STATE
    # the batch's columns, no trainer_state or logger twice
    assert seen["kwargs"] == ["ground_truth", "prompts"]
    torch.testing.assert_close(rewards, torch.tensor([[2.25, 1.0, 0.0], [2.25, 0.0, 0.0]]))
    assert logs.metrics == {"progress": [0.25], "accuracy": [0.5]}
    assert logs.extras == {"golden_answer": ["4", "4"], "extracted_answer": ["4", "5"],
                           "length": [9, 9]}


def test_a_function_without_the_keywords_keeps_working():
    """plain_reward would raise TypeError on trainer_state=...; accuracy_reward
    takes **kw and ignores them."""
    logs = RewardLogs()
    rewards = compute_rewards([plain_reward, accuracy_reward], ["q", "q"], ["1", "2"], 5.0,
                              logs, STATE, solution=["1", "1"])  # (2, 2)

    torch.testing.assert_close(rewards, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    assert logs.metrics == {} and logs.extras == {}


def _fake_rollout(texts):
    """What score reads of a rollout: N texts, their ids and masks."""
    ids = torch.ones(len(texts), 3, dtype=torch.long)  # (N, T)
    return SimpleNamespace(texts=texts, completion_ids=ids,
                           completion_mask=torch.ones(len(texts), 3))  # (N, T)


def test_score_gives_back_the_logged_extras_and_metrics_of_every_call():
    """Two calls in a step (two --dynamic-sampling rounds): the metrics are averaged
    over the calls, the extras follow the completions."""
    logs = RewardLogs()
    for texts in (["\\boxed{4}", "no"], ["\\boxed{4}", "\\boxed{4}"]):
        rows = [{"prompt": "q", "ground_truth": "4"}] * 2
        score([boxed_reward], rows, _fake_rollout(texts), False, 5.0, STATE, logs)

    assert logs.extras["extracted_answer"] == ["4", "[none]", "4", "4"]
    assert logs.extras["golden_answer"] == ["4"] * 4
    assert logged_metrics(logs, {"reward_mean": 0.0}) == {"accuracy": 0.75}
    assert logged_metrics(logs, {}, prefix="eval_") == {"eval_accuracy": 0.75}


def test_a_metric_named_like_a_record_key_stops_the_run(capsys):
    logs = RewardLogs()
    logs.log_metric_for("my_reward")("loss", 1.0)

    with pytest.raises(SystemExit):
        logged_metrics(logs, {"step": 1, "loss": 0.5})
    assert capsys.readouterr().out.strip() == (
        "error: reward function my_reward logged metric 'loss', which is the name of one "
        "of train.py's own numbers (loss in metrics.jsonl): rename it")


@pytest.mark.parametrize("name, value, match", [
    ("verdict", "good", r"^reward function bad logged metric 'verdict' = 'good': log_metric "
                        r"takes a finite real number$"),
    ("accuracy", math.nan, r"^reward function bad logged metric 'accuracy' = nan"),
    ("accuracy", torch.ones(2), r"^reward function bad logged metric 'accuracy' = tensor"),
    ("eval_accuracy", 1.0, r"^reward function bad logged metric 'eval_accuracy': eval_ is"),
    ("", 1.0, r"^reward function bad logged a metric named '': name it"),
])
def test_a_bad_log_metric_fails_in_one_line_naming_function_and_metric(name, value, match):
    def bad(completions, log_metric, **kwargs):
        log_metric(name, value)
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match=match) as error:
        compute_rewards([bad], ["q"], ["a"], 5.0)
    assert "\n" not in str(error.value)


def test_a_refused_call_the_function_catches_still_fails():
    def careless(completions, log_metric, log_extra, **kwargs):
        try:
            log_extra("verdicts", ["ok"])
        except ValueError:
            pass
        return [0.0] * len(completions)

    match = (r"^reward function careless logged extra column 'verdicts' with 1 values: "
             r"log_extra takes a list of 2 \(one per completion\)$")
    with pytest.raises(ValueError, match=match):
        compute_rewards([careless], ["q", "q"], ["a", "b"], 5.0)


def _sleeper(name, seconds, value):
    async def sleeper(prompts, completions, **kwargs):
        await asyncio.sleep(seconds)
        return [value] * len(completions)

    sleeper.__name__ = name
    return sleeper


def test_async_functions_run_together_and_keep_their_columns():
    """Two that each sleep 1 s take about 1 s, not 2; the sync one between them
    keeps its column."""
    funcs = [_sleeper("judge_a", 1.0, 1.0), plain_reward, _sleeper("judge_b", 1.0, 2.0)]

    t0 = time.perf_counter()
    rewards = compute_rewards(funcs, ["q"], ["1"], 10.0, None, STATE, solution=["1"])  # (1, 3)
    seconds = time.perf_counter() - t0

    assert seconds < 1.8, f"{seconds:.2f} s: the async rewards ran one after the other"
    torch.testing.assert_close(rewards, torch.tensor([[1.0, 1.0, 2.0]]))
    # TRL's own form, through score
    rows = [{"prompt": "q"}] * 2
    assert score([judge], rows, _fake_rollout(["a", ""]), False, 5.0).tolist() == [[1.0], [0.0]]


def test_async_time_limit_and_errors_name_the_function():
    funcs = [_sleeper("quick_judge", 0.0, 1.0), _sleeper("slow_judge", 30.0, 1.0)]

    t0 = time.perf_counter()
    match = (r"^reward function slow_judge did not return within 0.3 s: make it faster, or "
             r"raise --reward-timeout$")
    with pytest.raises(RuntimeError, match=match):
        compute_rewards(funcs, ["q"], ["a"], 0.3)
    assert time.perf_counter() - t0 < 2.0

    async def broken_judge(completions, **kwargs):
        raise KeyError("no column 'answer'")

    with pytest.raises(RuntimeError, match=r"^reward function broken_judge raised KeyError"):
        compute_rewards([funcs[0], broken_judge], ["q"], ["a"], 5.0)

    async def exiting_judge(completions, **kwargs):
        raise SystemExit(0)

    with pytest.raises(RuntimeError, match="reward function exiting_judge raised SystemExit"):
        compute_rewards([exiting_judge], ["q"], ["a"], 5.0)
    # the event loop survived both
    torch.testing.assert_close(compute_rewards(funcs[:1], ["q"], ["a"], 5.0),
                               torch.tensor([[1.0]]))
    assert any(t.name == "reward event loop" for t in threading.enumerate())


# -----------------------------------------------------------------------------
# End to end: train.py on 2 ranks, 3 steps of 2 optimizer steps each
STEPS = 3
ARGS = ["--engine", "hf", "--steps", STEPS, "--prompts-per-step", 4, "--G", 4,
        "--minibatch-size", 4, "--eval-every", STEPS, "--eval-size", 8,
        "--rewards", "test_reward_extras.progress_reward", "test_reward_extras.judge",
        "--eval-reward", "test_reward_extras.progress_reward"]


def test_logged_metrics_reach_metrics_jsonl_averaged_over_calls_and_ranks(tmp_path):
    _, _, records = run_train(ARGS, tmp_path / "out", nproc=2)
    first, steps = records[0], records[1:]
    assert [r["step"] for r in steps] == [1, 2, 3]

    # max_steps and global_step count optimizer steps: 2 a step here
    assert {r["max_steps"] for r in steps} == {2 * STEPS}
    assert [r["global_step"] for r in steps] == [0, 2, 4]
    # epoch: the prompts drawn before the batch / the train prompts
    epoch = steps[1]["epoch"]
    assert epoch > 0
    assert [r["epoch"] for r in steps] == pytest.approx([0, epoch, 2 * epoch])

    for r in steps:
        assert r["per_value"] == pytest.approx(2 / 3)
        assert r["rank_1_only"] == 1.0
        assert r["judge_calls"] == 1.0
        # the async judge scored the batch (1.0 a non-empty completion)
        assert 0 < r["reward/judge"] <= 1

    # the evaluations' under eval_, with the state after the steps before
    assert first["eval_global_step"] == 0 and first["eval_epoch"] == 0
    assert steps[-1]["eval_global_step"] == 2 * STEPS
    assert steps[-1]["eval_epoch"] == pytest.approx(STEPS * epoch)
    assert steps[-1]["eval_per_value"] == pytest.approx(2 / 3)
    assert "eval_judge_calls" not in steps[-1]


def test_a_non_number_logged_ends_the_run_in_one_line(tmp_path):
    args = ["--engine", "hf", "--steps", 1, "--eval-size", 8,
            "--rewards", "test_reward_extras.logs_a_word"]
    rc, out, _ = run_train(args, tmp_path / "out", check=False, timeout=120)

    assert rc != 0, out[-2000:]
    line = ("error (rank 0): reward function logs_a_word logged metric 'verdict' = 'good': "
            "log_metric takes a finite real number")
    assert line in out.splitlines(), out[-2000:]
    assert "Traceback" not in out, out[-3000:]
