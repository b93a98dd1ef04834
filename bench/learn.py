"""`python -m bench learn`: SmolLM2-135M-Instruct learns word problems on a
laptop's CPU in 15 minutes of training, and TRL's GRPOTrainer runs the same
recipe for the same training time. One plot of both.

    python -m bench learn                        # seeds 0 and 1, ours then TRL (~40 min)
    python -m bench learn --seeds 0 --max-minutes 5
    python -m bench learn --no-trl               # train.py only
    python -m bench learn --tiny                 # 2 steps each at toy sizes: checks the script

The recipe (docs/benchmarks.md, "A learning run", shows what it gives):
- the task: one-step + and - word problems with 1-digit operands
  (tests/real_model.py, bench real's file); 64 held out, never trained on.
- the system prompt: a short one the 135M model follows ("Think briefly ...,
  then give the final answer as a number"). R1's long prompt costs 60 more
  prompt tokens a row and the model never writes its <think> format.
- the rewards: final_number_reward (1 when the last number written is the
  answer) and DAPO's soft overlong punishment over the last 16 of the 64
  tokens (--overlong-buffer 16: 0 up to 48 tokens, -1 at 64), weight 1 each.
  No format reward: in 416 samples of the R1 recipe this model never earned
  the think-format one, and a reward it never earns teaches nothing. Without
  the punishment, one seed in two learned to write its answer and then ramble
  to the length limit, ending on no number (held-out 0.36 -> 0.34); with
  --mask-truncated instead, most early completions are cut and left out, and
  held-out moved +0.02 in 15 minutes. The table reports how many greedy
  answers were cut.
- full fine-tuning, lr 3e-5 constant (train.py's cosine over --steps 1000 moves
  it by under 0.1 % in a run this short), AdamW, grad clip 1, beta 0, fp32.
- G = 8 completions of 4 prompts a step, 64 new tokens, T = 0.7.

TRL trains 8 completions a forward and backward (per_device_train_batch_size 8,
gradient_accumulation_steps 4: one generation of 32 a step), as train.py's
--micro-batch-size 8: with all 32 in one forward each TRL process held 12.7 GB,
and two of them did not fit in 24 GB.

The held-out figure: greedy, final_number_reward, the 64 problems, every few
steps. train.py evaluates with its own evaluate(); TRL's model is evaluated by
the same HF engine and reward from a callback. The clock is training time:
rollout, reward and update seconds, evaluations not counted. Each run stops
at its first step past --max-minutes; its last point is its last evaluation
within them. The seeds of one trainer run at the same time, 1 thread each (one
core each); then the other trainer's.

Writes docs/learning_run.png (--plot) and prints a markdown section.
"""
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.real import real_model_or_exit, tree, write_dataset
from bench.shared import ROOT

SYSTEM_PROMPT = ("Think briefly inside <think> </think>, then give the final "
                 "answer as a number.")
RECIPE = dict(prompts=4, G=8, max_new_tokens=64, overlong_buffer=16, temperature=0.7,
              lr=3e-5)
TINY = dict(prompts=2, G=2, max_new_tokens=8, overlong_buffer=2)
NUM_EVAL = 64
# held-out evaluations: train.py every EVAL_EVERY steps; TRL (about twice as
# slow a step) every TRL_EVAL_EVERY
EVAL_EVERY = 4
TRL_EVAL_EVERY = 2


def recipe(tiny):
    return {**RECIPE, **(TINY if tiny else {})}


def train_flags(r, seed, eval_every):
    return [
        "--system-prompt", SYSTEM_PROMPT,
        "--rewards", "final_number_reward", "--eval-reward", "final_number_reward",
        "--overlong-buffer", str(r["overlong_buffer"]),
        "--G", str(r["G"]), "--prompts-per-step", str(r["prompts"]),
        "--micro-batch-size", str(r["G"]),
        "--max-new-tokens", str(r["max_new_tokens"]),
        "--temperature", str(r["temperature"]), "--lr", str(r["lr"]),
        "--warmup-steps", "0", "--beta", "0", "--entropy-coef", "0", "--grad-clip", "1",
        "--max-prompt-len", "256", "--engine", "hf", "--dtype", "float32",
        "--eval-every", str(eval_every), "--seed", str(seed),
    ]


def training_clock(records):
    """train.py's metrics records -> [(training seconds so far, record)]."""
    clock = 0.0
    out = []
    for r in records:
        clock += sum(v for k, v in r.items() if k.startswith("time_"))
        out.append((clock, r))
    return out


def read_records(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        # a line being written has no newline yet
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_ours(model, dataset, seeds, budget_s, work, tiny):
    """train.py, one process a seed, all at once -> {seed: [(clock, step,
    greedy)]}, {seed: wall seconds}. Each is stopped (SIGTERM) at its first
    step past budget_s of training time."""
    r = recipe(tiny)
    steps = 2 if tiny else 1000
    procs = {}
    for seed in seeds:
        out = os.path.join(work, f"ours_{seed}")
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--model", model,
               "--dataset", dataset, "--split", f"train[{NUM_EVAL}:]",
               "--eval-split", f"train[:{NUM_EVAL}]", "--eval-size", str(NUM_EVAL),
               "--steps", str(steps), "--threads", "1", "--save-every", str(10 * steps),
               "--out-dir", out, *train_flags(r, seed, 1 if tiny else EVAL_EVERY)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        log = open(out + ".log", "w")
        procs[seed] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT), out, time.time())

    curves = {}
    walls = {}
    while procs:
        time.sleep(2)
        for seed, (proc, out, t0) in list(procs.items()):
            clocked = training_clock(read_records(os.path.join(out, "metrics.jsonl")))
            past = clocked and clocked[-1][0] > budget_s
            if proc.poll() is None and not past:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
            elif proc.returncode != 0:
                raise RuntimeError(f"train.py failed ({proc.returncode}): see {out}.log")

            walls[seed] = time.time() - t0
            curves[seed] = [(c, rec["step"], rec["eval_greedy"], rec["eval_greedy_truncated"])
                            for c, rec in clocked if "eval_greedy" in rec and c <= budget_s]
            print(f"train.py seed {seed}: {len(clocked) - 1} steps, held-out greedy "
                  f"{curves[seed][0][2]:.3f} -> {curves[seed][-1][2]:.3f}", flush=True)
            del procs[seed]
    return curves, walls


def trl_learn(args):
    """The TRL side, in its own process (`python -m bench _trl_learn`): trains until
    args.budget seconds of training time, evaluating as it goes; writes
    [(clock, step, greedy)] to args.out."""
    from transformers import TrainerCallback

    import data
    from bench.trl_real import trl_trainer
    from reward import final_number_reward, get_soft_overlong_punishment, score
    from rollout import HFEngine

    torch.set_num_threads(1)
    r = recipe(args.tiny)
    with open(args.dataset) as f:
        rows = [json.loads(line) for line in f]
    eval_rows = rows[:NUM_EVAL]
    train_rows = rows[NUM_EVAL:]
    curve = []

    class Clock(TrainerCallback):
        """Training seconds (evaluations not counted), the held-out evaluations,
        and the stop at the budget."""

        def __init__(self):
            self.clock = 0.0
            self.eval_ids = None  # the held-out prompts, tokenized at the first evaluation

        def evaluate(self, model, step):
            tokenizer = trainer.processing_class
            if self.eval_ids is None:
                _, self.eval_ids, _ = data.prepare_prompts(tokenizer, eval_rows,
                                                           SYSTEM_PROMPT, 256, "held-out")
            engine = HFEngine(model, tokenizer)
            rollout = engine.generate(self.eval_ids, 1, r["max_new_tokens"], temperature=0.0)
            rewards = score([final_number_reward], eval_rows, rollout, True, 300)
            curve.append((self.clock, step, rewards[:, 0].nan_to_num().mean().item(),
                          1 - rollout.is_finished.float().mean().item()))
            print(f"TRL step {step}: clock {self.clock:.0f} s, held-out greedy "
                  f"{curve[-1][2]:.3f}", flush=True)

        def on_train_begin(self, _args, state, control, model=None, **kw):
            self.evaluate(model, 0)

        def on_step_begin(self, *_, **__):
            self.t0 = time.time()

        def on_step_end(self, _args, state, control, model=None, **kw):
            self.clock += time.time() - self.t0
            past = self.clock > args.budget
            if state.global_step % (1 if args.tiny else TRL_EVAL_EVERY) == 0 or past:
                self.evaluate(model, state.global_step)
            # only ever set it: the max_steps stop (DefaultFlowCallback's) runs first
            if past:
                control.should_training_stop = True

    steps = 2 if args.tiny else 1000
    punishment = get_soft_overlong_punishment(r["max_new_tokens"], r["overlong_buffer"])
    trainer = trl_trainer(args.model, train_rows, SYSTEM_PROMPT, r,
                          os.path.dirname(args.out), steps, args.seed, [Clock()],
                          [final_number_reward, punishment], [1.0, 1.0], micro=r["G"])
    trainer.train()
    with open(args.out, "w") as f:
        json.dump(curve, f)


def run_trl(model, dataset, seeds, budget_s, work, tiny):
    """TRL, one process a seed, all at once -> {seed: [(clock, step, greedy)]},
    {seed: wall seconds}."""
    procs = {}
    for seed in seeds:
        out = os.path.join(work, f"trl_{seed}.json")
        cmd = [sys.executable, "-m", "bench", "_trl_learn", "--model", model,
               "--dataset", dataset, "--out", out, "--seed", str(seed),
               "--budget", str(budget_s)]
        if tiny:
            cmd.append("--tiny")
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        log = open(os.path.join(work, f"trl_{seed}.log"), "w")
        procs[seed] = (subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                        stderr=subprocess.STDOUT), out, time.time())

    curves = {}
    walls = {}
    for seed, (proc, out, t0) in procs.items():
        if proc.wait() != 0:
            raise RuntimeError(f"the TRL run failed ({proc.returncode}): see "
                               f"{work}/trl_{seed}.log")
        walls[seed] = time.time() - t0
        with open(out) as f:
            # its last point may lie past the budget: the step that crossed it
            curves[seed] = [tuple(p) for p in json.load(f) if p[0] <= budget_s]
        print(f"TRL seed {seed}: held-out greedy {curves[seed][0][2]:.3f} -> "
              f"{curves[seed][-1][2]:.3f}", flush=True)
    return curves, walls


def plot(curves, png):
    """{trainer: {seed: [(clock, step, greedy)]}} -> png: held-out greedy against
    training minutes and against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    # a colour family a trainer, a shade and a marker a seed
    styles = {"train.py": ("-", ["tab:blue", "tab:cyan", "navy"]),
              "TRL": ("--", ["tab:red", "tab:orange", "tab:brown"])}
    markers = ["o", "s", "^"]
    for trainer, by_seed in curves.items():
        line, colours = styles[trainer]
        for i, (seed, points) in enumerate(sorted(by_seed.items())):
            clock, step, greedy, _ = zip(*points)
            style = dict(color=colours[i % 3], marker=markers[i % 3],
                         label=f"{trainer}, seed {seed}")
            axes[0].plot([c / 60 for c in clock], greedy, line, **style)
            axes[1].plot(step, greedy, line, **style)

    for ax, xlabel in zip(axes, ("training time (min, 1 core, evaluations not counted)",
                                 "step (32 completions)")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy (64 problems)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SmolLM2-135M-Instruct, GRPO on word problems: train.py and TRL 1.16, "
                 "the same recipe")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def report(curves, walls, args, budget_s):
    command = "python -m bench learn"
    if args.seeds != [0, 1]:
        command += " --seeds " + " ".join(map(str, args.seeds))
    if args.max_minutes != 15:
        command += f" --max-minutes {args.max_minutes:g}"
    if args.tiny:
        command += " --tiny"
    lines = [
        f"Command: `{command}`. Tree `{tree()}`. Training budget {budget_s / 60:.1f} min "
        f"a run, 1 thread each, the seeds of one trainer at the same time.",
        "",
        "| trainer, seed | step of the last evaluation | held-out greedy at start | at the end "
        f"| gain | best | greedy answers cut at {recipe(args.tiny)['max_new_tokens']} tokens, "
        "start -> end "
        "| wall (start-up and evaluations too) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for trainer, by_seed in curves.items():
        for seed, points in sorted(by_seed.items()):
            start = points[0][2]
            end = points[-1][2]
            best = max(p[2] for p in points)
            lines.append(f"| {trainer}, {seed} | {points[-1][1]} | {start:.3f} | {end:.3f} "
                         f"| {end - start:+.3f} | {best:.3f} "
                         f"| {points[0][3]:.2f} -> {points[-1][3]:.2f} "
                         f"| {walls[trainer][seed] / 60:.1f} min |")
    return "\n".join(lines) + "\n"


def bench_learn(args):
    real_model = real_model_or_exit("bench learn")
    model = real_model.smollm2_dir()
    work = tempfile.mkdtemp(prefix="bench_learn_")
    _, dataset = write_dataset(real_model, work, NUM_EVAL)
    budget_s = args.max_minutes * 60
    print(f"bench learn: {model}, seeds {args.seeds}, {args.max_minutes:g} min of "
          f"training a run, work folder {work}", flush=True)

    curves = {}
    walls = {}
    curves["train.py"], walls["train.py"] = run_ours(model, dataset, args.seeds, budget_s,
                                                     work, args.tiny)
    if not args.no_trl:
        from common import require

        require("trl", "python -m bench learn needs TRL for its side (not a requirement "
                "of this repo): pip install trl, or --no-trl")
        curves["TRL"], walls["TRL"] = run_trl(model, dataset, args.seeds, budget_s, work,
                                              args.tiny)

    png = args.plot or os.path.join(work, "learning_run.png")
    plot(curves, png)
    section = report(curves, walls, args, budget_s)
    with open(os.path.join(work, "curves.json"), "w") as f:
        json.dump({t: {str(s): p for s, p in c.items()} for t, c in curves.items()}, f)
    print("\n" + section)
    print(f"plot: {png}; curves in {work}/curves.json")
    gains = [c[-1][2] - c[0][2] for c in curves["train.py"].values()]
    print(f"train.py's gain: median {statistics.median(gains):+.3f}, "
          f"least {min(gains):+.3f}")
