"""The catalogue of bad inputs (README, "Bad inputs"): each exits non-zero, before heavy work, with one line
that says what to change; the torchrun cases show that every rank exits (no hang)."""
import json
import os

import pytest

from helpers import run_train

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
    """A folder that shadows vllm and wandb with modules that fail to import, as on a machine without them."""
    d = tmp_path_factory.mktemp("fake")
    for name in ("vllm", "wandb"):
        (d / f"{name}.py").write_text(f'raise ImportError("No module named {name} (test double)")\n')
    return d


CASES = {  # name: (extra args, expected text in the error line)
    "G<2": (["--G", "1"], "argument --G: must be >= 2 (a group needs two completions to compare), got 1"),
    "steps<1": (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    "mu<1": (["--num-iterations", "0"], "argument --num-iterations: must be >= 1, got 0"),
    "unknown loss_type": (["--loss-type", "ppo"], "invalid choice: 'ppo'"),
    "unknown scale_rewards": (["--scale-rewards", "std"], "invalid choice: 'std'"),
    "unknown reward": (["--rewards", "nope_reward"], "unknown reward function 'nope_reward'"),
    "reward path does not import": (["--rewards", "no_such_pkg.fn"], "cannot import it"),
    "weights count": (["--rewards", "exact_match_reward", "--reward-weights", "1", "2"], "--reward-weights has 2 values"),
    "reward wrong count": (["--rewards", "bad_rewards.wrong_count"], "wrong_count must return a list of 256"),
    "reward non-number": (["--rewards", "bad_rewards.non_number"], "non_number returned 'yes'"),
    "reward raises": (["--rewards", "bad_rewards.raising"], "raising raised KeyError"),
    "all prompts too long": (["--max-prompt-len", "2"], "longer than --max-prompt-len 2"),
    "max_new_tokens<=0": (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1, got 0"),
    "temperature<=0": (["--temperature", "0"], "argument --temperature: must be > 0 for GRPO sampling"),
    "top_p out of range": (["--top-p", "1.5"], "argument --top-p: must be in (0, 1], got 1.5"),
    "eps<0": (["--epsilon-low", "-0.1"], "argument --epsilon-low: must be >= 0, got -0.1"),
    "beta<0": (["--beta", "-0.1"], "argument --beta: must be >= 0, got -0.1"),
    "lr<=0": (["--lr", "0"], "argument --lr: must be > 0, got 0"),
    "micro does not divide": (["--micro-batch-size", "7"], "must divide --minibatch-size"),
    "triton + sequence IS": (["--loss-impl", "triton", "--importance-sampling-level", "sequence"], "token only"),
    "model path missing": (["--model", "/no/such/model"], "no such directory"),
    "resume without checkpoint": (["--resume", "yes"], "no checkpoint under"),
    "fsdp on one process": (["--fsdp"], "--fsdp shards over ranks"),
}


@pytest.mark.parametrize("name", CASES)
def test_bad_input(name, tmp_path):
    args, expected = CASES[name]
    rc, out, _ = run_train(FAST + args, tmp_path / "out", check=False, timeout=120)
    assert rc != 0, out[-2000:]
    assert expected in out, out[-2000:]
    assert "Traceback" not in out, out[-3000:]


def test_dataset_missing_prompt_column(datasets, tmp_path):
    rc, out, _ = run_train(FAST + ["--dataset", datasets / "wrong_column.jsonl"], tmp_path, check=False)
    assert rc != 0 and "prompt" in out and "question" in out and "Traceback" not in out, out[-2000:]


def test_dataset_empty(datasets, tmp_path):
    rc, out, _ = run_train(FAST + ["--dataset", datasets / "empty.jsonl"], tmp_path, check=False)
    assert rc != 0 and "empty" in out.lower() and "Traceback" not in out, out[-2000:]


@pytest.mark.parametrize("module,args,expected", [
    ("vllm", ["--engine", "vllm"], "vLLM is not installed"),
    ("wandb", ["--wandb", "proj"], "--wandb needs the wandb package"),
])
def test_missing_optional_package(module, args, expected, fake_modules, tmp_path):
    env = {"PYTHONPATH": f"{fake_modules}{os.pathsep}{os.path.join(os.path.dirname(__file__))}"}
    rc, out, _ = run_train(FAST + args, tmp_path, check=False, env=env)
    assert rc != 0 and expected in out and "Traceback" not in out, out[-2000:]


def test_out_dir_not_writable(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    rc, out, _ = run_train(FAST, blocker / "out", check=False)
    assert rc != 0 and "is not writable" in out and "Traceback" not in out, out[-2000:]


def test_resume_with_other_config(tmp_path):
    run_train(FAST + ["--eval-size", "8"], tmp_path)
    rc, out, _ = run_train(FAST + ["--G", "4"], tmp_path, check=False)
    assert rc != 0 and "different run configuration" in out and "'G': (8, 4)" in out, out[-2000:]


@pytest.mark.parametrize("args,expected", [
    (["--prompts-per-step", "3"], "must be divisible by the 2 ranks"),
    (["--prompts-per-step", "1"], "every rank needs a prompt"),
    (["--rewards", "bad_rewards.raising"], "raising raised KeyError"),
])
def test_bad_input_two_ranks(args, expected, tmp_path):
    """Every rank exits (the run ends, no hang) and the message is shown."""
    rc, out, _ = run_train(FAST + args, tmp_path, nproc=2, check=False, timeout=180)
    assert rc != 0 and expected in out, out[-3000:]
