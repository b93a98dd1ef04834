"""bench.py's pure pieces (`python bench.py gpu --tiny` in .ci/run runs the rest end to end): the never-EOS
tokenizer that makes every completion run to full length, and the summary of train.py's metrics."""
import math

import torch

import bench
import task


def test_never_eos_tokenizer_survives_save_and_reload(tmp_path):
    tokenizer = bench.never_eos_tokenizer(bench.QWEN_VOCAB)
    assert tokenizer.eos_token_id == bench.QWEN_VOCAB and tokenizer.pad_token_id == 0
    model = bench.build_model("tiny", tokenizer, "cpu", torch.float32, vocab_size=1024)  # its config says qwen2
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reloaded, _ = task.load_tokenizer(str(tmp_path))  # as train.py and vLLM load it
    assert reloaded.eos_token_id == bench.QWEN_VOCAB
    assert reloaded("739>")["input_ids"] == task.build_tokenizer()("739>")["input_ids"]
    assert reloaded.decode([9, 500, 5]) == "73"  # ids the tokenizer lacks (a model can sample them) decode to ''
    assert bench.never_eos_tokenizer().eos_token_id == len(task.build_tokenizer())  # the default: right after


def test_summarize_train_skips_warm_up_steps_and_tolerates_no_memory_key():
    times = dict(time_rollout=1.0, time_reward=0.1, time_update=2.0, time_sync=0.5, tokens_per_s=100.0)
    records = [dict(step=0, eval_greedy=0.0)] + [dict(step=s, **times) for s in range(1, 6)]
    records[1]["time_update"] = 60.0  # step 1: compilation
    summary = bench.summarize_train(records)
    assert summary["steps_measured"] == "3-5" and summary["time_update"] == 2.0
    assert math.isclose(summary["time_step"], 3.6)
    assert summary["mem_peak_gb"] is None  # on CPU, or before train.py logged it
    records[4]["mem_peak_gb"], records[5]["mem_peak_gb"] = 30.0, 31.5
    assert bench.summarize_train(records)["mem_peak_gb"] == 31.5
    assert bench.finite({"a": [float("nan"), 1.0], "b": float("inf")}) == {"a": [None, 1.0], "b": None}
