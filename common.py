"""
The few things every file needs and that are not a stage.
It imports nothing from the project.

    rank, world, master, ddp   torchrun's RANK and WORLD_SIZE (alone: 0, 1, True, False)
    print0(...)                print on rank 0 only
    fail(msg)                  "error: msg", exit 2 on all ranks (none left waiting)
    all_ranks_ok(ok), barrier  one verdict for all ranks; a barrier (no-op on 1 process)
    setup(threads, dtype)      process group, device, threads; stop when the launcher dies
    mark(phase), startup_line  how long each start-up phase took
    step_line(record)          the one line printed per step
    private_rng(seed), unwrap  a seeded stretch of the global RNGs; the module under DDP
    is_lora(model)             whether the policy carries LoRA adapters (peft)
"""
import importlib
import logging
import os
import random
import sys
import threading
import time
import warnings
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
master = rank == 0
ddp = world > 1


def cause(e):
    """An exception in a few words: its type and first line, and those of its cause.

    datasets wraps pyarrow's errors, and transformers wraps the hub's.
    """
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    text = f"{type(e).__name__}: {first}"

    if e.__cause__ is not None:
        text += f" <- {cause(e.__cause__)}"
    return text


def print0(*a, **kw):
    if master:
        print(*a, **kw, flush=True)


def fail(msg, everywhere=True):
    """Exit non-zero with one line that says what to change.

    The line is printed once, or by the rank that hit it.
    """
    if master or not everywhere:
        where = "" if everywhere else f" (rank {rank})"
        print(f"error{where}: {msg}", flush=True)

    # Every rank is here: none exits before the master's line is out. torchrun
    # stops the other ranks as soon as one exits.
    if everywhere and dist.is_initialized():
        dist.barrier()
    raise SystemExit(2)


_marks = []  # (phase, time it ended)


def mark(phase):
    """Note the end of a start-up phase (startup_line says how long each took)."""
    _marks.append((phase, time.time()))


def startup_line(t_launch):
    """Rank 0's line on how long the start-up took.

    For example "start-up 21.3 s: imports, data 6.1 s, models 0.4 s, engine 9.8 s,
    first evaluation 5.0 s".
    """
    t = t_launch
    parts = []
    for phase, end in _marks:
        parts.append(f"{phase} {end - t:.1f} s")
        t = end

    return f"start-up {t - t_launch:.1f} s: " + ", ".join(parts)


def collective_device():
    """Where a tensor must live for a collective.

    That is the current GPU under NCCL, the CPU under gloo.
    """
    if dist.get_backend() == "nccl":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def all_ranks_ok(ok):
    """True iff every rank is ok.

    A rank that hit an error must not leave the others waiting in a collective.
    """
    if not ddp:
        return ok

    flag = torch.tensor([int(ok)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def barrier():
    if ddp:
        dist.barrier()


def require(module, message):
    """Import an optional package, or fail with one line that says how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        fail(message)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(threads, dtype_name):
    """Process group, device and torch threads -> (device, compute dtype).

    The process group is nccl on GPUs, gloo on CPU. setup also silences
    save_pretrained's per-shard progress bars, which would break the step bar
    (datasets' bars: task.py). And it makes a rollout server that is gone end this
    rank with its one line: server.py's ConnectionError, from any thread.
    """
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()

    # vLLM's noise that asks nothing of the user. One is a Triton notice it logs
    # before configuring its own logger (Python's last-resort handler prints it).
    # The other is a deprecation warning from its own import (vLLM 0.32).
    logging.getLogger("vllm").addHandler(logging.NullHandler())
    warnings.filterwarnings("ignore", r"`torch.distributed.reduce_op` is deprecated",
                            FutureWarning)

    watch_launcher()
    one_line_errors(ConnectionError)

    if torch.cuda.is_available():
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    else:
        device = torch.device("cpu")
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)

    auto = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"auto": auto, "float32": torch.float32, "bfloat16": torch.bfloat16}
    return device, dtypes[dtype_name]


def watch_launcher(poll_s=1.0):
    """End this worker when its launcher dies.

    This holds under torchrun, or another launcher that sets LOCAL_RANK. A kill -9
    of the agent leaves the workers training on, unseen, into an out-dir that a
    relaunch then finds locked. A daemon thread compares os.getppid() with its
    value at start. The exit is abrupt (os._exit), which loses at most the step in
    flight: checkpoints are atomic, and a torn metrics line is dropped on resume.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return

    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(poll_s)

        try:
            print(f"error (rank {rank}): the launcher (pid {launcher}) is gone: "
                  "stopping this worker", flush=True)
        finally:
            os._exit(3)

    threading.Thread(target=watch, name="watch_launcher", daemon=True).start()


def one_line_errors(*kinds):
    """An uncaught exception of exactly these classes ends this rank in one line.

    The line is "error (rank R): its message", and the exit status 1, not a
    traceback. server.RemoteEngine's ConnectionError already says what is gone and
    what to do. It can come from many calls that each rank makes on its own: a
    generate, a sync, the --async batch's Future. Subclasses keep their traceback:
    a raw socket's ConnectionRefusedError from elsewhere says less.
    """
    default = sys.excepthook

    def hook(kind, error, traceback):
        if kind in kinds:
            print(f"error (rank {rank}): {error}", flush=True)
        else:
            default(kind, error, traceback)

    sys.excepthook = hook


def is_lora(model):
    """Whether model (unwrapped from DDP) is a peft PeftModel (--lora-rank). Here,
    not in lora.py, so that a run without LoRA never imports lora.py."""
    return hasattr(model, "peft_config")


def unwrap(model):
    """The module under a DDP wrapper (its parameter names lack the 'module.' prefix)."""
    return model.module if hasattr(model, "module") else model


@contextmanager
def private_rng(seed):
    """Run the body on the global RNGs seeded by seed, then restore them.

    The RNGs are torch's CPU and CUDA device ones, random's and numpy's.
    """
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    python_state = random.getstate()
    numpy_state = np.random.get_state()

    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)

        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def step_line(record, times=None):
    """The one line printed per step; step 0 is the first evaluation.

    metrics.jsonl holds every number.
    """
    parts = [f"step {record['step']}"]

    if times is not None:
        parts.append(f"reward {record['reward_mean']:.3f}")
        parts.append(f"loss {record['loss']:.4f}")
        if "kl" in record:
            parts.append(f"kl {record['kl']:.4f}")
        if "entropy_coef" in record:  # --adaptive-entropy
            parts.append(f"entropy_coef {record['entropy_coef']:.4f}")
        parts.append(f"len {record['len_mean']:.1f}")
        parts.append(" ".join(f"{k} {v:.2f}s" for k, v in times.items()))

    if "eval_greedy" in record:
        passes = ""
        for k, v in record.items():
            if k.startswith("pass@"):
                passes += f" {k} {v:.3f}"
        parts.append(f"held-out greedy {record['eval_greedy']:.3f} "
                     f"sampled {record['eval_sampled']:.3f}{passes}")

    return " | ".join(parts)
