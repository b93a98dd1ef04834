"""Memory on the CPU: how many completions a forward takes, and the C heap's
free pages handed back to the system.

    auto_micro_batch(...)    completions per forward for --micro-batch-size 0
    install_trims(...)       malloc_trim after each optimizer step, each weight
                             sync, and (recomputed layers) each backward
    release_free_memory()    one malloc_trim(0)

Figures: docs/benchmarks.md ("The micro-batch on the CPU", "The seventh pass").
"""
import ctypes
import ctypes.util

import torch


# the most logits one forward of the update makes on the CPU: 2^25 fp32
# numbers (128 MiB), auto_micro_batch
MICRO_BATCH_LOGITS = 2**25


def auto_micro_batch(minibatch, max_new_tokens, vocab_size, device):
    """Completions per forward and backward for --micro-batch-size 0.

    On a GPU: the whole minibatch. On the CPU: the largest divisor of the
    minibatch whose (n, max_new_tokens, vocab_size) logits stay within
    MICRO_BATCH_LOGITS numbers, at least 1. Why: there the update of a real
    vocabulary's logits is bound by their memory traffic, and a whole minibatch
    of them is both slower and far larger than a few rows at a time
    (docs/benchmarks.md, "The micro-batch on the CPU"). A small vocabulary (the
    default toy) keeps the whole minibatch.
    """
    if torch.device(device).type != "cpu":
        return minibatch
    fits = max(1, MICRO_BATCH_LOGITS // (max_new_tokens * vocab_size))
    return max(n for n in range(1, min(fits, minibatch) + 1) if minibatch % n == 0)


def _libc_trim():
    """glibc's malloc_trim, or None (musl, macOS)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_trim()


def release_free_memory():
    """Give the pages of freed CPU tensors back to the system.

    glibc keeps freed blocks under its mmap threshold (which grows to 32 MB as
    large blocks are freed) in its heap, and only the heap's top is returned by
    itself. A backward frees hundreds of such blocks between live ones, so the
    resident set stays hundreds of MB above the live tensors, and the next
    forward's differently sized blocks do not all fit the holes. malloc_trim(0)
    releases every free page (https://man7.org/linux/man-pages/man3/malloc_trim.3.html);
    the next use faults them back in. A call walks the whole heap (tens of ms in
    a process that has loaded torch): worth it for large models only (install_trims).
    No-op off glibc.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def install_trims(model, optimizer, engine, each_backward):
    """Hand the heap's free pages back after each optimizer step and each weight
    sync that sent weights (vLLM's reload passes each layer through a copy);
    with each_backward, also at the end of each backward through model.

    Why after each backward only where layers are recomputed
    (--gradient-checkpointing): there the next micro-batch's activations are few
    pages to fault back in. Without recompute they are hundreds of MB a
    micro-batch, faulted back each time (docs/benchmarks.md, "The seventh pass").
    """
    optimizer.register_step_post_hook(lambda *args: release_free_memory())

    sync_weights = engine.sync_weights

    def sync_and_trim(*args, **kwargs):
        synced = sync_weights(*args, **kwargs)
        if synced["bytes"]:
            release_free_memory()
        return synced
    engine.sync_weights = sync_and_trim

    if each_backward:
        model.register_forward_hook(_trim_after_its_backward)


def _trim_after_its_backward(module, args, output):
    """A forward hook: the backward through this output ends with a trim."""
    logits = getattr(output, "logits", None)
    if logits is None or not logits.requires_grad:
        return

    engine = torch.autograd.Variable._execution_engine
    logits.register_hook(lambda grad: engine.queue_callback(release_free_memory))
