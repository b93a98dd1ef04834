"""What the benchmarks share.

The model shapes, the never-EOS tokenizer and random-init models built from them,
the repo root, and a median timer.
"""
import json
import os
import statistics
import time

import torch

# The repo root: train.py runs from here, and `python -m bench _memory_step` too
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Qwen2.5's vocabulary (embedding rows)
QWEN_VOCAB = 151_936
# name: (hidden, layers, heads, kv heads, intermediate)
SHAPES = {
    "tiny": (128, 2, 4, 4, 256),  # task.build_tiny_model's shape
    "25M": (512, 8, 8, 8, 1408),
    "0.5B-shape": (896, 24, 14, 2, 4864),  # Qwen2.5-0.5B's
}


def never_eos_tokenizer(vocab_size=None):
    """task.build_tokenizer() with EOS "<never>" at id vocab_size.

    vocab_size defaults to right after the tokenizer's own tokens. A model of
    vocab_size logits cannot sample it, so every completion runs to full length,
    and engines do the same work. The id may lie far past the tokenizer's own
    (151,936: a Qwen2.5-sized vocabulary); sampled ids in between decode to ''.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    import task

    base = task.build_tokenizer()
    vocab_size = vocab_size or len(base)

    spec = json.loads(base.backend_tokenizer.to_str())
    spec["model"]["vocab"]["<never>"] = vocab_size
    never = dict(id=vocab_size, content="<never>", single_word=False, lstrip=False,
                 rstrip=False, normalized=False, special=True)
    spec["added_tokens"].append(never)

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   eos_token="<never>", pad_token=task.EOS,
                                   unk_token=task.UNK)


def build_model(shape, tokenizer, device, dtype, vocab_size=None):
    """A randomly initialised Qwen2 of SHAPES[shape] (seed 0).

    vocab_size defaults to the ids below the tokenizer's EOS.
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    # eos_token_id None: the tokenizer's EOS is the only one
    config = Qwen2Config(vocab_size=vocab_size or tokenizer.eos_token_id,
                         hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=None,
                         pad_token_id=tokenizer.pad_token_id)

    torch.manual_seed(0)
    # initialised where it runs (0.5B parameters initialise slowly on a CPU)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype=dtype)


def bench_command(mode, args):
    """The command line a report names: python -m bench MODE [--steps N] [--tiny]."""
    command = f"python -m bench {mode}"
    if args.steps:
        command += f" --steps {args.steps}"
    if args.tiny:
        command += " --tiny"
    return command


def median_seconds(fn, repeats, setup=None, warmup=None, cuda_events=False):
    """Median seconds of fn(setup()) over `repeats` calls, after one untimed warm-up.

    The warm-up is warmup() where given (a short call that only pays the one-time
    costs), else one call of fn itself. setup's work is not timed (e.g. the forward
    whose backward is timed). On a GPU the clock is synchronised around each call,
    or with cuda_events the time is the GPU's between two CUDA events.
    """
    setup = setup or (lambda: None)
    cuda = torch.cuda.is_available()

    if warmup is None:
        fn(setup())
    else:
        warmup()

    times = []
    for _ in range(repeats):
        x = setup()
        if cuda:
            torch.cuda.synchronize()

        if cuda and cuda_events:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(x)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
            continue

        t0 = time.perf_counter()
        fn(x)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    return statistics.median(times)
