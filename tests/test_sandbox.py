"""sandbox.py: correct code scores 1.0, partial code its fraction, and every
hostile program scores 0 while the trainer (this pytest process) and the machine
stay intact, each within a few seconds."""
import os
import resource
import socket
import subprocess
import sys
import time

import pytest

from tools import sandbox
from code_problems import make_code_dataset
from tools.sandbox import code_reward, extract_code, run_tests

ROOT = os.geteuid() == 0
# root with CAP_SYS_ADMIN: the full sandbox (G1, G2 in sandbox.py)
UNSHARE = "import ctypes; exit(ctypes.CDLL(None).unshare(0x40000000 | 0x00020000))"
NAMESPACES = False
if ROOT:
    NAMESPACES = subprocess.run([sys.executable, "-c", UNSHARE]).returncode == 0
# one worker: sandbox_processes() sees every program's uid
pytestmark = pytest.mark.xdist_group("test_sandbox")
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


@pytest.fixture(autouse=True)
def short_limits(monkeypatch):
    # every hostile run must end within ~TIMEOUT_S
    monkeypatch.setattr(sandbox, "TIMEOUT_S", 3.0)
    monkeypatch.setattr(sandbox, "CPU_S", 3)
    # the fork bomb stays at 8 processes
    monkeypatch.setattr(sandbox, "MAX_PROCS", 8)


def fenced(code):
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


def sandbox_processes(settle_s=3.0):
    """PIDs of live processes owned by any sandbox uid: the sandbox must leave
    none behind.

    A process SIGKILLed a moment ago may still be exiting (a fork bomb's
    hundreds, on a loaded machine): wait up to settle_s for those, far too short
    for a survivor that goes on forking.
    """
    deadline = time.time() + settle_s
    while (pids := _sandbox_pids()) and time.time() < deadline:
        time.sleep(0.05)
    return pids


def _sandbox_pids():
    uids = {str(sandbox.SANDBOX_UID + i) for i in range(sandbox.UIDS)}

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue  # exited meanwhile

        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if uid_line.split()[1] in uids and "State:\tZ" not in status:
            pids.append(pid)
    return pids


def test_correct_partial_and_no_code():
    right = fenced("def add(a, b):\n    return a + b")
    better = "\nBetter:\n```\ndef add(a, b):\n    return b + a\n```"
    completions = [
        right,
        # fails add(-1, 1): 2 of 3
        fenced("def add(a, b):\n    return abs(a) + b"),
        # no code block
        "I think the answer is a + b.",
        # conversational
        [{"role": "assistant", "content": right}],
        # the last block counts
        fenced("def add(a, b):\n    return a - b") + better,
        # a non-python block is not code to run
        "```bash\necho hi\n```",
    ]

    rewards = code_reward(completions, [ADD_TESTS] * len(completions))

    assert rewards == pytest.approx([1.0, 2 / 3, 0.0, 1.0, 1.0, 0.0])


@pytest.mark.skipif(
    not ROOT, reason="programs run as uids of their own only as root (sandbox.py, N5)")
def test_two_processes_at_once_never_kill_each_others_programs():
    """Two trainer ranks on one node score programs at the same time. Before,
    each process numbered its uids from SANDBOX_UID, so one's clean-up after every
    program (kill all of its uid) killed the other's, scored 0."""
    slow = fenced("import time\ntime.sleep(2)\ndef ok():\n    return 1")
    code = (f"import sandbox; print(sandbox.code_reward([{slow!r}] * 2, "
            "[['assert ok() == 1']] * 2))")
    other = subprocess.Popen([sys.executable, "-c", code],
                             cwd=os.path.dirname(sandbox.__file__),
                             stdout=subprocess.PIPE, text=True)
    # its two programs are sleeping
    time.sleep(0.7)

    quick = fenced("def ok():\n    return 1")
    deadline = time.time() + 1.5
    # ours start and end meanwhile, each followed by its clean-up
    while time.time() < deadline:
        assert code_reward([quick] * 2, [["assert ok() == 1"]] * 2) == [1.0, 1.0]

    assert other.communicate(timeout=30)[0].strip() == "[1.0, 1.0]"


def test_test_function_format():
    tests = ("def helper():\n    return 3\n\n"
             "def test_small():\n    assert add(1, 2) == helper()\n\n"
             "def test_negative():\n    assert add(-5, 2) == -3\n")

    assert code_reward([fenced("def add(a, b):\n    return a + b")], [tests]) == [1.0]
    # helper is not a test
    wrong = fenced("def add(a, b):\n    return abs(a + b)")
    assert code_reward([wrong], [tests]) == [0.5]


def test_extract_code_takes_last_python_block():
    text = ("```python\nx = 1\n```\ntext\n```bash\nls\n```\n"
            "```py\nx = 2\n```\n```json\n{}\n```")

    assert extract_code(text) == "x = 2\n"
    assert extract_code("```python\nunclosed") is None


def test_example_task_reference_solutions_score_one():
    rows = make_code_dataset()

    rewards = code_reward([r["solution"] for r in rows], [r["tests"] for r in rows])
    assert rewards == [1.0] * len(rows)

    # right for 0 and 1 only
    wrong = fenced("def fib(n):\n    return n")
    fib_row = next(r for r in rows if "fib" in r["prompt"])
    assert code_reward([wrong], [fib_row["tests"]]) == [0.5]


def test_bad_input_raises():
    with pytest.raises(ValueError, match="one per completion"):
        code_reward(["a", "b"], [ADD_TESTS])

    with pytest.raises(ValueError, match="list of assert strings"):
        code_reward([fenced("x = 1")], [42])


def test_batch_runs_in_parallel_and_a_hang_costs_only_its_own_sample():
    hang = fenced("def add(a, b):\n    return a + b\nwhile True:\n    pass")
    start = time.time()

    rewards = code_reward([fenced("def add(a, b):\n    return a + b"), hang, hang],
                          [ADD_TESTS] * 3)

    assert rewards == [1.0, 0.0, 0.0]
    # two workers: the hangs overlap
    assert time.time() - start < 2 * sandbox.TIMEOUT_S + 2


# program -> tests that would pass if the attack worked
HOSTILE = {
    "infinite_loop": (
        "def add(a, b):\n    return a + b\nwhile True:\n    pass",
        ADD_TESTS),
    "fork_bomb": (
        "import os\ndef add(a, b):\n    return a + b\nwhile True:\n    try:\n"
        "        os.fork()\n    except OSError:\n        pass",
        ADD_TESTS),
    "memory_bomb": (
        "blocks = []\ntry:\n    while True:\n        blocks.append(bytearray(1 << 26))\n"
        "except MemoryError:\n    pass\ngot = len(blocks) << 26",
        ["assert got >= 4 << 30", "assert len(bytearray(8 << 30)) > 0"]),
    "sys_exit_before_tests": (
        "import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b",
        ADD_TESTS),
    "os_exit_in_test": (
        "import os\ndef add(a, b):\n    os._exit(0)",
        ADD_TESTS),
    "forged_results": (
        "import os\nfor fd in range(3, 64):\n    try:\n"
        "        os.write(fd, b'pass 0\\npass 1\\npass 2\\ndone\\n')\n"
        "    except OSError:\n        pass\nprint('pass 0\\ndone')\nos._exit(0)",
        ADD_TESTS),
    "huge_output": (
        "import sys\ndef add(a, b):\n    return a + b\nwhile True:\n"
        "    print('x' * 10**6)\n    sys.stderr.write('y' * 10**6)",
        ADD_TESTS),
    "huge_file": (
        "size = 0\ntry:\n    with open('big', 'wb') as f:\n        while True:\n"
        "            size += f.write(b'x' * (1 << 20))\n"
        "except OSError:\n    pass  # EFBIG at FILE_MB",
        ["assert size > 100 << 20"]),
    "kill_trainer": (
        "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), signal.SIGKILL)\n"
        "    os.killpg(os.getpgid(os.getppid()), signal.SIGKILL)\n    return a + b",
        ADD_TESTS),
}


NEEDS_ROOT = pytest.mark.skipif(
    not ROOT, reason="without root the program runs as the trainer's user (N5)")
HOSTILE_NAMES = [pytest.param(n, marks=NEEDS_ROOT) if n == "kill_trainer" else n
                 for n in HOSTILE]


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_hostile_program_scores_zero_and_everything_survives(name):
    program, tests = HOSTILE[name]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.time()

    assert code_reward([fenced(program)], [tests]) == [0.0]

    assert time.time() - start < sandbox.TIMEOUT_S + 2
    # KiB: the output is not kept
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert rss_after - rss_before < 100_000
    if ROOT:
        # forks, bombs, children: all killed
        assert sandbox_processes() == []


@pytest.mark.skipif(
    not NAMESPACES, reason="needs root with mount namespaces (see sandbox.py, N5)")
def test_cannot_write_outside_its_dir(tmp_path):
    # unique per run
    name = f"tinygrpo_escape_{tmp_path.name}"
    outside = [tmp_path / name, f"/tmp/{name}", f"/work/{name}", os.path.abspath(name)]
    program = ("def write(path):\n    open(path, 'w').write('x')\n    return True\n"
               f"OUTSIDE = {list(map(str, outside))}\n")
    # many files, each under FILE_MB: the tmpfs size bounds the total
    program += ("def fill():\n    total = 0\n    try:\n        for i in range(20):\n"
                "            with open(f'f{i}', 'wb') as f:\n"
                "                total += f.write(b'x' * (15 << 20))\n"
                "    except OSError:\n        pass\n    return total")
    tests = [f"assert write(OUTSIDE[{i}])" for i in range(len(outside))]
    tests += ["assert write('inside.txt')", "assert fill() > 100 << 20"]

    passed, total, status = run_tests(program, tests)

    # only the write inside its own dir worked
    assert (passed, total, status) == (1, 6, "ok")
    assert not any(os.path.exists(p) for p in outside)


def test_cannot_read_trainer_environment(monkeypatch):
    # the trainer's env: e.g. an API key
    monkeypatch.setenv("TINYGRPO_SECRET", "hunter2-7f3a")
    # without root /proc/<trainer>/environ is readable (N5)
    pids = "[os.getppid(), 1]" if ROOT else "[]"
    program = ("import os\nleaked = str(dict(os.environ))\n"
               f"for pid in {pids}:\n    try:\n"
               "        leaked += open(f'/proc/{pid}/environ').read()\n"

               "    except OSError:\n        pass")

    passed, total, status = run_tests(program, ["assert 'hunter2' in leaked",
                                                "assert 'PATH' in leaked"])

    # the program ran and saw only its scrubbed env
    assert (passed, total, status) == (1, 2, "ok")


def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.5)
    port = server.getsockname()[1]

    program = ("import ctypes, socket, struct\ndef connect():\n"
               f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
               "    return True\n"
               "def connect_raw():  # libc directly, around the audit hook\n"
               "    libc = ctypes.CDLL(None)\n    fd = libc.socket(2, 1, 0)\n"
               f"    addr = struct.pack('<HH4s8x', 2, socket.htons({port}), "
               "bytes([127, 0, 0, 1]))\n"
               "    return fd >= 0 and libc.connect(fd, addr, len(addr)) == 0\n")
    tests = ["assert connect()"]
    if NAMESPACES:
        tests += ["assert connect_raw()"]  # else only the hook cuts the network

    try:
        assert run_tests(program, tests)[:2] == (0, len(tests))
        with pytest.raises(socket.timeout):
            server.accept()  # nobody connected
    finally:
        server.close()
