"""
Environments and function tools, as TRL 1.16's GRPOTrainer takes them
(environment_factory=, tools=):

    python train.py --model M --dataset D --environment my_module.MyEnv
    python train.py --model M --dataset D --tools my_module.add my_module.multiply
    # several environments, chosen by each row's "environment" column
    python train.py ... --environment wordle=my_envs.Wordle math=my_envs.Calculator

An environment is a class, built once per completion (the G rollouts of a
prompt stay apart):

    class MyEnv:
        def reset(self, **row):     # the row's columns; returns None, or text
            ...                     #   appended to the last user message
        def guess(self, n: int) -> str:
            '''Each public method is a tool: type hints and a Google-style
            docstring say how to call it (transformers' get_json_schema).

            Args:
                n: the guess
            '''
        def get_reward(self):       # optional: the finished rollout's score, a
            ...                     #   reward column of weight 1 (the class name)

Function tools are plain functions written the same way. tools.py's loop calls
them all; this file holds where they run.

Each instance lives in a process of its own (environment_child.py), which the
trainer asks for resets, calls and the reward over a pipe. So:
1. A tool that raises or exits answers the policy with its error text, in TRL's
   "{'error': ...}" form; training goes on.
2. A tool that hangs past --tool-timeout (+ GRACE_S) is killed with its process
   group, and the instance is gone: its later calls answer that, its reward is
   None. Processes a tool started in a session of their own escape the kill.
3. Nothing a tool does reaches the trainer's memory. It is not a sandbox: the
   process runs as the trainer's user (sandbox.py's guarantees are for
   --tools python's code, whose tool runs it there).
4. An instance that fails to start or reset costs its row the environment: a
   warning, and its reward is None. Failing on every row of a generate call,
   on every rank, stops the run in one line (reset_failures).

Tests: python -m pytest -q tests/test_environment.py
"""
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection

from common import all_ranks_ok, fail

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "environment_child.py")
# start-up: the interpreter, and the imports of the environment's module
START_TIMEOUT_S = 60.0
# past --tool-timeout before a call's process is killed: a tool that keeps its
# own timeout (the python tool's sandbox) answers first, and cleans up
GRACE_S = 5.0


@dataclass(frozen=True)
class EnvironmentSpec:
    """What one environment name builds, and what it shows the policy."""

    # the factory's import path, or None: the function tools alone
    path: str | None
    # the function tools' import paths, beside the environment's methods
    tool_paths: tuple
    # {tool name: JSON schema}: what the chat template renders
    schemas: dict
    # the class defines get_reward
    has_reward: bool
    # the class's name: its reward column's
    name: str


class EnvironmentProcess:
    """One instance in its own process; every method answers, none raises."""

    def __init__(self, path, tool_paths, seed, timeout_s):
        self.timeout_s = timeout_s
        self.dead = None  # why it stopped answering

        ours, theirs = socket.socketpair()
        # the tools may read it (environments/python_tool.py)
        env = dict(os.environ, TINYGRPO_TOOL_TIMEOUT=str(timeout_s))
        self.process = subprocess.Popen(
            [sys.executable, CHILD, str(theirs.fileno())], pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL, start_new_session=True, env=env)
        theirs.close()
        self.connection = Connection(ours.detach())
        # what the trainer can import, the child can
        self.connection.send(("build", path, list(tool_paths), seed, sys.path))

    def ask(self, *request, timeout_s=None):
        """-> (ok, value or error text). A hang or an exit kills the process."""
        if self.dead:
            return False, self.dead
        if request:
            self.connection.send(request)

        timeout_s = timeout_s or self.timeout_s
        try:
            if not self.connection.poll(timeout_s + GRACE_S):
                self.kill(f"the tool did not answer within {timeout_s:g} s "
                          "(--tool-timeout)")
                return False, self.dead
            status, value = self.connection.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            self.kill(f"the environment's process exited with status {code}")
            return False, self.dead

        return status == "ok", value

    def started(self):
        """-> (ok, the tool names or why it could not build)."""
        return self.ask(timeout_s=START_TIMEOUT_S)

    def reset(self, row):
        return self.ask("reset", row)

    def call(self, name, arguments):
        """-> (the result's text or the error the policy reads, failed)."""
        ok, value = self.ask("call", name, arguments)
        if ok:
            return value
        return str({"error": value}), True

    def reward(self):
        ok, value = self.ask("reward")
        return value if ok else None

    def kill(self, why):
        self.dead = why
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def close(self):
        self.connection.close()
        if self.dead is None:
            self.kill("closed")


def probe(path, tool_paths, timeout_s=START_TIMEOUT_S):
    """Build one instance in a child and ask what it shows -> EnvironmentSpec.
    ValueError saying what is wrong with it."""
    what = path or " ".join(tool_paths)
    child = EnvironmentProcess(path, tool_paths, seed=0, timeout_s=timeout_s)
    try:
        ok, value = child.started()
        if ok:
            ok, value = child.ask("probe")
    finally:
        child.close()

    if not ok:
        raise ValueError(f"--environment/--tools {what}: {value}")
    if not value["tools"]:
        raise ValueError(f"--environment {what} has no tools: give it a public method "
                         "with type hints and a docstring, or pass --tools")

    name = value["name"] if path else "tools"
    return EnvironmentSpec(path, tuple(tool_paths), value["tools"], value["reward"], name)


def load_specs(environments, tool_paths):
    """--environment [name=]path ... and --tools path ... -> {name: EnvironmentSpec}.

    One environment without a name is None's: every row uses it. Named ones are
    chosen by the row's "environment" column. Function tools alone are None's.
    """
    if not environments:
        return {None: probe(None, tool_paths)}

    pairs = [e.split("=", 1) if "=" in e else (None, e) for e in environments]
    names = [name for name, _ in pairs]
    if len(pairs) > 1 and None in names or len(set(names)) < len(names):
        raise ValueError("--environment: several environments need distinct names, "
                         "name=module.Class each (the rows' environment column)")

    with ThreadPoolExecutor(len(pairs)) as pool:
        specs = pool.map(lambda pair: probe(pair[1], tool_paths), pairs)
        return dict(zip(names, specs))


def spec_of(specs, row):
    """The row's environment: its "environment" column among several."""
    if None in specs:
        return specs[None]

    name = row.get("environment")
    if name not in specs:
        raise ValueError(f"a row's environment column is {name!r}, not one of "
                         f"{sorted(specs)} (--environment)")
    return specs[name]


def start(specs, rows, seed, timeout_s):
    """One instance per row, in parallel, each reset with its row -> (instances,
    observations: None or text per row). One that fails to start or reset is
    killed, its error kept as its `dead` (reset_failures reads them)."""
    instances = []
    for i, row in enumerate(rows):
        spec = spec_of(specs, row)
        instances.append(EnvironmentProcess(spec.path, spec.tool_paths, seed + i,
                                            timeout_s))

    def reset(pair):
        instance, row = pair
        ok, value = instance.started()
        if ok:
            # the "environment" column routes; TRL does not pass it on
            columns = {k: v for k, v in row.items() if k != "environment" or None in specs}
            ok, value = instance.reset(columns)
        if not ok:
            instance.kill(value)
            return None
        return value

    with ThreadPoolExecutor(min(32, len(rows))) as pool:
        observations = list(pool.map(reset, zip(instances, rows)))
    return instances, observations


def reset_failures(specs, rows, instances, earlier=None):
    """Why each of start's instances failed to start or reset (None: it did not)
    -> that list, one per row.

    Some rows failing: a warning each; their completions are sampled without an
    environment, and their rewards are None. Every row of a generate call
    failing, on every rank, stops the run in one line, naming the first row's
    environment and error: trained on, every reward would be None, a NaN reward
    and a zero loss at every step (issue 61). earlier: the failures of the
    call's earlier chunks, when these rows are its last; None while more are to
    come.

    The verdict is one for all ranks: each rank reaches its call's last chunk
    once, and train.py's ranks call generate in step (one call per sampling
    round, two per evaluation), so all are in the all_reduce. A rank whose rows
    all failed, beside one whose did not, holds some rows of the step: warnings.
    """
    failures = [instance.dead for instance in instances]

    # the call's last rows: stop if not one row of any rank's call has its
    # environment
    if earlier is not None and all_ranks_ok(all(earlier + failures)):
        spec = spec_of(specs, rows[0])
        what = spec.path or " ".join(spec.tool_paths)
        fail(f"the environment {what} failed to start or reset on every row of the "
             f"batch, the first with {(earlier + failures)[0]}; every completion would "
             f"be sampled without it, its reward None: fix it")

    for failure in failures:
        if failure is not None:
            print(f"warning: an environment failed to start or reset ({failure}); its "
                  "completion is sampled without it, and its reward is None",
                  file=sys.stderr)
    return failures
