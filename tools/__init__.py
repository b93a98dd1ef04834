"""Tools and environments: multi-turn rollouts (--tools, --environment).

    multiturn.py          ToolEngine, the tool-calling loop around an engine
    tool_format.py        how a call and its result are written (fences, chat templates)
    environment.py        each environment in a process of its own
    environment_child.py  the process an environment lives in
    sandbox.py            code run in a sandboxed child (the python tool, code_reward)
    sandbox_child.py      that child

The built-in environments are in environments/ (--environment environments.NAME.CLASS).
"""
