"""Shared test setup: the repo root on sys.path, and 1 torch thread (CI has 2 cores).

Without a GPU it also sets the Triton interpreter, which must be set before triton
is first imported.
"""
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


def pytest_configure(config):
    """Register the same_math marker, and start zygote.py's warm servers, once
    per session.

    The servers start in the xdist controller, or the only process. The test
    subprocesses fork from them instead of importing torch, transformers and
    vLLM again (TINYGRPO_TEST_ZYGOTE=0: cold).
    """
    config.addinivalue_line(
        "markers", "same_math: holds two computations of the same math against each other, "
        "in fp64 to helpers.FP64_TOL or in fp32 to helpers.fp32_tol; .ci/run reruns them "
        "under other CPU kernels (MKL_CBWR=SSE4_2, ATEN_CPU_CAPABILITY=default)")
    controller = "PYTEST_XDIST_WORKER" not in os.environ
    wanted = os.environ.get("TINYGRPO_TEST_ZYGOTE", "1") != "0"
    running = "TINYGRPO_ZYGOTE_VLLM" in os.environ

    if controller and wanted and not running:
        from helpers import start_zygotes

        config.stop_zygotes = start_zygotes()


def pytest_unconfigure(config):
    if hasattr(config, "stop_zygotes"):
        config.stop_zygotes()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, trainer model, tokenizer, prompt ids).

    The model is task.py's tied-embedding tiny Qwen2 (head_dim 32).
    """
    from helpers import PROMPTS
    from task import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)

    path = str(tmp_path_factory.mktemp("tiny"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)

    return path, model, tokenizer, [tokenizer(p)["input_ids"] for p in PROMPTS]
