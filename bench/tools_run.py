"""
`python -m bench tools_run`: does the tool help a real model learn a task that
needs it?

SmolLM2-135M-Instruct (tests/real_model.py) on word problems whose answers are
4-5 digit products: real_model.make_word_problems with 3-digit operands, kept
when the product has 4 or 5 digits. It is trained by train.py with --tools
python, and the same run without tools is the control. Both have the same
prompts (the tools' system prompt, "Use Python." after each question), flags and
seed: only --tools differs.

    python -m bench tools_run         # two runs of --steps (default 12), the table
    python -m bench tools_run --tiny  # 1 step each, 4 held out: checks the script

Reported, at the start and the end, each model in its own mode:
- held-out greedy accuracy (reward.final_number_reward: the number written
  after the last output block);
- the share of held-out completions that call the tool (with tools: a ```python
  block ran; without: one was written and closed).
And over the first and last third of the steps, the training reward and
tool_calls_mean; seconds per step. It prints a section for docs/benchmarks.md.

Simplifications:
1. The held-out figures come from this script (greedy, HFEngine, in-process, on
   the merged final model), not from train.py's own evaluation, which runs on 4
   problems only and has no tool-call figure. The held-out problems are the
   dataset file's first rows, never trained on.
2. One seed, a few steps on a shared CPU: an honest figure, not a gate.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.real import load_real_model_module, tree
from bench.shared import ROOT, bench_command

# 3-digit operands, one multiplication: a product of 4-5 digits the model cannot
# do in its head
PROBLEMS = dict(digits=3, ops="*", two_step=0.0)
NUM_TRAIN = 400
NUM_EVAL = 32
SUFFIX = " Use Python."
MAX_NEW = 96
# LoRA as bench real's run (a third less update, no AdamW state for the base).
# T = 0.7: at T = 1 this model's samples are mostly noise. G = 8 for groups whose
# rewards differ.
FLAGS = [
    "--lora-rank", "16", "--lr", "2e-4", "--warmup-steps", "2", "--beta", "0",
    "--G", "8", "--prompts-per-step", "2", "--max-new-tokens", str(MAX_NEW),
    "--temperature", "0.7",
    "--rewards", "final_number_reward",
    "--eval-reward", "final_number_reward",
    "--engine", "hf", "--eval-every", "0", "--eval-size", "4", "--max-prompt-len", "512",
]
TOOL_FLAGS = ["--tools", "python", "--max-tool-calls", "2", "--tool-output-tokens", "64"]
TINY = dict(steps=1, num_train=8, num_eval=4,
            flags=["--G", "2", "--max-new-tokens", "24"])


def problems(real_model, n):
    """n word problems whose answer has 4 or 5 digits, "Use Python." after each
    question. real_model: tests/real_model.py, loaded."""
    rows = real_model.make_word_problems(8 * n, seed=0, **PROBLEMS)
    rows = [r for r in rows if 1000 <= int(r["solution"]) < 100000]
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} problems with 4-5 digit answers: ask for "
                         f"fewer")

    return [dict(r, prompt=r["prompt"] + SUFFIX) for r in rows[:n]]


def train(out, model, dataset, num_eval, steps, flags):
    """train.py in a subprocess -> (metrics records, wall seconds); its output in
    out.log."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model,
           "--dataset", dataset, "--split", f"train[{num_eval}:]",
           "--eval-split", f"train[:{num_eval}]", "--steps", str(steps),
           "--save-every", str(steps), "--keep-last", "1", "--out-dir", out, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    t0 = time.time()
    with open(out + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                       check=True)

    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], time.time() - t0


def held_out(model_path, tokenizer, ids, rows, tools, max_new):
    """Greedy completions of the held-out prompts -> (accuracy, the share of
    completions that call)."""
    from tools.environment import load_specs
    from model import load_model
    from reward import final_number_reward
    from rollout import HFEngine
    from tools.tool_format import FENCE, FenceFormat
    from tools.multiturn import ToolEngine

    model = load_model(model_path, torch.float32, torch.device("cpu"), False, None)
    engine = HFEngine(model, tokenizer)
    if tools:
        # --tools python's loop, as train.py builds it
        specs = load_specs(["environments.python_tool.PythonTool"], [])
        engine = ToolEngine(engine, tokenizer, FenceFormat(tokenizer, 64), specs,
                            max_calls=2, timeout_s=10.0)

    rollout = engine.generate(ids, 1, max_new, temperature=0.0)

    completions = [[{"role": "assistant", "content": t}] for t in rollout.texts]
    accuracy = final_number_reward(completions, [r["solution"] for r in rows])
    if tools:
        called = [len(calls) > 0 for calls in rollout.tool_calls]
    else:
        called = [FENCE.search(t) is not None for t in rollout.texts]
    return statistics.mean(accuracy), statistics.mean(called)


def thirds(trained, key):
    third = max(1, len(trained) // 3)
    values = [r.get(key, 0.0) for r in trained]

    return statistics.mean(values[:third]), statistics.mean(values[-third:])


def bench_tools_run(args):
    real_model = load_real_model_module()
    reason = real_model.missing()
    if reason:
        print(f"tools_run: no real model here ({reason})")
        return

    torch.set_num_threads(args.threads)
    steps = TINY["steps"] if args.tiny else args.steps or 12
    num_eval = TINY["num_eval"] if args.tiny else NUM_EVAL
    num_train = TINY["num_train"] if args.tiny else NUM_TRAIN
    max_new = 24 if args.tiny else MAX_NEW
    extra = TINY["flags"] if args.tiny else []

    from config import TOOLS_SYSTEM_PROMPT
    from data import prepare_prompts
    from model import load_tokenizer

    # the dataset file and the held-out prompts
    model_dir = real_model.smollm2_dir()
    work = tempfile.mkdtemp(prefix="tinygrpo-tools-run-")
    rows = problems(real_model, num_eval + num_train)
    dataset = os.path.join(work, "problems.jsonl")
    with open(dataset, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tokenizer, _ = load_tokenizer(model_dir)
    eval_rows, eval_ids, _ = prepare_prompts(tokenizer, rows[:num_eval],
                                             TOOLS_SYSTEM_PROMPT, 512, "held-out")


    # the two runs
    flags = FLAGS + extra + ["--system-prompt", TOOLS_SYSTEM_PROMPT]
    results = {}
    for name, tools in (("with --tools python", True), ("without tools", False)):
        out = os.path.join(work, "tools" if tools else "plain")
        print(f"{name}: train.py, {steps} steps ({out}.log)", flush=True)

        run_flags = flags + TOOL_FLAGS if tools else flags
        records, wall = train(out, model_dir, dataset, num_eval, steps, run_flags)

        final = os.path.join(out, "model")
        start = held_out(model_dir, tokenizer, eval_ids, eval_rows, tools, max_new)
        end = held_out(final, tokenizer, eval_ids, eval_rows, tools, max_new)
        results[name] = (records, wall, start, end)
        print(f"    held-out accuracy {start[0]:.3f} -> {end[0]:.3f}, calls "
              f"{start[1]:.2f} -> {end[1]:.2f}, {wall / 60:.1f} min", flush=True)

    print(report(results, steps, num_eval, args))
    print(f"(work folder: {work})")


def report(results, steps, num_eval, args):
    """The markdown section for docs/benchmarks.md."""
    command = bench_command("tools_run", args)

    lines = [
        f"Command: `{command}`. Tree `{tree()}`. Word problems `{PROBLEMS}` with "
        f"4-5 digit answers, {num_eval} held out; train.py flags `{' '.join(FLAGS)}` and "
        f"the tools' system prompt, plus `{' '.join(TOOL_FLAGS)}` for the tool run; "
        f"{steps} steps.",
        "",
        "| run | held-out greedy accuracy: start -> end "
        "| held-out completions that call: start -> end "
        "| train reward: first -> last third "
        "| train tool_calls_mean: first -> last third "
        "| s/step |",
        "|---|---|---|---|---|---|",
    ]

    for name, (records, wall, start, end) in results.items():
        trained = records[1:]
        reward = thirds(trained, "reward_mean")
        calls = thirds(trained, "tool_calls_mean")
        step_s = statistics.median(sum(v for k, v in r.items() if k.startswith("time_"))
                                   for r in trained)

        call_text = "-"
        if "tool_calls_mean" in trained[0]:
            call_text = f"{calls[0]:.2f} -> {calls[1]:.2f}"
        lines.append(f"| {name} | {start[0]:.3f} -> {end[0]:.3f} | {start[1]:.2f} -> "
                     f"{end[1]:.2f} | {reward[0]:.3f} -> {reward[1]:.3f} | {call_text} | "
                     f"{step_s:.0f} |")

    return "\n".join(lines)
