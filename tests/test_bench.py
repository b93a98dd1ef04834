"""bench/'s pure pieces; `python -m bench gpu --tiny` in .ci/run runs the rest end to end.

The never-EOS tokenizer that makes every completion run to full length, the
summaries of train.py's metrics, and the command line.
"""
import json
import math
import subprocess
import sys

import torch

import task
from bench.gpu import finite
from bench.gpu_train import summarize_train, summarize_what_ran
from bench.runs import run_summary
from bench.shared import QWEN_VOCAB, build_model, never_eos_tokenizer
from helpers import ENV, ROOT
from model import load_tokenizer


def test_never_eos_tokenizer_survives_save_and_reload(tmp_path):
    tokenizer = never_eos_tokenizer(QWEN_VOCAB)
    assert tokenizer.eos_token_id == QWEN_VOCAB
    assert tokenizer.pad_token_id == 0

    # its config says qwen2
    model = build_model("tiny", tokenizer, "cpu", torch.float32, vocab_size=1024)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    # as train.py and vLLM load it
    reloaded, _ = load_tokenizer(str(tmp_path))
    assert reloaded.eos_token_id == QWEN_VOCAB
    assert reloaded("739>")["input_ids"] == task.build_tokenizer()("739>")["input_ids"]
    # ids the tokenizer lacks (a model can sample them) decode to ''
    assert reloaded.decode([9, 500, 5]) == "73"

    # the default: right after the tokenizer's own ids
    assert never_eos_tokenizer().eos_token_id == len(task.build_tokenizer())


def test_summarize_train_skips_warm_up_steps_and_tolerates_no_memory_key():
    times = dict(time_rollout=1.0, time_reward=0.1, time_update=2.0, time_sync=0.5,
                 tokens_per_s=100.0)
    records = [dict(step=0, eval_greedy=0.0)]
    records += [dict(step=s, **times) for s in range(1, 6)]
    # step 1: compilation
    records[1]["time_update"] = 60.0

    summary = summarize_train(records)
    assert summary["steps_measured"] == "3-5"
    assert summary["time_update"] == 2.0
    assert math.isclose(summary["time_step"], 3.6)
    # on CPU, or before train.py logged it
    assert summary["mem_peak_gb"] is None

    records[4]["mem_peak_gb"] = 30.0
    records[5]["mem_peak_gb"] = 31.5
    assert summarize_train(records)["mem_peak_gb"] == 31.5

    nan = float("nan")
    inf = float("inf")
    assert finite({"a": [nan, 1.0], "b": inf}) == {"a": [None, 1.0], "b": None}


def test_a_train_run_cut_short_reports_the_steps_it_finished(tmp_path):
    times = dict(time_rollout=1.0, time_reward=0.1, time_update=2.0, time_sync=0.5,
                 tokens_per_s=100.0)
    lines = [json.dumps(dict(step=s, **times)) for s in range(1, 5)]
    metrics = tmp_path / "metrics.jsonl"
    # killed while writing step 5's line
    metrics.write_text("\n".join(lines) + '\n{"step": 5, "time_ro')

    section = {}
    summarize_what_ran(str(metrics), section)
    assert section["steps_measured"] == "3-4"
    assert math.isclose(section["time_step"], 3.6)

    # nothing past the warm-up, or no file: nothing reported
    metrics.write_text("\n".join(lines[:2]))
    section = {}
    summarize_what_ran(str(metrics), section)
    summarize_what_ran(str(tmp_path / "absent.jsonl"), section)
    assert section == {}


def fake_run():
    """Metrics records of a 6-step run.

    Step 4's delta (5.0 s) follows step 3's evaluation.
    """
    elapsed = [0.1, 0.2, 0.3, 5.3, 5.4, 5.5]
    records = [dict(step=0, eval_greedy=0.0)]
    for s, e in enumerate(elapsed, 1):
        records.append(dict(step=s, elapsed=e, time_update=0.05))
    records[3]["eval_greedy"] = 0.5
    records[5]["eval_greedy"] = 0.96
    return records


def test_run_summary_leaves_evaluations_out_of_the_training_time():
    """runs / trl: the median step, the first held-out >= 0.95, the training time to it.

    The median is of the step deltas. A step right after an evaluation is counted
    at the median, since its delta holds the evaluation. The training time is
    summed up to the first held-out >= 0.95.
    """
    records = fake_run()
    median, first, to_095 = run_summary(records)
    assert math.isclose(median, 0.1)
    assert first == 5
    # 0.1 + 4 steps of 0.1
    assert math.isclose(to_095, 0.5)

    # never reached
    assert run_summary(records[:4])[1:] == (None, None)


def test_python_m_bench_runs_reads_an_out_dir(tmp_path):
    """`python -m bench runs OUT` from the repo root: the command line end to end."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in fake_run())

    cmd = [sys.executable, "-m", "bench", "runs", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = "median step 0.100 s | update 0.050 | held-out >= 0.95 at step 5"
    assert line in proc.stdout


def test_trl_real_summary_leaves_the_first_step_out():
    """trl --real: medians over steps 2.., the update as the step less the
    rollout, and train.py's records read as the TRL run's are."""
    from bench.trl_real import ours, summary

    records = [dict(step_s=9.0, rollout_s=5.0, completion_tokens=64, rss_peak_gb=1.0),
               dict(step_s=3.0, rollout_s=1.0, completion_tokens=40, rss_peak_gb=2.0),
               dict(step_s=5.0, rollout_s=2.0, completion_tokens=60, rss_peak_gb=1.5),
               dict(step_s=4.0, rollout_s=1.5, completion_tokens=50, rss_peak_gb=1.2)]
    s = summary(records)
    assert (s["step_s"], s["rollout_s"], s["tokens"]) == (4.0, 1.5, 50)
    assert s["update_s"] == 2.5
    assert math.isclose(s["rollout_tok_s"], 50 / 1.5)
    assert s["rss_peak_gb"] == 2.0  # the peak of all steps, the first too

    # train.py: step 0 is the first evaluation; the rollout holds the rewards
    metrics = [dict(step=0),
               dict(step=1, time_rollout=2.0, time_reward=0.5, time_update=3.0,
                    time_sync=0.5, len_mean=10.0, rss_peak_gb=1.0)]
    assert ours(metrics, G=4, prompts=2) == [dict(step_s=6.0, rollout_s=2.5,
                                                   completion_tokens=80.0,
                                                   rss_peak_gb=1.0)]


def test_real_reads_a_flag_as_train_py_does():
    """bench real: a flag given twice (TINY_FLAGS after TRAIN_FLAGS) counts
    at its last value, as argparse reads it; with_flag changes a copy."""
    from bench.real import TINY_FLAGS, TRAIN_FLAGS, flag, floors, with_flag

    tiny = TRAIN_FLAGS + TINY_FLAGS
    assert (flag(tiny, "--G"), flag(tiny, "--prompts-per-step")) == ("2", "2")
    assert flag(tiny, "--beta", "0") == "0"
    assert flag(tiny, "--no-such-flag", "x") == "x"

    doubled = with_flag(tiny, "--prompts-per-step", 8)
    assert flag(doubled, "--prompts-per-step") == "8"
    assert flag(tiny, "--prompts-per-step") == "2"
    assert len(doubled) == len(tiny)

    # the floors count the completions of the flags' last values: 2 x 2 x 8
    record = dict(len_mean=8.0, len_max=8, time_rollout=1.0, time_update=1.0,
                  tokens_per_s=32.0)
    floor = {"float32": 1.0, "gbps": 1.0}
    s = floors(record, "float32", floor, params=10e9, head=0, prompt_len=0, flags=tiny)
    assert math.isclose(s["rollout_vs_compute"], 2 * 10e9 * 32 / 1e9)


def test_learn_counts_training_seconds_and_reports_each_runs_gain():
    """learn: the clock sums a step's time_* keys (an evaluation is not one of
    them), and the table gives each run's start, end, gain, best and cut answers."""
    from argparse import Namespace

    from bench.learn import report, training_clock

    records = [dict(step=0, eval_greedy=0.25, eval_greedy_truncated=0.5),
               dict(step=1, time_rollout=2.0, time_reward=0.5, time_update=3.0, elapsed=70.0),
               dict(step=2, time_rollout=1.0, time_update=2.5, elapsed=80.0,
                    eval_greedy=0.5, eval_greedy_truncated=0.75)]
    clocked = training_clock(records)
    assert [c for c, _ in clocked] == [0.0, 5.5, 9.0]
    assert clocked[2][1]["step"] == 2

    curves = {"train.py": {0: [(0.0, 0, 0.25, 0.5), (9.0, 2, 0.5, 0.75)]},
              "TRL": {0: [(0.0, 0, 0.25, 0.5), (4.0, 1, 0.75, 0.0), (8.0, 2, 0.5, 0.25)]}}
    walls = {"train.py": {0: 120.0}, "TRL": {0: 60.0}}
    args = Namespace(seeds=[0], max_minutes=15.0, tiny=False)
    table = report(curves, walls, args, 900.0)
    assert "`python -m bench learn --seeds 0`" in table
    assert "| train.py, 0 | 2 | 0.250 | 0.500 | +0.250 | 0.500 | 0.50 -> 0.75 | 2.0 min |" in table
    assert "| TRL, 0 | 2 | 0.250 | 0.500 | +0.250 | 0.750 | 0.50 -> 0.25 | 1.0 min |" in table
