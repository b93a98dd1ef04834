"""`python -m bench overlap`: server mode on vLLM's own server, synchronous
against --max-staleness 2, and the colocated run beside them, on SmolLM2-135M-
Instruct and bench learn's recipe (issue: server mode and bounded staleness).

    python -m bench overlap                      # 3 runs x seeds 0 1, 20 steps (~50 min)
    python -m bench overlap --seeds 0 --steps 4  # a quick look
    python -m bench overlap --tiny               # 2 steps each, short rows: checks the script

The runs, each from the same start (the model, the data, the seed):
1. sync: vLLM's server pinned to core 0 (taskset, 1 thread), the trainer to
   core 1 (1 thread); sampling and training take turns (server mode without
   --max-staleness).
2. staleness 2: the same processes with --max-staleness 2: the next batches
   are drawn on core 0 while core 1 updates.
3. colocated: train.py alone with the in-process vLLM engine, 2 threads, on
   both cores; sampling and training take turns.
One server serves every server-mode run (its start-up is not timed): the
trainer sends its weights at start-up, and each sync resets the prefix cache.

The recipe is bench learn's (bench/learn.py says why each): full fine-tuning in
fp32, G = 8 completions of 4 prompts a step, 64 new tokens, T = 0.7, lr 3e-5
constant, the final-number reward and DAPO's overlong punishment. It is a
recipe where sampling is a real share of the step: on one core the server
samples the 32 completions in about half the update's time.

Reported per run: steps an hour (3600 / the median step's wall, evaluations
taken out), the median rollout, update, sync and wait seconds, and held-out
greedy accuracy (64 problems, every --eval-every steps) against training time
and against steps. Training time: each step's wall, evaluations taken out
(an evaluation's seconds are the wall of the step after it less the run's
median step). The goals checked: an overlapped step takes <= 1.15 x
max(rollout, update) of its own run, and --max-staleness 2 makes >= 1.3 x the
synchronous steps an hour.

--frozen runs them with lr 1e-30 (the policy never changes: no fp32 weight
moves by so little): the same work a step
in every run, as the completions' lengths stay those of the start. Learning
changes them apart (a run that shortens its completions sooner makes shorter
steps), so this is the steps-an-hour comparison at equal lengths.

Writes docs/server_overlap.png (--plot) and prints a markdown section.
"""
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from bench.learn import NUM_EVAL, read_records, recipe, train_flags
from bench.real import real_model_or_exit, tree, write_dataset
from bench.shared import ROOT

RUNS = ("sync", "staleness 2", "colocated")
PORT = 8791
# the KV cache of the server: 1 GiB holds 8 GiB / (2 x 30 layers x 576 x 4 bytes)
# = 60,000 tokens of SmolLM2-135M, 40 times a step's rows
KEY = "bench-key"
# every route behind the key (README: Server mode); on loopback, plain http
SERVER_FLAGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
                "--kv-cache-memory-bytes", str(1 << 30), "--no-enable-chunked-prefill",
                "--logprobs-mode", "processed_logprobs",
                "--worker-extension-cls", "engines.worker_extension.WeightSync",
                "--middleware", "engines.worker_extension.RequireKey", "--api-key", KEY,
                "--uvicorn-log-level", "warning"]
STARTUP_S = 300


def start_server(model, work):
    """vLLM's server on core 0, one thread -> its process, once /health answers."""
    cmd = ["taskset", "-c", "0", sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", model, "--port", str(PORT), *SERVER_FLAGS]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": ROOT,
           "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    return started(cmd, ROOT, env, os.path.join(work, "server.log"))


def started(cmd, cwd, env, log_path):
    """Start a server (its own process group) -> its process, once /health at
    PORT answers."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)

    deadline = time.time() + STARTUP_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode}): see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5)
            return proc
        except OSError:
            time.sleep(2)
    stop(proc)
    raise RuntimeError(f"the server did not come up in {STARTUP_S} s: see {log_path}")


def stop(proc):
    """SIGTERM to the process group (the server's engine and workers too)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def train(run, seed, model, dataset, steps, eval_every, work, tiny, frozen=False):
    """One train.py run (a subprocess) -> its metrics records. frozen: lr 1e-30."""
    out = os.path.join(work, f"{run.replace(' ', '_')}_{seed}")
    r = recipe(tiny)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model,
           "--dataset", dataset, "--split", f"train[{NUM_EVAL}:]",
           "--eval-split", f"train[:{NUM_EVAL}]", "--eval-size", str(NUM_EVAL),
           "--steps", str(steps), "--save-every", str(10 * steps), "--out-dir", out,
           *train_flags(r, seed, eval_every)]
    # train_flags' HF engine is replaced: vLLM here, in the server or in-process
    cmd[cmd.index("--engine") + 1] = "vllm"
    if frozen:
        # train.py takes no lr 0; this one moves no fp32 weight (below half an ulp)
        cmd[cmd.index("--lr") + 1] = "1e-30"
    threads = 2 if run == "colocated" else 1
    cmd += ["--threads", str(threads)]
    if run != "colocated":
        cmd = ["taskset", "-c", "1", *cmd, "--vllm-mode", "server",
               "--vllm-url", f"http://127.0.0.1:{PORT}", "--vllm-api-key", KEY]
    if run == "staleness 2":
        cmd += ["--max-staleness", "2"]

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"train.py ({run}, seed {seed}) failed ({code}): see {out}.log")
    records = read_records(os.path.join(out, "metrics.jsonl"))
    print(f"{run}, seed {seed}: {len(records) - 1} steps in {time.time() - t0:.0f} s "
          f"(start-up and evaluations included)", flush=True)
    # the checkpoint and the final model: not needed past the metrics
    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    shutil.rmtree(os.path.join(out, "model"), ignore_errors=True)
    return records


def summarize(records, eval_every):
    """A run's records -> its figures: the median step's wall (evaluations out),
    the stages' medians, and [(training seconds, step, held-out greedy)]."""
    steps = [r for r in records if r["step"] > 0]
    walls = [b["elapsed"] - a["elapsed"] for a, b in zip([dict(elapsed=0.0)] + steps, steps)]
    # a step after an evaluation holds it: left out of the median
    evaluated = {r["step"] for r in records if "eval_greedy" in r}
    clean = [w for r, w in zip(steps, walls) if r["step"] - 1 not in evaluated]
    median_step = statistics.median(clean or walls)

    clock = 0.0
    curve = [(0.0, 0, records[0]["eval_greedy"])]
    for r, wall in zip(steps, walls):
        if r["step"] - 1 in evaluated and r["step"] > 1:
            wall = min(wall, median_step)
        clock += wall
        if "eval_greedy" in r:
            curve.append((clock, r["step"], r["eval_greedy"]))

    def median(key):
        values = [r[key] for r in steps if key in r]
        return statistics.median(values) if values else None

    return dict(step_s=median_step, steps_per_hour=3600 / median_step,
                rollout_s=median("time_rollout"), update_s=median("time_update"),
                sync_s=median("time_sync"), wait_s=median("time_wait"),
                len_mean=median("len_mean"), staleness_max=max(
                    (r.get("staleness_max", 0) for r in steps), default=0),
                dropped=sum(r.get("stale_dropped", 0) for r in steps), curve=curve)


def plot(results, png):
    """{run: {seed: figures}} -> png: held-out greedy against training minutes
    and against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"sync": "tab:blue", "staleness 2": "tab:red", "colocated": "tab:green"}
    names = {"sync": "server, synchronous", "staleness 2": "server, --max-staleness 2",
             "colocated": "colocated, 2 threads"}
    for run, by_seed in results.items():
        for i, (seed, figures) in enumerate(sorted(by_seed.items())):
            clock, step, greedy = zip(*figures["curve"])
            style = dict(color=colours[run], marker="os"[i % 2], linestyle="-:"[i % 2],
                         label=f"{names[run]}, seed {seed}")
            axes[0].plot([c / 60 for c in clock], greedy, **style)
            axes[1].plot(step, greedy, **style)

    for ax, xlabel in zip(axes, ("training time (min, evaluations taken out)",
                                 "step (32 completions)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy (64 problems)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct on 2 cores: vLLM's server (core 0) + trainer "
                 "(core 1), against colocated")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def report(results, args, steps, eval_every):
    command = "python -m bench overlap"
    if args.seeds != [0, 1]:
        command += " --seeds " + " ".join(map(str, args.seeds))
    if args.steps:
        command += f" --steps {args.steps}"
    if args.tiny:
        command += " --tiny"
    if args.frozen:
        command += " --frozen"
    lines = [
        f"Command: `{command}`. Tree `{tree()}`. {steps} steps a run, held-out greedy every "
        f"{eval_every}.",
        "",
        "| run, seed | steps an hour | median step s | rollout s | update s | sync s | wait s "
        "| held-out greedy: start -> end (step) | completion tokens (median) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def s(x):
        return "-" if x is None else f"{x:.2f}"

    for run, by_seed in results.items():
        for seed, f in sorted(by_seed.items()):
            start, end = f["curve"][0], f["curve"][-1]
            lines.append(f"| {run}, {seed} | {f['steps_per_hour']:.0f} | {f['step_s']:.2f} "
                         f"| {s(f['rollout_s'])} | {s(f['update_s'])} | {s(f['sync_s'])} "
                         f"| {s(f['wait_s'])} | {start[2]:.3f} -> {end[2]:.3f} ({end[1]}) "
                         f"| {f['len_mean']:.1f} |")

    lines.append("")
    for seed in sorted(results["sync"]):
        sync, ahead = results["sync"][seed], results["staleness 2"][seed]
        colocated = results["colocated"][seed]
        bound = max(ahead["rollout_s"], ahead["update_s"])
        lines.append(
            f"- seed {seed}: --max-staleness 2 makes {ahead['steps_per_hour'] / sync['steps_per_hour']:.2f}x "
            f"the synchronous steps an hour (goal >= 1.3), "
            f"{ahead['steps_per_hour'] / colocated['steps_per_hour']:.2f}x the colocated run's; "
            f"its step is {ahead['step_s'] / bound:.2f} x max(rollout, update) of its own "
            f"run (goal <= 1.15); staleness max {ahead['staleness_max']:.0f}, "
            f"{ahead['dropped']} batches dropped")
    return "\n".join(lines) + "\n"


def smollm2_and_problems(mode):
    """-> (SmolLM2's folder, a new work folder, the word problems' file in it),
    or SystemExit saying what is missing for `python -m bench mode`."""
    real_model = real_model_or_exit(f"bench {mode}")
    work = tempfile.mkdtemp(prefix=f"bench_{mode}_")
    _, dataset = write_dataset(real_model, work, NUM_EVAL)
    return real_model.smollm2_dir(), work, dataset


def bench_overlap(args):
    model, work, dataset = smollm2_and_problems("overlap")
    steps = 2 if args.tiny else (args.steps or 20)
    eval_every = 1 if args.tiny else max(1, steps // 4)
    if args.frozen:  # the first and last step's evaluations only
        eval_every = steps
    print(f"bench overlap: {model}, seeds {args.seeds}, {steps} steps a run, work "
          f"folder {work}{', lr 1e-30' if args.frozen else ''}", flush=True)

    results = {run: {} for run in RUNS}
    server = start_server(model, work)
    try:
        for seed in args.seeds:
            for run in RUNS[:2]:
                records = train(run, seed, model, dataset, steps, eval_every, work, args.tiny,
                                args.frozen)
                results[run][seed] = summarize(records, eval_every)
    finally:
        stop(server)
    # the colocated runs with the server gone: both cores theirs
    for seed in args.seeds:
        records = train("colocated", seed, model, dataset, steps, eval_every, work, args.tiny,
                        args.frozen)
        results["colocated"][seed] = summarize(records, eval_every)

    png = args.plot or os.path.join(work, "server_overlap.png")
    plot(results, png)
    with open(os.path.join(work, "results.json"), "w") as f:
        json.dump({run: {str(s): v for s, v in r.items()} for run, r in results.items()}, f)
    print("\n" + report(results, args, steps, eval_every))
    print(f"plot: {png}; figures in {work}/results.json")


# -----------------------------------------------------------------------------
# `python -m bench server_ranks`: 2 trainer ranks against one server, vLLM's
# own against the one-at-a-time server of OLD_TREE

OLD_TREE = "850674b"  # the last tree with our own HTTP server (server.py)


def start_old_server(tree_dir, model, work):
    """OLD_TREE's `python server.py` on core 0 -> its process, once it answers."""
    cmd = ["taskset", "-c", "0", sys.executable, "server.py", "--model", model,
           "--port", str(PORT), "--dtype", "float32", "--max-model-len", "512",
           "--kv-cache-memory-bytes", str(1 << 30)]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0", "OMP_NUM_THREADS": "1"}
    return started(cmd, tree_dir, env, os.path.join(work, "old_server.log"))


def train_two_ranks(tree_dir, name, model, dataset, steps, work, tiny):
    """train.py of tree_dir on 2 ranks (torchrun, both on core 1) against the
    server at PORT -> its records."""
    out = os.path.join(work, name)
    r = recipe(tiny)
    # 4 prompts a rank, G completions each
    flags = train_flags(dict(r, prompts=2 * r["prompts"]), 0, 0)
    flags[flags.index("--engine") + 1] = "vllm"
    cmd = ["taskset", "-c", "1", sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", "2", "train.py", "--model", model, "--dataset", dataset,
           "--split", f"train[{NUM_EVAL}:]", "--eval-split", f"train[:{NUM_EVAL}]",
           "--eval-size", str(NUM_EVAL), "--steps", str(steps), "--save-every",
           str(10 * steps), "--threads", "1", "--out-dir", out, *flags,
           "--vllm-mode", "server", "--vllm-url", f"http://127.0.0.1:{PORT}"]
    if tree_dir == ROOT:
        # vLLM's server, behind the key (OLD_TREE's own server has none)
        cmd += ["--vllm-api-key", KEY]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(out + ".log", "w") as log:
        code = subprocess.run(cmd, cwd=tree_dir, env=env, stdout=log,
                              stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"train.py of {tree_dir} failed ({code}): see {out}.log")
    return read_records(os.path.join(out, "metrics.jsonl"))


def bench_server_ranks(args):
    model, work, dataset = smollm2_and_problems("server_ranks")
    steps = 2 if args.tiny else (args.steps or 4)
    old_dir = os.path.join(work, "old_tree")
    os.makedirs(old_dir)
    subprocess.run(f"git archive {OLD_TREE} | tar -x -C {old_dir}", shell=True, cwd=ROOT,
                   check=True)
    print(f"bench server_ranks: {model}, 2 ranks, {steps} steps a run, the old tree "
          f"{OLD_TREE} in {old_dir}", flush=True)

    # each run's (rollout seconds, completion tokens a second) a step
    rollouts = {}
    for name, tree_dir in (("old", old_dir), ("vllm", ROOT)):
        if name == "old":
            server = start_old_server(old_dir, model, work)
        else:
            server = start_server(model, work)
        try:
            records = train_two_ranks(tree_dir, name, model, dataset, steps, work, args.tiny)
        finally:
            stop(server)
        rollouts[name] = [(r["time_rollout"], r["tokens_per_s"]) for r in records if r["step"] > 0]
        print(f"{name}: rollout seconds, tokens a second of steps 1..{steps}: "
              f"{[(round(s, 2), round(t)) for s, t in rollouts[name]]}", flush=True)

    # step 1 samples from the same start in both; after it, the runs' lengths part
    first = {name: each[0] for name, each in rollouts.items()}
    later = {name: [statistics.median(x) for x in zip(*each[1:])]
             for name, each in rollouts.items()}
    print(f"\nCommand: `python -m bench server_ranks`. Tree `{tree()}` against `{OLD_TREE}`'s "
          f"server.py. 2 ranks x {2 * recipe(args.tiny)['prompts'] // 2} prompts x G = "
          f"{recipe(args.tiny)['G']}, the server on core 0, both ranks on core 1.\n\n"
          f"| server | step 1: rollout s, completion tokens a second | steps 2..{steps}, "
          f"medians |\n|---|---|---|\n"
          f"| ours, one request at a time ({OLD_TREE}) | {first['old'][0]:.2f}, "
          f"{first['old'][1]:.0f} | {later['old'][0]:.2f}, {later['old'][1]:.0f} |\n"
          f"| vLLM's own | {first['vllm'][0]:.2f}, {first['vllm'][1]:.0f} | "
          f"{later['vllm'][0]:.2f}, {later['vllm'][1]:.0f} |\n\nvLLM's own, tokens a "
          f"second: {first['vllm'][1] / first['old'][1]:.2f}x at step 1, "
          f"{later['vllm'][1] / later['old'][1]:.2f}x after")


# -----------------------------------------------------------------------------
# `python -m bench contention`: why overlap buys little on this machine. The
# update's forward and backward of SmolLM2-135M on core 1, alone and while core
# 0 streams memory (what a decode step of the server does) or computes in cache


def load_on_core0(kind, stop_at):
    """A busy loop on core 0 until time stop_at: 'memory' copies 256 MB
    buffers (bandwidth-bound), 'compute' multiplies 128 x 128 matrices
    (cache-resident)."""
    os.sched_setaffinity(0, {0})
    import torch

    torch.set_num_threads(1)
    if kind == "memory":
        a, b = torch.ones(64 << 20), torch.empty(64 << 20)
        while time.time() < stop_at:
            b.copy_(a)
    else:
        x = torch.randn(128, 128)
        while time.time() < stop_at:
            x = torch.tanh(x @ x)


def bench_contention(args):
    import multiprocessing

    import torch
    from transformers import AutoModelForCausalLM

    real_model = real_model_or_exit("bench contention")
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(real_model.smollm2_dir(), dtype=torch.float32)
    ids = torch.randint(0, 49152, (8, 100))  # (8, 100): one micro-batch of bench learn's

    def step():
        t0 = time.time()
        model(ids).logits.float().log_softmax(-1).mean().backward()
        return time.time() - t0

    step()
    times = {}
    for kind in ("alone", "memory", "compute"):
        load = None
        if kind != "alone":
            context = multiprocessing.get_context("spawn")
            load = context.Process(target=load_on_core0, args=(kind, time.time() + 120))
            load.start()
            time.sleep(2)
        times[kind] = statistics.median(step() for _ in range(args.repeats))
        if load is not None:
            load.terminate()
            load.join()
        print(f"{kind}: {times[kind]:.2f} s a forward + backward of 8 x 100 tokens", flush=True)

    print(f"\nCommand: `python -m bench contention`. Tree `{tree()}`. SmolLM2-135M fp32, 1 thread "
          f"on core 1, median of {args.repeats}.\n\n| core 0 meanwhile | s | against alone |\n"
          f"|---|---|---|\n" + "\n".join(f"| {k} | {v:.2f} | {v / times['alone']:.2f}x |"
                                        for k, v in times.items()))
