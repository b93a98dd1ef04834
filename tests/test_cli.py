"""The catalogue of bad inputs (README, "Bad inputs").

Each exits non-zero, before heavy work, with one line that says what to change.
The torchrun cases show that every rank exits (no hang).
"""
import json
import os

import pytest

import config
from config import check_flags
from helpers import run_train, train_parser

FAST = ["--engine", "hf", "--steps", "1", "--eval-size", "8"]


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    with open(d / "wrong_column.jsonl", "w") as f:
        f.write(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")

    open(d / "empty.jsonl", "w").close()
    return d


@pytest.fixture(scope="module")
def fake_modules(tmp_path_factory):
    """A folder that shadows vllm and wandb with modules that fail to import.

    As on a machine without them.
    """
    d = tmp_path_factory.mktemp("fake")
    for name in ("vllm", "wandb"):
        source = f'raise ImportError("No module named {name} (test double)")\n'
        (d / f"{name}.py").write_text(source)
    return d


# name: (args, expected text in the error line): argparse's ranges, checked
# in-process (no subprocess)
FLAG_CASES = {
    "G<2":
        (["--G", "1"],
         "argument --G: must be >= 2 (a group needs two completions to compare), "
         "got 1"),
    "steps<1": (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    "max_staleness<0":
        (["--max-staleness", "-1"], "argument --max-staleness: must be >= 0, got -1"),
    "mu<1":
        (["--num-iterations", "0"], "argument --num-iterations: must be >= 1, got 0"),
    "unknown loss_type": (["--loss-type", "ppo"], "invalid choice: 'ppo'"),
    "unknown scale_rewards": (["--scale-rewards", "std"], "invalid choice: 'std'"),
    "unknown fast": (["--fast", "yes"], "invalid choice: 'yes'"),
    "max_new_tokens<=0":
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    "temperature<=0":
        (["--temperature", "0"],
         "argument --temperature: must be > 0 for GRPO sampling"),
    "top_p out of range":
        (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    "eps<0":
        (["--epsilon-low", "-0.1"], "argument --epsilon-low: must be >= 0, got -0.1"),
    "beta<0": (["--beta", "-0.1"], "argument --beta: must be >= 0, got -0.1"),
    "lr<=0": (["--lr", "0"], "argument --lr: must be > 0, got 0"),

    # nonsense values: every numeric flag has a range, and nan / inf pass none
    "grad_clip<0":
        (["--grad-clip", "-1"], "argument --grad-clip: must be >= 0, got -1"),
    "reward weight NaN":
        (["--reward-weights", "1", "nan"], "argument --reward-weights: must be "),
    "reward weight inf":
        (["--reward-weights", "inf"], "argument --reward-weights: must be "),
    "lr NaN": (["--lr", "nan"], "argument --lr: must be > 0, got nan"),
    "warmup<0":
        (["--warmup-steps", "-1"], "argument --warmup-steps: must be >= 0, got -1"),
    "eval_every<0":
        (["--eval-every", "-1"], "argument --eval-every: must be >= 0, got -1"),
    "threads=0": (["--threads", "0"], "argument --threads: must be >= 1, got 0"),
    "vllm_memory=0":
        (["--vllm-memory", "0"], "argument --vllm-memory: must be in (0, 1], got 0"),
    "vllm_memory=1.5":
        (["--vllm-memory", "1.5"],
         "argument --vllm-memory: must be in (0, 1], got 1.5"),
    "task_digits=0":
        (["--task-digits", "0"], "argument --task-digits: must be in [1, 6], got 0"),
    "task_digits=13":
        (["--task-digits", "13"], "argument --task-digits: must be in [1, 6], got 13"),
    "steps not an integer":
        (["--steps", "1e3"], "argument --steps: '1e3' is not an integer"),
    "keep_last=0": (["--keep-last", "0"], "argument --keep-last: must be >= 1, got 0"),
    "save_every=0":
        (["--save-every", "0"], "argument --save-every: must be >= 1, got 0"),
    "eval_size=0": (["--eval-size", "0"], "argument --eval-size: must be >= 1, got 0"),
    "seed<0": (["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    "tis_cap<0": (["--tis-cap", "-2"], "argument --tis-cap: must be >= 0, got -2"),
    "reward_timeout=0":
        (["--reward-timeout", "0"],
         "argument --reward-timeout: must be in (0, 1800], got 0"),
    "reward_timeout too long":
        (["--reward-timeout", "1e6"],
         "argument --reward-timeout: must be in (0, 1800]"),
    "dynamic_sampling<0":
        (["--dynamic-sampling", "-1"],
         "argument --dynamic-sampling: must be >= 0, got -1"),
    "eval_samples<0":
        (["--eval-samples", "-1"], "argument --eval-samples: must be >= 0, got -1"),
    "eval_k=0":
        (["--eval-samples", "4", "--eval-k", "0"],
         "argument --eval-k: must be >= 1, got 0"),
    "overlong_buffer<0":
        (["--overlong-buffer", "-1"], "argument --overlong-buffer: must be >= 0, got -1"),
}


@pytest.fixture(scope="module")
def parser():
    return train_parser()


def one_error_line(out):
    """True when out is one line that starts with "error: "."""
    return out.startswith("error: ") and out.count("\n") == 1


@pytest.mark.parametrize("name", FLAG_CASES)
def test_bad_flag(name, parser, capsys):
    args, expected = FLAG_CASES[name]

    with pytest.raises(SystemExit) as e:
        parser.parse_args(args)

    out = capsys.readouterr().out
    assert e.value.code == 2, out
    assert one_error_line(out) and expected in out, out


def test_good_flags_parse(parser):
    args = parser.parse_args(["--G", "4", "--reward-weights", "0.5", "-1",
                              "--vllm-memory", "1", "--task-digits", "6"])

    assert args.G == 4
    assert args.reward_weights == [0.5, -1.0]
    assert args.vllm_memory == 1.0
    assert args.task_digits == 6
    assert args.reward_timeout == 300
    assert args.fast == "auto"


# name: (args, expected text): the rules between flags (config.check_flags), in-process
RULE_CASES = {
    "weights count":
        (["--rewards", "exact_match_reward", "--reward-weights", "1", "2"],
         "--reward-weights has 2 values"),
    "weights all zero":
        (["--reward-weights", "0", "0"],
         "--reward-weights are all 0: every advantage would be 0"),
    "micro does not divide":
        (["--micro-batch-size", "7"], "must divide --minibatch-size"),
    "triton + sequence IS":
        (["--loss-impl", "triton", "--importance-sampling-level", "sequence"],
         "token only"),
    "model path missing": (["--model", "/no/such/model"], "no such directory"),
    "fsdp on one process": (["--fsdp"], "--fsdp shards over ranks"),
    "async without a server":
        (["--async"], "--async overlaps a rollout server's generation with the update"),
    "async with dynamic sampling":
        (["--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1", "--async",
          "--dynamic-sampling", "2"],
         "--async samples one round ahead"),
    "async and max staleness":
        (["--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1", "--async",
          "--max-staleness", "2"],
         "--async is --max-staleness 1: give one of --async and --max-staleness 2"),
    "max staleness with dynamic sampling":
        (["--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1", "--max-staleness",
          "0", "--dynamic-sampling", "2"],
         "--max-staleness draws one round a step"),
    "dynamic sampling of 1 round":
        (["--dynamic-sampling", "1"], "--dynamic-sampling 1 draws no second round"),
    "eval_k without eval_samples":
        (["--eval-k", "1"], "--eval-k needs --eval-samples n"),
    "eval_k > eval_samples":
        (["--eval-samples", "4", "--eval-k", "1", "8"],
         "--eval-k 1 8: each k must be <= --eval-samples 4"),
    "vllm sleep with LoRA":
        (["--vllm-sleep", "--lora-rank", "8"], "--vllm-sleep needs a sync of every layer"),
    "overlong buffer > max new tokens":
        (["--max-new-tokens", "8", "--overlong-buffer", "9"],
         "--overlong-buffer 9 is longer than --max-new-tokens 8"),
    "no CA certificate file":
        (["--vllm-mode", "server", "--vllm-url", "https://10.0.0.1:1", "--vllm-ca-cert",
          "/no/cert.pem"], "--vllm-ca-cert /no/cert.pem: no such file"),
}


@pytest.mark.parametrize("name", RULE_CASES)
def test_bad_flag_combination(name, parser, capsys):
    """train.py's validation block, in-process.

    Parse, fill the task defaults, check the rules between flags.
    """
    argv, expected = RULE_CASES[name]
    args = config.fill_defaults(parser.parse_args(argv))

    with pytest.raises(SystemExit) as e:
        check_flags(args)

    out = capsys.readouterr().out
    assert e.value.code == 2, out
    assert one_error_line(out) and expected in out, out


# A flag that only matters under another one, given alone: refused, not ignored in silence
DEPENDENT_CASES = {
    "--lora-alpha": (["--lora-alpha", "8"], "--lora-rank R"),
    "--lora-dropout": (["--lora-dropout", "0.1"], "--lora-rank R"),
    "--lora-targets": (["--lora-targets", "q_proj"], "--lora-rank R"),
    "--vllm-url": (["--vllm-url", "http://127.0.0.1:1"], "--vllm-mode server"),
    "--vllm-api-key": (["--vllm-api-key", "KEY"], "--vllm-mode server"),
    "--vllm-ca-cert": (["--vllm-ca-cert", __file__], "--vllm-mode server"),
    "--allow-plain-http": (["--allow-plain-http"], "--vllm-mode server"),
    "--allow-open-dev-routes": (["--allow-open-dev-routes"], "--vllm-mode server"),
    "--max-staleness": (["--max-staleness", "0"], "--vllm-mode server"),
    "--vllm-memory with --engine hf":
        (["--engine", "hf", "--vllm-memory", "0.5"], "colocated vLLM"),
    "--dataset-config": (["--dataset-config", "main"], "--dataset"),
    "--split": (["--split", "train[:10]"], "--dataset"),
    "--eval-split": (["--eval-split", "train[:10]"], "--dataset"),
    "--prompt-column": (["--prompt-column", "question"], "--dataset"),
    "--solution-column": (["--solution-column", "answer"], "--dataset"),
    "--system-prompt": (["--system-prompt", "Be brief."], "--dataset"),
    "--task-digits with --dataset":
        (["--dataset", "x.jsonl", "--task-digits", "4"], "built-in task"),
}


@pytest.mark.parametrize("name", DEPENDENT_CASES)
def test_a_dependent_flag_alone_is_refused(name, parser, capsys):
    argv, needs = DEPENDENT_CASES[name]
    args = config.fill_defaults(parser.parse_args(argv))

    with pytest.raises(SystemExit) as e:
        check_flags(args)

    out = capsys.readouterr().out
    flag = name.split()[0]
    assert e.value.code == 2 and out.count("\n") == 1, out
    assert out.startswith(f"error: {flag} does nothing without ") and needs in out, out


def test_every_dependent_flag_is_accepted_with_the_flag_it_needs(parser):
    argv = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.1",
            "--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1",
            "--vllm-ca-cert", __file__, "--allow-plain-http", "--allow-open-dev-routes",
            "--dataset", "x.jsonl", "--split", "train[:10]", "--system-prompt", "S"]
    args = parser.parse_args(argv)

    # no SystemExit
    check_flags(config.fill_defaults(args))


# name: (extra args, expected text in the error line): train.py end to end, a
# subprocess each. The messages of get_reward_funcs and compute_rewards are also
# tested in-process: tests/test_reward.py.
CASES = {
    "G<2 (argparse, end to end)":
        (["--G", "1"], "argument --G: must be >= 2 (a group needs two completions"),
    "unknown reward":
        (["--rewards", "nope_reward"], "unknown reward function 'nope_reward'"),
    "reward raises": (["--rewards", "bad_rewards.raising"], "raising raised KeyError"),
    "reward exits":
        (["--rewards", "bad_rewards.exiting"],
         "reward function exiting raised SystemExit: 0"),
    "all prompts too long":
        (["--max-prompt-len", "2"], "longer than --max-prompt-len 2"),
    "max_new_tokens above the context":
        (["--max-new-tokens", "64"],
         "--max-new-tokens 64 leaves no room for a prompt in the model's context of "
         "64 tokens: lower it"),
    "micro does not divide (check_flags, end to end)":
        (["--micro-batch-size", "7"], "must divide --minibatch-size"),
    "resume without checkpoint": (["--resume", "yes"], "no checkpoint under"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name, tmp_path):
    args, expected = CASES[name]
    rc, out, _ = run_train(FAST + args, tmp_path / "out", check=False, timeout=120)

    assert rc != 0, out[-2000:]
    assert expected in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]
    model = tmp_path / "out" / "model"
    assert not os.path.exists(model), "a failed run must not leave a final model"


def test_dataset_missing_prompt_column(datasets, tmp_path):
    args = FAST + ["--dataset", datasets / "wrong_column.jsonl"]
    rc, out, _ = run_train(args, tmp_path, check=False)

    assert rc != 0, out[-2000:]
    assert "prompt" in out and "question" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_dataset_empty(datasets, tmp_path):
    args = FAST + ["--dataset", datasets / "empty.jsonl"]
    rc, out, _ = run_train(args, tmp_path, check=False)

    assert rc != 0, out[-2000:]
    assert "empty" in out.lower(), out[-2000:]
    assert "Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("module,args,expected", [
    ("vllm", ["--engine", "vllm"], "vLLM is not installed"),
    ("wandb", ["--wandb", "proj"], "--wandb needs the wandb package"),
])
def test_missing_optional_package(module, args, expected, fake_modules, tmp_path):
    tests = os.path.dirname(__file__)
    env = {"PYTHONPATH": f"{fake_modules}{os.pathsep}{tests}"}
    rc, out, _ = run_train(FAST + args, tmp_path, check=False, env=env)

    assert rc != 0, out[-2000:]
    assert expected in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_out_dir_not_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")

    rc, out, _ = run_train(FAST, blocker / "out", check=False)
    assert rc != 0, out[-2000:]
    assert "is not writable" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]


def test_resume_with_other_config(tmp_path):
    run_train(FAST + ["--eval-size", "8"], tmp_path)

    rc, out, _ = run_train(FAST + ["--G", "4"], tmp_path, check=False)
    assert rc != 0, out[-2000:]
    assert "different run configuration" in out and "'G': (8, 4)" in out, out[-2000:]


@pytest.mark.parametrize("args,expected", [
    (["--prompts-per-step", "3"], "must be divisible by the 2 ranks"),
    (["--prompts-per-step", "1"], "every rank needs a prompt"),
    (["--rewards", "bad_rewards.raising"], "raising raised KeyError"),
    (["--rewards", "bad_rewards.stuck_on_rank_1", "--reward-timeout", "3"],
     "error (rank 1): reward function stuck_on_rank_1 did not return within 3 s"),
])
def test_bad_input_two_ranks(args, expected, tmp_path):
    """Every rank exits, and the message is shown.

    The run ends, with no hang: not gloo's 30-minute timeout either.
    """
    rc, out, _ = run_train(FAST + args, tmp_path, nproc=2, check=False, timeout=180)
    assert rc != 0 and expected in out, out[-3000:]


def test_model_folder_without_tokenizer(tiny, tmp_path):
    """A model folder without a tokenizer stops train.py.

    transformers 5 builds an empty tokenizer for such a folder instead of failing.
    """
    import shutil

    model = tmp_path / "model_without_tokenizer"
    shutil.copytree(tiny[0], model, ignore=shutil.ignore_patterns("tokenizer*"))

    rc, out, _ = run_train(FAST + ["--model", model], tmp_path / "out", check=False)
    assert rc != 0, out[-2000:]
    assert f"--model '{model}': has no tokenizer" in out, out[-2000:]
    assert "Traceback" not in out, out[-2000:]
