"""Checkpoints: everything a bit-exact resume needs, written so that a crash never passes for a checkpoint.

    out/checkpoints/step_NNNNNN/
        model/           safetensors + tokenizer (save_pretrained: transformers and vLLM load it); with LoRA the
                         merged weights, and model/adapter/ (PeftModel.save_pretrained: what a resume loads)
        trainer.pt       optimizer state, step, optimizer step, prompts consumed, the run configuration it belongs to
        rng_rank{R}.pt   rank R's RNG states (python, numpy, torch, cuda), its rollout engine's state, and with
                         --async its next batch, already sampled (a resumed run trains on it, as the straight one)
        complete.json    written last: the size of every file above

An out-dir holds one run: run.json (its configuration, written at its start), metrics.jsonl, checkpoints/, the
final model/, and run.lock, which rank 0 holds (flock) while the run lives. Nothing in it is overwritten by another
run: a second run on a live one is refused, --resume no on a folder that holds a run is refused, and so is a
configuration that differs from the one that wrote it.

    check_out_dir(out_dir)             writable on every rank, and locked by this run (ValueError: in use, by whom)
    resume_point(out_dir, resume, ..)  -> the checkpoint to resume from and its state, or why the out-dir is not ours
    find(root)                         -> the latest complete checkpoint, and the incomplete ones it skipped
    load(path, run_config)             -> its trainer state; ValueError if another configuration wrote it
    save(root, step, ...)              write step_N.tmp on every rank, fsync, mark complete, rename, keep the last K
    restore(path, saved, ...)          optimizer, RNG states, engine state -> (step, optimizer step, prompts consumed,
                                       next batch)
    open_metrics(path, step)           metrics.jsonl cut back to the checkpoint's step (a torn last line dropped)

Run the tests: python -m pytest -q tests/test_resume.py

Simplifications:
1. Every rank writes its own RNG file into a shared folder (one node, or a shared file system).
2. Model and optimizer are gathered to full tensors on rank 0 (FSDP2 too): simple, and a checkpoint loads on any
   number of ranks; the cost is rank 0's host memory for one full copy.
3. The data order is a pure function of (seed, prompts consumed) (task.batch_indices): the count is all it needs
   (step * prompts per step, unless --dynamic-sampling drew extra rounds).
4. Completeness is file sizes (complete.json), not checksums: it catches a crash mid-write, a missing or truncated
   file, not a bit flipped in place. The lock is flock(2): local file systems, and NFS through its lock manager.
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
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from common import all_ranks_ok, barrier, master, rank
from lora import is_lora, load_adapter, merged_state_dict

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to full tensors (a collective with FSDP)
MARKER = "complete.json"
_held = []  # the open lock file: the lock lasts as long as this process


def run_config(args, world):
    """The arguments a resumed run must share with its checkpoint (not those that only change speed or logging)."""
    skip = ("steps", "eval_every", "eval_size", "save_every", "keep_last", "resume", "out_dir", "wandb", "threads",
            "engine", "vllm_memory", "vllm_url", "loss_impl", "micro_batch_size", "reward_timeout", "eval_reward",
            "eval_samples", "eval_k")
    return {k: v for k, v in vars(args).items() if k not in skip} | dict(world_size=world)


def check_out_dir(out_dir):
    """Create out_dir, make sure every rank can write there (before hours of rollouts go into it), and lock it
    for this run: one run per out-dir. A collective (once the process group exists): every rank gets the verdict."""
    error = None
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test_{rank}_{os.getpid()}")  # its own name: two runs may race here
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        error = f"--out-dir {out_dir!r} is not writable ({e.strerror}): choose another --out-dir"
    if error is None and master:
        error = lock(out_dir)
    if not all_ranks_ok(error is None):
        raise ValueError(error or f"another rank cannot write to or lock --out-dir {out_dir!r} (see its message)")


def lock(out_dir):
    """Take out_dir/run.lock (flock, exclusive) for the life of this process -> None, or why not (held by whom).
    The kernel drops the lock when the process ends, kill -9 included, so a dead run never blocks the next one."""
    f = open(os.path.join(out_dir, "run.lock"), "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not said which"
        f.close()
        return (f"--out-dir {out_dir!r} is in use by another run ({holder}): wait for it to end, stop it, or use "
                f"another --out-dir")
    f.truncate(0)
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    _held.append(f)
    return None


def _records(path):
    """The lines of metrics.jsonl (0 when there is none)."""
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def resume_point(out_dir, resume, run_config, log=print):
    """--resume auto|yes|no -> (checkpoint folder or None, its trainer state or None). Resumes the latest complete
    checkpoint (incomplete ones are skipped with a warning); a run that stopped before its first checkpoint starts
    again from step 0, saying so. Rank 0 writes run.json for a run that starts. ValueError, rather than overwrite or
    mix another run: --resume no on an out-dir that holds a run, --resume yes without a checkpoint, and a checkpoint
    or run.json written by another configuration (or records no run.json vouches for)."""
    root, metrics, info = (os.path.join(out_dir, f) for f in ("checkpoints", "metrics.jsonl", "run.json"))
    path, incomplete = find(root)
    records = _records(metrics)
    if resume == "no":
        steps = [int(p.rsplit("_", 1)[1]) for p in ([path] if path else []) + incomplete]
        held = ([f"checkpoints up to step {max(steps)}"] if steps else []) + (
            [f"metrics.jsonl with {records} records"] if records else []) + (
            ["a final model/"] if os.path.isdir(os.path.join(out_dir, "model")) else [])
        if held:
            raise ValueError(f"--resume no: {out_dir!r} holds a run ({', '.join(held)}): use another --out-dir or "
                             f"delete it (--resume auto continues it)")
    for p in incomplete:
        log(f"warning: {p} is incomplete (a crash while writing it, or a file missing or cut short): skipped")
    if path:
        return path, load(path, run_config)
    if resume == "yes":
        raise ValueError(f"--resume yes: no checkpoint under {root} (incomplete ones do not count)")
    if records:  # it stopped before its first checkpoint: it is redone from step 0, if it is this run
        try:
            saved = json.load(open(info))
        except (OSError, ValueError):  # none, or cut short
            saved = None
        diff = {k: (saved.get(k), v) for k, v in run_config.items() if saved.get(k) != v} if saved else None
        if saved is None or diff:
            why = (f"it was written by a different run configuration {diff} (saved, now): use the same arguments, "
                   if diff else "no run.json says which run wrote them: use ")
            raise ValueError(f"{metrics} holds {records} records but there is no checkpoint to resume from, and "
                             f"{why}another --out-dir, or delete it")
        log(f"warning: no complete checkpoint under {root} (the run stopped before its first --save-every): starting "
            f"again from step 0 (the {records} records in {metrics} are dropped: their steps are redone)")
    if master:
        with open(info + ".tmp", "w") as f:
            json.dump(run_config, f, indent=1, default=str)
        os.replace(info + ".tmp", info)
    return None, None


def _files(path):
    return sorted(os.path.relpath(f, path) for f in glob.glob(os.path.join(path, "**"), recursive=True)
                  if os.path.isfile(f) and not f.endswith(MARKER))


def is_complete(path):
    """Its marker exists and every file it lists has the size it had when written (no truncation, none missing)."""
    try:
        sizes = json.load(open(os.path.join(path, MARKER)))
        return all(os.path.getsize(os.path.join(path, f)) == n for f, n in sizes.items())
    except (OSError, ValueError):
        return False


def find(root):
    """-> (the latest complete step_N folder or None, the later incomplete ones that were skipped)."""
    skipped = []
    for path in sorted(glob.glob(os.path.join(root, "step_*[0-9]")), reverse=True):  # ".tmp" = an interrupted write
        if is_complete(path):
            return path, skipped
        skipped.append(path)
    return None, skipped


def load(path, run_config):
    try:
        saved = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    except Exception as e:  # the right size but not a checkpoint: a file overwritten in place
        raise ValueError(f"{path}/trainer.pt is unreadable ({type(e).__name__}): delete {path} to resume from the "
                         f"checkpoint before it") from None
    diff = {k: (saved["config"].get(k), v) for k, v in run_config.items() if saved["config"].get(k) != v}
    if diff:
        raise ValueError(f"{path} was written by a different run configuration {diff} (saved, now): use the same "
                         f"arguments, or another --out-dir")
    return saved


def save_model(model, path, state_dict, tokenizer):
    """A save_pretrained folder (safetensors: loadable by transformers and vLLM). A LoRA policy is saved merged,
    under the plain checkpoint's names (what the engine samples from), with its adapter in path/adapter."""
    if is_lora(model):
        model.save_pretrained(os.path.join(path, "adapter"))  # adapter_model.safetensors, adapter_config.json
        model, state_dict = model.get_base_model(), merged_state_dict(model, state_dict)
    model.save_pretrained(path, state_dict=state_dict)
    tokenizer.save_pretrained(path)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root, step, model, optimizer, engine, tokenizer, trainer_state, keep_last, device, pending=None):
    """A collective: every rank writes its RNG file (and pending: this rank's next batch, with --async), FSDP2
    gathers the shards, rank 0 writes the rest."""
    path = os.path.join(root, f"step_{step:06d}")
    tmp = path + ".tmp"
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    rng = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state() if device.type == "cuda" else None,
               engine=engine.state_dict(), pending=pending)  # the engines sample from a stream seeded by (seed, call)
    torch.save(rng, os.path.join(tmp, f"rng_rank{rank}.pt"))
    model_state = get_model_state_dict(model, options=FULL)  # every rank: FSDP gathers the shards
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    if master:
        save_model(model, os.path.join(tmp, "model"), model_state, tokenizer)
        torch.save(dict(optimizer=optimizer_state, **trainer_state), os.path.join(tmp, "trainer.pt"))
    barrier()
    if master:  # flushed to disk before the marker, the marker before the rename: a power cut leaves no half one
        files = _files(tmp)
        for f in files:
            _fsync(os.path.join(tmp, f))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({f: os.path.getsize(os.path.join(tmp, f)) for f in files}, f)
            f.flush()
            os.fsync(f.fileno())
        if os.path.isdir(path):  # an incomplete one the resume skipped (a complete one would have been resumed)
            shutil.rmtree(path)
        os.replace(tmp, path)
        _fsync(root)
        done = [p for p in sorted(glob.glob(os.path.join(root, "step_*[0-9]"))) if p <= path and is_complete(p)]
        for old in glob.glob(os.path.join(root, "step_*[0-9]")):  # keep the last K complete ones, and the later
            if old < done[-keep_last:][0]:  # incomplete leftovers of a crash (replaced when their step comes)
                shutil.rmtree(old)


def restore(path, saved, model, optimizer, engine, device):
    """Load the LoRA adapter (if any), the optimizer, then this rank's RNG states and engine state -> (step, optimizer
    step, prompts consumed from the data stream, the pending batch save() was given or None). Call it after the
    engine is built: vLLM's start-up reseeds the global RNGs."""
    if is_lora(model):  # the policy was built from the initial model: the checkpoint's adapter is the trained part
        load_adapter(model, os.path.join(path, "model", "adapter"))
    set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True))
    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"]), np.random.set_state(rng["numpy"]), torch.set_rng_state(rng["torch"])
    engine.load_state_dict(rng["engine"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])
    return saved["step"], saved["opt_step"], saved["prompts_consumed"], rng.get("pending")


def open_metrics(path, keep_until, log=print):
    """Rank 0: metrics.jsonl open for appending, holding only the records up to step keep_until (None: none).
    Records of steps after the checkpoint are dropped (they are redone), so is a torn line (a crash mid-write);
    both are said. The cut file replaces the old one in one rename: a crash now loses nothing."""
    kept, dropped, torn = [], 0, 0
    if keep_until is not None and not os.path.exists(path):
        log(f"warning: {path} is missing: the records up to step {keep_until} are lost, the run goes on without them")
    if keep_until is not None and os.path.exists(path):
        for line in open(path):
            try:
                if json.loads(line)["step"] <= keep_until:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
            except (ValueError, KeyError, TypeError):
                torn += 1  # its step is redone
    if dropped or torn:
        log(f"{path}: kept the {len(kept)} records up to step {keep_until}; dropped {dropped} later record(s)"
            + (f" and {torn} torn line(s)" if torn else "") + " (their steps are redone)")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
    return open(path, "a")
