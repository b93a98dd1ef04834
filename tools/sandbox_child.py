"""
The sandbox's child: one program of sandbox.py, isolated, limited and run.

sandbox.run_as starts it as a script, once per program:

    python -I sandbox_child.py    # stdin: the job (JSON); cwd: its work dir

It reads the job from stdin, isolates itself (as root), drops to the program's
uid, sets the limits, runs the program and then its tests. It reports on a
private pipe, the fd job["result_fd"], in lines tagged with the job's nonce:

    NONCE ready              setup done: from here on, errors are the program's
    NONCE done 0 2 3         the tests that passed, by index (test mode)
    NONCE output STATUS HEX  what it printed, hex-encoded (tool mode)

The interpreter reads this whole file before it runs a line of it, as root: after
the uid switch the file need not be readable. -I keeps this file's folder off
sys.path, so the child imports the standard library only, never a project module.
The program runs in a namespace of its own, not in this module's globals.
The guarantees (G1-G6) and their limits (N1-N5) are in sandbox.py's docstring.
"""
import ctypes
import io
import json
import os
import resource
import sys
import traceback

# mount(2) flags
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 1 << 14
MS_PRIVATE = 1 << 18

# unshare(2) flags
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

PR_SET_NO_NEW_PRIVS = 38

libc = ctypes.CDLL(None, use_errno=True)


def private_ancestor(path):
    """The topmost folder above path that others cannot enter, or None."""
    parts = path.strip("/").split("/")
    ancestors = ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]
    return next((d for d in ancestors if not os.stat(d).st_mode & 1), None)


def mount(source, target, fstype, flags, options=None):
    """mount(2), or the end of the child: never a weaker sandbox."""
    source = source and source.encode()
    if libc.mount(source, target.encode(), fstype, flags, options) != 0:
        sys.exit(f"sandbox: mount {target} failed: {os.strerror(ctypes.get_errno())}")


class Output(io.StringIO):
    """Tool mode's stdout and stderr: `limit` characters, then the program
    stops."""

    def __init__(self, fd, nonce, limit):
        super().__init__()
        self.fd = fd
        self.nonce = nonce
        self.limit = limit

    def write(self, s):
        # never a copy of a flood
        super().write(s[:self.limit + 1 - self.tell()])
        if self.tell() > self.limit:
            self.report("Killed", f"Killed: output over {self.limit} characters")
        return len(s)

    def report(self, status, why=""):
        """One line to the trainer, then the end of the program."""
        text = "\n".join(filter(None, [self.getvalue()[:self.limit], why]))
        line = f"{self.nonce} output {status} {text.encode().hex()}\n"
        os.write(self.fd, line.encode())
        os._exit(0)


def uncover_python():
    """Python may sit in a folder the uid cannot enter (pyenv in /root, mode 700).

    Cover that folder with an empty tmpfs, which hides the rest of it, and bind
    the python install back in.
    """
    hidden = {}
    for prefix in {sys.prefix, sys.base_prefix}:
        private = private_ancestor(prefix)
        if private:
            hidden[prefix] = private

    # opened before the tmpfs covers them
    fds = {prefix: os.open(prefix, os.O_PATH) for prefix in hidden}

    for private in set(hidden.values()):
        mount("tmpfs", private, b"tmpfs", 0, b"mode=755")

    for prefix, fd in fds.items():
        os.makedirs(prefix, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", prefix, None, MS_BIND | MS_REC)
        os.close(fd)


def isolate(job, uid):
    """As root: private network and mount namespaces, the file system read-only
    but for a fresh tmpfs at the work dir, then the program's uid (G1, G2, G3)."""
    if libc.unshare(CLONE_NEWNET | CLONE_NEWNS) == 0:
        # the mounts below stay in this namespace
        mount(None, "/", None, MS_REC | MS_PRIVATE)

        uncover_python()

        for mnt in [line.split()[1] for line in open("/proc/self/mounts")]:
            mount(None, mnt.replace("\\040", " "), None, MS_REMOUNT | MS_BIND | MS_RDONLY)

        options = f"size={job['tmpfs_mb']}m,mode=700,uid={uid},gid={uid}".encode()
        mount("tmpfs", job["workdir"], b"tmpfs", MS_NOSUID | MS_NODEV, options)

    os.setgroups([])
    os.setgid(uid)
    # irreversible: the real, effective and saved ids; no capabilities
    os.setuid(uid)

    stdlib = os.path.dirname(os.__file__)
    if not os.access(stdlib, os.R_OK | os.X_OK):
        sys.exit(f"sandbox: uid {uid} cannot read {stdlib}: install python where others "
                 "can read it, or allow mount namespaces (CAP_SYS_ADMIN)")



def refuse_sockets(event, args):
    if event == "socket.__new__":
        raise PermissionError("sandbox: no network")


def confine(job):
    """No new privileges, the work dir, the limits and the socket hook (G2,
    G4)."""

    # setuid binaries cannot regain root
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    os.chdir(job["workdir"])

    for name, value in job["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))

    # an audit hook cannot be removed once added
    sys.addaudithook(refuse_sockets)


def run_program(job, fd, nonce):
    """The program once as module `solution`, then its tests in its namespace.

    Tool mode reports what it printed and how it ended. Test mode reports the
    tests that passed, in one line: it fits the 64 KiB pipe.
    """
    tests = job["tests"]

    out = None
    if job.get("capture"):
        # tool mode: print() and tracebacks go to a bounded buffer
        out = Output(fd, nonce, job["capture"])
        sys.stdout = out
        sys.stderr = out

    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(job["program"], "solution.py", "exec"), namespace)
    except SystemExit as e:
        # sys.exit(0) and sys.exit() end a program as running to the end does;
        # another status is a failure the policy must see
        if out and e.code not in (None, 0):
            print(f"SystemExit: the program exited with status {e.code}")
            out.report("error")
    except BaseException as e:
        # tests: what it defined before failing still gets tested
        if out:
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

    os.write(fd, f"{nonce} done {' '.join(passed)}\n".encode())
    # skip the program's atexit hooks and buffered output
    os._exit(0)


def main():
    job = json.loads(sys.stdin.buffer.read())
    # the job, with its nonce, is gone from stdin
    os.dup2(os.open(os.devnull, os.O_RDWR), 0)

    uid = job["uid"]
    if uid is not None:
        isolate(job, uid)
    else:
        # not root: a user namespace may still give a private network namespace
        libc.unshare(CLONE_NEWUSER | CLONE_NEWNET)  # best effort

    confine(job)

    nonce = job["nonce"]
    fd = job["result_fd"]
    # setup done: from here on, errors are the program's
    os.write(fd, f"{nonce} ready\n".encode())
    # stderr, a pipe to the trainer until now, goes to /dev/null too
    os.dup2(0, 2)

    run_program(job, fd, nonce)


if __name__ == "__main__":
    main()
