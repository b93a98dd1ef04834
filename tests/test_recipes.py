"""--config FILE.yaml: a recipe as a file (config.recipe_words), and recipes/.

Every recipe parses and passes the flags' rules; the command line overrides a
file; bad input stops in one line; run.json records the file and its values;
the recipes a CPU can run train a step; the data the recipes ship is what its
script writes.
"""
import glob
import os
import subprocess
import sys

import pytest

import checkpoint
import config
from helpers import ROOT, run_train
from real_model import missing, smollm2_dir, write_word_problems

RECIPES = sorted(glob.glob(os.path.join(ROOT, "recipes", "*.yaml")))
# the recipes a CPU runs: SmolLM2-135M-Instruct (tests/real_model.py)
CPU_RECIPES = ["smollm2_lora.yaml", "smollm2_learn.yaml", "smollm2_tools.yaml",
               "smollm2_guess_number.yaml"]
# the recipes that train on data they ship (recipes/data/), and what their run
# must log: the tool loop's metric, the environment's reward
SHIPPED = {"smollm2_tools.yaml": "tool_calls_mean",
           "smollm2_guess_number.yaml": "reward/GuessNumber"}


def parsed(argv):
    """train.py's flags from argv, the recipe's defaults filled in and checked."""
    args = config.parse_args(argv)
    config.fill_defaults(args)
    config.check_flags(args)
    return args


def one_error(argv, capsys):
    """config.parse_args on argv must stop with one error line -> that line."""
    with pytest.raises(SystemExit) as e:
        config.parse_args(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_recipe_parses(path):
    args = parsed(["--config", path])
    assert args.config == path
    assert args.model is not None and args.dataset is not None


def test_the_command_line_overrides_the_file(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("G: 4\nprompts_per_step: 8\nrewards: [exact_match_reward]\n"
                      "mask-truncated: true\nkl_bias_correction: false\nseed: null\n")

    args = parsed(["--config", str(recipe), "--G", "2"])
    assert args.G == 2  # the command line's
    assert args.prompts_per_step == 8  # the file's, underscores or dashes
    assert args.rewards == ["exact_match_reward"]  # a list: the flag's values
    assert args.mask_truncated and not args.kl_bias_correction  # switches
    assert args.seed == config.parser.get_default("seed")  # null: the default

    # run.json records the file and the values it gave
    recorded = checkpoint.run_config(args, 1)
    assert recorded["config"] == str(recipe) and recorded["prompts_per_step"] == 8


@pytest.mark.parametrize("text, words", [
    ("Gx: 4\n", "unknown field 'Gx'"),
    ("G: four\n", "argument --G: 'four' is not an integer"),
    ("mask-truncated: 3\n", "mask-truncated is a switch: true or false"),
    ("G: [4, 8]\n", "G takes one value"),
    ("- G\n- 4\n", "a recipe maps flag names to values, got a list"),
    ("G: [\n", "not a YAML file"),
])
def test_bad_input_stops_in_one_line(tmp_path, capsys, text, words):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(text)

    line = one_error(["--config", str(recipe)], capsys)
    assert line.startswith(f"error: --config {recipe}: ") and words in line, line


def test_a_missing_recipe_file_stops_in_one_line(tmp_path, capsys):
    missing = tmp_path / "nowhere.yaml"
    line = one_error(["--config", str(missing)], capsys)
    assert "cannot read it" in line and str(missing) in line


@pytest.mark.parametrize("field, line", [
    ("chat_template: {tmp}/no.jinja", "--chat-template {tmp}/no.jinja: no such file"),
    ("model: {tmp}/no_model", "--model '{tmp}/no_model': no such directory"),
])
def test_a_recipe_naming_a_missing_file_stops_in_one_line(tmp_path, capsys, field, line):
    """The rules check the flags a file gave as the command line's."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("dataset: x.jsonl\n" + field.format(tmp=tmp_path) + "\n")
    with pytest.raises(SystemExit) as e:
        parsed(["--config", str(recipe)])
    assert e.value.code == 2

    captured = capsys.readouterr()
    lines = [x for x in (captured.out + captured.err).splitlines() if x.strip()]
    assert len(lines) == 1 and line.format(tmp=tmp_path) in lines[0], lines


def test_a_recipe_naming_a_missing_dataset_stops_in_one_line(tmp_path):
    """A dataset file is looked for where the rows load: one line, no traceback."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"dataset: {tmp_path}/no_rows.jsonl\nsteps: 1\n")
    code, output, _ = run_train(["--config", str(recipe)], tmp_path / "out", check=False)

    assert code == 2, output[-2000:]
    assert f"dataset file not found: {tmp_path}/no_rows.jsonl" in output
    assert "Traceback" not in output


# the real-checkpoint tier, as tests/test_real_model.py: skipped where its model
# file is not installed (the Makefile installs it), on the worker that converts it
@pytest.mark.skipif(missing() is not None, reason=missing() or "")
@pytest.mark.xdist_group("real_model")
@pytest.mark.parametrize("name", CPU_RECIPES)
def test_a_cpu_recipe_trains_a_step(tmp_path, name):
    """The recipe as it is, but one short step, on the model folder and the
    word problems of tests/real_model.py (the recipe's header says how to make
    them), or the data the recipe ships."""
    short = ["--model", smollm2_dir(), "--steps", "1",
             "--prompts-per-step", "1", "--G", "2", "--micro-batch-size", "2",
             "--max-new-tokens", "8", "--eval-size", "2", "--eval-every", "0"]
    if name not in SHIPPED:
        short += ["--dataset", write_word_problems(str(tmp_path / "problems.jsonl"), 72)]
    if name == "smollm2_learn.yaml":  # its punishment ramps over the last 16 tokens
        short += ["--overlong-buffer", "4"]
    _, output, records = run_train(["--config", os.path.join(ROOT, "recipes", name), *short],
                                   tmp_path / "out", timeout=600)
    assert [r["step"] for r in records] == [0, 1], output[-2000:]
    assert records[1]["loss"] == records[1]["loss"]  # not NaN
    if name in SHIPPED:
        assert "engine ToolEngine" in output and SHIPPED[name] in records[1], output[-2000:]


def test_the_shipped_data_is_what_its_script_writes(tmp_path):
    """recipes/data/make.py is deterministic, and the files in the repo are its
    output: neither changed without the other."""
    subprocess.run([sys.executable, os.path.join(ROOT, "recipes", "data", "make.py"),
                    str(tmp_path)], check=True, capture_output=True)

    for name in ("products.jsonl", "guess_number.jsonl"):
        with open(os.path.join(ROOT, "recipes", "data", name), "rb") as f:
            shipped = f.read()
        assert (tmp_path / name).read_bytes() == shipped, name
