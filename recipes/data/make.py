"""
The recipes' datasets: small jsonl files, made once by this script and shipped
beside the recipes, so that `python train.py --config recipes/X.yaml` finds its
data without a step of its own. The script is deterministic (fixed seeds): run
again, it writes the same bytes (tests/test_recipes.py holds it to that).

    python recipes/data/make.py       # rewrites recipes/data/*.jsonl
    python recipes/data/make.py DIR   # writes them into DIR instead

    products.jsonl      recipes/smollm2_tools.yaml: 128 word problems whose answer
                        is a 4-5 digit product, "Use Python." after each question
                        (bench tools_run's problems); the first 32 held out
    guess_number.jsonl  recipes/smollm2_guess_number.yaml: 96 games of guess the
                        number (environments/guess_number.py: the prompt, the
                        secret as the solution); the first 32 held out, another
                        draw of secrets than the 64 trained on

Simplifications:
1. Small on purpose (a few tens of KB in the repo): a recipe's run draws 2
   prompts a step, and the data recycles by epochs. For more rows, raise the
   counts below and run the script again.
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
# (held out, trained on)
PRODUCTS = (32, 96)
GAMES = (32, 64)


def products():
    """bench tools_run's problems: one multiplication each, of operands up to 3
    digits."""
    from bench.real import load_real_model_module
    from bench.tools_run import problems

    return problems(load_real_model_module(), sum(PRODUCTS))


def games():
    """Held-out games first, their secrets drawn with another seed."""
    from environments.guess_number import make_rows

    held_out, trained = GAMES
    return make_rows(held_out, seed=1) + make_rows(trained, seed=0)


def write(folder, name, rows):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def main(folder):
    # run as a script: the repo's modules (bench, environments) from its root
    sys.path.insert(0, ROOT)
    os.makedirs(folder, exist_ok=True)

    for name, rows in (("products.jsonl", products()), ("guess_number.jsonl", games())):
        path = write(folder, name, rows)
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else HERE)
