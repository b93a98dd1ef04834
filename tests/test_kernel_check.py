"""kernels/check.py: the start-up check that holds kernels/grpo.py to loss.py on
a run's settings.

It passes on the code as it is, for each objective and knob the kernel has;
it fails where loss.py's objective is edited and the kernel is not: in
process (the objective monkeypatched), where --loss-impl auto falls back to
loss.py with one line and --loss-impl triton stops; and as a fork would meet
it, train.py run in a copy of the repo whose loss.py was edited. On CPU the
kernel runs under TRITON_INTERPRET=1 (conftest.py).
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import loss
from kernels.check import agrees_with_reference, checked_impl
from loss import LossSettings

from helpers import ROOT

# numpy (the interpreter) warns on inf/NaN in branches tl.where discards: see test_kernel.py
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# the runs' settings the kernel computes: each objective, beta (with the KL
# correction), delta, the temperature and entropy bonus, the IS correction and
# the off-policy mask
SETTINGS = {
    "grpo": LossSettings(),
    "dapo": LossSettings(loss_type="dapo", epsilon_high=0.28),
    "cispo": LossSettings(loss_type="cispo", epsilon_high=5.0),
    "sapo": LossSettings(loss_type="sapo"),
    "beta": LossSettings(beta=0.04),
    "beta, kl correction, delta": LossSettings(beta=0.1, kl_bias_correction=True, delta=4.0),
    "dr_grpo, temperature, entropy": LossSettings(loss_type="dr_grpo", max_new_tokens=16,
                                                   temperature=0.7, entropy_coef=0.01),
    "bnpo, IS, off-policy mask": LossSettings(loss_type="bnpo", is_correction="token_mask",
                                              is_min=0.5, is_max=2.0, off_policy_mask=0.5),
}


def edit_objective(monkeypatch, factor):
    """Scale loss.py's default objective, pg_t, by factor, as a fork's edit would:
    loss.clipped, and every entry of the table loss.py dispatches through that
    holds it."""
    original = loss.clipped

    def edited(*args, **kwargs):
        per_token, stats = original(*args, **kwargs)
        return factor * per_token, stats

    monkeypatch.setattr(loss, "clipped", edited)
    for name, objective in getattr(loss, "SURROGATES", {}).items():
        if objective is original:
            monkeypatch.setitem(loss.SURROGATES, name, edited)


@pytest.mark.same_math
@pytest.mark.parametrize("name", SETTINGS)
def test_the_kernel_agrees_with_loss_py(name):
    ok, numbers = agrees_with_reference(SETTINGS[name], DEVICE)
    assert ok, numbers


def test_the_check_leaves_the_global_rng_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    agrees_with_reference(LossSettings(), DEVICE)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("factor", [1.5, -1.0])
@pytest.mark.parametrize("name", ["grpo", "beta"])
def test_an_edited_objective_fails_the_check(name, factor, monkeypatch):
    edit_objective(monkeypatch, factor)
    ok, numbers = agrees_with_reference(SETTINGS[name], DEVICE)
    assert not ok, numbers
    assert numbers.startswith("on-policy: loss "), numbers


def test_auto_falls_back_to_loss_py_with_one_line(monkeypatch, capsys):
    edit_objective(monkeypatch, 1.5)
    impl, why = checked_impl("auto", "auto: the fused kernel on CUDA", LossSettings(), DEVICE)

    out = capsys.readouterr().out
    assert (impl, why) == ("torch", "auto: kernels/grpo.py differs from loss.py")
    assert out.count("\n") == 1, out
    assert out.startswith("loss: kernels/grpo.py differs from loss.py on this run's settings "
                          "(on-policy: loss "), out
    assert out.endswith("using loss.py. Update kernels/grpo.py to match, or pass "
                        "--loss-impl torch\n"), out


def test_explicit_triton_stops_with_one_error_line(monkeypatch, capsys):
    edit_objective(monkeypatch, 1.5)
    with pytest.raises(SystemExit) as e:
        checked_impl("triton", "--loss-impl triton", LossSettings(), DEVICE)

    out = capsys.readouterr().out
    assert e.value.code == 2
    assert out.count("\n") == 1, out
    assert out.startswith("error: --loss-impl triton: kernels/grpo.py differs from loss.py"), out


def test_the_unedited_kernel_keeps_its_place(capsys):
    impl, why = checked_impl("triton", "--loss-impl triton", LossSettings(beta=0.04), DEVICE)
    assert (impl, why) == ("triton", "--loss-impl triton; agrees with loss.py")
    assert capsys.readouterr().out == ""


def test_a_fork_that_edits_loss_py_stops_at_start_up(tmp_path):
    """A copy of the repo whose loss.py's clipped objective is scaled by 1.5:
    train.py --loss-impl triton stops before the first step, with one error line.

    Run cold (not through tests/zygote.py), from the copy, so that every
    project module is the copy's.
    """
    fork = tmp_path / "fork"
    shutil.copytree(ROOT, fork, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "tests", "bench", "docs", "*.png"))
    lines = (fork / "loss.py").read_text().splitlines(keepends=True)
    objective = [i for i, x in enumerate(lines) if x.lstrip().startswith("per_token = -torch.min(")]
    assert len(objective) == 1, "loss.py's clipped objective moved: update this test"
    i = objective[0]
    lines[i] = lines[i].replace("-torch.min(", "-1.5 * torch.min(", 1)
    (fork / "loss.py").write_text("".join(lines))
    assert "per_token = -1.5 * torch.min(" in (fork / "loss.py").read_text()

    cmd = [sys.executable, "train.py", "--loss-impl", "triton", "--steps", "1",
           "--eval-every", "0", "--eval-size", "40", "--engine", "hf",
           "--out-dir", str(tmp_path / "out")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, cwd=fork, env=env, capture_output=True, text=True, timeout=300)

    out = proc.stdout + proc.stderr
    errors = [x for x in out.splitlines() if x.startswith("error")]
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: --loss-impl triton: kernels/grpo.py differs from "
                                "loss.py on this run's settings (on-policy: loss "), errors[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
