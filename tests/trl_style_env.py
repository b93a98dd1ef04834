"""Environments written as TRL's documentation writes them for GRPOTrainer's
environment_factory, unchanged: a class with reset, tool methods with type hints
and Google-style docstrings, and get_reward. tests/test_environment.py runs them
in train.py. HostileEnv's tools misbehave on purpose."""
import os
import sys
import time


class CounterEnv:
    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = int(kwargs["solution"])
        return None

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def decrement(self, step: int) -> int:
        """
        Decrement the internal counter.

        Args:
            step: Value to subtract from the counter.

        Returns:
            The updated counter value.
        """
        self.counter -= step
        return self.counter

    def get_reward(self) -> float:
        return 1.0 if self.counter == self.target else 0.0


class NoteEnv:
    """reset returns text: it is appended to the last user message."""

    def reset(self, **kwargs) -> str | None:
        return f" (note {kwargs['solution']})"

    def echo(self, text: str) -> str:
        """
        Echo the text.

        Args:
            text: What to echo.
        """
        return text


class HostileEnv:
    def reset(self, **kwargs):
        return None

    def hang(self) -> str:
        """Never returns."""
        while True:
            time.sleep(1)

    def boom(self) -> str:
        """Raises."""
        raise RuntimeError("boom from the tool")

    def huge(self) -> str:
        """Returns ten million characters."""
        return "x" * 10_000_000

    def leave(self) -> str:
        """Calls sys.exit(3)."""
        sys.exit(3)

    def die(self) -> str:
        """Ends its process."""
        os._exit(7)
