"""Resuming a run: what train.py reads back from its out-dir when it holds one
(checkpoint.py writes it all, and resume_point decides, calling these).

    held_run_point(out_dir, ...)  where a run resumes, if its out-dir holds one (or refused)
    load(path, run_config)        a checkpoint's trainer state, if it is this run's
    restore(path, saved, ...)     the adapter, optimizer, RNG and engine states into the live run
    cut_metrics(path, step)       metrics.jsonl cut back to the resumed step
    refuse_held_run, check_same_run   --resume no, and records with no checkpoint

    python train.py --out-dir out            # again: resumes out's run (--resume auto)

Run the tests: python -m pytest -q tests/test_checkpoint.py tests/test_resume.py
"""
import json
import os
import random

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

from common import is_lora, rank


def held_run_point(out_dir, resume, run_config, path, incomplete, records, log=print):
    """checkpoint.resume_point's verdict on an out-dir that holds a run, or under
    --resume yes|no -> (the checkpoint to resume, its trainer state), or None:
    start at step 0. path: the latest complete checkpoint; incomplete: later
    ones, skipped; records: metrics.jsonl's lines. ValueError: refused."""
    root = os.path.join(out_dir, "checkpoints")
    metrics = os.path.join(out_dir, "metrics.jsonl")
    if resume == "no":
        refuse_held_run(out_dir, path, incomplete, records)

    for p in incomplete:
        log(f"warning: {p} is incomplete (a crash while writing it, "
            f"or a file missing or cut short): skipped")
    if path:
        return path, load(path, run_config)
    if resume == "yes":
        raise ValueError(f"--resume yes: no checkpoint under {root} "
                         f"(incomplete ones do not count)")

    # stopped before its first checkpoint: redone from step 0, if it is this run
    if records:
        check_same_run(os.path.join(out_dir, "run.json"), metrics, records, run_config)
        log(f"warning: no complete checkpoint under {root} "
            f"(the run stopped before its first --save-every): "
            f"starting again from step 0 (the {records} records in {metrics} "
            f"are dropped: their steps are redone)")
    return None


def refuse_held_run(out_dir, path, incomplete, records):
    """--resume no: ValueError if out_dir holds a run (checkpoints: path, the
    latest complete, and the incomplete ones; records in metrics.jsonl; a
    final model/), saying what it holds."""
    steps = [int(p.rsplit("_", 1)[1]) for p in ([path] if path else []) + incomplete]
    held = []
    if steps:
        held.append(f"checkpoints up to step {max(steps)}")
    if records:
        held.append(f"metrics.jsonl with {records} records")
    if os.path.isdir(os.path.join(out_dir, "model")):
        held.append("a final model/")
    if held:
        raise ValueError(f"--resume no: {out_dir!r} holds a run "
                         f"({', '.join(held)}): use another --out-dir or delete it "
                         f"(--resume auto continues it)")


def check_same_run(info, metrics, records, run_config):
    """ValueError unless run.json (info) vouches for the records.

    It must hold the same configuration.
    """
    try:
        saved = json.load(open(info))
    # none, or cut short
    except (OSError, ValueError):
        saved = None

    diff = None
    if saved:
        diff = {k: (saved.get(k), v) for k, v in run_config.items() if saved.get(k) != v}
    if saved is None or diff:
        why = "no run.json says which run wrote them: use "
        if diff:
            why = (f"it was written by a different run configuration {diff} "
                   f"(saved, now): use the same arguments, ")
        raise ValueError(f"{metrics} holds {records} records but there is no checkpoint "
                         f"to resume from, and {why}another --out-dir, or delete it")


def load(path, run_config):
    """A complete checkpoint's trainer state (trainer.pt), once its run
    configuration is this run's; else ValueError."""
    try:
        saved = torch.load(os.path.join(path, "trainer.pt"), weights_only=False)
    # the right size but not a checkpoint: a file overwritten in place
    except Exception as e:
        raise ValueError(f"{path}/trainer.pt is unreadable ({type(e).__name__}): "
                         f"delete {path} to resume from the checkpoint "
                         f"before it") from None

    diff = {k: (saved["config"].get(k), v) for k, v in run_config.items()
            if saved["config"].get(k) != v}
    if diff:
        raise ValueError(f"{path} was written by a different run configuration {diff} "
                         f"(saved, now): use the same arguments, or another --out-dir")
    return saved


def restore(path, saved, model, optimizer, engine, device, reference=None):
    """Load the LoRA adapter (if any), the optimizer, this rank's RNG and engine states.

    And into reference (--sync-ref-every), the reference's weights: save() wrote
    them. -> (step, optimizer step, prompts consumed, save()'s pending batches or
    None). Call it after the engine is built: vLLM's start-up reseeds the global
    RNGs.
    """
    # the policy was built from the initial model: the checkpoint's adapter is the
    # trained part
    if is_lora(model):
        from scale.lora import load_adapter

        load_adapter(model, os.path.join(path, "model", "adapter"))

    options = StateDictOptions(full_state_dict=True)
    set_optimizer_state_dict(model, optimizer, saved["optimizer"], options=options)
    if reference is not None:
        weights = torch.load(os.path.join(path, "reference.pt"), map_location=device)
        reference.load_state_dict(weights)

    rng = torch.load(os.path.join(path, f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    engine.load_state_dict(rng["engine"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])

    return saved["step"], saved["opt_step"], saved["prompts_consumed"], rng.get("pending")


def cut_metrics(path, keep_until, log=print):
    """Rank 0: metrics.jsonl cut back to step keep_until, the resumed step.

    It keeps only the records up to that step. Later records (redone) and torn
    lines (a crash mid-write) are dropped, saying so. The cut file replaces the
    old one in one rename, so a crash now loses nothing.
    """
    kept = []
    dropped = 0
    torn = 0
    if not os.path.exists(path):
        log(f"warning: {path} is missing: the records up to step {keep_until} are lost, "
            f"the run goes on without them")

    if os.path.exists(path):
        for line in open(path):
            try:
                if json.loads(line)["step"] <= keep_until:
                    kept.append(line if line.endswith("\n") else line + "\n")
                else:
                    dropped += 1
            except (ValueError, KeyError, TypeError):
                torn += 1  # its step is redone

    if dropped or torn:
        torn_lines = f" and {torn} torn line(s)" if torn else ""
        log(f"{path}: kept the {len(kept)} records up to step {keep_until}; "
            f"dropped {dropped} later record(s){torn_lines} (their steps are redone)")

    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)
