"""bench.py's pure pieces (`python bench.py gpu --tiny` in .ci/run runs the rest end to end): the never-EOS
tokenizer that makes every completion run to full length, and the summaries of train.py's metrics."""
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


def test_run_summary_leaves_evaluations_out_of_the_training_time():
    """bench.py runs / trl: the median of the step deltas, a step right after an evaluation counted at the median (its
    delta holds the evaluation), the first held-out >= 0.95 and the training time summed up to it."""
    elapsed = [0.1, 0.2, 0.3, 5.3, 5.4, 5.5]  # step 4's delta (5.0 s) follows step 3's evaluation
    records = [dict(step=0, eval_greedy=0.0)] + [dict(step=s, elapsed=e) for s, e in enumerate(elapsed, 1)]
    records[3]["eval_greedy"], records[5]["eval_greedy"] = 0.5, 0.96
    median, first, to_095 = bench.run_summary(records)
    assert math.isclose(median, 0.1) and first == 5 and math.isclose(to_095, 0.5)  # 0.1 + 4 steps of 0.1
    assert bench.run_summary(records[:4])[1:] == (None, None)  # never reached
