"""TRL's names (trl_names.py): a GRPOConfig file or a `trl grpo` command line,
read as train.py's flags with TRL's meaning (docs/trl.md).

Parse-level, in this process (config.parse_args, fill_defaults, check_flags),
but one run: the seed GRPOConfig trains a step. TRL's own source is checked
against the tables where TRL is installed.
"""
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

import config
from trl_compat import trl_names
from helpers import ENV, ROOT, run_train
from real_model import missing, smollm2_dir, write_word_problems

SEED = """\
per_device_train_batch_size: 2
num_generations: 8
max_prompt_length: 512
max_completion_length: 1024
learning_rate: 1e-6
beta: 0.04
num_train_epochs: 1
bf16: true
use_vllm: true
vllm_mode: colocate
reward_funcs: [accuracy_reward, think_format_reward]
reward_weights: [1.0, 0.1]
"""


@pytest.fixture
def seed_file(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(SEED)
    return str(path)


@pytest.fixture
def model_and_data(tmp_path):
    """A model folder (check_flags only asks that it exists) and a local jsonl."""
    model = tmp_path / "tiny_model"
    model.mkdir()
    data = tmp_path / "problems.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1?", "solution": str(i + 1)}) + "\n"
                            for i in range(12)))
    return str(model), str(data)


def parse(argv):
    """The flags as train.py reads them: TRL's names through trl_names.py."""
    argv = [str(a) for a in argv]
    if config.speaks_trl(argv):
        return trl_names.parse_args(argv)
    return config.parse_args(argv)


def parsed(argv):
    """train.py's flags from argv, the recipe filled in and the rules checked."""
    args = parse(argv)
    config.fill_defaults(args)
    config.check_flags(args)
    return args


def one_error(argv, capsys):
    """argv must stop the run with one line -> that line."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    lines = [line for line in (out.out + out.err).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def printed(capsys):
    return capsys.readouterr().out.splitlines()


# -----------------------------------------------------------------------------
# The seed GRPOConfig, and `trl grpo`'s command line

def test_the_seed_config_as_is_stops_with_trls_rule(seed_file, capsys):
    line = one_error(["--config", seed_file], capsys)
    assert line == ("error: the effective batch size (num_processes * "
                    "per_device_train_batch_size * gradient_accumulation_steps = 1 * 2 * 1) "
                    "must be evenly divisible by num_generations (8), TRL's rule: e.g. "
                    "per_device_train_batch_size 8")


def test_the_seed_config_maps_with_trls_meaning(seed_file, capsys):
    args = parsed(["--config", seed_file, "--per_device_train_batch_size", "16"])

    # 16 completions a generation batch (1 process, 1 accumulation step): 2 prompts of 8
    assert (args.G, args.prompts_per_step, args.micro_batch_size, args.minibatch_size) == (
        8, 2, 16, 0)
    assert (args.max_prompt_len, args.max_new_tokens, args.lr, args.beta) == (
        512, 1024, 1e-6, 0.04)
    assert (args.dtype, args.engine, args.vllm_mode) == ("bfloat16", "vllm", "colocate")
    assert args.rewards == ["accuracy_reward", "think_format_reward"]
    assert args.reward_weights == [1.0, 0.1]
    # TRL's defaults where ours differ, said in one line
    assert args.loss_type == "dapo" and args.seed == 42 and args.warmup_steps == 0
    assert (args.is_correction, args.is_max, args.is_min) == ("sequence_mask", 3.0, 0.0)
    assert args.kl_bias_correction and args.gradient_checkpointing
    line, = [x for x in printed(capsys) if x.startswith("TRL's defaults")]
    assert "loss_type dapo" in line and "vllm_importance_sampling_correction true" in line
    assert "linear lr schedule" in line
    # one epoch over the training set: resolved once train.py has the rows
    assert args.trl_epochs["num_train_epochs"] == 1.0


def test_the_seed_config_trains_a_step(seed_file, tmp_path):
    """The file as it is, with the batch TRL's rule asks for and a CPU's
    lengths on the command line, on the built-in task. --engine hf (ours, over
    use_vllm): vLLM's CPU engine takes longer to start than the whole step."""
    short = ["--config", seed_file, "--per_device_train_batch_size", "16",
             "--max_completion_length", "4", "--max_steps", "1", "--eval-size", "8",
             "--engine", "hf"]
    _, output, records = run_train(short, tmp_path / "out", timeout=300)

    assert [r["step"] for r in records] == [0, 1], output[-2000:]
    assert records[1]["loss"] == records[1]["loss"]  # not NaN
    saved = json.load(open(tmp_path / "out" / "run.json"))
    assert (saved["loss_type"], saved["G"], saved["prompts_per_step"], saved["dtype"]) == (
        "dapo", 8, 2, "bfloat16")
    # --engine hf: no vLLM samples, so no importance-sampling correction (as in TRL)
    assert saved["is_correction"] == "off"
    assert "TRL's defaults, where train.py's differ" in output


def test_the_trl_grpo_command_line(model_and_data, capsys):
    model, data = model_and_data
    args = parsed(["--model_name_or_path", model, "--dataset_name", data,
                   "--reward_funcs", "accuracy_reward", "think_format_reward",
                   "--reward_weights", "1.0", "0.1", "--use_vllm", "true",
                   "--dataset_test_split", "train[:4]", "--max_completion_length", "16",
                   "--max_steps", "2"])

    assert (args.model, args.dataset, args.eval_split) == (model, data, "train[:4]")
    assert args.rewards == ["accuracy_reward", "think_format_reward"]
    assert args.reward_weights == [1.0, 0.1]
    assert (args.engine, args.max_new_tokens, args.steps) == ("vllm", 16, 2)
    # TRL's per_device_train_batch_size 8: one prompt of 8 a step
    assert (args.G, args.prompts_per_step) == (8, 1)
    # TRL renders a prompt without a system prompt
    assert args.system_prompt == ""
    assert args.lr == 1e-6 and args.dtype == "bfloat16"


@pytest.mark.skipif(missing() is not None, reason=missing() or "")
@pytest.mark.xdist_group("real_model")
def test_the_trl_grpo_command_line_trains_a_step(tmp_path):
    """`trl grpo`'s command line with train.py in its place, end to end:
    SmolLM2-135M-Instruct (tests/real_model.py) on word problems, vLLM sampling
    (use_vllm) in bf16 (TRL's default), only the batch, lengths and steps made a
    CPU's. With TRL's max_prompt_length 512 and a few short rows, vLLM's cache is
    one max-length row: the case that needs its null block counted (rollout.py)."""
    data = write_word_problems(str(tmp_path / "problems.jsonl"), 24)
    argv = ["--model_name_or_path", smollm2_dir(), "--dataset_name", data,
            "--reward_funcs", "accuracy_reward", "think_format_reward",
            "--reward_weights", "1.0", "0.1", "--use_vllm", "true",
            "--dataset_test_split", "train[:2]", "--per_device_train_batch_size", "2",
            "--num_generations", "2", "--max_completion_length", "8", "--max_steps", "1"]
    _, output, records = run_train(argv, tmp_path / "out", timeout=600)

    assert [r["step"] for r in records] == [0, 1], output[-2000:]
    assert "engine VLLMEngine" in output and "loss_type dapo" in output
    saved = json.load(open(tmp_path / "out" / "run.json"))
    assert (saved["rewards"], saved["reward_weights"]) == (
        ["accuracy_reward", "think_format_reward"], [1.0, 0.1])
    # TRL's importance-sampling correction, on where vLLM samples
    assert (saved["dtype"], saved["is_correction"]) == ("bfloat16", "sequence_mask")


def test_our_recipe_files_never_load_trl_names():
    """A run of our flags alone stays train.py's: no trl_names.py, our defaults."""
    recipe = os.path.join(ROOT, "recipes", "gsm8k_1gpu.yaml")
    code = (f"import sys, config\n"
            f"args = config.parse_args(['--config', {recipe!r}, '--lr', '3e-6'])\n"
            f"assert args.loss_type == 'grpo' and 'trl_compat.trl_names' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, env={**ENV, "PYTHONPATH": ROOT}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

    # our flags spelled with underscores are ours still
    args = parse(["--config", recipe, "--max_new_tokens", "4", "--eval_size", "8"])
    assert (args.max_new_tokens, args.eval_size, args.loss_type) == (4, 8, "grpo")
    assert not getattr(args, "trl_epochs", None)


def test_a_trl_file_takes_trls_loss_type_and_our_recipe_keeps_ours(tmp_path):
    trl_file = tmp_path / "trl.yaml"
    trl_file.write_text("num_generations: 4\nper_device_train_batch_size: 8\n")
    ours = tmp_path / "ours.yaml"
    ours.write_text("G: 4\nprompts_per_step: 2\n")

    assert parse(["--config", trl_file]).loss_type == "dapo"
    assert parse(["--config", ours]).loss_type == "grpo"
    # given, either way, it is what the file says
    trl_file.write_text("num_generations: 4\nper_device_train_batch_size: 8\nloss_type: grpo\n")
    assert parse(["--config", trl_file]).loss_type == "grpo"


# -----------------------------------------------------------------------------
# Each field's mapping

@pytest.mark.parametrize("words, expected", [
    # sampling
    ("--temperature 0.7 --top_p 0.9 --top_k 20 --min_p 0.05 --repetition_penalty 1.1",
     dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1)),
    ("--min_p null", dict(min_p=0.0)),
    ("--max_prompt_length 256", dict(max_prompt_len=256)),
    # the loss
    ("--epsilon 0.1", dict(epsilon_low=0.1, epsilon_high=0.1)),
    ("--epsilon 0.1 --epsilon_high 0.28", dict(epsilon_low=0.1, epsilon_high=0.28)),
    ("--loss_type bnpo --num_iterations 2 --importance_sampling_level sequence",
     dict(loss_type="bnpo", num_iterations=2, importance_sampling_level="sequence")),
    ("--scale_rewards false", dict(scale_rewards="none")),
    ("--scale_rewards true", dict(scale_rewards="group")),
    ("--scale_rewards batch", dict(scale_rewards="batch")),
    ("--mask_truncated_completions true --top_entropy_quantile 0.2 --delta 4",
     dict(mask_truncated=True, top_entropy_quantile=0.2, delta=4.0)),
    ("--multi_objective_aggregation normalize_then_sum",
     dict(reward_aggregation="normalize_then_sum")),
    ("--beta 0.04", dict(beta=0.04, kl_bias_correction=True)),
    ("--beta 0.04 --use_bias_correction_kl false", dict(beta=0.04, kl_bias_correction=False)),
    ("--beta 0.04 --no_use_bias_correction_kl", dict(kl_bias_correction=False)),
    ("--beta 0.04 --sync_ref_model --ref_model_sync_steps 64 --ref_model_mixup_alpha 0.5",
     dict(sync_ref_every=64, ref_mixup_alpha=0.5)),
    ("--loss_type sapo --sapo_temperature_neg 2", dict(sapo_tau=[1.0, 2.0])),
    ("--loss_type vespo --vespo_k_pos 1 --vespo_lambda_neg 4 --use_vllm --vllm_importance_sampling_mode token_mask",
     dict(vespo_k=[1.0, 3.0], vespo_lambda=[3.0, 4.0], is_correction="token_mask")),
    ("--use_adaptive_entropy --entropy_coef 0.01 --entropy_target 1.5",
     dict(adaptive_entropy=True, entropy_coef=0.01, entropy_target=1.5)),
    ("--off_policy_mask_threshold 0.5", dict(off_policy_mask=0.5)),
    # the vLLM engine and its correction
    ("--use_vllm true --vllm_gpu_memory_utilization 0.5 --vllm_enable_sleep_mode",
     dict(engine="vllm", vllm_memory=0.5, vllm_sleep=True, is_correction="sequence_mask")),
    ("--use_vllm --vllm_importance_sampling_mode token_truncate "
     "--vllm_importance_sampling_clip_max 2 --vllm_importance_sampling_clip_min 0.5",
     dict(is_correction="token_truncate", is_max=2.0, is_min=0.5)),
    ("--use_vllm --vllm_importance_sampling_cap 5", dict(is_max=5.0)),
    ("--use_vllm --vllm_importance_sampling_correction false", dict(is_correction="off")),
    ("--use_vllm false", dict(engine="hf", is_correction="off")),
    ("--use_vllm --vllm_mode server --vllm_server_port 8001",
     dict(vllm_mode="server", vllm_url="http://0.0.0.0:8001")),
    ("--use_vllm --vllm_mode server --vllm_server_base_url http://host:9",
     dict(vllm_url="http://host:9")),
    # the optimizer, the precision
    ("--learning_rate 3e-6 --weight_decay 0.1 --max_grad_norm 0.5 --seed 7",
     dict(lr=3e-6, weight_decay=0.1, grad_clip=0.5, seed=7)),
    ("--bf16 false", dict(dtype="float32")),
    ("--no_gradient_checkpointing", dict(gradient_checkpointing=False)),
    ("--gradient_checkpointing false", dict(gradient_checkpointing=False)),
    ("--warmup_steps 5", dict(warmup_steps=5)),
    ("--warmup_steps 0.25", dict(warmup_steps=1)),  # of the 4 steps
    ("--warmup_ratio 0.5", dict(warmup_steps=2)),
    ("--lr_scheduler_type cosine_with_min_lr --lr_scheduler_kwargs {\"min_lr_rate\":0.1}",
     dict(lr=1e-6)),
    # the batch: a generation batch of 2 forwards, an optimizer step each
    ("--per_device_train_batch_size 8 --steps_per_generation 2 --max_steps 8",
     dict(prompts_per_step=2, minibatch_size=8, micro_batch_size=8, steps=4)),
    ("--per_device_train_batch_size 8 --generation_batch_size 16 --max_steps 8",
     dict(prompts_per_step=2, minibatch_size=8, steps=4)),
    ("--per_device_train_batch_size 4 --gradient_accumulation_steps 4",
     dict(prompts_per_step=2, micro_batch_size=4, minibatch_size=0)),
    ("--num_iterations 2 --max_steps 8", dict(steps=4)),
    # output, checkpoints, evaluation, logging
    ("--output_dir o --save_steps 3 --save_total_limit 5 --num_iterations 2 --max_steps 8",
     dict(out_dir="o", save_every=2, keep_last=5)),
    ("--eval_strategy steps --eval_steps 2", dict(eval_every=2)),
    ("--eval_strategy no", dict(eval_every=0)),
    ("--log_completions --logging_steps 2", dict(log_completions=2)),
    ("--resume_from_checkpoint true", dict(resume="yes")),
    ("--report_to none", dict(report_to=["none"])),
])
def test_a_field_maps_to_our_flag(words, expected):
    # 4 steps of one prompt (TRL's per_device_train_batch_size 8 over --G 8)
    base = "--max_steps 4" if "max_steps" not in words else ""
    args = parse(f"{words} {base}".split())
    for dest, value in expected.items():
        assert getattr(args, dest) == value, (dest, getattr(args, dest), value)


def test_lora_maps_with_peft_s_defaults():
    args = parse(["--use_peft", "--lora_r", "8", "--max_steps", "1"])
    assert (args.lora_rank, args.lora_alpha, args.lora_dropout) == (8, 32.0, 0.05)
    assert args.lora_targets == ["q_proj", "v_proj"]
    args = parse(["--use_peft", "--lora_target_modules", "all-linear", "--max_steps", "1"])
    assert args.lora_targets == config.LORA_TARGETS
    # without use_peft TRL ignores them: a warning, no LoRA
    assert parse(["--lora_r", "8", "--max_steps", "1"]).lora_rank == 0


def test_rewards_with_a_reward_model_and_the_soft_overlong_punishment(capsys):
    args = parse(["--reward_model_name_or_path", "org/rm", "--reward_funcs", "accuracy_reward",
                  "get_soft_overlong_punishment", "--reward_weights", "1", "0.5", "1",
                  "--max_completion_length", "1280", "--max_steps", "1"])
    assert args.rewards == ["org/rm", "accuracy_reward"] and args.reward_weights == [1.0, 0.5]
    assert args.overlong_buffer == 256
    capsys.readouterr()

    line = one_error(["--reward_funcs", "get_soft_overlong_punishment", "--max_steps", "1"],
                     capsys)
    assert "`trl grpo` fixes it at max_completion_len=1280" in line


def test_spellings_and_precedence(tmp_path):
    # dashes as TrlParser takes them; --name=value
    args = parse(["--num-generations", "4", "--per_device_train_batch_size=8", "--max_steps", "1"])
    assert (args.G, args.prompts_per_step) == (4, 2)

    # the command line over the file; our own flag over the TRL field that maps to it
    path = tmp_path / "grpo.yaml"
    path.write_text("num_generations: 4\nper_device_train_batch_size: 8\nuse_vllm: true\n"
                    "max_steps: 1\nlearning-rate: 1e-5\n")
    args = parse(["--config", path, "--num_generations", "8", "--engine", "hf", "--lr", "2e-5"])
    assert (args.G, args.prompts_per_step, args.engine, args.lr) == (8, 1, "hf", 2e-5)
    assert args.is_correction == "off"  # no vLLM samples to correct
    # our own flags in the file join TRL's
    path.write_text("num_generations: 4\nmax_steps: 1\neval-size: 16\n")
    assert parse(["--config", path]).eval_size == 16


def test_a_file_s_env_section_sets_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_NAMES_TEST", "before")
    path = tmp_path / "grpo.yaml"
    path.write_text("env:\n  TRL_NAMES_TEST: after\nnum_generations: 4\nmax_steps: 1\n")
    parse(["--config", path])
    assert os.environ["TRL_NAMES_TEST"] == "after"


def test_num_train_epochs_becomes_steps_once_the_rows_are_known(capsys):
    args = parse(["--num_train_epochs", "2", "--per_device_train_batch_size", "16",
                  "--warmup_ratio", "0.5"])
    assert args.trl_epochs["num_train_epochs"] == 2.0 and args.prompts_per_step == 2

    # 7 rows: 3 whole steps of 2 prompts an epoch (TRL drops the partial one)
    trl_names.resolve_epochs(args, 7)
    assert args.steps == 6 and args.warmup_steps == 3
    assert "--steps 6" in printed(capsys)[-1]

    with pytest.raises(ValueError, match="the 1 training prompts fill no step of 2"):
        trl_names.resolve_epochs(args, 1)


# -----------------------------------------------------------------------------
# The one-line messages

def test_a_field_with_no_equivalent_warns_in_one_line_each(capsys):
    parse(["--max_steps", "1", "--push_to_hub", "true", "--logging_steps", "5",
           "--torch_compile", "false"])  # at TRL's default: nothing to say
    warnings = [x for x in printed(capsys) if x.startswith("warning")]
    assert warnings == [
        "warning: push_to_hub true: no equivalent here, ignored (nothing is pushed to the "
        "Hub here)",
        "warning: logging_steps 5: ignored (train.py logs every step (metrics.jsonl, "
        "--report-to, --log-completions))",
    ]


@pytest.mark.parametrize("words, message", [
    ("--fp16 true", "fp16 true has no equivalent here (--dtype is float32 or bfloat16"),
    ("--optim adafactor", "optim adafactor has no equivalent here (the optimizer is torch's"),
    # a name both have is TRL's in a TRL run: dtype is the weights'
    ("--num_generations 8 --dtype bfloat16",
     "dtype bfloat16 has no equivalent here (the weights load in float32"),
    ("--shuffle_dataset false", "shuffle_dataset false has no equivalent here"),
    ("--lr_scheduler_type cosine", "lr_scheduler_type cosine has no equivalent here"),
    ("--max_completion_length null", "max_completion_length null has no equivalent here"),
    ("--resume_from_checkpoint out/step_1", "resume_from_checkpoint out/step_1 has no"),
    ("--num_generationz 8", "unrecognized argument --num_generationz: not a flag of train.py"),
    ("--num_generations eight", "num_generations: 'eight' is not an integer"),
    ("--num_generations 1", "num_generations 1: argument --G: must be >= 2"),
    ("--num_generations 4 8", "--num_generations takes one value, got 2"),
    ("--no_gradient_checkpointing false", "--no_gradient_checkpointing takes no value"),
    ("--per_device_train_batch_size 8 --steps_per_generation 3 --gradient_accumulation_steps 2",
     "steps_per_generation (3) must be a multiple of gradient_accumulation_steps (2) here"),
    ("--generation_batch_size 16 --steps_per_generation 2",
     "'generation_batch_size' and 'steps_per_generation' can not be both configured"),
    ("--generation_batch_size 12", "generation_batch_size (12) must be divisible by the global"),
    ("--steps_per_generation 2 --max_steps 3", "max_steps 3 must be a multiple of the 2 "),
    ("--num_train_epochs 0", "num_train_epochs 0.0 trains no step"),
])
def test_a_refused_input_stops_in_one_line(words, message, capsys):
    line = one_error(words.split(), capsys)
    assert line.startswith("error: ") and message in line, line


def test_a_file_s_field_names_the_file(tmp_path, capsys):
    path = tmp_path / "grpo.yaml"
    path.write_text("num_generations: 8\nnum_generationz: 8\n")
    line = one_error(["--config", path], capsys)
    assert line == (f"error: --config {path}: unknown field 'num_generationz': not a flag of "
                    f"train.py (python train.py --help), nor a field of TRL's GRPOConfig "
                    f"(docs/trl.md)")

    path.write_text("num_generations: 8\nfp16: true\n")
    assert one_error(["--config", path], capsys).startswith(f"error: --config {path}: fp16 true")


def test_a_prompt_s_completions_stay_on_one_rank(monkeypatch, capsys):
    """On 2 processes TRL would split a prompt's 8 completions over both."""
    monkeypatch.setattr(trl_names, "world", 2)
    line = one_error(["--per_device_train_batch_size", "4", "--max_steps", "1"], capsys)
    assert "per_device_train_batch_size x steps_per_generation (4 x 1) must be a multiple of " \
           "num_generations (8) here" in line
    assert parse(["--max_steps", "1"]).prompts_per_step == 2  # 8 x 2 ranks / 8


# -----------------------------------------------------------------------------
# The tables against TRL's source, and docs/trl.md

def test_every_field_of_trls_grpo_is_classified_at_its_default():
    """Every field `trl grpo` parses (TRL 1.16) is mapped, harmless or refused,
    and the tables hold TRL's defaults."""
    pytest.importorskip("trl")
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    fields = {}
    for kind in (GRPOScriptArguments, ModelConfig, DatasetMixtureConfig, GRPOConfig):
        for f in dataclasses.fields(kind):
            if f.init:
                missing = f.default is dataclasses.MISSING
                fields[f.name] = f.default_factory() if missing else f.default

    older = {"max_prompt_length", "warmup_ratio", "torch_dtype"}
    assert set(trl_names.DEFAULTS) - older == set(fields)
    wrong = {k: (trl_names.DEFAULTS[k], v) for k, v in fields.items()
             if trl_names.DEFAULTS[k] != v}
    assert not wrong, wrong


def test_docs_name_every_field():
    """docs/trl.md names each field trl_names.py reads, or its family (`hub_*`)."""
    doc = open(os.path.join(ROOT, "docs", "trl.md")).read()
    families = re.findall(r"`([a-z0-9_]+)\*`", doc)
    unnamed = [name for name in trl_names.DEFAULTS
               if f"`{name}" not in doc and not name.startswith(tuple(families))]
    assert not unnamed, unnamed
