"""Environments whose reset raises (environment.reset_failures, issue 61):
on every row, on the rows whose solution is "bad", or on rank 1 only (the
instance's process inherits the trainer's RANK). tests/test_environment.py
runs them."""
import os


class Guess:
    """guess and get_reward: what makes an environment (a tool, a reward)."""

    def reset(self, **row):
        self.secret = row["solution"]
        self.found = False

    def guess(self, number: int) -> str:
        """
        Guess the secret.

        Args:
            number: the guess
        """
        self.found = str(number) == self.secret
        return "correct" if self.found else "wrong"

    def get_reward(self) -> float:
        return float(self.found)


class ResetAlwaysFails(Guess):
    def reset(self, **row):
        raise ValueError(f"no board for solution {row['solution']}")


class ResetFailsOnBadRows(Guess):
    def reset(self, **row):
        if row["solution"] == "bad":
            raise KeyError("a bad row")
        super().reset(**row)


class ResetFailsOnRank1(Guess):
    def reset(self, **row):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("rank 1 has no board")
        super().reset(**row)
