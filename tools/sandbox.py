"""
Python in a sandboxed subprocess.

code_reward: the fraction of its sample's unit tests that a completion's last
```python block passes (0.0: no code, a hang, an early exit). run_code, the tool
mode of tools.py: what a program printed (OUTPUT_CHARS at most), its traceback,
or how it stopped.

The `tests` column holds per sample either
(a) a list of assert statements, one test each, or
(b) a string of code defining top-level `def test_*():` functions.
The program runs once as module `solution`: no `__main__`, stdin /dev/null, and
its errors do not stop the tests. Then the tests run in its namespace.

Each program runs in a child process, sandbox_child.py, started as a script. The
child isolates itself, drops to the program's uid, sets the limits and runs the
program; it reports on a private pipe (sandbox_child.py says how).

Guaranteed (Linux, the trainer running as root with CAP_SYS_ADMIN):
G1. Writes only to its own fresh tmpfs (TMPFS_MB): a private mount namespace,
    all else read-only.
G2. No network: a private network namespace (loopback down), plus an audit hook
    refusing sockets.
G3. Cannot signal or read the trainer: a uid of its own (SANDBOX_UID.. +UIDS,
    flocked: no two programs on the host share one), no capabilities,
    no_new_privs, its own session, a clean env.
G4. Limits per process: CPU seconds, address space (MEM_MB), open files, file
    size, no core dumps. RLIMIT_NPROC = MAX_PROCS counts every process of the
    uid: it bounds the whole program.
G5. A wall-clock timeout SIGKILLs the process group, then every process of the
    uid (setsid too).
G6. Printing cannot fake results: nonce-tagged lines on a private pipe (stdout
    and stderr discarded) count only with the final "done" line. An exit, crash,
    kill or hang before it scores 0.0.
Not guaranteed:
N1. Not a security boundary against a determined attacker: shared kernel, no
    seccomp, no VM.
N2. No defence against reward hacking in the process. It shares the interpreter
    with its tests: the program can patch builtins, return always-equal objects
    or read the nonce from memory.
N3. Reads are limited only by file permissions: world-readable files, others'
    cmdlines in /proc.
N4. No total memory cap (no cgroup): at worst WORKERS * MAX_PROCS * MEM_MB of
    address space.
N5. Root without CAP_SYS_ADMIN (Docker): no namespaces. /tmp is writable, and
    only the audit hook cuts the network (ctypes gets around it). Not root: no
    uid switch. It can signal and read the trainer, RLIMIT_NPROC counts all the
    user's processes, and setsid escapes the timeout.

Run the tests: python -m pytest -q tests/test_sandbox.py tests/test_tools.py
Score the example task's reference solutions (all 1.0):
python tests/code_problems.py
"""
import ast
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

# wall clock per program, start-up included
TIMEOUT_S = 10.0
# RLIMIT_CPU per process
CPU_S = 10
# RLIMIT_AS per process: python + numpy import needs ~0.5 GB of address space
MEM_MB = 1024
# RLIMIT_NPROC: processes and threads of the program's uid (root only, see N5)
MAX_PROCS = 8
# largest file
FILE_MB = 16
# working dir size
TMPFS_MB = 64
# open files
MAX_FILES = 64
# tool mode: printed characters kept; one more stops the program
OUTPUT_CHARS = 4096
# programs run in parallel
WORKERS = os.cpu_count() or 1
# the first uid/gid programs run as: a range no one on the host uses
SANDBOX_UID = 64000
# programs run as SANDBOX_UID .. SANDBOX_UID + UIDS - 1
UIDS = 256
# a uid is taken while its lock file here is flocked
UID_LOCKS = "/tmp/tinygrpo-sandbox-uids"
# the child program, run as a script
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
# at most WORKERS programs of this process at once
_slots = threading.BoundedSemaphore(WORKERS)


def take_uid():
    """-> (uid, lock fd): a uid no other program on the host runs as, held while
    fd is open (G3)."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)

    for uid in range(SANDBOX_UID, SANDBOX_UID + UIDS):
        fd = os.open(os.path.join(UID_LOCKS, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)

    raise RuntimeError(f"all {UIDS} sandbox uids from {SANDBOX_UID} are taken: too many "
                       f"programs on this host")


def kill_all(uid):
    """kill(-1) as uid: every process it owns, wherever it went (G5)."""
    subprocess.run(["kill", "-9", "--", "-1"], user=uid, group=uid, extra_groups=[],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def extract_code(completion):
    """The last ```python (or untagged ```) block of a completion (text or
    messages), or None."""
    text = completion if isinstance(completion, str) else completion[-1]["content"]

    # pairs the fences in order
    blocks = re.findall(r"```([\w+-]*)[^\n]*\n(.*?)```", text, re.DOTALL)
    python_tags = ("", "python", "py", "python3")
    code = [body for tag, body in blocks if tag.lower() in python_tags]

    return code[-1] if code else None


def count_tests(tests):
    """The number of tests in one sample's `tests` entry, and the test function
    names (format b)."""
    if isinstance(tests, str):
        try:
            tree = ast.parse(tests)
        except SyntaxError as e:
            raise ValueError(f"tests code does not parse ({e}); fix the dataset's "
                             f"`tests` column") from e

        functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        names = [name for name in functions if name.startswith("test_")]
        return len(names), names

    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return len(tests), []

    raise ValueError(f"tests must be a list of assert strings or a string of test_* "
                     f"functions, got {tests!r}")


def run_tests(program, tests, timeout_s=None):
    """Run `program`, then its `tests`, in the sandbox -> (passed, total, status).

    status: "ok", "timeout", or "exited" (it ended before all tests ran:
    sys.exit, os._exit, a crash, a kill).
    """
    total, test_names = count_tests(tests)
    job = dict(program=program, tests=tests, test_names=test_names)
    if timeout_s is None:
        timeout_s = TIMEOUT_S

    records, timed_out = run_job(job, timeout_s)

    done = [record.split()[1:] for record in records if record.startswith("done")]
    if not done:
        if timed_out:
            return 0, total, "timeout"
        return 0, total, "exited"

    passed = {int(i) for i in done[0] if i.isdigit() and int(i) < total}
    return len(passed), total, "ok"


def run_code(program, timeout_s=None):
    """Tool mode: `program` once in the sandbox -> (text, status).

    text: what it printed, then how it ended unless it ran to the end. status:
    "ok", "error" (the text ends with the traceback), "Timeout" or "Killed"
    (over OUTPUT_CHARS of output, a limit, a signal, an exit). The last report
    counts (N2).
    """
    if timeout_s is None:
        timeout_s = TIMEOUT_S
    job = dict(program=program, tests=[], capture=OUTPUT_CHARS)

    records, timed_out = run_job(job, timeout_s)

    lines = "\n".join(records)
    reports = re.findall(r"^output (\w+) ((?:[0-9a-f]{2})*)$", lines, re.MULTILINE)
    if reports:
        status, text = reports[-1]
        return bytes.fromhex(text).decode(errors="replace"), status
    if timed_out:
        return f"Timeout: over {timeout_s:g} s", "Timeout"
    why = "Killed: it ended before its output was in (a limit, a signal or an exit)"
    return why, "Killed"


def run_job(job, timeout_s):
    """One program in the sandbox -> (its nonce-tagged records, the nonce
    dropped; timed out?)."""
    # blocks while WORKERS programs of this process are running
    with _slots:
        uid = None
        lock = None
        if os.geteuid() == 0:
            uid, lock = take_uid()

        try:
            return run_as(uid, job, timeout_s)
        finally:
            if lock is not None:
                # the uid is free again: none of its processes is left
                os.close(lock)


def run_as(uid, job, timeout_s):
    """sandbox_child.py as uid (None: this process's own) on job -> (records,
    timed out?)."""
    if uid is not None:
        # what a trainer killed mid-program left behind as this uid
        kill_all(uid)

    workdir = tempfile.mkdtemp(prefix="tinygrpo-sandbox-")
    read_fd, write_fd = os.pipe()
    nonce = secrets.token_hex(16)
    limits = {
        "RLIMIT_CPU": CPU_S,
        "RLIMIT_AS": MEM_MB << 20,
        "RLIMIT_NPROC": MAX_PROCS,
        "RLIMIT_FSIZE": FILE_MB << 20,
        "RLIMIT_NOFILE": MAX_FILES,
        "RLIMIT_CORE": 0,
    }
    job = dict(job, nonce=nonce, result_fd=write_fd, uid=uid, workdir=workdir,
               tmpfs_mb=TMPFS_MB, limits=limits)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "LANG": "C.UTF-8",
        # threads count as processes
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
    }

    try:
        if uid is not None:
            # used as is when the mount namespace is not available
            os.chown(workdir, uid, uid)

        # -I: this folder is not on the child's sys.path (sandbox_child.py)
        proc = subprocess.Popen([sys.executable, "-I", CHILD], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                env=env, cwd=workdir, pass_fds=(write_fd,),
                                start_new_session=True)
        os.close(write_fd)

        try:
            _, setup_err = proc.communicate(json.dumps(job).encode(), timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            setup_err = b""

        # the process group outlives the child while the program has children
        # in it

        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass  # no process left in the group
        proc.wait()
        if uid is not None:
            kill_all(uid)

        # all writers are dead, but never hang here (N5)
        os.set_blocking(read_fd, False)
        try:
            # one read: a pipe holds at most 64 KiB
            records = os.read(read_fd, 1 << 20)
        except BlockingIOError:
            records = b""
    finally:
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)

    lines = records.decode(errors="replace").splitlines()
    if f"{nonce} ready" not in lines and not timed_out:
        why = setup_err.decode(errors="replace")
        raise RuntimeError(f"sandbox failed to start:\n{why}")

    tag = f"{nonce} "
    records = [line[len(tag):] for line in lines if line.startswith(tag)]
    return records, timed_out


def code_reward(completions, tests, **kw):
    """The fraction of each sample's `tests` (format a or b) that its last
    ```python block passes."""
    if len(tests) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(tests)} tests "
                         f"entries: one per completion")


    programs = [extract_code(c) for c in completions]

    def score(program, sample_tests):
        if program is None:
            return 0.0
        passed, total, _ = run_tests(program, sample_tests)
        return passed / total if total else 0.0

    # the threads only wait on subprocesses
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(score, programs, tests))
