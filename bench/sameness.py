"""
`python -m bench sameness`: does a change of the source leave every run the same,
bit for bit? The same train.py runs on two checkouts, then every record of their
metrics.jsonl compared, less the wall-clock and memory fields.

    python -m bench sameness run TREE OUTROOT [--only NAME ...] [--extra="FLAGS"]
    python -m bench sameness compare BASEROOT NEWROOT

run: each run of RUNS in the checkout folder TREE (train.py of TREE, cwd=TREE), one
after the other, into OUTROOT/NAME (its --out-dir), its output in OUTROOT/NAME.log,
1 torch thread (OMP_NUM_THREADS=1). A run that succeeds leaves
OUTROOT/NAME/sameness.json (its command, seconds and TREE's commit); one that has
it is skipped, so an interrupted `run` resumes. An out-dir without it is removed
and its run started again. The first run that fails stops everything, with the
tail of its log. --extra appends flags to every run (`--extra="--fast auto"`:
with the = when the flags are one word). --only NAME ...: those runs only.

compare: for each run in both roots, metrics.jsonl of each, without the keys
time*, tokens_per_s, elapsed, tool_seconds, rss_peak_gb and mem_peak_gb, compared
as lists of dicts with ==. NaN and infinities are read as the strings JSON writes,
so a NaN equals a NaN. It prints a markdown table (identical, or the first step,
key and the two values that differ) and exits 1 if any run differs.

The runs, each `python train.py --out-dir OUTROOT/NAME FLAGS` (docs/benchmarks.md,
"The restructured layout: the same runs, bit for bit"):

    default_hf    --engine hf                                    (400 steps)
    default_vllm  --engine vllm                                  (400 steps)
    lora_hf       --engine hf --lora-rank 8 --beta 0.04 --steps 60
    lora_vllm     --engine vllm --lora-rank 8 --beta 0.04 --steps 20
    knobs1        --loss-type sapo --beta 0.04 --kl-bias-correction --num-iterations 2
                  --minibatch-size 64 --micro-batch-size 32 --is-correction
                  token_truncate --mask-truncated --top-entropy-quantile 0.5
                  --dynamic-sampling 3 --steps 30
    knobs2        --loss-type cispo --epsilon-high 5 --importance-sampling-level
                  sequence --off-policy-mask 0.1 --num-iterations 2 --scale-rewards
                  batch --steps 30
    knobs3        --loss-type dr_grpo --is-correction sequence_mask --is-min 0.5
                  --tis-cap 0 --eval-samples 4 --minibatch-size 128 --steps 30
    triton        TRITON_INTERPRET=1, --loss-impl triton --beta 0.04 --steps 3
    ranks2        torchrun --standalone --nproc_per_node 2 train.py --engine hf
                  --steps 30 --beta 0.04 --top-entropy-quantile 0.5
    tools_hf      --tools python on the coder, 8 steps, --engine hf (TOOLS below)
    tools_vllm    the same, --engine vllm

The coder (tests/test_tools.py's `coder` fixture): a 1-layer Qwen2 of task.py,
fine-tuned with tests/helpers.fine_tune to answer "6*7=" with a ```python block
that prints 6*7, the output block, then the answer. It is built once per OUTROOT,
by TREE's own code in a subprocess (cwd=TREE), into OUTROOT/_coder/model, beside
the 4 problems (problems.jsonl) and the reward (coder_reward.py: test_tools.py's
answer_reward, copied here so that train.py need not import the test file).
compare also says whether the two roots' coders are the same bytes.
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

# the tools runs' data and model, in OUTROOT
CODER = "_coder"
TOOLS = ("--model {coder}/model --dataset {coder}/problems.jsonl --eval-split train[:4] "
         "--system-prompt '' --tools python --max-new-tokens 64 --tool-output-tokens 32 "
         "--lr 3e-3 --rewards coder_reward.answer_reward "
         "--eval-reward coder_reward.answer_reward --steps 8 --eval-every 4 "
         "--eval-size 4 --prompts-per-step 2 --G 4")

# name: train.py's flags ({coder}: OUTROOT/_coder), and optionally its environment
# and ranks (torchrun)
RUNS = {
    "default_hf": dict(flags="--engine hf"),
    "default_vllm": dict(flags="--engine vllm"),
    "lora_hf": dict(flags="--engine hf --lora-rank 8 --beta 0.04 --steps 60"),
    "lora_vllm": dict(flags="--engine vllm --lora-rank 8 --beta 0.04 --steps 20"),
    "knobs1": dict(flags="--loss-type sapo --beta 0.04 --kl-bias-correction "
                   "--num-iterations 2 --minibatch-size 64 --micro-batch-size 32 "
                   "--is-correction token_truncate --mask-truncated "
                   "--top-entropy-quantile 0.5 --dynamic-sampling 3 --steps 30"),
    "knobs2": dict(flags="--loss-type cispo --epsilon-high 5 "
                   "--importance-sampling-level sequence --off-policy-mask 0.1 "
                   "--num-iterations 2 --scale-rewards batch --steps 30"),
    "knobs3": dict(flags="--loss-type dr_grpo --is-correction sequence_mask --is-min 0.5 "
                   "--tis-cap 0 --eval-samples 4 --minibatch-size 128 --steps 30"),
    "triton": dict(flags="--loss-impl triton --beta 0.04 --steps 3",
                   env={"TRITON_INTERPRET": "1"}),
    "ranks2": dict(flags="--engine hf --steps 30 --beta 0.04 --top-entropy-quantile 0.5",
                   nproc=2),
    "tools_hf": dict(flags=TOOLS + " --engine hf", env={"PYTHONPATH": "{coder}"}),
    "tools_vllm": dict(flags=TOOLS + " --engine vllm", env={"PYTHONPATH": "{coder}"}),
}

# wall-clock and memory fields: they differ from run to run (and any key starting
# with "time")
WALL_CLOCK = {"tokens_per_s", "elapsed", "tool_seconds", "rss_peak_gb", "mem_peak_gb"}

# tests/test_tools.py's PROBLEMS
PROBLEMS = {"6*7=": "42", "5*9=": "45", "8*8=": "64", "3*4=": "12"}

# tests/test_tools.py's answer_reward, as a module train.py imports (--rewards)
REWARD_MODULE = '''\
def answer_reward(completions, solution, tool_calls, **kw):
    """1 when the text after the last output block is the answer, plus 0.1 per
    call that ran without an error."""
    answers = [c.rsplit("```\\n", 1)[-1].strip() for c in completions]
    ran = [sum(not call["error"] for call in calls) for calls in tool_calls]

    return [float(a == s) + 0.1 * k for a, s, k in zip(answers, solution, ran)]
'''

# tests/test_tools.py's coder fixture, run by TREE's python code (cwd=TREE):
# argv[1] the model folder, argv[2] PROBLEMS as JSON
CODER_SCRIPT = '''\
import json, os, sys
sys.path[:0] = [os.getcwd(), os.path.join(os.getcwd(), "tests")]
import torch
torch.set_num_threads(1)
from helpers import fine_tune
from task import TEXT_CHARS, build_tiny_model, build_tokenizer

out, problems = sys.argv[1], json.loads(sys.argv[2])
chars = build_tokenizer(TEXT_CHARS)
model = build_tiny_model(chars, seed=0, hidden_size=64, num_layers=1, num_heads=2,
                         max_len=128)

def encode(text):
    return chars(text, add_special_tokens=False)["input_ids"]

rows = []
for question, answer in problems.items():
    target = f"```python\\nprint({question[:-1]})\\n```\\n```output\\n{answer}\\n```\\n{answer}"
    rows.append((encode(question), encode(target) + [chars.eos_token_id]))
fine_tune(model, [(p, c, c) for p, c in rows], steps=200)

model.save_pretrained(out)
chars.save_pretrained(out)
'''


def bench_sameness(args):
    usage = ("usage: python -m bench sameness run TREE OUTROOT [--only NAME ...] "
             "[--extra=FLAGS] | compare BASEROOT NEWROOT")
    words = args.out_dirs
    if len(words) != 3 or words[0] not in ("run", "compare"):
        sys.exit(usage)
    unknown = set(args.only or []) - set(RUNS)
    if unknown:
        sys.exit(f"--only: no run {sorted(unknown)}; the runs: {', '.join(RUNS)}")

    if words[0] == "run":
        run_all(words[1], words[2], args.only or list(RUNS), shlex.split(args.extra or ""))
    elif not compare(words[1], words[2]):
        sys.exit(1)


# -----------------------------------------------------------------------------
# run

def run_all(tree, outroot, names, extra):
    tree = os.path.abspath(tree)
    outroot = os.path.abspath(outroot)
    if not os.path.isfile(os.path.join(tree, "train.py")):
        sys.exit(f"{tree}: no train.py")
    os.makedirs(outroot, exist_ok=True)
    commit = tree_commit(tree)
    print(f"tree {tree} ({commit}) -> {outroot}", flush=True)

    for name in names:
        out = os.path.join(outroot, name)
        if os.path.exists(os.path.join(out, "sameness.json")):
            print(f"{name}: done already, skipped", flush=True)
            continue
        # an interrupted run: from the start, not train.py's resume
        shutil.rmtree(out, ignore_errors=True)

        coder = os.path.join(outroot, CODER)
        run = RUNS[name]
        if "{coder}" in run["flags"]:
            build_coder(tree, coder)
        cmd, env = command(run, out, coder, extra)

        print(f"{name}: {shlex.join(cmd)}", flush=True)
        seconds = run_logged(cmd, tree, env, out + ".log", name)
        print(f"{name}: {seconds:.1f} s", flush=True)

        with open(os.path.join(out, "sameness.json"), "w") as f:
            json.dump(dict(command=cmd, env=run.get("env", {}), seconds=seconds,
                           tree=tree, commit=commit), f, indent=1)


def command(run, out, coder, extra):
    """-> (train.py's command line, its environment)."""
    flags = shlex.split(run["flags"].format(coder=coder))
    nproc = run.get("nproc", 1)
    if nproc == 1:
        cmd = [sys.executable, "train.py"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), "train.py"]
    cmd += ["--out-dir", out, *flags, *extra]

    # the environment set here only: nothing of the caller's decides which
    # modules load or which loss runs
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: v.format(coder=coder) for k, v in run.get("env", {}).items()})
    return cmd, env


def run_logged(cmd, cwd, env, log_path, name):
    """Run cmd, its output in log_path -> wall seconds. Exit with the log's tail if
    it fails."""
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.time() - t0

    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.readlines()[-40:]
        sys.exit(f"{''.join(tail)}\n{name} FAILED (exit {proc.returncode} after "
                 f"{seconds:.0f} s): {log_path}")
    return seconds


def build_coder(tree, coder):
    """The tools runs' model, data and reward in coder (once: kept if there)."""
    model = os.path.join(coder, "model")
    if os.path.exists(os.path.join(model, "config.json")):
        return
    os.makedirs(coder, exist_ok=True)

    with open(os.path.join(coder, "problems.jsonl"), "w") as f:
        for question, answer in PROBLEMS.items():
            f.write(json.dumps(dict(prompt=question, solution=answer)) + "\n")
    with open(os.path.join(coder, "coder_reward.py"), "w") as f:
        f.write(REWARD_MODULE)

    cmd = [sys.executable, "-c", CODER_SCRIPT, model, json.dumps(PROBLEMS)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["OMP_NUM_THREADS"] = "1"
    seconds = run_logged(cmd, tree, env, coder + ".log", "the coder")
    print(f"the coder: {seconds:.1f} s -> {model}", flush=True)


def tree_commit(tree):
    proc = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return proc.stdout.strip() or "no git commit"


# -----------------------------------------------------------------------------
# compare

def read_records(out):
    """metrics.jsonl's records without the wall-clock keys; NaN and infinities as
    the strings "NaN", "Infinity", "-Infinity"."""
    records = []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            record = json.loads(line, parse_constant=str)
            records.append({k: v for k, v in record.items()
                            if not k.startswith("time") and k not in WALL_CLOCK})
    return records


def first_difference(a, b):
    """Two lists of records that differ -> (step, key, a's value, b's value)."""
    for x, y in zip(a, b):
        if x != y:
            key = next(k for k in sorted(set(x) | set(y))
                       if x.get(k, "(absent)") != y.get(k, "(absent)"))
            return x.get("step"), key, x.get(key, "(absent)"), y.get(key, "(absent)")

    n = min(len(a), len(b))
    step = (a if len(a) > n else b)[n].get("step")
    return step, "(record)", "present" if len(a) > n else "absent", \
        "present" if len(b) > n else "absent"


def seconds_of(out):
    path = os.path.join(out, "sameness.json")
    if not os.path.exists(path):
        return "?"
    with open(path) as f:
        return f"{json.load(f)['seconds']:.0f}"


def compare(base, new):
    """Print the table -> True when every run in both roots is identical."""
    names = [n for n in sorted(os.listdir(base))
             if os.path.exists(os.path.join(base, n, "metrics.jsonl"))
             and os.path.exists(os.path.join(new, n, "metrics.jsonl"))]
    # the table's order first
    names.sort(key=lambda n: list(RUNS).index(n) if n in RUNS else len(RUNS))
    if not names:
        print(f"no run in both {base} and {new}")
        return False

    print(f"base {base}, new {new}\n")
    print("| run | flags | records | seconds (base / new) | result |")
    print("|---|---|---|---|---|")
    all_same = True
    for name in names:
        a = read_records(os.path.join(base, name))
        b = read_records(os.path.join(new, name))
        flags = RUNS[name]["flags"].format(coder=CODER) if name in RUNS else "?"
        if name in RUNS and RUNS[name].get("nproc", 1) > 1:
            flags = f"{RUNS[name]['nproc']} ranks, {flags}"
        if name in RUNS and "TRITON_INTERPRET" in RUNS[name].get("env", {}):
            flags = f"TRITON_INTERPRET=1, {flags}"
        records = len(a) if len(a) == len(b) else f"{len(a)} / {len(b)}"
        seconds = f"{seconds_of(os.path.join(base, name))} / " \
            f"{seconds_of(os.path.join(new, name))}"

        if a == b:
            result = "identical"
        else:
            all_same = False
            step, key, x, y = first_difference(a, b)
            result = f"DIFFERS at step {step}, {key}: {x!r} / {y!r}"
        print(f"| {name} | `{flags}` | {records} | {seconds} | {result} |")

    coders = [os.path.join(root, CODER, "model", "model.safetensors") for root in (base, new)]
    if all(os.path.exists(p) for p in coders):
        with open(coders[0], "rb") as f, open(coders[1], "rb") as g:
            same = f.read() == g.read()
        print(f"\nthe coders (tools runs): {'the same bytes' if same else 'DIFFER'}")

    print("\nall identical" if all_same else "\nSOME RUNS DIFFER")
    return all_same
