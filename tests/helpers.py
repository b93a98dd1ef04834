"""Run train.py as a user would, and read what it leaves.

train.py runs as a subprocess, on 1 process or under torchrun. Or build only its
argument parser, in-process, to test flag ranges in milliseconds.
"""
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
