"""
`python -m bench game_run`: does an environment that answers let a real model
learn a game it cannot win blind?

SmolLM2-135M-Instruct (tests/real_model.py) plays guess the number
(environments/guess_number.py: a secret from 1 to 16, "higher", "lower" or
"correct" after each guess, the environment's get_reward the only reward),
through the chat template's tool calls (assets/chatml_tools.jinja). The control
is the same prompt without the environment: one answer, scored by
final_number_reward against the secret. Each for each seed; only the
environment differs.

    python -m bench game_run                  # 2 seeds x 2 runs of --steps (default 6)
    python -m bench game_run --tiny           # 1 step each, 4 held out: checks the script

Reported per run: held-out success (greedy, 64 games never trained on: the
environment's reward > 0, or the control's number right), the share of held-out
completions that make a call, and over the first and last third of the steps
the training reward, its spread within groups (reward_std: 0 means nothing to
learn from) and tool_calls_mean.
"""
import json
import os
import statistics
import tempfile

import torch

from bench.real import load_real_model_module, tree
from bench.shared import ROOT, bench_command
from bench.tools_run import thirds, train

GUESS = "environments.guess_number.GuessNumber"
# train.py runs in ROOT
TEMPLATE = "assets/chatml_tools.jinja"
# a 135M model needs the call's form spelled out (it writes Python otherwise)
SYSTEM_PROMPT = ('Play by calling the guess tool. Reply with only a tool call, like this:\n'
                 '<tool_call>\n{"name": "guess", "arguments": {"number": 8}}\n</tool_call>')
NUM_TRAIN = 400
NUM_EVAL = 64
MAX_NEW = 160
FLAGS = [
    "--lora-rank", "16", "--lr", "2e-4", "--warmup-steps", "2", "--beta", "0",
    "--G", "8", "--prompts-per-step", "2", "--max-new-tokens", str(MAX_NEW),
    "--temperature", "0.7", "--engine", "hf", "--eval-every", "0", "--eval-size", "4",
    "--max-prompt-len", "512", "--chat-template", TEMPLATE,
    "--system-prompt", SYSTEM_PROMPT,
]
ENV_FLAGS = ["--environment", GUESS, "--max-tool-calls", "6", "--tool-output-tokens", "16"]
CONTROL_FLAGS = ["--rewards", "final_number_reward", "--eval-reward", "final_number_reward"]
TINY = dict(steps=1, num_eval=4, flags=["--G", "2", "--max-new-tokens", "24"])


def held_out(model_path, tokenizer, rows, with_env, max_new):
    """Greedy games -> (success rate, the share of completions that call)."""
    import data
    from tools.environment import load_specs
    from model import load_model
    from reward import final_number_reward
    from rollout import HFEngine
    from tools.tool_format import TemplateFormat
    from tools.multiturn import ToolEngine

    model = load_model(model_path, torch.float32, torch.device("cpu"), False, None)
    engine = HFEngine(model, tokenizer)

    tools_of = None
    if with_env:
        specs = load_specs([GUESS], [])
        engine = ToolEngine(engine, tokenizer, TemplateFormat(tokenizer, 16), specs,
                            max_calls=6, timeout_s=10.0)

        def tools_of(row):
            return list(specs[None].schemas.values())

    _, ids, _ = data.prepare_prompts(tokenizer, rows, SYSTEM_PROMPT, 512, "held-out",
                                     tools_of=tools_of)
    extra = dict(rows=rows) if with_env else {}
    rollout = engine.generate(ids, 1, max_new, temperature=0.0, **extra)

    if with_env:
        won = [value > 0 for _, value in rollout.environment_rewards]
        called = [len(calls) > 0 for calls in rollout.tool_calls]
        return statistics.mean(won), statistics.mean(called)

    completions = [[{"role": "assistant", "content": t}] for t in rollout.texts]
    won = final_number_reward(completions, [r["solution"] for r in rows])
    called = ["<tool_call>" in t for t in rollout.texts]
    return statistics.mean(won), statistics.mean(called)


def bench_game_run(args):
    real_model = load_real_model_module()
    reason = real_model.missing()
    if reason:
        print(f"game_run: no real model here ({reason})")
        return

    torch.set_num_threads(args.threads)
    steps = TINY["steps"] if args.tiny else args.steps or 6
    num_eval = TINY["num_eval"] if args.tiny else NUM_EVAL
    max_new = 24 if args.tiny else MAX_NEW
    extra = TINY["flags"] if args.tiny else []
    seeds = args.seeds if len(args.seeds) > 1 or args.tiny else [0, 1]

    from environments.guess_number import make_rows
    from model import load_tokenizer

    model_dir = real_model.smollm2_dir()
    work = tempfile.mkdtemp(prefix="tinygrpo-game-run-")
    # held-out games first: another draw of secrets than the training rows
    rows = make_rows(num_eval, seed=1) + make_rows(NUM_TRAIN, seed=0)
    dataset = os.path.join(work, "games.jsonl")
    with open(dataset, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tokenizer, _ = load_tokenizer(model_dir)
    with open(os.path.join(ROOT, TEMPLATE)) as f:
        tokenizer.chat_template = f.read()
    eval_rows = rows[:num_eval]

    start = {name: held_out(model_dir, tokenizer, eval_rows, name == "environment", max_new)
             for name in ("environment", "control")}
    results = []
    for seed in seeds:
        for name, flags in (("environment", ENV_FLAGS), ("control", CONTROL_FLAGS)):
            out = os.path.join(work, f"{name}_{seed}")
            print(f"{name}, seed {seed}: train.py, {steps} steps ({out}.log)", flush=True)

            run_flags = FLAGS + extra + flags + ["--seed", str(seed)]
            records, wall = train(out, model_dir, dataset, num_eval, steps, run_flags)
            end = held_out(os.path.join(out, "model"), tokenizer, eval_rows,
                           name == "environment", max_new)
            results.append((name, seed, records, wall, start[name], end))
            print(f"    held-out success {start[name][0]:.3f} -> {end[0]:.3f}, "
                  f"{wall / 60:.1f} min", flush=True)

    print(report(results, steps, num_eval, args))
    print(f"(work folder: {work})")


def report(results, steps, num_eval, args):
    """The markdown section for docs/benchmarks.md."""
    command = bench_command("game_run", args)

    lines = [
        f"Command: `{command}`. Tree `{tree()}`. Guess the number 1-16, {num_eval} held-out "
        f"games; train.py flags `{' '.join(FLAGS[:-2])}` and the system prompt in "
        f"bench/game_run.py, plus `{' '.join(ENV_FLAGS)}` (environment) or "
        f"`{' '.join(CONTROL_FLAGS)}` (control); {steps} steps.",
        "",
        "| run | seed | held-out success: start -> end | held-out completions that call: "
        "start -> end | train reward: first -> last third | train reward_std: first -> "
        "last third | train tool_calls_mean: first -> last third | s/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, seed, records, wall, start, end in results:
        trained = records[1:]
        reward = thirds(trained, "reward_mean")
        spread = thirds(trained, "reward_std")
        calls = thirds(trained, "tool_calls_mean")
        step_s = statistics.median(sum(v for k, v in r.items() if k.startswith("time_"))
                                   for r in trained)

        call_text = "-"
        if "tool_calls_mean" in trained[0]:
            call_text = f"{calls[0]:.2f} -> {calls[1]:.2f}"
        lines.append(f"| {name} | {seed} | {start[0]:.3f} -> {end[0]:.3f} | {start[1]:.2f} "
                     f"-> {end[1]:.2f} | {reward[0]:.3f} -> {reward[1]:.3f} | "
                     f"{spread[0]:.3f} -> {spread[1]:.3f} | {call_text} | {step_s:.0f} |")
    return "\n".join(lines)
