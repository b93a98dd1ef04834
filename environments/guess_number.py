"""
Guess the number: a game that needs its replies. The secret is the row's
solution; the policy calls guess(n) and reads "higher", "lower" or "correct". The environment
owns the reward: 1.0 when a guess was correct, less a little for each guess
before it.

    python -m environments.guess_number data.jsonl 2000    # the rows: prompt, solution
    python train.py --model M --dataset data.jsonl \
        --environment environments.guess_number.GuessNumber \
        --chat-template assets/chatml_tools.jinja

A 1-100 game takes at most 7 guesses by bisection; --max-tool-calls bounds them.
"""
import json
import random
import sys

LOW = 1
HIGH = 16
PROMPT = (f"I am thinking of a whole number from {LOW} to {HIGH}. Find it with the "
          "guess tool; after each guess I say higher, lower or correct.")
# a guess after the first costs this much of the reward
COST = 0.1


class GuessNumber:
    def reset(self, solution, **row):
        self.secret = int(solution)
        self.guesses = 0
        self.solved = False
        return None

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: your guess
        """
        if self.solved:
            return "you already found it"
        self.guesses += 1

        number = int(number)
        if number < self.secret:
            return "higher"
        if number > self.secret:
            return "lower"
        self.solved = True
        return "correct"

    def get_reward(self):
        if not self.solved:
            return 0.0
        return max(0.0, 1.0 - COST * (self.guesses - 1))


def make_rows(n, seed=0):
    """n games: the prompt, and the secret as the solution."""
    rng = random.Random(seed)
    return [dict(prompt=PROMPT, solution=str(rng.randint(LOW, HIGH))) for _ in range(n)]


if __name__ == "__main__":
    path, n = sys.argv[1], int(sys.argv[2])
    with open(path, "w") as f:
        for row in make_rows(n):
            f.write(json.dumps(row) + "\n")
