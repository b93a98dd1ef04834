"""zygote.py, the suite's warm start of its subprocesses, acts as `python SCRIPT`.

The exit code, output, traceback, argv, cwd, environment, `-m MODULE`, a forwarded
signal, and our own modules imported fresh (common.py reads RANK).
"""
import os
import signal
import subprocess
import time

import pytest

from helpers import ROOT, script_cmd, zygote_env

pytestmark = pytest.mark.skipif(not zygote_env(),
                                reason="TINYGRPO_TEST_ZYGOTE=0: the suite runs cold")

SCRIPT = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
import common
assert __name__ == "__main__"
print("argv", sys.argv[1:], "cwd", os.getcwd(), "rank", common.rank,
      "env", os.environ.get("PROBE"), flush=True)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "exit":
    sys.exit(int(sys.argv[2]))
if sys.argv[1] == "raise":
    raise KeyError("boom")
if sys.argv[1] == "sleep":
    time.sleep(60)
"""


def run(tmp_path, *args, module=False, **popen):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)

    cmd, warm = script_cmd(str(script), 1)
    assert warm and cmd[-2].endswith("zygote.py"), cmd
    # `python -m probe`, found in the cwd
    if module:
        cmd = cmd[:-1] + ["-m", "probe"]

    # to the "base" server (no vLLM: a quicker exit)
    args = [*args, "--engine", "hf"]
    env = {**os.environ, **warm, "PROBE": "x", "RANK": "3",
           "PYTHONPATH": os.path.join(ROOT, "tests")}
    return subprocess.Popen(cmd + args, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


@pytest.mark.parametrize("args,code", [
    (["exit", "3"], 3),
    (["exit", "0"], 0),
    (["raise"], 1),
])
def test_exit_code_output_and_traceback(tmp_path, args, code):
    proc = run(tmp_path, *args)
    out, err = proc.communicate(timeout=120)

    assert proc.returncode == code, (out, err)
    assert out == f"argv {[*args, '--engine', 'hf']} cwd {tmp_path} rank 3 env x\n", out
    assert err.startswith("to stderr\n"), err
    assert ("KeyError: 'boom'" in err) == (args == ["raise"]), err


def test_module_runs_as_main(tmp_path):
    """`zygote.py -m MODULE` is `python -m MODULE`.

    That is how the suite starts torchrun's agent warm.
    """
    proc = run(tmp_path, "exit", "3", module=True)
    out, err = proc.communicate(timeout=120)

    assert proc.returncode == 3, err
    expected = f"argv ['exit', '3', '--engine', 'hf'] cwd {tmp_path} rank 3 env x\n"
    assert out == expected, err


def test_signal_reaches_the_script(tmp_path):
    proc = run(tmp_path, "sleep")

    # until the script is running
    deadline = time.time() + 120
    while time.time() < deadline and "argv" not in proc.stdout.readline():
        pass

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGTERM
