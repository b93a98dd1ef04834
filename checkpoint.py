"""Checkpoints: everything a bit-exact resume needs, written so that a crash never passes for a checkpoint.

    out/checkpoints/step_NNNNNN/
        model/           safetensors + tokenizer (save_pretrained: transformers and vLLM load it)
        trainer.pt       optimizer state, step, optimizer step, the run configuration it belongs to
        rng_rank{R}.pt   rank R's RNG states (python, numpy, torch, cuda) and its rollout engine's state
        complete.json    written last: the size of every file above

    find(root)                         -> the latest complete checkpoint, and the incomplete ones it skipped
    load(path, run_config)             -> its trainer state; ValueError if another configuration wrote it
    save(root, step, ...)              write step_N.tmp on every rank, fsync, mark complete, rename, keep the last K
    restore(path, saved, ...)          optimizer, RNG states and engine state -> (step, optimizer step)
    open_metrics(path, step)           metrics.jsonl cut back to the checkpoint's step (a torn last line dropped)

Run the tests: python -m pytest -q tests/test_resume.py

Simplifications:
1. Every rank writes its own RNG file into a shared folder (one node, or a shared file system).
2. Model and optimizer are gathered to full tensors on rank 0 (FSDP2 too): simple, and a checkpoint loads on any
   number of ranks; the cost is rank 0's host memory for one full copy.
3. The data order is a pure function of (seed, step) (task.batch_indices), so it needs no state.
"""
import glob
import json
import os
import random
import shutil

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from common import barrier, master, rank

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to full tensors (a collective with FSDP)
MARKER = "complete.json"


def run_config(args, world):
    """The arguments a resumed run must share with its checkpoint (not those that only change speed or logging)."""
    skip = ("steps", "eval_every", "eval_size", "save_every", "keep_last", "resume", "out_dir", "wandb", "threads",
            "engine", "vllm_memory", "vllm_url", "loss_impl", "micro_batch_size")
    return {k: v for k, v in vars(args).items() if k not in skip} | dict(world_size=world)


def check_out_dir(out_dir):
    """Create out_dir and make sure this rank can write there, before hours of rollouts go into it."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        open(os.path.join(out_dir, f".write_test_{rank}"), "w").close()
        os.remove(os.path.join(out_dir, f".write_test_{rank}"))
    except OSError as e:
        raise ValueError(f"--out-dir {out_dir!r} is not writable ({e.strerror}): choose another --out-dir") from None


def resume_point(root, resume, run_config, log=print):
    """--resume auto|yes|no -> (checkpoint folder or None, its trainer state or None). Incomplete checkpoints are
    skipped with a warning; ValueError for --resume yes without one, or one written by another configuration."""
    path, incomplete = find(root) if resume != "no" else (None, [])
    for p in incomplete:
        log(f"warning: {p} is incomplete (a crash while writing it?): skipped")
    if resume == "yes" and path is None:
        raise ValueError(f"--resume yes: no checkpoint under {root}")
    return path, load(path, run_config) if path else None


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
    saved = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    diff = {k: (saved["config"].get(k), v) for k, v in run_config.items() if saved["config"].get(k) != v}
    if diff:
        raise ValueError(f"{path} was written by a different run configuration {diff} (saved, now): use the same "
                         f"arguments, another --out-dir, or --resume no to start over")
    return saved


def save_model(model, path, state_dict, tokenizer):
    model.save_pretrained(path, state_dict=state_dict)  # safetensors: loadable by transformers and vLLM
    tokenizer.save_pretrained(path)


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root, step, model, optimizer, engine, tokenizer, trainer_state, keep_last, device):
    """A collective: every rank writes its RNG file, FSDP2 gathers the shards, rank 0 writes the rest."""
    path = os.path.join(root, f"step_{step:06d}")
    tmp = path + ".tmp"
    if master:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    rng = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state() if device.type == "cuda" else None,
               engine=engine.state_dict())  # the engines sample from a stream seeded by (seed, call number)
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
        os.replace(tmp, path)
        _fsync(root)
        for old in sorted(glob.glob(os.path.join(root, "step_*[0-9]")))[:-keep_last]:
            shutil.rmtree(old)


def restore(path, saved, model, optimizer, engine, device):
    """Load the optimizer, then this rank's RNG states and engine state -> (step, optimizer step). Call it after
    the engine is built: vLLM's start-up reseeds the global RNGs."""
    set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True))
    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"]), np.random.set_state(rng["numpy"]), torch.set_rng_state(rng["torch"])
    engine.load_state_dict(rng["engine"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])
    return saved["step"], saved["opt_step"]


def open_metrics(path, keep_until):
    """Rank 0: metrics.jsonl open for appending, holding only the records up to step keep_until (None: none).
    Records of steps after the checkpoint are dropped (they are redone), so is a torn last line (a crash mid-write)."""
    kept = []
    if keep_until is not None and os.path.exists(path):
        for line in open(path):
            try:
                if json.loads(line)["step"] <= keep_until:
                    kept.append(line if line.endswith("\n") else line + "\n")
            except (ValueError, KeyError):
                pass  # a torn line: its step is redone
    f = open(path, "w")
    f.writelines(kept)
    return f
