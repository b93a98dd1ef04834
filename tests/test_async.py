"""--async (one-step-off-policy GRPO in server mode) end to end against vLLM's
own server: the session's (tests/test_server.py, shared_server).

Every batch after the first is sampled with the weights one update behind the
trainer's, as the server itself reports (sampler_version: the version the last
sync named, read back after the batch). The ratio is taken against the
sampler's log-probs: 1 on the one on-policy batch, not after. On 1 rank and 2
(DDP). A kill -9 of the trainer mid-run resumes bit-identically: the next batch,
already sampled, is in the checkpoint. The server killed mid-run ends the run
with RemoteEngine's one line, in seconds; restarted on the same port, the run
resumes against it (the last test: it restarts the session's server).

    python -m pytest -q tests/test_async.py
"""
import os
import subprocess
import time

import pytest
from safetensors.torch import load_file

from helpers import ENGINE_TOL, ROOT, read_metrics, run_train, script_cmd, without_timings
from test_resume import start_and_kill
from test_server import shared_server

# one worker starts the session's server (--dist loadgroup): test_server.py's group
pytestmark = pytest.mark.xdist_group("vllm_server")

STEPS = 6


@pytest.fixture(scope="module")
def server(request, tiny):
    return shared_server(request, tiny)


def async_args(tiny, server, steps=STEPS):
    return ["--model", tiny[0], "--vllm-mode", "server", *server.flags,
            "--async", "--lr", "3e-4", "--steps", str(steps),
            "--save-every", "2", "--eval-every", "3", "--eval-size", "16",
            "--prompts-per-step", "8", "--max-prompt-len", "16"]


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

    # the server's log-probs against the trainer's, a mean of exp(difference)
    assert abs(steps[0]["ratio_mean"] - 1) < ENGINE_TOL, steps
    assert all(abs(r["ratio_mean"] - 1) > ENGINE_TOL for r in steps[1:]), steps
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


def test_server_killed_then_restarted(server, tiny, tmp_path):
    """Last: 1 rank, --async, the server killed mid-run. The run stops within
    seconds with the documented one line, not a traceback or a hang; the server
    restarts on the same port (the start-up weights), and the run resumes from
    its last checkpoint against it, whose weights the start-up sync puts back."""
    out = tmp_path / "out"
    log = tmp_path / "train.log"
    # would run on for hours
    run = start_train(async_args(tiny, server, steps=100000), out, log, 1)
    wait_for_step(run, out, 3)
    assert run.poll() is None, open(log).read()[-3000:]

    server.kill()
    start = time.time()
    run.wait(timeout=60)

    output = open(log).read()
    assert run.returncode != 0 and time.time() - start < 20, output[-3000:]
    assert f"error (rank 0): rollout server {server.url}" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]

    # --save-every 2
    saved = max(r["step"] for r in read_metrics(out)) // 2 * 2
    server.restart(tiny[2], tiny[1].config)
    _, output, records = run_train(async_args(tiny, server, steps=saved + 2), out)

    assert f"resuming from {out / 'checkpoints'}" in output, output[-3000:]
    assert [r["step"] for r in records] == list(range(saved + 3)), records
    check_staleness(records)
