"""`python -m bench gpu`'s third section: train.py on a random-init model.

Its metrics are summarised.
"""
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque

import torch

from bench.shared import ROOT, build_model, never_eos_tokenizer

# the stages train.py times each step, summed into time_step
STAGES = ("rollout", "reward", "update", "sync")


def summarize_train(records, skip=2):
    """train.py's metrics records -> the median seconds per step, and more.

    The medians are over the steps after the first `skip`, where compilation and
    warm-up land. They are of rollout, reward, update, sync and their sum, and of
    the rollout tokens/s. Then the peak memory it logged: mem_peak_gb, the
    largest; None where it logs none (on CPU, or a train.py from before the key).
    """
    steps = [r for r in records if "time_rollout" in r and r["step"] > skip]
    if not steps:
        raise ValueError(f"metrics.jsonl has no step after step {skip}")

    medians = {}
    for k in STAGES:
        medians[f"time_{k}"] = statistics.median(r[f"time_{k}"] for r in steps)
    totals = [sum(r[f"time_{k}"] for k in STAGES) for r in steps]
    medians["time_step"] = statistics.median(totals)
    medians["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steps)

    peaks = [r["mem_peak_gb"] for r in records if r.get("mem_peak_gb") is not None]
    return dict(steps_measured=f"{steps[0]['step']}-{steps[-1]['step']}", **medians,
                mem_peak_gb=max(peaks) if peaks else None)


def save_model(run, model_dir):
    """run["model"]'s shape, random init, with never_eos_tokenizer, saved to model_dir."""
    tokenizer = never_eos_tokenizer(run["vocab"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, run["dtype"])
    model = build_model(run["model"], tokenizer, device, dtype, run["vocab"])

    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def follow(cmd, section):
    """Run train.py, its output printed as it goes, less the progress bars.

    Where it fails, the last lines of its output go into the RuntimeError. On the
    way out (the section's deadline), it ends train.py and what it started.
    """
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)
    tail = deque(maxlen=20)
    t0 = time.time()

    try:
        # text mode: tqdm's \r redraws arrive as lines of their own
        for line in proc.stdout:
            tail.append(line.rstrip())
            # "engine VLLMEngine, 1 rank(s), ..."
            if line.startswith("engine "):
                section["engine"] = line.split(",")[0].split()[1]
            if not re.search(r"\d+/\d+ \[", line):
                print(f"  train.py {time.time() - t0:5.0f}s | {line.rstrip()}")
        returncode = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    if returncode != 0:
        last = " | ".join(list(tail)[-4:])
        raise RuntimeError(f"train.py exited with {returncode}: " + last)


def bench_train(args, run, section):
    """Run train.py on a random-init model; summarise its metrics.jsonl into section.

    The model has run["model"]'s shape and never_eos_tokenizer: every completion
    runs to --max-new-tokens, so each step does the same work. The data is the
    built-in sort task.
    """
    tmp = tempfile.mkdtemp(prefix="bench_train_")
    model_dir = os.path.join(tmp, "model")
    out_dir = os.path.join(tmp, "out")

    try:
        save_model(run, model_dir)

        flags = []
        for k, v in run["train"].items():
            flags += [f"--{k.replace('_', '-')}", str(v)]
        engine = args.engine or ("vllm" if args.tiny else "auto")
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model_dir,
               *flags, "--eval-every", "0", "--save-every", "1000",
               "--dtype", run["dtype"], "--engine", engine,
               "--vllm-memory", str(args.vllm_memory), "--out-dir", out_dir]
        section["command"] = "python train.py " + shlex.join(cmd[2:]).replace(tmp, "TMP")
        print(section["command"])

        try:
            follow(cmd, section)
        finally:
            # a run its deadline cut short still reports the steps it finished
            summarize_what_ran(os.path.join(out_dir, "metrics.jsonl"), section)
        if "time_step" not in section:
            raise RuntimeError("train.py finished no step past the warm-up ones")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def summarize_what_ran(metrics_path, section):
    """summarize_train of the records train.py wrote, into section; nothing if none."""
    if not os.path.exists(metrics_path):
        return

    with open(metrics_path) as f:
        # the last line may be half written when train.py was killed
        records = []
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                break

    try:
        summary = summarize_train(records)
    except ValueError:
        # no step past the warm-up ones
        return
    section.update(summary)
