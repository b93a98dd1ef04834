"""--async (one-step-off-policy GRPO in server mode) end to end against a local
`python server.py` (tests/test_server.py starts it).

Every batch after the first is sampled with the weights one update behind the
trainer's, as the server itself reports (sampler_version, from the version each
sync names). The ratio is taken against the sampler's log-probs: 1 on the one
on-policy batch, not after. On 1 rank and 2 (DDP, FSDP2). A kill -9 mid-run
resumes bit-identically: the next batch, already sampled, is in the checkpoint.
A server killed mid-run ends the run with RemoteEngine's one line on every rank,
in seconds. The last test kills the module's server.

    python -m pytest -q tests/test_async.py
"""
import os
import subprocess
import time

import pytest
from safetensors.torch import load_file

from helpers import ROOT, read_metrics, run_train, script_cmd, without_timings
from test_resume import start_and_kill
from test_server import start_server

# one worker builds the rollout server and the straight run once (--dist
# loadgroup)

pytestmark = pytest.mark.xdist_group("test_async")

STEPS = 6


@pytest.fixture(scope="module")
def server(request, tiny, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("log") / "server.log"
    return start_server(request, tiny[0], tiny[2], log_path)


def async_args(tiny, server, steps=STEPS):
    return ["--model", tiny[0], "--vllm-mode", "server", "--vllm-url", server[1],
            "--async", "--lr", "3e-4", "--steps", str(steps), "--save-every", "2",
            "--eval-every", "3", "--eval-size", "16", "--prompts-per-step", "8",
            "--max-prompt-len", "16"]


@pytest.fixture(scope="module")
def straight(server, tiny, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("straight")
    return out_dir, run_train(async_args(tiny, server), out_dir)[2]


def check_staleness(records):
    """Step 1 samples from the start-up weights (on-policy). Batch k >= 2 was
    sampled by w_{k-2} and trained from w_{k-1}, the server says. The ratio is
    against the sampler: 1 up to numerics on-policy, not after."""
    steps = records[1:]
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    samplers = [r["sampler_version"] for r in steps]
    assert samplers == [0] + list(range(len(steps) - 1)), steps
    assert [r["policy_version"] for r in steps] == list(range(len(steps)))
    assert [r["staleness"] for r in steps] == [0] + [1] * (len(steps) - 1)

    assert abs(steps[0]["ratio_mean"] - 1) < 1e-4, steps
    assert all(abs(r["ratio_mean"] - 1) > 1e-4 for r in steps[1:]), steps
    assert all("time_wait" in r for r in steps[:-1])


def test_one_rank(straight):
    _, records = straight

    check_staleness(records)

    # the last step has no next batch in flight
    assert "time_wait" not in records[-1]
    assert all("eval_greedy" in r for r in records if r["step"] in (0, 3, 6))


def test_kill_and_resume_is_bit_identical(straight, server, tiny, tmp_path):
    """kill -9 during step 4 (after the checkpoint of step 2, which holds batch
    3, sampled by w_1), resume: the same records (versions included) and the
    same final weights as the run that was never interrupted."""
    straight_dir, records = straight

    start_and_kill(tmp_path, 1, kill_after_step=3, extra=async_args(tiny, server))
    _, out, _ = run_train(async_args(tiny, server), tmp_path)

    assert "resuming from" in out
    assert without_timings(read_metrics(tmp_path)) == without_timings(records)
    a = load_file(straight_dir / "model" / "model.safetensors")
    b = load_file(tmp_path / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_two_ranks_ddp(server, tiny, tmp_path):
    """2 trainer ranks with DDP, one step off-policy: each rank's batches carry
    the versions a single rank's do."""
    _, _, records = run_train(async_args(tiny, server, steps=4), tmp_path, nproc=2)

    check_staleness(records)


def start_train(args, out_dir, log, nproc):
    """train.py in the background, its output in log -> the process."""
    cmd, warm = script_cmd(os.path.join(ROOT, "train.py"), nproc)
    env = {**os.environ, "OMP_NUM_THREADS": "1", **warm}
    with open(log, "w") as f:
        return subprocess.Popen(cmd + ["--out-dir", str(out_dir), *args], cwd=ROOT,
                                env=env, stdout=f, stderr=f)


def wait_for_step(run, out_dir, at_step, timeout=180):
    """Wait until the run logged step at_step, or it ended, or timeout seconds
    passed."""
    deadline = time.time() + timeout
    while time.time() < deadline and run.poll() is None:
        if any(r["step"] >= at_step for r in read_metrics(out_dir)):
            break
        time.sleep(0.05)


def run_until_killed(server_proc, args, out_dir, log, nproc, at_step=4):
    """Start train.py, kill the rollout server once the run logged step at_step
    -> (exit code, output, seconds from the kill to the trainer's exit)."""
    run = start_train(args, out_dir, log, nproc)
    wait_for_step(run, out_dir, at_step)
    assert run.poll() is None, open(log).read()[-3000:]

    server_proc.kill()
    start = time.time()
    run.wait(timeout=60)

    return run.returncode, open(log).read(), time.time() - start


def test_one_rank_server_killed_then_resumed(request, tiny, tmp_path):
    """1 rank, --async, its own server killed mid-run: the documented one line
    (the background batch's error is raised as it is: no process group to
    gather it over), then a clean resume against a new server."""
    proc, url = start_server(request, tiny[0], tiny[2], tmp_path / "server.log")
    out = tmp_path / "out"
    # would run on for hours
    args = async_args(tiny, (proc, url), steps=100000)

    log = tmp_path / "train.log"
    code, output, seconds = run_until_killed(proc, args, out, log, nproc=1)

    assert code != 0 and seconds < 20, output[-3000:]
    one_line = f"error (rank 0): rollout server {url} did not answer"
    assert one_line in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]

    # --save-every 2
    saved = max(r["step"] for r in read_metrics(out)) // 2 * 2
    _, url2 = start_server(request, tiny[0], tiny[2], tmp_path / "server2.log")
    resumed = async_args(tiny, (None, url2), steps=saved + 2)

    _, output, records = run_train(resumed, out)

    assert f"resuming from {out / 'checkpoints'}" in output, output[-3000:]
    assert [r["step"] for r in records] == list(range(saved + 3)), records


def test_two_ranks_fsdp_then_server_killed(server, tiny, tmp_path):
    """Last: it kills the module's server. 2 trainer ranks with FSDP2 train one
    step off-policy. Then the server dies mid-run, and every rank stops within
    seconds with RemoteEngine's one line, not a traceback or a hang."""
    proc, url = server
    log = tmp_path / "train.log"
    out_dir = tmp_path / "out"
    # would run on for hours
    args = ["--fsdp", *async_args(tiny, server, steps=100000)]

    run = start_train(args, out_dir, log, 2)
    wait_for_step(run, out_dir, 4)
    assert run.poll() is None, open(log).read()[-3000:]

    proc.kill()
    start = time.time()
    run.wait(timeout=60)

    out = open(log).read()
    assert run.returncode != 0 and time.time() - start < 20, out[-3000:]
    check_staleness([r for r in read_metrics(out_dir) if r["step"] <= 4])
    for rank in (0, 1):
        one_line = f"error (rank {rank}): rollout server {url} did not answer"
        assert one_line in out, out[-3000:]

    # no traceback from train.py (torchrun prints its own summary)
    assert 'train.py", line' not in out, out[-3000:]
