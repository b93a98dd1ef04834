"""Checkpoints: everything a bit-exact resume needs.

They are written so that a crash never passes for one.

    out/checkpoints/step_NNNNNN/
        model/          save_pretrained's safetensors + tokenizer (transformers and
                        vLLM load it); with LoRA the merged weights, and
                        model/adapter/ (what a resume loads)
        trainer.pt      optimizer state, step, optimizer step, prompts consumed,
                        run configuration, --adaptive-entropy's coefficient and
                        last measured entropy
        reference.pt    with --sync-ref-every: the reference's weights, which
                        TR-DPO moves away from the initial model
        rng_rank{R}.pt  rank R's RNG states (python, numpy, torch, cuda), engine
                        state, and with --max-staleness (--async) the batches
                        drawn ahead, by prompt offset (a resumed run trains on
                        them too: staleness.py)
        complete.json   written last: the size of every file above

An out-dir holds one run: run.json (its configuration, written at its start),
metrics.jsonl, checkpoints/, the final model/, and run.lock, which rank 0 holds
(flock) while the run lives.

Nothing in it is overwritten by another run. A second run on a live one is
refused. --resume no on a folder that holds a run is refused, and so is a
configuration that differs from its own.

check_out_dir locks it. resume_point finds where a run starts (find; the rest
of a resume is resume/checkpoints.py's: load, restore, and the metrics cut that
open_metrics asks for). save writes a checkpoint.

Run the tests: python -m pytest -q tests/test_checkpoint.py tests/test_resume.py

Simplifications:
1. Every rank writes its own RNG file into a shared folder (one node, or a
   shared file system).
2. Model and optimizer are gathered to full tensors on rank 0 (FSDP2 too). It
   is simple, and a checkpoint loads on any number of ranks. The cost is rank
   0's host memory for one full copy.
3. The data order is a pure function of (seed, prompts consumed)
   (data.batch_indices): the count is all it needs. That is step * prompts per
   step, unless --dynamic-sampling drew extra rounds.
4. Completeness is file sizes (complete.json), not checksums. It catches a crash
   mid-write or a file missing or cut short, not a bit flipped in place. The
   lock is flock(2): local disks, NFS's lock manager.
"""
import fcntl
import glob
import json
import os
import random
import shutil
import socket

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from common import all_ranks_ok, barrier, is_lora, master, rank

# full tensors (FSDP: gathered)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
MARKER = "complete.json"
_held = []  # the open lock file: the lock lasts as long as this process


def run_config(args, world):
    """The arguments a resumed run must share with its checkpoint.

    Not the speed or logging ones.
    """
    skip = ("steps", "eval_every", "eval_size", "save_every", "keep_last", "resume",
            "out_dir", "wandb", "report_to", "project", "threads", "engine", "vllm_memory",
            "vllm_url", "vllm_api_key", "vllm_ca_cert", "allow_plain_http",
            "allow_open_dev_routes", "loss_impl", "micro_batch_size", "reward_timeout",
            "eval_reward", "eval_samples", "eval_k", "log_completions",
            # a resume may lower it: the batches now too stale are dropped (staleness.py)
            "max_staleness")
    shared = {k: v for k, v in vars(args).items() if k not in skip}
    return shared | dict(world_size=world)


def check_out_dir(out_dir):
    """Create out_dir, check that every rank can write there, and lock it for this run.

    The check comes before hours of rollouts go into it. A collective (once the
    process group exists): one verdict.
    """
    error = None
    try:
        os.makedirs(out_dir, exist_ok=True)
        # a name of its own: two runs may race here
        probe = os.path.join(out_dir, f".write_test_{rank}_{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        error = (f"--out-dir {out_dir!r} is not writable ({e.strerror}): "
                 f"choose another --out-dir")

    if error is None and master:
        error = lock(out_dir)

    if not all_ranks_ok(error is None):
        raise ValueError(error or f"another rank cannot write to or lock "
                                  f"--out-dir {out_dir!r} (see its message)")


def lock(out_dir):
    """Take out_dir/run.lock (flock, exclusive) for this process's life.

    -> None, or why not (held by whom). The kernel drops it when the process ends,
    kill -9 too: a dead run blocks nothing.
    """
    f = open(os.path.join(out_dir, "run.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not said which"
        f.close()
        return (f"--out-dir {out_dir!r} is in use by another run ({holder}): "
                f"wait for it to end, stop it, or use another --out-dir")

    f.truncate(0)
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    _held.append(f)
    return None


def _records(path):
    """The lines of metrics.jsonl (0 when there is none)."""
    if not os.path.exists(path):
        return 0
    return sum(1 for _ in open(path))


def resume_point(out_dir, resume, run_config, log=print):
    """--resume auto|yes|no -> (checkpoint folder or None, its trainer state or None).

    The latest complete checkpoint (incomplete ones skipped, with a warning), else
    step 0, and rank 0 writes run.json. ValueError rather than overwrite or mix
    another run: --resume no on an out-dir that holds a run, --resume yes without
    a checkpoint, and a checkpoint or run.json of another configuration (or
    records that no run.json vouches for).
    """
    root = os.path.join(out_dir, "checkpoints")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    info = os.path.join(out_dir, "run.json")
    path, incomplete = find(root)
    records = _records(metrics)

    # it holds a run (even one cut before its first checkpoint), or --resume
    # asks for one: resume it, or refuse (resume/checkpoints.py)
    if path or incomplete or records or resume != "auto":
        from resume.checkpoints import held_run_point

        point = held_run_point(out_dir, resume, run_config, path, incomplete, records, log)
        if point:
            return point

    if master:
        with open(info + ".tmp", "w") as f:
            json.dump(run_config, f, indent=1, default=str)
        os.replace(info + ".tmp", info)
    return None, None


def _files(path):
    files = glob.glob(os.path.join(path, "**"), recursive=True)
    return sorted(os.path.relpath(f, path) for f in files
                  if os.path.isfile(f) and not f.endswith(MARKER))


def is_complete(path):
    """Its marker exists and every file it lists has the size it was written with."""
    try:
        sizes = json.load(open(os.path.join(path, MARKER)))
        return all(os.path.getsize(os.path.join(path, f)) == n for f, n in sizes.items())
    except (OSError, ValueError):
        return False


def find(root):
    """-> (the latest complete step_N folder or None, the later incomplete ones skipped).

    A step_N.tmp folder is an interrupted write: the pattern leaves it out.
    """
    skipped = []
    for path in sorted(glob.glob(os.path.join(root, "step_*[0-9]")), reverse=True):
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def save_model(model, path, state_dict, tokenizer):
    """A save_pretrained folder (safetensors: transformers and vLLM load it).

    A LoRA policy is saved merged, as the engine samples from it, under plain
    names, with its adapter in path/adapter.
    """
    if is_lora(model):  # the adapter saved, and the base model merged (scale/lora.py)
        from scale.lora import save_adapter

        model, state_dict = save_adapter(model, path, state_dict)

    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root, step, model, optimizer, engine, tokenizer, trainer_state, keep_last,
         device, pending=None, reference=None):
    """Write checkpoint step_N under root. A collective.

    Every rank writes its RNG file (and pending: this rank's batches drawn
    ahead, with --max-staleness), FSDP2 gathers the shards, and rank 0 writes the rest. reference:
    the reference model when it is no longer the initial one (--sync-ref-every),
    else None.
    """
    path = os.path.join(root, f"step_{step:06d}")
    tmp = path + ".tmp"
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()

    # the engines sample from a stream seeded by (seed, call): its state resumes it
    cuda = None
    if device.type == "cuda":
        cuda = torch.cuda.get_rng_state()
    rng = dict(python=random.getstate(), numpy=np.random.get_state(),
               torch=torch.get_rng_state(), cuda=cuda, engine=engine.state_dict(),
               pending=pending)
    torch.save(rng, os.path.join(tmp, f"rng_rank{rank}.pt"))

    # every rank: FSDP gathers the shards
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    if master:
        save_model(model, os.path.join(tmp, "model"), model_state, tokenizer)
        trainer = dict(optimizer=optimizer_state, **trainer_state)
        torch.save(trainer, os.path.join(tmp, "trainer.pt"))
    # the same on every rank: each moved its copy by the same mixes
    if reference is not None and master:
        torch.save(reference.state_dict(), os.path.join(tmp, "reference.pt"))
    barrier()

    if master:
        _commit(root, path, tmp, keep_last)


def _commit(root, path, tmp, keep_last):
    """Rank 0: make the written tmp folder the checkpoint at path, then keep the last K.

    fsync before the marker, the marker before the rename: a power cut leaves no
    half checkpoint.
    """
    files = _files(tmp)
    for f in files:
        _fsync(os.path.join(tmp, f))
    with open(os.path.join(tmp, MARKER), "w") as f:
        json.dump({f: os.path.getsize(os.path.join(tmp, f)) for f in files}, f)
        f.flush()
        os.fsync(f.fileno())

    # an incomplete one the resume skipped (a complete one would have been resumed)
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.replace(tmp, path)
    _fsync(root)

    # keep the last K complete ones, and later incomplete ones (replaced when their
    # step comes)
    steps = sorted(glob.glob(os.path.join(root, "step_*[0-9]")))
    done = [p for p in steps if p <= path and is_complete(p)]
    for old in glob.glob(os.path.join(root, "step_*[0-9]")):
        if old < done[-keep_last:][0]:
            shutil.rmtree(old)


def open_metrics(path, keep_until, log=print):
    """Rank 0: metrics.jsonl open for appending: a new run's emptied, a resumed
    run's cut back to step keep_until (resume/checkpoints.py's cut_metrics)."""
    if keep_until is not None:
        from resume.checkpoints import cut_metrics

        cut_metrics(path, keep_until, log)
    else:
        with open(path + ".tmp", "w"):
            pass
        os.replace(path + ".tmp", path)
    return open(path, "a")
