"""--sync-ref-every N --ref-mixup-alpha A (TR-DPO, arXiv 2404.09656; TRL's
SyncRefModelCallback) from train.py's side.

Its rules (in-process, config.py), and a run checkpointed at every step: the
reference in each checkpoint is the one before it, mixed with that step's
policy exactly as TRL mixes (ref.mul_(1 - A).add_(policy, alpha=A)) after every
N-th optimizer step, and untouched after the others. The kill-and-resume test
with a moving reference: tests/test_resume.py.
"""
import os

import pytest
import torch
from safetensors.torch import load_file

import config
from config import check_flags
from helpers import parse_flags as parse
from helpers import assert_close_rel, fp32_tol, refused, run_train

ALPHA = 0.6
EVERY = 2
STEPS = 5
FAST = ["--engine", "hf", "--steps", str(STEPS), "--eval-size", "8", "--eval-every", "0",
        "--prompts-per-step", "4", "--save-every", "1", "--keep-last", str(STEPS)]


RULE_CASES = {
    "without a reference": (["--sync-ref-every", "2"],
                            "--sync-ref-every does nothing without --beta > 0"),
    "alpha alone": (["--ref-mixup-alpha", "0.5"],
                    "--ref-mixup-alpha does nothing without --sync-ref-every N"),
    "with LoRA": (["--beta", "0.04", "--sync-ref-every", "2", "--lora-rank", "4"],
                  "--sync-ref-every does not work with --lora-rank"),
    "with FSDP": (["--beta", "0.04", "--sync-ref-every", "2", "--fsdp"],
                  "--sync-ref-every does not work with --fsdp"),
}


@pytest.mark.parametrize("name", RULE_CASES)
def test_rules(name, capsys, monkeypatch):
    monkeypatch.setattr(config, "world", 2)  # --fsdp needs ranks
    argv, expected = RULE_CASES[name]
    out = refused(argv, capsys)
    assert expected in out, out


def test_accepted_with_a_reference():
    # no SystemExit
    check_flags(parse(["--beta", "0.04", "--sync-ref-every", "2", "--ref-mixup-alpha", "0.5"]))


def test_the_reference_mixes_in_the_policy_every_n_steps(tmp_path):
    """One optimizer step a step (the default): the mix follows steps EVERY, 2 EVERY."""
    flags = ["--beta", "0.04", "--sync-ref-every", str(EVERY),
             "--ref-mixup-alpha", str(ALPHA)]
    _, _, records = run_train(FAST + flags, tmp_path)
    assert [r["step"] for r in records] == list(range(STEPS + 1))

    ref = load_file(tmp_path / "init_model" / "model.safetensors")  # step 0's
    fired = []
    for step in range(1, STEPS + 1):
        folder = tmp_path / "checkpoints" / f"step_{step:06d}"
        policy = load_file(folder / "model" / "model.safetensors")
        saved = torch.load(folder / "reference.pt")
        assert set(policy) <= set(saved), set(policy) ^ set(saved)

        if step % EVERY == 0:
            fired.append(step)
            for k in policy:
                expected = ref[k].clone().mul_(1 - ALPHA).add_(policy[k], alpha=ALPHA)
                assert torch.equal(saved[k], expected), (step, k)
                # the formula, to fp32 rounding: two products and a sum on each
                # side (add_'s alpha may fuse a multiply-add), of the weights' magnitude
                formula = ALPHA * policy[k] + (1 - ALPHA) * ref[k]
                magnitude = max(policy[k].abs().max().item(), ref[k].abs().max().item())
                assert_close_rel(saved[k], formula, fp32_tol(3 + 3), scale=magnitude, msg=k)
            assert any(not torch.equal(saved[k], ref[k]) for k in policy), step
        else:
            assert all(torch.equal(saved[k], ref[k]) for k in policy), step
        ref = {k: saved[k] for k in policy}
    assert fired == [2, 4]


def test_no_reference_file_without_the_flag(tmp_path):
    run_train(FAST + ["--steps", "1", "--beta", "0.04"], tmp_path)
    assert not os.path.exists(tmp_path / "checkpoints" / "step_000001" / "reference.pt")
