"""Run train.py as a user would, and read what it leaves.

train.py runs as a subprocess, on 1 process or under torchrun. Or build only its
argument parser, in-process, to test flag ranges in milliseconds.
"""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# different lengths: left padding (HF) must not shift anything
PROMPTS = ["739>", "12>", "5>", "8086>"]
ENV = {**os.environ,
       "OMP_NUM_THREADS": "1",
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "VLLM_LOGGING_LEVEL": "WARNING",
       "TOKENIZERS_PARALLELISM": "false"}


ZYGOTE = os.path.join(ROOT, "tests", "zygote.py")


def start_zygotes():
    """Start zygote.py's two warm servers ("base", "vllm") -> a function that stops them.

    Their sockets are exported to this process's environment, which the pytest
    workers inherit (conftest.py, once per session).
    """
    # short: a socket path has at most 107 bytes
    folder = tempfile.mkdtemp(prefix="tgz")
    log = open(os.path.join(folder, "server.log"), "w")
    procs = []

    for kind in ("base", "vllm"):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.path.join(ROOT, "tests")}
        cmd = [sys.executable, ZYGOTE, "serve", os.path.join(folder, kind), kind]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log))
        os.environ[f"TINYGRPO_ZYGOTE_{kind.upper()}"] = os.path.join(folder, kind)

    # theirs (zygote.py, simplification 2)
    os.environ["TINYGRPO_ZYGOTE_PYTHONPATH"] = os.path.join(ROOT, "tests")

    def stop():
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
        log.close()
        shutil.rmtree(folder, True)

    return stop


def zygote_env():
    """The warm servers' sockets, or {} when there are none (TINYGRPO_TEST_ZYGOTE=0)."""
    return {k: v for k, v in os.environ.items() if k.startswith("TINYGRPO_ZYGOTE_")}


def script_cmd(script, nproc, cold=False):
    """-> (command, env to add): `python script`, or torchrun's.

    Both start through a warm server (zygote.py) unless cold: the script, and
    torchrun's agent too (its `import torch` is 2 s of CPU).
    """
    warm = {} if cold else zygote_env()

    # how a process starts: warm or cold
    if warm:
        python = [sys.executable, ZYGOTE]
    else:
        python = [sys.executable]
    if nproc == 1:
        return python + [script], warm

    torchrun = [*python, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}"]
    # (torchrun starts each rank with its own `python`)
    return torchrun + python[1:] + [script], warm


def run_two_rank_script(script, *args, timeout=300):
    """Run a test file as a 2-rank torchrun script.

    Fail with its output unless both ranks print 'rank N PASS'.
    """
    cmd, warm = script_cmd(os.path.abspath(script), 2)
    proc = subprocess.run(cmd + list(map(str, args)), env={**ENV, **warm}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)

    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "rank 0 PASS" in proc.stdout and "rank 1 PASS" in proc.stdout, log


def run_train(args, out_dir, nproc=1, timeout=300, env=None, check=True):
    """-> (returncode, combined output, metrics records).

    Fails the test with the output on a non-zero exit when check=True.
    """
    cmd, warm = script_cmd(os.path.join(ROOT, "train.py"), nproc)
    cmd += ["--out-dir", str(out_dir), *map(str, args)]
    full_env = {**os.environ,
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.path.join(ROOT, "tests"),
                **warm,
                **(env or {})}

    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    output = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{output[-4000:]}")

    return proc.returncode, output, read_metrics(out_dir)


def fine_tune(model, examples, steps, lr=3e-3):
    """Teach a tiny model its completions, in place: examples are (prompt ids,
    completion ids, labels: the completion's ids, -100 where no loss)."""
    import torch

    length = max(len(p) + len(c) for p, c, _ in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)  # (B, L)
    labels = torch.full((len(examples), length), -100)  # (B, L) the completions only
    for i, (p, c, target) in enumerate(examples):
        ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p):len(p) + len(c)] = torch.tensor(target)

    # lr 1e-2 spikes on the last steps (torch 2.13's CPU kernels)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    torch.manual_seed(0)
    for _ in range(steps):
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def fast_forward():
    """model.Forward with fast/update.py's functions, as fast.install hands them
    to train.py where the loss needs the logits: each prompt's forward shared by
    its completions, the log-probs and entropies by chunks (no fused head)."""
    from fast import update
    from model import Forward

    return Forward(logits=update.completion_logits, logps=update.selective_log_softmax,
                   entropies=update.entropy_from_logits)


def read_metrics(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path)]


def without_timings(records):
    """Metrics minus the wall-clock fields and the peak memory, which differ from
    run to run."""
    timings = ("tokens_per_s", "elapsed", "rss_peak_gb")
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in timings}
            for r in records]


def train_parser():
    """train.py's argparse parser (config.py), built in this process.

    parse_args(bad) prints the one-line error and raises SystemExit(2), exactly as
    the script does.
    """
    import config

    return config.parser


def parse_flags(argv):
    """train.py's flags from argv, the recipe's defaults filled in."""
    import config

    return config.fill_defaults(train_parser().parse_args(argv))


def refused(argv, capsys):
    """config.check_flags on argv must stop the run with one error line
    (exit 2) -> that line."""
    import pytest

    import config

    with pytest.raises(SystemExit) as e:
        config.check_flags(parse_flags(argv))

    out = capsys.readouterr().out
    assert e.value.code == 2 and out.startswith("error: "), out
    assert out.count("\n") == 1, out
    return out


# -----------------------------------------------------------------------------
# Two computations of the same math held against each other (the same_math
# marker, tests/README.md)

# fp32's machine epsilon (torch.finfo(torch.float32).eps): the gap between 1
# and the next fp32 number
EPS32 = 2.0 ** -23
# the same math in fp64: relative to the largest entry. fp64's rounding of the
# tiny models' sums is ~1e-14 of it (eps64 = 2.2e-16 times sums of <= 10^3
# terms), while a 1e-6 change of a forward or a backward is 10^4 times above
FP64_TOL = 1e-10


# An engine's sampling log-probs (vLLM's CPU kernels, the HF engines' decode
# loops) against the trainer's recomputation, both fp32: two orders of the same
# forward. No tolerance holds on every code path short of the worst case,
# fp32_tol(summed_terms) of a log-prob's magnitude (~1e-3 for task.py's tiny
# Qwen2); independent roundings grow as sqrt(n) eps instead (~3e-5 there at
# |logp| <= 5), and the gaps measured are ~1e-6 (tests/test_server.py) on this
# AVX-512 CPU as it is and under MKL_CBWR=SSE4_2. 1e-4 sits above both, and a
# stale or missing weight is > 1e-2 (each parity test checks that first).
ENGINE_TOL = 1e-4


@contextlib.contextmanager
def fp64_norms():
    """Within it, transformers' RMSNorms (fast.update.RMS_NORMS) compute an fp64
    input in fp64. Their own forward casts to fp32 and back: in an fp64 model
    that rounds every norm's output to fp32, and two paths whose inputs differ
    by fp64 rounding then part by an fp32 ulp (6e-8) where one rounds up and the
    other down. The formula is theirs: weight * (x * rsqrt(mean(x^2) + eps)).
    """
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    classes = (LlamaRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm, MistralRMSNorm)
    own = {cls: cls.forward for cls in classes}

    def forward(self, x):
        if x.dtype != torch.float64:
            return own[type(self)](self, x)
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))

    for cls in classes:
        cls.forward = forward
    try:
        yield
    finally:
        for cls in classes:
            cls.forward = own[cls]


def fp32_tol(n_summed):
    """How far apart two fp32 computations of the same math may land, relative
    to the magnitude of the numbers they sum: n_summed * eps32.

    Why: a sum of n terms is within (n - 1) * eps/2 * sum|x_i| of the exact sum
    in any order of addition (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., eq. 4.4), so two orders of it (another kernel or
    blocking: MKL's code path for the CPU's instruction set, ATen's vector
    width, a fused or tiled op) are within about n * eps of the terms'
    magnitude. Along a chain of sums (a model's layers) the first-order bounds
    add: n_summed counts the terms of every sum behind a compared number
    (summed_terms for a model). It is a worst case: the gaps measured are 3 to
    over 1000 times below it, as is, under MKL_CBWR=SSE4_2 and under
    ATEN_CPU_CAPABILITY=default, and a bug (a wrong mask, position, scale or
    cache slot) is far above it. A backward cannot be held
    tighter than its rounding in fp32: where a path also runs in fp64, its test
    compares there too, to FP64_TOL.
    """
    return n_summed * EPS32


def summed_terms(config, tokens):
    """n_summed (fp32_tol) of a log-prob or a weight's gradient through a
    transformers decoder of this config, over sequences of `tokens` positions.

    Per layer: the two norms' means (2 x hidden), the q/k/v projections
    (hidden), the scores (head_dim), the softmax and the attention's weighted
    sum (2 x tokens), o_proj (hidden), gate/up (hidden), down (intermediate);
    then the final norm and the head (2 x hidden), the log-softmax
    (vocabulary), and a weight's gradient, summed over the tokens.
    """
    d = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or d // config.num_attention_heads
    layer = 5 * d + head_dim + 2 * tokens + config.intermediate_size
    return config.num_hidden_layers * layer + 2 * d + config.vocab_size + tokens


def tiny_run_tol():
    """fp32_tol of a train.py run's logged numbers on task.py's tiny Qwen2 (the
    default model): summed_terms of its config at its 64 positions.

    A run's first update is two orders of the same forward and backward. The
    later ones follow AdamW's normalised steps, the same lr-sized move of every
    weight whose gradient is above its rounding, so two runs of the same math
    stay within this bound too (the tests that compare runs print the gaps
    measured: pytest -s).
    """
    import torch

    from task import build_tiny_model, build_tokenizer

    with torch.random.fork_rng():  # build_tiny_model seeds the global generator
        config = build_tiny_model(build_tokenizer()).config
    return fp32_tol(summed_terms(config, config.max_position_embeddings))


def assert_close_rel(got, want, rel, scale=None, msg=""):
    """|got - want| <= rel * scale everywhere; scale: want's largest magnitude
    by default (each entry's rounding follows the terms summed into it, at most
    the largest)."""
    import torch

    # a Python number as fp64 (torch.as_tensor would round it to fp32)
    got, want = (x if torch.is_tensor(x) else torch.tensor(x, dtype=torch.float64)
                 for x in (got, want))
    assert got.shape == want.shape, (msg, got.shape, want.shape)
    if scale is None:
        scale = want.abs().max().item() if want.numel() else 0.0
    err = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
    # shown with -s (pytest -s -m same_math: the margins)
    print(f"same math {msg}: {err:.3g} <= {rel:.3g} x {scale:.3g}, "
          f"{err / (rel * scale) if rel * scale else 0:.2g} of the bound")
    assert err <= rel * scale, (f"{msg}: differ by {err:.3g} > {rel:.3g} x {scale:.3g} "
                                f"(= {rel * scale:.3g})")
    return err


# Two runs' logged loss and KL, when they are the same math to fp32 rounding.
# Not derived: both are means that cancel (the advantages over a group; exp(d) -
# d - 1 against 1) to 1e-5..1e-3 here, below the worst-case bound of their fp32
# terms of order 1 (tiny_run_tol, 3e-4), which would test nothing. The gaps
# measured are 0 to 3e-8 (pytest -s), on this AVX-512 CPU as it is, under
# MKL_CBWR=SSE4_2 and under ATEN_CPU_CAPABILITY=default: both runs take each
# log-prob from the same weights through the same kernels but the one compared.
RUN_LOSS_TOL = dict(rel=1e-5, abs=1e-6)


def assert_run_loss_close(got, want, key):
    """|got - want| <= RUN_LOSS_TOL's abs + rel x |want|."""
    assert_close_rel(got, want, 1.0, scale=RUN_LOSS_TOL["abs"] + RUN_LOSS_TOL["rel"] * abs(want),
                     msg=key)
