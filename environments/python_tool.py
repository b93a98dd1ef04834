"""
The python tool: a program run in the sandbox (sandbox.py), what it printed
back. It is what --tools python calls for each closed ```python block
(tool_format.FenceFormat), and an environment like any other:

    python train.py --model M --dataset D --tools python
    # the same tool through the chat template's tool calls
    python train.py --model M --dataset D --environment environments.python_tool.PythonTool

A program that fails (a traceback, a timeout, a limit, a non-zero exit status)
comes back as its own text, and counts as a failed call (tool_error_rate).
"""
import os

from tools import sandbox


class ProgramFailed(Exception):
    """The program's output is the call's result as it is (environment_child.py
    shows a tool_output instead of TRL's {'error': ...} text)."""

    def __init__(self, output):
        super().__init__(output)
        self.tool_output = output


class PythonTool:
    def reset(self, **row):
        return None

    def python(self, code: str) -> str:
        """Run a Python program and return what it printed.

        Args:
            code: the program; print what you need to see
        """
        # the sandbox stops the program at --tool-timeout (environment.py sets it)
        timeout_s = float(os.environ.get("TINYGRPO_TOOL_TIMEOUT", sandbox.TIMEOUT_S))

        output, status = sandbox.run_code(code, timeout_s)
        if status != "ok":
            raise ProgramFailed(output)
        return output
