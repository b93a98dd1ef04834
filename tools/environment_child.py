"""
One environment instance, or the function tools alone, in a process of its own
(environment.py starts it; nothing else should).

    python environment_child.py FD

FD is this end of a socket pair. The first message names what to build:
("build", environment path or None, [tool paths], seed, the trainer's
sys.path). Then each message is
one request, answered by ("ok", value) or ("error", text):

    ("probe",)                  -> {"tools": {name: JSON schema}, "reward": bool,
                                    "name": the class name}
    ("reset", row)              -> None or the text reset returned
    ("call", name, arguments)   -> (the result as text, failed): a tool that
                                   raised answers TRL's "{'error': ...}" text,
                                   or its exception's tool_output text if it
                                   has one (environments/python_tool.py)
    ("reward",)                 -> get_reward()'s float, or None

A tool that raises, or exits (SystemExit), answers the policy with the error
text; the process goes on. What the tool prints goes to the trainer's stderr.
"""
import ctypes
import importlib
import inspect
import os
import random
import signal
import sys
from multiprocessing.connection import Connection

# a result longer than this is cut here, before it crosses the pipe; the
# trainer keeps at most --tool-output-tokens of it anyway
RESULT_CHARS = 100_000


def load(path):
    """"pkg.module.Name" or "pkg.module:Name" -> the object."""
    if ":" in path:
        module, _, name = path.partition(":")
    else:
        module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def public_methods(instance):
    """The instance's tools: its class's public functions but reset and get_reward,
    as TRL lists them (on the class, so that properties are not evaluated)."""
    names = [name for name, _ in inspect.getmembers(type(instance), inspect.isfunction)
             if not name.startswith("_") and name not in ("reset", "get_reward")]

    return {name: getattr(instance, name) for name in names}


def error_text(e):
    """An exception as the policy reads it: TRL's str({"error": str(e)})."""
    if getattr(e, "tool_output", None) is not None:
        return str(e.tool_output)
    if isinstance(e, SystemExit):
        message = f"the tool exited with status {e.code}"
    else:
        message = str(e) or type(e).__name__
    return str({"error": message})


def answer(instance, tools, request):
    """One request -> its value (the "ok" answer)."""
    kind = request[0]

    if kind == "probe":
        from transformers.utils import get_json_schema

        schemas = {name: get_json_schema(fn) for name, fn in tools.items()}
        reward = instance is not None and callable(getattr(instance, "get_reward", None))
        return dict(tools=schemas, reward=reward, name=type(instance).__name__)

    if kind == "reset":
        observation = instance.reset(**request[1]) if instance is not None else None
        if observation is not None and not isinstance(observation, str):
            raise TypeError(f"reset returned a {type(observation).__name__}: return "
                            "None or a string")
        return observation

    if kind == "call":
        _, name, arguments = request
        try:
            if name not in tools:
                raise ValueError(f"Tool {name} not found.")
            if not isinstance(arguments, dict):
                raise ValueError(f"the arguments of {name} must be a JSON object")
            result = str(tools[name](**arguments))
            failed = False
        except BaseException as e:
            # SystemExit too: the process must answer
            result = error_text(e)
            failed = True
        return result[:RESULT_CHARS], failed

    if kind == "reward":
        value = instance.get_reward()
        return None if value is None else float(value)

    raise ValueError(f"unknown request {kind!r}")


def main():
    # the trainer killed (kill -9): this process goes with it, even mid-tool
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        # the trainer died before the line above
        return

    connection = Connection(int(sys.argv[1]))
    # user code prints; keep it off the trainer's stdout (the metrics, the bar)
    os.dup2(2, 1)

    _, environment_path, tool_paths, seed, path = connection.recv()
    sys.path[:] = path
    instance = None
    tools = {}
    try:
        # an environment that draws numbers draws the same ones on a resume
        random.seed(seed)
        for path in tool_paths:
            fn = load(path)
            tools[fn.__name__] = fn
        if environment_path is not None:
            instance = load(environment_path)()
            if not callable(getattr(instance, "reset", None)):
                raise TypeError(f"{environment_path} defines no reset method: an "
                                "environment needs reset(**row)")
            tools.update(public_methods(instance))
        connection.send(("ok", sorted(tools)))
    except BaseException as e:
        connection.send(("error", f"{type(e).__name__}: {e}"))
        return

    while True:
        try:
            request = connection.recv()
        except EOFError:
            return
        try:
            connection.send(("ok", answer(instance, tools, request)))
        except BaseException as e:
            connection.send(("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
