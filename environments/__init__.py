"""Built-in environments and tools for --environment and --tools (environment.py
says how a class or a function becomes one):

    python_tool.PythonTool      --tools python's tool: code run in sandbox.py
    calculator.calculate        a function tool for word problems
    guess_number.GuessNumber    a game that needs the replies: higher or lower
"""
