"""
Code-execution reward: run each completion's last ```python block against the sample's unit tests in a
sandboxed subprocess; the reward is the fraction of tests passed (R1-style code RL, run locally).

    reward = (# tests whose code ran without raising) / (# tests)     # 0.0: no code, a hang, an early exit
    python sandbox.py      # scores the reference solutions of the built-in example task (all 1.0)

The `tests` column holds per sample either (a) a list of statements, one test each, e.g.
["assert add(1, 2) == 3"] (a test passes if it does not raise, so write asserts), or (b) one string of
code defining top-level `def test_*():` functions, one test each. The program's top level runs once as
module `solution` (no `__main__` block; stdin is /dev/null; an error there does not stop the tests), then
the tests run in its namespace.

Guaranteed (Linux, trainer running as root with CAP_SYS_ADMIN, as on our dev machine):
G1. Writes only to its own dir: a fresh tmpfs (TMPFS_MB) in a private mount namespace in which every
    other mount is read-only; it vanishes with the program.
G2. No network: a private network namespace (loopback down), plus an audit hook refusing sockets.
G3. Cannot signal or read the trainer: it runs as a uid of its own (SANDBOX_UID.. +UIDS, no capabilities,
    no_new_privs; flock-ed for the program's run, so no two programs on the host share one, whichever process
    runs them) in its own session, with a scrubbed env (PATH, HOME, LANG).
G4. Limits per process: CPU seconds, address space (MEM_MB), open files, file size, no core dumps;
    RLIMIT_NPROC = MAX_PROCS counts every process of the program's uid, so it bounds the whole program.
G5. A wall-clock timeout SIGKILLs the process group; after every program, every process of its uid is
    SIGKILLed too (also those that left the group with setsid).
G6. Printing cannot fake results: they travel as nonce-tagged lines on a private pipe (stdout, stderr
    are discarded) and count only next to the final "done" line: sys.exit, os._exit, a crash, a kill
    or a hang before all tests ran scores the whole program 0.0.
Not guaranteed:
N1. Not a security boundary against a determined attacker: shared kernel, no seccomp, no VM.
N2. No defence against reward hacking inside the process: the program shares the interpreter with its
    tests, so it can patch builtins, return objects whose __eq__ is always True, or dig the nonce out of
    memory (frames, gc). Robust scoring would compare outputs in the parent (stdin/stdout problems).
N3. Reads are not restricted beyond file permissions (world-readable files, others' cmdlines in /proc).
N4. No total memory cap (no cgroup): the worst case is WORKERS * MAX_PROCS * MEM_MB of address space.
N5. Root without CAP_SYS_ADMIN (e.g. Docker's default): no namespaces, so it can write to world-writable
    dirs (/tmp) and the network is cut only by the audit hook (ctypes gets around it). Not root: also
    no uid switch, so it can signal and read the trainer, RLIMIT_NPROC counts all the user's processes
    (forking fails), and processes that leave the process group survive the timeout; a user+network
    namespace cuts the network where the kernel allows it.
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

TIMEOUT_S = 10.0  # wall clock per program, start-up included
CPU_S = 10  # RLIMIT_CPU per process
MEM_MB = 1024  # RLIMIT_AS per process (python + numpy import needs ~0.5 GB of address space)
MAX_PROCS = 8  # RLIMIT_NPROC: processes and threads of the program's uid (root only, see N5)
FILE_MB, TMPFS_MB, MAX_FILES = 16, 64, 64  # largest file, working dir size, open files
WORKERS = os.cpu_count() or 1  # programs run in parallel
SANDBOX_UID, UIDS = 64000, 256  # programs run as uid/gid SANDBOX_UID.. +255: pick a range no one on the host uses
UID_LOCKS = "/tmp/tinygrpo-sandbox-uids"  # a uid is taken while its lock file here is flocked (G3)
_slots = threading.BoundedSemaphore(WORKERS)  # at most WORKERS programs of this process at once


def take_uid():
    """-> (uid, lock fd): a uid no other program on this host runs as (another rank's, another run's), held until
    the fd closes or this process dies. Before: a slot per process, so two ranks on a node killed each other's."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    for uid in range(SANDBOX_UID, SANDBOX_UID + UIDS):
        fd = os.open(os.path.join(UID_LOCKS, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {UIDS} sandbox uids from {SANDBOX_UID} are taken: too many programs on this host")


def kill_all(uid):  # kill(-1) as uid: every process it owns, wherever it went (G5)
    subprocess.run(["kill", "-9", "--", "-1"], user=uid, group=uid, extra_groups=[],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Runs in the child: isolate (as root), drop to the program's uid, set limits, run program + tests, report.
_HARNESS = r'''
import ctypes, json, os, resource, sys
def private_ancestor(path):  # the topmost directory above path that others cannot enter, if any
    parts = path.strip("/").split("/")
    return next((d for d in ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
                 if not os.stat(d).st_mode & 1), None)
def mount(source, target, fstype, flags, options=None):  # fail loudly: no silently weaker sandbox
    if libc.mount(source and source.encode(), target.encode(), fstype, flags, options) != 0:
        sys.exit(f"sandbox: mount {target} failed: {os.strerror(ctypes.get_errno())}")
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 1 << 14, 1 << 18
libc = ctypes.CDLL(None, use_errno=True)
def main():  # everything is local to main(): the program's globals are a separate dict
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)  # the job (with its nonce) is gone from stdin
    uid = job["uid"]
    if uid is not None:  # root: private network + mount namespaces, fs read-only but for a fresh tmpfs
        if libc.unshare(0x40000000 | 0x00020000) == 0:  # CLONE_NEWNET | CLONE_NEWNS
            mount(None, "/", None, MS_REC | MS_PRIVATE)  # mounts below stay in this namespace
            # python may sit in a dir the uid cannot enter (pyenv in /root, mode 700): cover that dir
            # with an empty tmpfs (hiding the rest of it) and bind the python install back in
            hidden = {p: private_ancestor(p) for p in {sys.prefix, sys.base_prefix} if private_ancestor(p)}
            fds = {p: os.open(p, os.O_PATH) for p in hidden}  # opened before the tmpfs covers them
            for private in set(hidden.values()):
                mount("tmpfs", private, b"tmpfs", 0, b"mode=755")
            for prefix, fd in fds.items():
                os.makedirs(prefix, exist_ok=True)
                mount(f"/proc/self/fd/{fd}", prefix, None, MS_BIND | MS_REC)
                os.close(fd)
            for mnt in [line.split()[1] for line in open("/proc/self/mounts")]:
                mount(None, mnt.replace("\\040", " "), None, MS_REMOUNT | MS_BIND | MS_RDONLY)
            opts = f"size={job['tmpfs_mb']}m,mode=700,uid={uid},gid={uid}".encode()
            mount("tmpfs", job["workdir"], b"tmpfs", MS_NOSUID | MS_NODEV, opts)
        os.setgroups([]); os.setgid(uid); os.setuid(uid)  # irreversible: real, effective, saved; no caps
        if not os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK):
            sys.exit(f"sandbox: uid {uid} cannot read {os.path.dirname(os.__file__)}: install python where "
                     "others can read it, or allow mount namespaces (CAP_SYS_ADMIN)")
    else:  # not root: a user namespace may still give a private network namespace
        libc.unshare(0x10000000 | 0x40000000)  # CLONE_NEWUSER | CLONE_NEWNET, best effort
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS: setuid binaries cannot regain root
    os.chdir(job["workdir"])
    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    def refuse_sockets(event, args):
        if event == "socket.__new__":
            raise PermissionError("sandbox: no network")
    sys.addaudithook(refuse_sockets)  # an audit hook cannot be removed once added
    nonce, fd, tests = job["nonce"], job["result_fd"], job["tests"]
    os.write(fd, f"{nonce} ready\n".encode())  # setup done; from here on, errors are the program's
    os.dup2(0, 2)  # stderr (a pipe to the trainer until now) goes to /dev/null too
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
    except BaseException:
        pass  # what it defined before failing still gets tested
    if isinstance(tests, str):
        try:
            exec(compile(tests, "tests.py", "exec"), namespace)
            tests = [f"{name}()" for name in job["test_names"]]
        except BaseException:
            tests = []
    passed = []
    for i, test in enumerate(tests):
        try:
            exec(test, namespace)
            passed.append(str(i))
        except BaseException:
            pass
    os.write(fd, f"{nonce} done {' '.join(passed)}\n".encode())  # one line: fits the 64 KiB pipe
    os._exit(0)  # skip the program's atexit hooks and buffered output
main()
'''


def extract_code(completion):
    """The last ```python (or untagged ```) block of a completion: a string or [{"role", "content"}, ...]."""
    text = completion if isinstance(completion, str) else completion[-1]["content"]
    blocks = re.findall(r"```([\w+-]*)[^\n]*\n(.*?)```", text, re.DOTALL)  # pairs fences in order
    code = [body for tag, body in blocks if tag.lower() in ("", "python", "py", "python3")]
    return code[-1] if code else None


def count_tests(tests):
    """Number of tests in one sample's `tests` entry, and the test function names (format b)."""
    if isinstance(tests, str):
        try:
            tree = ast.parse(tests)
        except SyntaxError as e:
            raise ValueError(f"tests code does not parse ({e}); fix the dataset's `tests` column") from e
        names = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        return len(names), names
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return len(tests), []
    raise ValueError(f"tests must be a list of assert strings or a string of test_* functions, got {tests!r}")


def run_tests(program, tests, timeout_s=None):
    """Run `program` then its `tests` in the sandbox. Returns (passed, total, status), status one of
    "ok", "timeout", "exited" (ended before all tests ran: sys.exit/os._exit/crash/killed)."""
    with _slots:  # blocks while WORKERS programs of this process are running
        uid, lock = take_uid() if os.geteuid() == 0 else (None, None)
        try:
            return run_as(uid, program, tests, TIMEOUT_S if timeout_s is None else timeout_s)
        finally:
            if lock is not None:
                os.close(lock)  # the uid is free again: none of its processes is left


def run_as(uid, program, tests, timeout_s):
    total, test_names = count_tests(tests)
    if uid is not None:
        kill_all(uid)  # what a trainer killed mid-program left behind as this uid
    workdir = tempfile.mkdtemp(prefix="tinygrpo-sandbox-")
    read_fd, write_fd = os.pipe()
    nonce = secrets.token_hex(16)
    limits = {"RLIMIT_CPU": CPU_S, "RLIMIT_AS": MEM_MB << 20, "RLIMIT_NPROC": MAX_PROCS,
              "RLIMIT_FSIZE": FILE_MB << 20, "RLIMIT_NOFILE": MAX_FILES, "RLIMIT_CORE": 0}
    job = dict(program=program, tests=tests, test_names=test_names, nonce=nonce, result_fd=write_fd,
               uid=uid, workdir=workdir, tmpfs_mb=TMPFS_MB, limits=limits)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # one thread each: threads count as procs
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)  # used as is when the mount namespace is not available
        proc = subprocess.Popen([sys.executable, "-I", "-c", _HARNESS], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd=workdir,
                                pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        try:
            _, setup_err = proc.communicate(json.dumps(job).encode(), timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out, setup_err = True, b""
        try:  # the session's process group outlives the harness while the program has children in it
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass  # no process left in the group
        proc.wait()
        if uid is not None:
            kill_all(uid)
        os.set_blocking(read_fd, False)  # all writers are dead, but never hang here (N5)
        try:
            records = os.read(read_fd, 1 << 20)  # one read: a pipe holds at most 64 KiB
        except BlockingIOError:
            records = b""
    finally:
        os.close(read_fd)
        shutil.rmtree(workdir, ignore_errors=True)
    lines = records.decode(errors="replace").splitlines()
    if f"{nonce} ready" not in lines and not timed_out:
        raise RuntimeError(f"sandbox failed to start:\n{setup_err.decode(errors='replace')}")
    done = [line.split()[2:] for line in lines if line.startswith(f"{nonce} done")]
    if not done:
        return 0, total, "timeout" if timed_out else "exited"
    return len({int(i) for i in done[0] if i.isdigit() and int(i) < total}), total, "ok"


def code_reward(completions, tests, **kw):
    """Fraction of the sample's tests passed by the last ```python block of each completion (0.0 if none).
    `tests`: the dataset column, one entry per completion (format a or b, see the module docstring)."""
    if len(tests) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(tests)} tests entries: one per completion")
    programs = [extract_code(c) for c in completions]

    def score(program, sample_tests):
        if program is None:
            return 0.0
        passed, total, _ = run_tests(program, sample_tests)
        return passed / total if total else 0.0

    with ThreadPoolExecutor(WORKERS) as pool:  # threads only wait on subprocesses
        return list(pool.map(score, programs, tests))


# --- A built-in example task: small functions, each with assert tests and a reference solution.
CODE_PROBLEMS = [
    ("add(a, b)", "returns the sum of a and b", "def add(a, b):\n    return a + b\n",
     ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]),
    ("is_palindrome(s)", "returns True if the string s reads the same backwards",
     "def is_palindrome(s):\n    return s == s[::-1]\n",
     ["assert is_palindrome('abba')", "assert not is_palindrome('abc')", "assert is_palindrome('')"]),
    ("fib(n)", "returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55", "assert fib(30) == 832040"]),
    ("count_vowels(s)", "returns how many of the characters of s are vowels (aeiou, either case)",
     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
     ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0", "assert count_vowels('AEIOU') == 5"]),
    ("second_largest(xs)", "returns the second largest distinct value of the list xs",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
     ["assert second_largest([1, 2, 3]) == 2", "assert second_largest([5, 5, 4]) == 4",
      "assert second_largest([-1, -7, 0]) == -1"]),
]


def make_code_dataset():
    """Rows {"prompt", "tests", "solution"} for code_reward; "solution" is a reference completion."""
    return [{"prompt": f"Write a Python function `{signature}` that {spec}. "
                       "Answer with the code in one ```python block.",
             "tests": tests, "solution": f"```python\n{reference}```"}
            for signature, spec, reference, tests in CODE_PROBLEMS]


if __name__ == "__main__":
    rows = make_code_dataset()
    rewards = code_reward([r["solution"] for r in rows], [r["tests"] for r in rows])
    for row, reward in zip(rows, rewards):
        print(f"{reward:.2f}  {row['prompt']}")
