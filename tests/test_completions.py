"""--log-completions: completions.jsonl, the console's table, the viewer.

- step_rows: a step's rows from a hand-made rollout (None rewards as null, the
  weighted total, truncation, log_extra columns; a column named as a field refused).
- open_log: a resume cuts the file back to its step (torn lines too); a new run empties it.
- log: one JSON line per row, the table above the bar, the tracker's table.
- The viewer (`python -m runlog.completions show`), piped: steps, filters, one-line errors.
- train.py on 2 ranks: every rank's completions, their rewards the record's.
- kill -9 after a checkpoint, then resume: each step once, whole, and the metrics
  of a run without the flag (logging draws from no RNG of the run's).
"""
import glob
import io
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import checkpoint
from runlog import completions
import config
from helpers import ROOT, assert_close_rel, fp32_tol, run_train, without_timings
from rollout import Rollout
from test_resume import ARGS as RESUME_ARGS
from test_resume import start_and_kill

NAMES = ["exact", "format"]


def a_rollout(texts, finished):
    N = len(texts)
    return Rollout(prompt_ids=[[1]] * N, completion_ids=torch.zeros(N, 3, dtype=torch.long),
                   completion_mask=torch.ones(N, 3), sampling_logps=torch.zeros(N, 3),
                   is_finished=torch.tensor(finished), texts=texts)


def some_rows(step=1, extra_columns=None):
    """4 completions of 2 prompts (a string and a conversation), G = 2."""
    rows = [{"prompt": "2+2?"}] * 2 + [{"prompt": [{"role": "user", "content": "3+3?"}]}] * 2
    rollout = a_rollout(["4", "5\nfive", "6", ""], [True, False, True, True])
    nan = float("nan")
    rewards = torch.tensor([[1.0, 0.5], [0.0, nan], [1.0, 1.0], [nan, nan]])  # (N, F)
    advantages = torch.tensor([0.7, -0.7, 0.0, 0.0])  # (N,)
    lengths = torch.tensor([2.0, 3.0, 2.0, 1.0])  # (N,)
    return completions.step_rows(step, rows, rollout, rewards, advantages, lengths,
                                 [1.0, 0.1], NAMES, extra_columns)


def test_step_rows():
    logs = SimpleNamespace(extra_columns={"source": ["a", "b", "c", "d"]})  # reward_extras'
    rows = some_rows(step=7, extra_columns=logs.extra_columns)

    assert [r["step"] for r in rows] == [7] * 4
    assert [r["prompt"] for r in rows] == ["2+2?", "2+2?", "user: 3+3?", "user: 3+3?"]
    assert [r["completion"] for r in rows] == ["4", "5\nfive", "6", ""]
    # weighted (1, 0.1), None left out; all None: null
    assert rows[0]["reward"] == pytest.approx(1.05) and rows[1]["reward"] == 0.0
    assert rows[3]["reward"] is None
    assert rows[1]["reward/exact"] == 0.0 and rows[1]["reward/format"] is None
    assert [r["advantage"] for r in rows] == pytest.approx([0.7, -0.7, 0.0, 0.0])
    assert [r["length"] for r in rows] == [2, 3, 2, 1]
    assert [r["truncated"] for r in rows] == [False, True, False, False]
    assert [r["source"] for r in rows] == ["a", "b", "c", "d"]
    # strict JSON: no NaN
    json.loads(json.dumps(rows), parse_constant=lambda c: pytest.fail(c))


def test_a_log_extra_column_named_as_a_field_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        some_rows(extra_columns={"advantage": [0] * 4})
    out = capsys.readouterr().out
    assert e.value.code == 2
    assert "log_extra column 'advantage', a field of completions.jsonl's own" in out, out


def write_steps(path, steps, torn=False):
    with open(path, "w") as f:
        for s in steps:
            for r in some_rows(step=s):
                f.write(json.dumps(r) + "\n")
        if torn:
            f.write('{"step": 9, "prompt": "cut sho')


def steps_in(path):
    return [json.loads(line)["step"] for line in open(path)]


def test_a_resume_cuts_the_file_back_to_its_step(tmp_path):
    path = tmp_path / completions.FILE
    write_steps(path, [1, 2, 3, 4], torn=True)
    said = []

    f = completions.open_log(tmp_path, 2, log=said.append)
    assert steps_in(path) == [1] * 4 + [2] * 4
    assert "dropped 8 later record(s) and 1 torn line(s)" in said[0], said
    # and it appends after them
    f.write(json.dumps({"step": 3}) + "\n")
    f.close()
    assert steps_in(path)[-1] == 3

    # a new run (keep_until None) starts empty
    completions.open_log(tmp_path, None).close()
    assert steps_in(path) == []

    # no file on a resume (the flag was off): empty, without a warning
    os.remove(path)
    completions.open_log(tmp_path, 5, log=said.append).close()
    assert steps_in(path) == [] and len(said) == 1


class Reporter:
    def __init__(self):
        self.calls = []

    def log_completions(self, rows, step):
        self.calls.append((rows, step))


def test_log_writes_prints_and_reports(capsys):
    rows = some_rows(step=3)
    f = io.StringIO()
    reporter = Reporter()

    completions.log(f, 3, rows, reporter)

    assert [json.loads(line) for line in f.getvalue().splitlines()] == rows
    assert reporter.calls == [(rows, 3)]
    out = capsys.readouterr().out
    assert f"completions of step 3 ({completions.PRINTED} of 4" in out, out
    # a reporter without tables (tensorboard-less dashboards): nothing asked of it
    completions.log(io.StringIO(), 3, rows, SimpleNamespace())


def test_the_table_is_a_few_rows_on_one_line_each():
    rows = some_rows(step=3, extra_columns={"source": ["a\nb", "b", "c", "d"]}) * 5  # 20
    text = completions.table(rows, step=3, k=3)

    lines = text.splitlines()
    assert lines[0] == f"completions of step 3 (3 of 20; all in {completions.FILE}):"
    # log_extra's columns last, as TRL's table
    assert lines[1].split() == ["prompt", "completion", "reward", "exact", "format",
                                "advantage", "source"]
    assert len(lines) == 5
    # a newline stays visible, on the row's one line
    assert all("\n" not in line for line in lines)
    # the same picks for the same step; the run's RNGs untouched
    state = torch.random.get_rng_state()
    assert completions.table(rows, step=3, k=3) == text
    assert completions.table(rows, step=4, k=3) != text
    assert torch.equal(torch.random.get_rng_state(), state)


def test_one_line():
    assert completions.one_line("5\nfive") == '"5\\nfive"'
    assert completions.one_line("") == '""'
    cut = completions.one_line("a" * 20 + "b" * 20, width=11)
    assert cut == '"aaaa...bbbb"'


def show(*argv):
    """`python -m runlog.completions show ...`, piped (not a TTY) -> (exit code, stdout, stderr)."""
    proc = subprocess.run([sys.executable, "-m", "runlog.completions", "show", *map(str, argv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_viewer(tmp_path):
    write_steps(tmp_path / completions.FILE, [2, 4], torn=True)

    code, out, err = show(tmp_path)
    assert code == 0, err
    assert "=== step 2: 4 of 4 completions ===" in out and "=== step 4:" in out
    assert "prompt:\n    user: 3+3?" in out
    # the full text, line by line
    assert "      5\n      five\n" in out
    assert ("[1] reward 0.00 (exact 0.00, format -), advantage -0.700, length 3, "
            "truncated") in out
    assert "(1 torn line(s) skipped" in out

    code, out, _ = show(tmp_path, "--last", "--min-reward", "1")
    assert "step 2" not in out and "=== step 4: 2 of 4 completions ===" in out
    assert "[0] reward 1.05" in out and "[2] reward 1.10" in out and "[1]" not in out

    code, out, _ = show(tmp_path, "--step", 2, "--truncated")
    assert "=== step 2: 1 of 4 completions ===" in out and "[1] " in out and "[0] " not in out

    code, out, _ = show(tmp_path, "--max-reward", "-1")
    assert code == 0 and out.startswith("no completion passes the filters")


@pytest.mark.parametrize("case,expected", [
    ("no folder", "is not a folder: give a run's --out-dir"),
    ("no file", "completions.jsonl does not exist: run train.py with --log-completions N"),
    ("no such step", "no step 3 in "),
])
def test_viewer_errors(case, expected, tmp_path):
    argv = [tmp_path / "nowhere"]
    if case == "no such step":
        write_steps(tmp_path / completions.FILE, [1, 2, 4])
        argv = [tmp_path, "--step", 3]
    elif case == "no file":
        argv = [tmp_path]

    code, out, err = show(*argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and expected in err, err
    if case == "no such step":
        assert "(logged: 1-2, 4)" in err


def test_flags(capsys):
    args = config.fill_defaults(config.parse_args(["--log-completions", "5", "--steps", "2"]))
    with pytest.raises(SystemExit):
        config.check_flags(args)
    assert "--log-completions 5 logs one step in 5, and the run has --steps 2" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit):
        config.parse_args(["--log-completions", "-1"])
    assert "argument --log-completions: must be >= 0, got -1" in capsys.readouterr().out

    # a logging flag: a resume may turn it on or off
    assert "log_completions" not in checkpoint.run_config(args, 1)


def by_step(out_dir):
    rows = {}
    for line in open(os.path.join(out_dir, completions.FILE)):
        r = json.loads(line)
        rows.setdefault(r["step"], []).append(r)
    return rows


def char_count(completions, log_extra, log_metric, **kwargs):
    """A reward as TRL's docs write one that logs: a column per completion
    (log_extra) and a number for the step (log_metric). 0 for every completion."""
    chars = [len(c) for c in completions]
    log_extra("chars", chars)
    log_metric("chars_mean", sum(chars) / len(chars))
    return [0.0] * len(completions)


def test_two_ranks(tmp_path):
    """Every rank's completions, in rank order; their rewards are the record's;
    a reward's log_extra column is in the file, its log_metric in the record."""
    rewards = ["exact_match_reward", "task.position_reward", "test_completions.char_count"]
    _, out, records = run_train(["--engine", "hf", "--steps", "2", "--eval-every", "0",
                                 "--eval-size", "8", "--prompts-per-step", "4", "--G", "4",
                                 "--log-completions", "1", "--rewards", *rewards,
                                 "--reward-weights", "1", "0.5", "0"], tmp_path, nproc=2)
    steps = by_step(tmp_path)
    assert sorted(steps) == [1, 2]
    assert out.count("completions of step ") == 2, out[-3000:]

    for record in records[1:]:
        rows = steps[record["step"]]
        assert len(rows) == 16
        # 4 groups of 4, one prompt each; 2 prompts from each rank
        prompts = [r["prompt"] for r in rows]
        assert all(len(set(prompts[g:g + 4])) == 1 for g in range(0, 16, 4))
        assert set(rows[0]) == {"step", "prompt", "completion", "reward", "advantage", "length",
                                "truncated", "reward/exact_match_reward", "reward/position_reward",
                                "reward/char_count", "chars"}
        # log_extra's column, row by row; log_metric's mean over both ranks' calls
        assert [r["chars"] for r in rows] == [len(r["completion"]) for r in rows]
        # a record's mean is an fp32 sum of the 16 rows' values: fp32_tol(16) of them
        chars_mean = sum(r["chars"] for r in rows) / 16
        assert_close_rel(record["chars_mean"], chars_mean, fp32_tol(16),
                         scale=max(r["chars"] for r in rows), msg="chars_mean")
        # the record's reward means are over both ranks' completions
        for key, logged in (("reward/exact_match_reward", "reward/exact_match_reward"),
                            ("reward/position_reward", "reward/position_reward"),
                            ("reward", "reward_mean")):
            values = [r[key] for r in rows]
            assert_close_rel(sum(values) / 16, record[logged], fp32_tol(16),
                             scale=max(map(abs, values)), msg=key)
        # a group's fp32 advantages sum to 0 (of their magnitude)
        for g in range(0, 16, 4):
            values = [r["advantage"] for r in rows[g:g + 4]]
            assert_close_rel(sum(values), 0.0, fp32_tol(4), scale=max(map(abs, values)),
                             msg="advantages")
        assert all(1 <= r["length"] <= 4 for r in rows)


def test_kill_and_resume(tmp_path):
    """kill -9 after a checkpoint, mid-run, then the same command: each step once."""
    flags = ["--log-completions", "1"]
    steps = 10
    rows_per_step = 8 * 8  # --prompts-per-step 8 (test_resume.ARGS) x G 8
    start_and_kill(tmp_path / "crashed", 1, kill_after_step=3, extra=flags)
    # the step's completions go before its record: steps 1-3 are in
    killed = by_step(tmp_path / "crashed")
    assert {1, 2, 3} <= set(killed), sorted(killed)
    saved = glob.glob(str(tmp_path / "crashed" / "checkpoints" / "step_*[0-9]"))
    assert max(int(p.rsplit("_", 1)[1]) for p in saved) < steps

    _, out, resumed = run_train(RESUME_ARGS + flags, tmp_path / "crashed")
    assert "resuming from" in out
    assert [r["step"] for r in resumed] == list(range(steps + 1))
    rows = by_step(tmp_path / "crashed")
    assert sorted(rows) == list(range(1, steps + 1))
    assert all(len(rows[s]) == rows_per_step for s in rows)

    # logging changed nothing of the run
    _, _, straight = run_train(RESUME_ARGS, tmp_path / "straight")
    assert without_timings(straight) == without_timings(resumed)
