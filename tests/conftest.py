"""Shared test setup: repo root on sys.path, 1 torch thread (CI has 2 cores), and the Triton
interpreter when there is no GPU (must be set before triton is first imported)."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, trainer model, tokenizer, prompt ids): task.py's tied-embedding tiny Qwen2 (head_dim 32)."""
    from helpers import PROMPTS
    from task import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    path = str(tmp_path_factory.mktemp("tiny"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, tokenizer, [tokenizer(p)["input_ids"] for p in PROMPTS]
