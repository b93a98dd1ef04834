"""
Python in a sandboxed subprocess. code_reward: the fraction of its sample's unit tests that a
completion's last ```python block passes (0.0: no code, a hang, an early exit). run_code (the tool
mode, tools.py): what a program printed (OUTPUT_CHARS at most), its traceback, or how it stopped.

The `tests` column holds per sample (a) a list of assert statements, one test each, or (b) a string
of code defining top-level `def test_*():` functions. The program runs once as module `solution` (no
`__main__`, stdin /dev/null, errors do not stop the tests), then the tests run in its namespace.

Guaranteed (Linux, the trainer running as root with CAP_SYS_ADMIN):
G1. Writes only to its own fresh tmpfs (TMPFS_MB): a private mount namespace, all else read-only.
G2. No network: a private network namespace (loopback down), plus an audit hook refusing sockets.
G3. Cannot signal or read the trainer: a uid of its own (SANDBOX_UID.. +UIDS, flocked: no two
    programs on the host share one), no capabilities, no_new_privs, its own session, a clean env.
G4. Limits per process: CPU seconds, address space (MEM_MB), open files, file size, no core
    dumps; RLIMIT_NPROC = MAX_PROCS counts every process of the uid: it bounds the whole program.
G5. A wall-clock timeout SIGKILLs the process group, then every process of the uid (setsid too).
G6. Printing cannot fake results: nonce-tagged lines on a private pipe (stdout, stderr discarded)
    count only with the final "done" line; an exit, crash, kill or hang before it scores 0.0.
Not guaranteed:
N1. Not a security boundary against a determined attacker: shared kernel, no seccomp, no VM.
N2. No defence against reward hacking in the process: sharing the interpreter with its tests, the
    program can patch builtins, return always-equal objects or read the nonce from memory.
N3. Reads are limited only by file permissions (world-readable files, others' cmdlines in /proc).
N4. No total memory cap (no cgroup): at worst WORKERS * MAX_PROCS * MEM_MB of address space.
N5. Root without CAP_SYS_ADMIN (Docker): no namespaces: /tmp is writable and only the audit hook
    (ctypes gets around it) cuts the network. Not root: no uid switch: it can signal and read the
    trainer, RLIMIT_NPROC counts all the user's processes, and setsid escapes the timeout.

Run: python sandbox.py   (scores the built-in task's reference solutions: all 1.0)
Run the tests: python -m pytest -q tests/test_sandbox.py tests/test_tools.py
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
FILE_MB = 16  # largest file
TMPFS_MB = 64  # working dir size
MAX_FILES = 64  # open files
OUTPUT_CHARS = 4096  # tool mode: printed characters kept; one more stops the program
WORKERS = os.cpu_count() or 1  # programs run in parallel
SANDBOX_UID = 64000  # the first uid/gid programs run as: a range no one on the host uses
UIDS = 256  # programs run as SANDBOX_UID .. SANDBOX_UID + UIDS - 1
UID_LOCKS = "/tmp/tinygrpo-sandbox-uids"  # a uid is taken while its lock file here is flocked
_slots = threading.BoundedSemaphore(WORKERS)  # at most WORKERS programs of this process at once


def take_uid():
    """-> (uid, lock fd): a uid no other program on the host runs as, held while fd is open (G3)."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    for uid in range(SANDBOX_UID, SANDBOX_UID + UIDS):
        fd = os.open(os.path.join(UID_LOCKS, str(uid)), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise RuntimeError(f"all {UIDS} sandbox uids from {SANDBOX_UID} are taken: too many programs "
                       f"on this host")


def kill_all(uid):
    """kill(-1) as uid: every process it owns, wherever it went (G5)."""
    subprocess.run(["kill", "-9", "--", "-1"], user=uid, group=uid, extra_groups=[],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# Runs in the child: isolate (as root), drop to the program's uid, set limits, run, report.
_HARNESS = r'''
import ctypes, io, json, os, resource, sys, traceback
def private_ancestor(path):  # the topmost dir above path that others cannot enter, if any
    parts = path.strip("/").split("/")
    ancestors = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
    return next((d for d in ancestors if not os.stat(d).st_mode & 1), None)
def mount(source, target, fstype, flags, options=None):  # fails loudly: never a weaker sandbox
    if libc.mount(source and source.encode(), target.encode(), fstype, flags, options) != 0:
        sys.exit(f"sandbox: mount {target} failed: {os.strerror(ctypes.get_errno())}")
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 1 << 14
MS_PRIVATE = 1 << 18
libc = ctypes.CDLL(None, use_errno=True)
class Output(io.StringIO):  # tool mode's stdout and stderr: `limit` characters, then it stops
    def write(self, s):
        super().write(s[:self.limit + 1 - self.tell()])  # never a copy of a flood
        if self.tell() > self.limit:
            self.report("Killed", f"Killed: output over {self.limit} characters")
        return len(s)
    def report(self, status, why=""):  # one line to the trainer, then the end of the program
        text = "\n".join(filter(None, [self.getvalue()[:self.limit], why]))
        os.write(self.fd, f"{self.nonce} output {status} {text.encode().hex()}\n".encode())
        os._exit(0)
def main():  # everything is local to main(): the program's globals are a separate dict
    job = json.loads(sys.stdin.buffer.read())
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)  # the job (with its nonce) is gone from stdin
    uid = job["uid"]
    if uid is not None:  # root: private network and mount namespaces, the fs read-only
        if libc.unshare(0x40000000 | 0x00020000) == 0:  # CLONE_NEWNET | CLONE_NEWNS
            mount(None, "/", None, MS_REC | MS_PRIVATE)  # mounts below stay in this namespace
            # python may sit in a dir the uid cannot enter (pyenv in /root, mode 700): cover that
            # dir with an empty tmpfs (hiding the rest of it) and bind the python install back in
            prefixes = {sys.prefix, sys.base_prefix}
            hidden = {p: private_ancestor(p) for p in prefixes if private_ancestor(p)}
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
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # irreversible: real, effective and saved ids; no capabilities
        if not os.access(os.path.dirname(os.__file__), os.R_OK | os.X_OK):
            sys.exit(f"sandbox: uid {uid} cannot read {os.path.dirname(os.__file__)}: install "
                     "python where others can read it, or allow mount namespaces (CAP_SYS_ADMIN)")
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
    nonce = job["nonce"]
    fd = job["result_fd"]
    tests = job["tests"]
    os.write(fd, f"{nonce} ready\n".encode())  # setup done; from here on, errors are the program's
    os.dup2(0, 2)  # stderr (a pipe to the trainer until now) goes to /dev/null too
    out = None
    if job.get("capture"):  # tool mode: print() and tracebacks go to a bounded buffer
        out = sys.stdout = sys.stderr = Output()
        out.fd, out.nonce, out.limit = fd, nonce, job["capture"]
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
    except BaseException as e:  # tests: what it defined before failing still gets tested
        if out and not isinstance(e, SystemExit):
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            out.report("error")
    if out:
        out.report("ok")
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
    """The last ```python (or untagged ```) block of a completion (text or messages), or None."""
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
            raise ValueError(f"tests code does not parse ({e}); fix the dataset's `tests` "
                             f"column") from e
        functions = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
        names = [name for name in functions if name.startswith("test_")]
        return len(names), names
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return len(tests), []
    raise ValueError(f"tests must be a list of assert strings or a string of test_* functions, "
                     f"got {tests!r}")


def run_tests(program, tests, timeout_s=None):
    """Run `program` then its `tests` in the sandbox -> (passed, total, status), status one of
    "ok", "timeout", "exited" (ended before all tests ran: sys.exit/os._exit/crash/killed)."""
    total, test_names = count_tests(tests)
    job = dict(program=program, tests=tests, test_names=test_names)
    records, timed_out = run_job(job, TIMEOUT_S if timeout_s is None else timeout_s)
    done = [record.split()[1:] for record in records if record.startswith("done")]
    if not done:
        return 0, total, "timeout" if timed_out else "exited"
    return len({int(i) for i in done[0] if i.isdigit() and int(i) < total}), total, "ok"


def run_code(program, timeout_s=None):
    """Tool mode: `program` once in the sandbox -> (what it printed, then how it ended unless it ran
    to the end, status): "ok", "error" (the text ends with the traceback), "Timeout" or "Killed"
    (over OUTPUT_CHARS of output, a limit, a signal, an exit). The last report counts (N2)."""
    timeout_s = TIMEOUT_S if timeout_s is None else timeout_s
    records, timed_out = run_job(dict(program=program, tests=[], capture=OUTPUT_CHARS), timeout_s)
    reports = re.findall(r"^output (\w+) ((?:[0-9a-f]{2})*)$", "\n".join(records), re.MULTILINE)
    if reports:
        return bytes.fromhex(reports[-1][1]).decode(errors="replace"), reports[-1][0]
    if timed_out:
        return f"Timeout: over {timeout_s:g} s", "Timeout"
    return "Killed: it ended before its output was in (a limit, a signal or an exit)", "Killed"


def run_job(job, timeout_s):
    """One program in the sandbox -> (its nonce-tagged records, the nonce dropped; timed out?)."""
    with _slots:  # blocks while WORKERS programs of this process are running
        uid, lock = take_uid() if os.geteuid() == 0 else (None, None)
        try:
            return run_as(uid, job, timeout_s)
        finally:
            if lock is not None:
                os.close(lock)  # the uid is free again: none of its processes is left


def run_as(uid, job, timeout_s):
    if uid is not None:
        kill_all(uid)  # what a trainer killed mid-program left behind as this uid
    workdir = tempfile.mkdtemp(prefix="tinygrpo-sandbox-")
    read_fd, write_fd = os.pipe()
    nonce = secrets.token_hex(16)
    limits = {"RLIMIT_CPU": CPU_S, "RLIMIT_AS": MEM_MB << 20, "RLIMIT_NPROC": MAX_PROCS,
              "RLIMIT_FSIZE": FILE_MB << 20, "RLIMIT_NOFILE": MAX_FILES, "RLIMIT_CORE": 0}
    job = dict(job, nonce=nonce, result_fd=write_fd, uid=uid, workdir=workdir, tmpfs_mb=TMPFS_MB,
               limits=limits)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # threads count as processes
    try:
        if uid is not None:
            os.chown(workdir, uid, uid)  # used as is when the mount namespace is not available
        proc = subprocess.Popen([sys.executable, "-I", "-c", _HARNESS], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env,
                                cwd=workdir, pass_fds=(write_fd,), start_new_session=True)
        os.close(write_fd)
        try:
            _, setup_err = proc.communicate(json.dumps(job).encode(), timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            setup_err = b""
        try:  # the process group outlives the harness while the program has children in it
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
    return [line[len(nonce) + 1:] for line in lines if line.startswith(f"{nonce} ")], timed_out


def code_reward(completions, tests, **kw):
    """The fraction of each sample's `tests` (format a or b) its last ```python block passes."""
    if len(tests) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(tests)} tests entries: "
                         f"one per completion")
    programs = [extract_code(c) for c in completions]

    def score(program, sample_tests):
        if program is None:
            return 0.0
        passed, total, _ = run_tests(program, sample_tests)
        return passed / total if total else 0.0

    with ThreadPoolExecutor(WORKERS) as pool:  # threads only wait on subprocesses
        return list(pool.map(score, programs, tests))


CODE_PROBLEMS = [  # a built-in example task: small functions, assert tests, reference solutions
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
    """Rows {"prompt", "tests", "solution"} for code_reward; "solution": a reference completion."""
    return [{"prompt": f"Write a Python function `{signature}` that {spec}. "
                       "Answer with the code in one ```python block.",
             "tests": tests, "solution": f"```python\n{reference}```"}
            for signature, spec, reference, tests in CODE_PROBLEMS]


if __name__ == "__main__":
    rows = make_code_dataset()
    rewards = code_reward([r["solution"] for r in rows], [r["tests"] for r in rows])
    for row, reward in zip(rows, rewards):
        print(f"{reward:.2f}  {row['prompt']}")
