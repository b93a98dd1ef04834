"""--report-to (report.py): the dashboards hold what metrics.jsonl holds.

- A 2-step run with --report-to trackio tensorboard, the network cut off
  (tests/no_network.py): trackio's store (its own reader) and tensorboard's
  event file (its EventAccumulator) hold each record of metrics.jsonl, at its
  step, steps 0 to 2; trackio's run holds the flags as its config; no
  connection or name lookup was tried.
- log_completions: trackio's table reads back as the rows given; tensorboard's
  text is a markdown table of them, a cell's | and line breaks escaped.
- wandb, offline, where it is installed: its summary holds the last record.
- --report-to none reports nowhere; the rules between the flags, one line each;
  a missing package stops the run in one line, naming the pip install.
"""
import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from helpers import ENV, ROOT, read_metrics, refused, script_cmd

FLAGS = ["--engine", "hf", "--steps", "2", "--eval-size", "8", "--eval-every", "0",
         "--prompts-per-step", "8"]
# trackio reaches the network only where these say so (a Space, a server)
TRACKIO_REMOTE = ("TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID",
                  "TRACKIO_DATASET_ID", "TRACKIO_WEBHOOK_URL")
ROWS = [
    dict(step=3, prompt="739>", completion="379", **{"reward/exact_match_reward": 1.0},
         advantage=0.75, length=4, truncated=False),
    dict(step=3, prompt="12>", completion="2|1\nx", **{"reward/exact_match_reward": 0.0},
         advantage=-0.75, length=5, truncated=True),
]


def offline_env(tmp_path):
    """trackio's store in tmp_path, every remote it knows unset, the hub offline."""
    env = {k: v for k, v in ENV.items() if k not in TRACKIO_REMOTE}
    return {**env, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": os.path.join(ROOT, "tests")}


def run_offline(script_args, env, timeout=300):
    """`python SCRIPT ARGS` under tests/no_network.py -> its output (it must succeed)."""
    cmd, warm = script_cmd(os.path.join(ROOT, "tests", "no_network.py"), 1)
    proc = subprocess.run(cmd + script_args, cwd=ROOT, env={**env, **warm},
                          capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def in_python(code, env):
    """Run code in a fresh python (trackio reads TRACKIO_DIR when imported) -> stdout."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def same(logged, recorded):
    """A dashboard's value is the record's (both NaN counts as the same)."""
    if isinstance(recorded, float) and math.isnan(recorded):
        return isinstance(logged, float) and math.isnan(logged)
    return logged == recorded


@pytest.fixture(scope="module")
def reported(tmp_path_factory):
    """A 2-step run reporting to trackio and tensorboard, offline -> (its tmp dir,
    out-dir, env, output)."""
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "out"
    env = offline_env(tmp)
    output = run_offline(["train.py", "--out-dir", str(out), *FLAGS,
                          "--report-to", "trackio", "tensorboard"], env)
    return tmp, out, env, output


def test_the_network_guard_blocks_a_connection(tmp_path):
    script = tmp_path / "reach.py"
    script.write_text("import urllib.request\n"
                      "try:\n"
                      "    urllib.request.urlopen('http://huggingface.co', timeout=5)\n"
                      "except OSError:\n"
                      "    pass\n")
    cmd = [sys.executable, os.path.join(ROOT, "tests", "no_network.py"), str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert "network blocked: huggingface.co" in proc.stderr, proc.stderr


def test_trackio_holds_the_records_of_metrics_jsonl(reported):
    tmp, out, env, output = reported
    assert "network blocked" not in output, output[-4000:]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [0, 1, 2]

    code = ("import json, trackio\n"
            "from trackio.sqlite_storage import SQLiteStorage\n"
            "runs = trackio.Api().runs('tinygrpo')\n"
            "logs = SQLiteStorage.get_logs('tinygrpo', runs[0].name)\n"
            "print(json.dumps(dict(names=[r.name for r in runs], config=runs[0].config,"
            " logs=logs), default=str))\n")
    stored = json.loads(in_python(code, env))
    assert stored["names"] == [str(out)]
    assert stored["config"]["report_to"] == ["trackio", "tensorboard"]
    assert stored["config"]["steps"] == 2 and stored["config"]["out_dir"] == str(out)
    # every flag but the server's key, which no dashboard gets
    assert "vllm_api_key" not in stored["config"] and "vllm_url" in stored["config"]

    # one entry per step, system metrics aside (psutil: trackio logs them apart)
    by_step = {log["step"]: log for log in stored["logs"]}
    assert sorted(by_step) == [0, 1, 2]
    for record in records:
        logged = by_step[record["step"]]
        for key, value in record.items():
            if key != "step":
                assert same(logged[key], value), (record["step"], key, logged[key], value)


def test_tensorboard_holds_the_records_of_metrics_jsonl(reported):
    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, _, _ = reported
    records = read_metrics(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()

    tags = set(events.Tags()["scalars"])
    assert tags == {k for r in records for k in r if k != "step"}
    for tag in tags:
        steps = [(e.step, e.value) for e in events.Scalars(tag)]
        # an event holds a float32
        expected = [(r["step"], float(np.float32(r[tag]))) for r in records if tag in r]
        assert len(steps) == len(expected), tag
        for (step, value), (want_step, want) in zip(steps, expected):
            assert step == want_step and same(value, want), (tag, step, value, want)

    # the flags, as text at step 0
    (config,) = events.Tensors("config/text_summary")
    assert '"report_to": [' in config.tensor_proto.string_val[0].decode()


def test_trackio_log_completions_reads_back_the_rows(tmp_path):
    env = offline_env(tmp_path)
    code = ("import json, trackio\nfrom runlog import report\n"
            "from types import SimpleNamespace\n"
            "from trackio.sqlite_storage import SQLiteStorage\n"
            f"args = SimpleNamespace(project='p', wandb=None, out_dir={str(tmp_path)!r})\n"
            "reporter = report.Reporter({'trackio': trackio}, args, start_step=0)\n"
            f"reporter.log_completions({ROWS!r}, 3)\n"
            "reporter.close()\n"
            f"print(json.dumps(SQLiteStorage.get_logs('p', {str(tmp_path)!r})))\n")
    (log,) = json.loads(in_python(code, env).strip().splitlines()[-1])

    assert log["step"] == 3
    assert log["completions"]["_type"] == "trackio.table"
    assert log["completions"]["_value"] == ROWS


def test_tensorboard_log_completions_is_a_markdown_table(tmp_path):
    import torch.utils.tensorboard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from runlog import report

    args = SimpleNamespace(project="p", wandb=None, out_dir=str(tmp_path))
    reporter = report.Reporter({"tensorboard": torch.utils.tensorboard}, args, start_step=0)
    reporter.log_completions(ROWS, 3)
    reporter.close()

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (text,) = events.Tensors("completions/text_summary")
    assert text.step == 3
    assert text.tensor_proto.string_val[0].decode().splitlines() == [
        "| step | prompt | completion | reward/exact_match_reward | advantage | length "
        "| truncated |",
        "|---|---|---|---|---|---|---|",
        "| 3 | 739> | 379 | 1 | 0.75 | 4 | False |",
        "| 3 | 12> | 2\\|1<br>x | 0 | -0.75 | 5 | True |",
    ]


def test_wandb_offline_holds_the_last_record(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install "
                                        "wandb); its offline run is checked where it is")
    env = {**offline_env(tmp_path), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path)}
    out = tmp_path / "out"
    output = run_offline(["train.py", "--out-dir", str(out), *FLAGS, "--wandb", "tinygrpo"],
                         env)
    assert "network blocked" not in output, output[-4000:]

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    summary_path = run_dir / "files" / "wandb-summary.json"
    if summary_path.exists():  # wandb < 0.31 writes the summary as JSON offline
        summary = json.load(open(summary_path))
        last = read_metrics(out)[-1]
        for key, value in last.items():
            assert same(summary[key], value), (key, summary[key], value)
    else:  # 0.31 keeps it in the run's binary log, which only its Go core reads
        (log,) = run_dir.glob("run-*.wandb")
        assert log.stat().st_size > 0
        assert "step 2 | reward" in (run_dir / "files" / "output.log").read_text()


def test_report_to_none_reports_nowhere():
    import config
    from runlog import report

    (action,) = [a for a in config.parser._actions if a.dest == "report_to"]
    assert action.choices == [*report.BACKENDS, "none"]
    args = SimpleNamespace(report_to=["none"], wandb=None, project="tinygrpo", out_dir="out")
    assert report.backends(["none"], None) == []
    assert report.backends(["trackio", "tensorboard", "trackio"], "p") == [
        "trackio", "tensorboard", "wandb"]
    assert report.open(args, None) is None


@pytest.mark.parametrize("argv,expected", [
    (["--report-to", "none", "trackio"],
     "--report-to none trackio: none reports nowhere: give it alone"),
    (["--wandb", "a", "--project", "b"],
     "--wandb a is --report-to wandb --project a: give the project once"),
    (["--project", "p"], "--project does nothing without --report-to trackio or wandb"),
    (["--report-to", "tensorboard", "--project", "p"],
     "--project does nothing without --report-to trackio or wandb"),
])
def test_report_flag_rules(argv, expected, capsys):
    assert expected in refused(argv, capsys)


def test_missing_trackio_is_one_line(tmp_path):
    (tmp_path / "trackio.py").write_text(
        'raise ImportError("No module named trackio (test double)")\n')
    env = {**offline_env(tmp_path),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.path.join(ROOT, 'tests')}"}
    cmd, warm = script_cmd(os.path.join(ROOT, "train.py"), 1)
    proc = subprocess.run(cmd + ["--out-dir", str(tmp_path / "out"), *FLAGS,
                                 "--report-to", "trackio"],
                          cwd=ROOT, env={**env, **warm}, capture_output=True, text=True,
                          timeout=300)
    output = proc.stdout + proc.stderr

    assert proc.returncode != 0, output[-2000:]
    assert ("error: --report-to trackio needs the trackio package: pip install trackio"
            in output), output[-2000:]
    assert "Traceback" not in output, output[-2000:]
