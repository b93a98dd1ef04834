"""Start train.py, or a test script, in a process forked from a warm interpreter.

This replaces a cold `python`. The suite runs ~110 such processes, and each cold
start re-imports torch, transformers and vLLM (7-12 s of a 2-core machine).

    python tests/zygote.py serve SOCKET vllm|base
        a server: conftest.py starts the two, once per pytest session
    python tests/zygote.py SCRIPT ARGS...
        the client: run SCRIPT as `python SCRIPT ARGS...` would
    python tests/zygote.py -m MODULE ARGS...
        or `python -m MODULE ARGS...` (torchrun: its ranks' clients)

The client is what the launcher starts (pytest, or torchrun per rank). It hands its
stdin/stdout/stderr, argv, cwd and environment to the server. The server forks a
monitor, and the monitor forks the worker. The worker takes the client's stdio,
environment, argv and cwd, and runs SCRIPT as __main__. Signals sent to the client
(torchrun's SIGTERM on a failed rank) are forwarded to the worker. If the client
dies, the worker is SIGKILLed. The client exits as the worker did, with the same
code or the same signal. So torchrun, the exit codes and the output are the real
ones.

Where it differs from a cold start (tests that depend on one of these start their
process cold: helpers.script_cmd):
1. Third-party modules are imported before the worker's environment is set: an env
   var they read at import time (vLLM's log level) has the server's value. Our own
   modules are not preloaded (common.py reads RANK at import): each worker imports
   them. PYTHONPATH entries the server lacks go on sys.path after the script's
   folder.
2. The "vllm" server has vLLM imported. A run with --engine hf, --vllm-url or a
   PYTHONPATH of its own (a fake vllm module) goes to the "base" server, which has
   not. So vLLM's import-time side effects stay out, as in a cold start.
3. Every worker shares the server's str-hash seed. random and numpy's global RNGs
   are reseeded from the OS.
4. The process's command line (/proc/PID/cmdline) is the server's, not
   `python train.py`. Its parent is its monitor, not the launcher (common.py's
   launcher watch; a SIGSTOP to the client stops only the client). Under torchrun
   the agent is a warm worker too (helpers.script_cmd): its children are the
   ranks' clients.
5. Most preloaded objects are frozen (gc.freeze): the worker's garbage collector
   skips them. rollout.py does the same before vLLM starts, and vLLM's shutdown
   unfreezes everything.
Set TINYGRPO_TEST_ZYGOTE=0 to run every test subprocess cold.
"""
import gc
import json
import os
import signal
import socket
import struct
import sys
import time


def recv_exactly(conn, size, maxfds=0):
    # the fds come with the first bytes
    data, fds, _, _ = socket.recv_fds(conn, size, maxfds)

    while data and len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            break
        data += more

    return data, fds


# --- client -----------------------------------------------------------------------

def server_kind(argv):
    """The warm server ("base" or "vllm") that a run of argv goes to."""
    paths = [os.environ.get(k, "").split(os.pathsep)
             for k in ("PYTHONPATH", "TINYGRPO_ZYGOTE_PYTHONPATH")]
    # e.g. a folder with a fake vllm module
    own_path = bool(set(paths[0]) - set(paths[1]) - {""})
    # argparse keeps the last one
    hf = [b for a, b in zip(argv, argv[1:]) if a == "--engine"][-1:] == ["hf"]

    # -m: torchrun's agent
    if hf or "--vllm-url" in argv or own_path or argv[0] == "-m":
        return "base"
    return "vllm"


def client(argv):
    path = os.environ[f"TINYGRPO_ZYGOTE_{server_kind(argv).upper()}"]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    # the server may still be importing (conftest.py starts it with the session)
    for _ in range(1200):
        try:
            conn.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            time.sleep(0.1)
    else:
        sys.exit(f"zygote: no server at {path}")

    request = json.dumps(dict(argv=argv, cwd=os.getcwd(), env=dict(os.environ),
                              unbuffered=sys.stdout.write_through))
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request.encode()], [0, 1, 2])
    # JSON lines: the worker's pid, then how it ended
    replies = conn.makefile("rb")

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                 signal.SIGUSR1, signal.SIGUSR2)
    for sig in forwarded:
        signal.signal(sig, lambda signum, frame: conn.sendall(struct.pack("!I", signum)))

    pid = json.loads(replies.readline() or "null")
    # for tests that kill a run: the worker's pid, by ours
    if pid and os.environ.get("TINYGRPO_ZYGOTE_PIDS"):
        record = os.path.join(os.environ["TINYGRPO_ZYGOTE_PIDS"], str(os.getpid()))
        with open(record, "w") as f:
            f.write(str(pid))

    line = replies.readline()
    if not line:
        sys.exit("zygote: the server went away")

    status = json.loads(line)
    # die of the same signal, as the worker did
    if status["signal"]:
        for sig in forwarded:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), status["signal"])
    os._exit(status["code"])


# --- server -----------------------------------------------------------------------

def preload(kind):
    """Third-party modules only.

    Ours read RANK and friends at import (common.py), so each worker imports them.
    """
    import matplotlib

    matplotlib.use("Agg")  # as plot.py
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import tokenizers  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    # torchrun --standalone's
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    # torchrun's, itself run as __main__ by a worker
    import torch.distributed.launcher.api  # noqa: F401
    import torch.utils.checkpoint  # noqa: F401
    import tqdm  # noqa: F401
    import transformers  # noqa: F401

    # Freeze what is loaded so far (~330k objects): a worker's GC never walks them,
    # in its run or at its exit (1.3 -> 0.6 s a process). Not triton's (next, via
    # torch._dynamo): nanobind reports them leaked.
    gc.collect()
    gc.freeze()

    from transformers import (AutoModelForCausalLM, LlamaForCausalLM,  # noqa: F401
                              PreTrainedTokenizerFast, Qwen2ForCausalLM)
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    # a cache built at the first save or load: 0.2 s of each run
    get_checkpoint_conversion_mapping("qwen2")

    if kind == "vllm":
        try:
            from vllm import LLM, SamplingParams, TokensPrompt  # noqa: F401

            # what LLM() imports on CPU: 1.4 s of each engine's start-up
            if not torch.cuda.is_available():
                import vllm.model_executor.model_loader  # noqa: F401
                import vllm.v1.worker.cpu_model_runner  # noqa: F401
                import vllm.v1.worker.cpu_worker  # noqa: F401
        # not installed or broken: the worker meets it as a cold start would
        except Exception:
            pass


def serve(path, kind):
    """Fork a monitor per client connection.

    Returns (request, fds) only in a worker, which __main__ runs.
    """
    preload(kind)
    parent = os.getppid()
    sys.stdout.flush()
    sys.stderr.flush()
    # monitors are reaped by the kernel
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    # clients connect only once it listens
    os.rename(path + ".tmp", path)
    listener.settimeout(1.0)

    # until the pytest session that started it is gone
    while os.getppid() == parent:
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue

        conn.settimeout(None)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            try:
                return monitor(conn)
            except BaseException:
                import traceback

                traceback.print_exc()
                os._exit(1)
        conn.close()

    os.unlink(path)
    sys.exit(0)


def monitor(conn):
    """Fork the worker, forward the client's signals, report how the worker ended.

    In the worker it returns the worker's request.
    """
    size, fds = recv_exactly(conn, 4, maxfds=3)
    request = json.loads(recv_exactly(conn, struct.unpack("!I", size)[0])[0])

    pid = os.fork()
    if pid == 0:
        conn.close()
        return request, fds

    for fd in fds:
        os.close(fd)
    conn.sendall(b"%d\n" % pid)

    import select

    pidfd = os.pidfd_open(pid)
    client_gone = False
    while True:
        watched = [pidfd] if client_gone else [pidfd, conn]
        ready, _, _ = select.select(watched, [], [])
        if pidfd in ready:
            break

        data, _ = recv_exactly(conn, 4)
        if len(data) == 4:
            os.kill(pid, struct.unpack("!I", data)[0])
        # the client died (e.g. SIGKILLed by torchrun): so does its worker
        else:
            client_gone = True
            os.kill(pid, signal.SIGKILL)

    _, status = os.waitpid(pid, 0)
    if not client_gone:
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        code = os.WEXITSTATUS(status) if not sig else 1
        conn.sendall(json.dumps(dict(code=code, signal=sig)).encode() + b"\n")
    os._exit(0)


def worker(request, fds):
    """Become `python SCRIPT ARGS...` and run SCRIPT.

    The interpreter then exits as that command would (exit code, traceback,
    atexit, finalisation), since nothing of the server's is left on the stack.
    """
    import builtins
    import io
    import random
    import types

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)

    # the standard streams, as a fresh interpreter builds them
    unbuffered = request["unbuffered"]
    for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        if name == "stdin":
            raw = open(fd, "rb", closefd=False)
            stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors)
        else:
            raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
            line_buffering = name == "stderr" or os.isatty(fd)
            stream = io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors,
                                      line_buffering=line_buffering,
                                      write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # as Python sets it (BrokenPipeError instead)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)

    os.chdir(request["cwd"])
    served = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    os.environ.clear()
    os.environ.update(request["env"])
    own = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    sys.path[1:1] = [p for p in own if p and p not in served]

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()

    # as `python -m MODULE`: cwd first on sys.path, __main__ the module's
    if request["argv"][0] == "-m":
        import runpy

        sys.argv = request["argv"][1:]
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        return

    script = os.path.abspath(request["argv"][0])
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(script)

    # Not runpy.run_path's temporary module: the script's globals must live until
    # the interpreter's exit, as a cold start's (a DDP model freed earlier
    # deadlocks in gloo's teardown).
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main
    with open(script, "rb") as f:
        exec(compile(f.read(), script, "exec"), main.__dict__)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        worker(*serve(sys.argv[2], sys.argv[3]))
    else:
        client(sys.argv[1:])
