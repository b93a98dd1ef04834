"""`python -m bench runs OUT [OUT ...]` and `python -m bench trl`.

runs puts train.py out-dirs side by side. trl runs TRL's GRPOTrainer against
train.py on the default run.
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.shared import ROOT


def run_summary(records):
    """A run's metrics records -> (median step, first held-out >= 0.95, time to it).

    The median step is of the wall-clock deltas of `elapsed`. A step right after an
    evaluation or a checkpoint takes the median instead, as those are not training.
    Then the first step whose held-out greedy is >= 0.95, and the training time to
    it (the deltas summed).
    """
    steps = [r for r in records if r["step"] > 0]
    after_eval = {r["step"] + 1 for r in records if "eval_greedy" in r}
    deltas = {b["step"]: b["elapsed"] - a["elapsed"] for a, b in zip(steps, steps[1:])}
    median = statistics.median(v for k, v in deltas.items() if k not in after_eval)

    first = next((r["step"] for r in records if r.get("eval_greedy", 0) >= 0.95), None)
    # never reached (None), or at the first evaluation, before any training (0)
    if not first:
        return median, first, first

    training = 0
    for k, v in deltas.items():
        if k <= first:
            training += median if k in after_eval else v
    return median, first, steps[0]["elapsed"] + training


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def bench_runs(args):
    """train.py out-dirs side by side, from their metrics.jsonl.

    Each line gives run_summary and the median of each logged stage.
    """
    for out in args.out_dirs:
        records = read_metrics(out)
        median, first, to_095 = run_summary(records)

        steps = [r for r in records if r["step"] > 0]
        stages = sorted({k for r in steps for k in r if k.startswith("time_")})
        parts = []
        for k in stages:
            stage_median = statistics.median(r.get(k, 0.0) for r in steps)
            parts.append(f"{k[5:]} {stage_median:.3f}")
        medians = " ".join(parts)

        line = (f"{out}: median step {median:.3f} s | {medians} | held-out >= 0.95 at "
                f"step {first}")
        if first:
            line += f" ({to_095:.1f} s of training)"
        if "staleness" in steps[-1]:
            line += f" | staleness {steps[-1]['staleness']}"
        print(line)


def trl_timer(recipe, steps, tokenizer, eval_rows, eval_every):
    """A TrainerCallback that times TRL's steps as train.py logs its own.

    It records the wall clock at each step's end, less the evaluations, and the
    held-out greedy accuracy every eval_every steps.
    """
    from transformers import TrainerCallback

    from reward import exact_match_reward
    from rollout import HFEngine

    eval_ids = [tokenizer(r["prompt"])["input_ids"] for r in eval_rows]
    solutions = [r["solution"] for r in eval_rows]

    class Timer(TrainerCallback):
        # as train.py's clock, which starts right before its loop
        def on_train_begin(self, *_, **__):
            self.records = []
            self.excluded = 0.0
            self.t0 = time.time()

        def on_step_end(self, targs, state, control, model=None, **_):
            now = time.time()
            record = dict(step=state.global_step, elapsed=now - self.t0 - self.excluded)

            if state.global_step % eval_every == 0 or state.global_step == steps:
                engine = HFEngine(model, tokenizer)
                greedy = engine.generate(eval_ids, 1, recipe["max_new_tokens"],
                                         temperature=0.0)
                passed = exact_match_reward(greedy.texts, solutions)
                record["eval_greedy"] = statistics.mean(passed)
                self.excluded += time.time() - now

            self.records.append(record)

    return Timer()


def bench_trl(args):
    """TRL's GRPOTrainer against train.py on the default task and recipe, per seed.

    TRL is not a requirement of this repo (pip install trl). The runs go one after
    the other, with the same tiny model (task.save_tiny_model), data, rewards and
    weights. 32 prompts x G = 8 a step, one optimizer step per batch, lr 3e-4 (10
    warmup steps, cosine to lr/10), entropy bonus 0.1, beta 0, eps 0.2, grad clip
    1, loss "grpo", --threads torch threads each. The held-out greedy accuracy is
    measured on the same 500 prompts every --eval-every steps (not timed). It
    prints s/step, the first step >= 0.95, the training time to it and the wall
    time.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import config
    import data
    import task
    from common import require
    from reward import get_reward_funcs

    if args.real:
        from bench.trl_real import bench_trl_real
        return bench_trl_real(args)

    trl = require("trl", "python -m bench trl needs TRL (not a requirement of this "
                  "repo): pip install trl")
    # TRL's dependency
    import datasets

    recipe = config.defaults(True, True, 3)
    steps = args.steps or config.parser.get_default("steps")
    rows = []
    for seed in args.seeds:
        work = tempfile.mkdtemp(prefix="bench_trl_")
        t_start = time.time()

        # 1. TRL
        init = os.path.join(work, "init")
        task.save_tiny_model(init, seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(init)
        model = AutoModelForCausalLM.from_pretrained(init)
        train_rows, eval_rows = data.load_rows(None, digits=3, eval_size=500, seed=seed,
                                               config=None, split="train",
                                               eval_split="test", prompt_column="prompt",
                                               solution_column="solution")
        timer = trl_timer(recipe, steps, tokenizer, eval_rows, args.eval_every)

        # fp32, as ours
        grpo_config = trl.GRPOConfig(
            output_dir=work, max_steps=steps, per_device_train_batch_size=32 * 8,
            num_generations=8, max_completion_length=recipe["max_new_tokens"],
            learning_rate=recipe["lr"], warmup_steps=10,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs=dict(min_lr_rate=0.1), weight_decay=0.0,
            max_grad_norm=1.0, beta=0.0, epsilon=0.2,
            entropy_coef=recipe["entropy_coef"], loss_type="grpo",
            reward_weights=recipe["reward_weights"], temperature=1.0, use_cpu=True,
            seed=seed, logging_steps=50, save_strategy="no", report_to=[],
            disable_tqdm=True, dataloader_num_workers=0, bf16=False)
        rewards = list(get_reward_funcs(recipe["rewards"]))
        dataset = datasets.Dataset.from_list(train_rows)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=rewards, args=grpo_config,
                                  train_dataset=dataset, processing_class=tokenizer,
                                  callbacks=[timer])

        torch.set_num_threads(args.threads)
        trainer.train()
        name = f"TRL {trl.__version__} GRPOTrainer"
        rows.append((name, seed, *run_summary(timer.records), time.time() - t_start))

        # 2. train.py, with each engine
        ours = [("tinygrpo (default: auto)", [], "auto")]
        if not args.no_vllm:
            ours.append(("tinygrpo --engine vllm", ["--engine", "vllm"], "vllm"))
        for name, engine, folder in ours:
            out = os.path.join(work, folder)
            t0 = time.time()
            cmd = [sys.executable, "train.py", "--seed", str(seed), "--steps", str(steps),
                   "--out-dir", out, "--threads", str(args.threads),
                   "--eval-every", str(args.eval_every), *engine]
            subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
            rows.append((name, seed, *run_summary(read_metrics(out)), time.time() - t0))

        # 3. the comparison
        trl_row = rows[-1 - len(ours)]
        trl_median = trl_row[2]
        trl_to = trl_row[4]
        for name, seed_, median, first, to_095, wall in rows[-1 - len(ours):]:
            line = (f"seed {seed_} {name:<26} {median:.3f} s/step "
                    f"({trl_median / median:.2f}x TRL's speed) | held-out >= 0.95 at "
                    f"step {first} after {to_095 or float('nan'):.1f} s of training")
            if to_095 and trl_to:
                line += f" ({trl_to / to_095:.2f}x)"
            print(line + f" | wall {wall:.0f} s", flush=True)

        folders = ", ".join(folder for *_, folder in ours)
        print(f"seed {seed}: train.py's runs are in {work} ({folders}): python -m bench "
              f"runs DIR for their stages")
