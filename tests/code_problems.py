"""
An example task for code_reward (sandbox.py): small functions, assert tests and
a reference solution for each.

    make_code_dataset()   -> rows {"prompt", "tests", "solution"}

    python tests/code_problems.py   # scores the reference solutions: all 1.0
"""
import os
import sys

# (signature, what it does, reference solution, tests)
CODE_PROBLEMS = [
    ("add(a, b)", "returns the sum of a and b",
     "def add(a, b):\n    return a + b\n",
     ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"]),
    ("is_palindrome(s)", "returns True if the string s reads the same backwards",
     "def is_palindrome(s):\n    return s == s[::-1]\n",
     ["assert is_palindrome('abba')", "assert not is_palindrome('abc')",
      "assert is_palindrome('')"]),
    ("fib(n)", "returns the n-th Fibonacci number, with fib(0) == 0 and fib(1) == 1",
     "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
     "    return a\n",
     ["assert fib(0) == 0", "assert fib(1) == 1", "assert fib(10) == 55",
      "assert fib(30) == 832040"]),
    ("count_vowels(s)",
     "returns how many of the characters of s are vowels (aeiou, either case)",

     "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
     ["assert count_vowels('hello') == 2", "assert count_vowels('xyz') == 0",
      "assert count_vowels('AEIOU') == 5"]),
    ("second_largest(xs)", "returns the second largest distinct value of the list xs",
     "def second_largest(xs):\n    return sorted(set(xs))[-2]\n",
     ["assert second_largest([1, 2, 3]) == 2", "assert second_largest([5, 5, 4]) == 4",
      "assert second_largest([-1, -7, 0]) == -1"]),
]


def make_code_dataset():
    """Rows {"prompt", "tests", "solution"} for code_reward; "solution" is a
    reference completion."""
    rows = []
    for signature, spec, reference, tests in CODE_PROBLEMS:
        prompt = (f"Write a Python function `{signature}` that {spec}. "
                  "Answer with the code in one ```python block.")
        rows.append({"prompt": prompt, "tests": tests,
                     "solution": f"```python\n{reference}```"})

    return rows



if __name__ == "__main__":
    # sandbox.py lives in the repo root (a script's sys.path starts at tests/)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tools.sandbox import code_reward

    rows = make_code_dataset()
    rewards = code_reward([r["solution"] for r in rows], [r["tests"] for r in rows])
    for row, reward in zip(rows, rewards):
        print(f"{reward:.2f}  {row['prompt']}")
