"""Run train.py as a user would (a subprocess, 1 process or torchrun) and read what it leaves; or build only its
argument parser, in-process, to test flag ranges in milliseconds."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["739>", "12>", "5>", "8086>"]  # different lengths: left padding (HF) must not shift anything
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
       "TOKENIZERS_PARALLELISM": "false"}


ZYGOTE = os.path.join(ROOT, "tests", "zygote.py")


def start_zygotes():
    """Start zygote.py's two warm servers ("base", "vllm") and export their sockets to this process's environment,
    which the pytest workers inherit (conftest.py, once per session) -> a function that stops them."""
    folder = tempfile.mkdtemp(prefix="tgz")  # short: a socket path has at most 107 bytes
    log, procs = open(os.path.join(folder, "server.log"), "w"), []
    for kind in ("base", "vllm"):
        procs.append(subprocess.Popen([sys.executable, ZYGOTE, "serve", os.path.join(folder, kind), kind], cwd=ROOT,
                                      env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests")},
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log))
        os.environ[f"TINYGRPO_ZYGOTE_{kind.upper()}"] = os.path.join(folder, kind)
    os.environ["TINYGRPO_ZYGOTE_PYTHONPATH"] = os.path.join(ROOT, "tests")  # theirs (zygote.py: simplification 2)
    return lambda: ([p.kill() for p in procs], [p.wait() for p in procs], log.close(), shutil.rmtree(folder, True))


def zygote_env():
    """The warm servers' sockets, or {} when there are none (TINYGRPO_TEST_ZYGOTE=0)."""
    return {k: v for k, v in os.environ.items() if k.startswith("TINYGRPO_ZYGOTE_")}


def script_cmd(script, nproc, cold=False):
    """-> (command, env to add): `python script` or torchrun's, through a warm server (zygote.py) unless cold: the
    script, and torchrun's agent too (its `import torch` is 2 s of CPU)."""
    warm = {} if cold else zygote_env()
    python = [sys.executable, ZYGOTE] if warm else [sys.executable]  # how a process starts: warm or cold
    if nproc == 1:
        return python + [script], warm
    torchrun = [*python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return torchrun + python[1:] + [script], warm  # (torchrun starts each rank with its own `python`)


def run_two_rank_script(script, *args, timeout=300):
    """Run a test file as a 2-rank torchrun script; fail with its output unless both ranks print 'rank N PASS'."""
    cmd, warm = script_cmd(os.path.abspath(script), 2)
    proc = subprocess.run(cmd + list(map(str, args)), env={**ENV, **warm}, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "rank 0 PASS" in proc.stdout and "rank 1 PASS" in proc.stdout, log


def run_train(args, out_dir, nproc=1, timeout=300, env=None, check=True):
    """-> (returncode, combined output, metrics records). Fails the test with the output on a non-zero exit
    when check=True."""
    cmd, warm = script_cmd(os.path.join(ROOT, "train.py"), nproc)
    cmd += ["--out-dir", str(out_dir), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "tests"), **warm, **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"train.py failed ({proc.returncode}):\n{output[-4000:]}")
    return proc.returncode, output, read_metrics(out_dir)


def read_metrics(out_dir):
    path = os.path.join(out_dir, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def without_timings(records):
    """Metrics minus the wall-clock fields, which differ from run to run."""
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in ("tokens_per_s", "elapsed")}
            for r in records]


def train_parser():
    """train.py's argparse parser (config.py), built in this process: parse_args(bad) prints the
    one-line error and raises SystemExit(2), exactly as the script does."""
    import config
    return config.parser
