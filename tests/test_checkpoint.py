"""checkpoint.py in-process (no train.py subprocess).

What an out-dir is, and how resume picks a checkpoint. An out-dir holds one run.
--resume no never overwrites one. --resume auto resumes the latest complete
checkpoint (incomplete ones are skipped with a warning) or, without any,
restarts the same run from step 0, saying so. A second live run is refused by
the lock, which a dead run cannot hold. End to end: tests/test_resume.py.
"""
import json
import os
import signal
import socket

import pytest
import torch

import checkpoint
from rollout import HFEngine

CONFIG = {"G": 8, "lr": 0.0003, "world_size": 1}


def fake_checkpoint(root, step, config=CONFIG, complete=True):
    """A step_N folder laid out as save() writes it (small files).

    With its complete.json marker, when complete.
    """
    path = os.path.join(root, f"step_{step:06d}")
    os.makedirs(os.path.join(path, "model"))
    trainer = dict(config=config, step=step, opt_step=step)
    torch.save(trainer, os.path.join(path, "trainer.pt"))
    torch.save({}, os.path.join(path, "rng_rank0.pt"))
    with open(os.path.join(path, "model", "model.safetensors"), "wb") as f:
        f.write(b"\0" * 4096)

    if complete:
        files = checkpoint._files(path)
        sizes = {f: os.path.getsize(os.path.join(path, f)) for f in files}
        json.dump(sizes, open(os.path.join(path, "complete.json"), "w"))
    return path


def write_metrics(out_dir, steps, torn=False):
    with open(os.path.join(out_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "reward_mean": 0.5}) + "\n" for s in steps)
        if torn:
            f.write('{"step": 99, "rew')


def snapshot(out_dir):
    """Every file under out_dir with its bytes.

    To show that a refused run changed nothing.
    """
    files = {}
    for d, _, names in os.walk(out_dir):
        for f in names:
            path = os.path.join(d, f)
            files[os.path.relpath(path, out_dir)] = open(path, "rb").read()
    return files


# --- Checkpoint integrity: find() falls back to the latest complete checkpoint ---

DAMAGES = ["no trainer.pt", "weights cut short", "no marker", "rng file missing"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_find_skips_a_damaged_latest_checkpoint(damage, tmp_path):
    root = str(tmp_path / "checkpoints")
    fake_checkpoint(root, 2)
    latest = fake_checkpoint(root, 4)
    # an interrupted write: never a candidate
    os.makedirs(os.path.join(root, "step_000006.tmp"))

    if damage == "no trainer.pt":
        os.remove(os.path.join(latest, "trainer.pt"))
    elif damage == "weights cut short":
        os.truncate(os.path.join(latest, "model", "model.safetensors"), 100)
    elif damage == "no marker":
        os.remove(os.path.join(latest, "complete.json"))
    else:
        os.remove(os.path.join(latest, "rng_rank0.pt"))
    assert checkpoint.find(root) == (os.path.join(root, "step_000002"), [latest])

    logged = []
    path, saved = checkpoint.resume_point(str(tmp_path), "auto", CONFIG,
                                          log=logged.append)
    assert path.endswith("step_000002")
    assert saved["step"] == 2
    assert len(logged) == 1
    assert "step_000004 is incomplete" in logged[0] and "skipped" in logged[0]


def test_unreadable_trainer_state_is_one_line(tmp_path):
    path = fake_checkpoint(str(tmp_path / "checkpoints"), 2)
    size = os.path.getsize(os.path.join(path, "trainer.pt"))
    # the right size, garbage inside
    open(os.path.join(path, "trainer.pt"), "wb").write(b"x" * size)

    with pytest.raises(ValueError, match="trainer.pt is unreadable.*delete"):
        checkpoint.resume_point(str(tmp_path), "auto", CONFIG)


def test_open_metrics_cuts_back_and_repairs_a_torn_last_line(tmp_path):
    write_metrics(tmp_path, range(6), torn=True)

    logged = []
    f = checkpoint.open_metrics(str(tmp_path / "metrics.jsonl"), 3, log=logged.append)
    f.write(json.dumps({"step": 4}) + "\n")
    f.close()

    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3, 4]
    assert "dropped 2 later record(s) and 1 torn line(s)" in logged[0]


def test_save_replaces_an_incomplete_checkpoint_and_keeps_the_last_complete_ones(tiny, tmp_path):
    """A resume that skipped an incomplete step_N writes step_N again.

    (The old bug: os.replace onto a full folder.) keep-last counts complete
    checkpoints only, and leaves later leftovers alone until their step comes.
    """
    _, model, tokenizer, _ = tiny
    root = str(tmp_path / "checkpoints")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = HFEngine(model, tokenizer)
    fake_checkpoint(root, 1, complete=False)  # older junk
    fake_checkpoint(root, 3, complete=False)  # skipped by the resume, written again below
    fake_checkpoint(root, 9, complete=False)  # a leftover beyond the current step

    for step in (2, 3, 4):
        state = dict(step=step, opt_step=step, config=CONFIG)
        checkpoint.save(root, step, model, optimizer, engine, tokenizer, state,
                        keep_last=2, device=torch.device("cpu"))

    assert sorted(os.listdir(root)) == ["step_000003", "step_000004", "step_000009"]
    assert checkpoint.is_complete(os.path.join(root, "step_000003"))
    assert checkpoint.find(root)[0].endswith("step_000004")


# --- Reusing an out-dir: one run per out-dir ---

HELD = ["checkpoint", "incomplete checkpoint", "metrics", "final model"]


@pytest.mark.parametrize("held", HELD)
def test_resume_no_refuses_an_out_dir_that_holds_a_run(held, tmp_path):
    if held == "checkpoint":
        fake_checkpoint(str(tmp_path / "checkpoints"), 100)
    elif held == "incomplete checkpoint":
        fake_checkpoint(str(tmp_path / "checkpoints"), 100, complete=False)
    elif held == "metrics":
        write_metrics(tmp_path, range(3))
    else:
        os.makedirs(tmp_path / "model")

    before = snapshot(tmp_path)
    refused = r"--resume no: .* holds a run \(.*\): use another --out-dir or delete it"
    with pytest.raises(ValueError, match=refused):
        checkpoint.resume_point(str(tmp_path), "no", CONFIG)
    assert snapshot(tmp_path) == before


def test_resume_no_starts_in_an_empty_or_never_started_out_dir(tmp_path):
    assert checkpoint.resume_point(str(tmp_path), "no", CONFIG) == (None, None)
    # the run's identity, before its first checkpoint
    assert json.load(open(tmp_path / "run.json")) == CONFIG
    # nothing to lose yet
    assert checkpoint.resume_point(str(tmp_path), "no", CONFIG | {"G": 4}) == (None, None)


def test_auto_without_checkpoint_restarts_the_same_run_and_says_so(tmp_path):
    checkpoint.resume_point(str(tmp_path), "auto", CONFIG)  # the run starts: run.json
    write_metrics(tmp_path, range(5))  # ... and dies before its first checkpoint

    logged = []
    point = checkpoint.resume_point(str(tmp_path), "auto", CONFIG, log=logged.append)
    assert point == (None, None)
    assert "starting again from step 0" in logged[0] and "5 records" in logged[0]


def test_auto_without_checkpoint_refuses_records_of_another_or_unknown_run(tmp_path):
    checkpoint.resume_point(str(tmp_path), "auto", CONFIG)
    write_metrics(tmp_path, range(5))
    before = snapshot(tmp_path)

    another = r"holds 5 records .* different run configuration \{'G': \(8, 4\)\}"
    with pytest.raises(ValueError, match=another):
        checkpoint.resume_point(str(tmp_path), "auto", CONFIG | {"G": 4})

    os.remove(tmp_path / "run.json")
    unknown = "no run.json says which run wrote them: use another --out-dir, or delete it"
    with pytest.raises(ValueError, match=unknown):
        checkpoint.resume_point(str(tmp_path), "auto", CONFIG)
    assert snapshot(tmp_path) == {k: v for k, v in before.items() if k != "run.json"}


def test_resume_refuses_a_checkpoint_of_another_configuration(tmp_path):
    fake_checkpoint(str(tmp_path / "checkpoints"), 2)
    another = r"different run configuration \{'G': \(8, 4\)\}"
    with pytest.raises(ValueError, match=another):
        checkpoint.resume_point(str(tmp_path), "auto", CONFIG | {"G": 4})


# --- Two runs on one out-dir: the lock ---

def test_lock_refuses_a_live_holder_and_names_it(tmp_path):
    assert checkpoint.lock(str(tmp_path)) is None

    # a second open file: flock refuses it, as it would another process
    msg = checkpoint.lock(str(tmp_path))
    assert f"pid {os.getpid()} on host {socket.gethostname()}" in msg
    assert "is in use by another run" in msg


def test_a_dead_run_cannot_hold_the_lock(tmp_path):
    """The holder is SIGKILLed: the kernel drops its flock.

    The next run takes the out-dir.
    """
    read, write = os.pipe()
    pid = os.fork()
    # the child: take the lock, say so, wait to be killed
    if pid == 0:
        try:
            if checkpoint.lock(str(tmp_path)) is None:
                os.write(write, b"1")
            else:
                os.write(write, b"0")
            signal.pause()
        finally:
            os._exit(0)

    # so that the read below ends if the child dies without a word
    os.close(write)
    try:
        assert os.read(read, 1) == b"1"
        assert f"pid {pid} " in checkpoint.lock(str(tmp_path))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)

    assert checkpoint.lock(str(tmp_path)) is None


def test_open_metrics_says_when_the_records_before_the_checkpoint_are_missing(tmp_path):
    logged = []
    checkpoint.open_metrics(str(tmp_path / "metrics.jsonl"), 3, log=logged.append).close()

    assert "metrics.jsonl is missing: the records up to step 3 are lost" in logged[0]
