"""The speed machinery, installed once at load (gpt-fast's pattern): the stage
files hold the plain algorithm and never import this package. train.py calls
install after it has built the policy, the engine and the optimizer, and gets
back faster equals of the plain pieces, the same numbers to rounding
(tests/test_fast.py holds --fast on against --fast off).

    python train.py              # --fast auto: what is measured to help on this device
    python train.py --fast off   # the plain reference path
    python train.py --fast on    # all of it wherever it runs, measured or not

What install swaps in, each where it applies:
1. attention.py: transformers' "sdpa" with the grouped KV heads as they are
   (CPU), for the policy and the reference.
2. decode.py: the HF engine's decode loop (a prompt's keys and values once for
   its completions, a preallocated cache, the LM head in tiles, a two-level
   CDF sampler, rows that end leave the batch); full-attention models only.
3. update.py: the update's forward (each prompt once for its completions, each
   gradient into .grad as soon as it is computed, the norms' backward by hand,
   the per-position modules on real tokens), its log-probs and entropies by
   chunks, and the LM head fused with the log-prob where the loss needs
   nothing else (CPU, fp32). dedup.py: one row of each set of identical
   completions, weighed by its count.
4. lora.py: a LoRA layer as one matmul of its merged weight (CPU).
5. memory.py: the micro-batch for --micro-batch-size 0 (CPU: a few rows of a
   real vocabulary's logits), and glibc's malloc_trim after each optimizer step
   and weight sync (models from 25M parameters; --fast on: any).
Figures: docs/benchmarks.md, the passes of the CPU work.
"""
from contextlib import contextmanager

import torch

# models from this size hand their freed heap back (memory.install_trims): a
# trim costs tens of ms, worth it from hundreds of MB a step, not on a toy
TRIM_MIN_PARAMS = 25e6


def install(mode, *, args, model, reference, engine, optimizer, device, dtype, loss_impl,
            minibatch):
    """Install the speed machinery for a run of these flags (args: config.py's).

    mode "auto" or "on". model: the policy as the forwards call it (DDP's
    wrapper, or FSDP2's sharded model); reference: the frozen reference or
    None; engine: the rollout engine (an HF engine is replaced); optimizer:
    the policy's; minibatch: the completions of an optimizer step on this
    rank. -> (engine, forward: a model.Forward, completions per forward, what
    it did in a few words).
    """
    from common import unwrap
    from fast import update
    from fast.dedup import unique_rows
    from fast.memory import MICRO_BATCH_LOGITS, auto_micro_batch, install_trims
    from model import Forward, full_attention, truncates
    from rollout import HFEngine

    done = []
    policy = unwrap(model)

    # 1) grouped-KV attention on the CPU, for every model the trainer runs
    if device.type == "cpu":
        from fast.attention import register_gqa_attention

        name = register_gqa_attention()
        for m in (policy, reference):
            transformer = next((x for x in _modules(m) if hasattr(x, "set_attn_implementation")),
                               None)
            if transformer is not None:
                transformer.set_attn_implementation(name)
        done.append("grouped-KV attention")

    # 2) the HF engine's decode loop. A model with sliding-window layers keeps
    # the plain loop: the fast one's left-padded rows are off there (the strict
    # xfail in tests/test_decode.py), the plain one's are right
    if type(engine) is HFEngine and full_attention(policy):
        from fast.decode import FastHFEngine

        engine = FastHFEngine(engine.model, engine.tokenizer, seed=engine.seed,
                              dtype=engine.dtype)
        done.append("the decode loop")

    # 3) the update's forward; the LM head fused with the log-prob where the
    # loss needs the log-probs alone (no entropy, no truncated sampling)
    head_logps = None
    needs_logits = (args.entropy_coef or args.adaptive_entropy
                    or truncates(args.top_k, args.top_p, args.min_p))
    if (update.fusable_head(model) and dtype == torch.float32 and loss_impl == "torch"
            and not needs_logits):
        head_logps = update.completion_logps
    forward = Forward(logits=update.completion_logits, logps=update.selective_log_softmax,
                      entropies=update.entropy_from_logits, head_logps=head_logps,
                      distinct_rows=unique_rows)
    done.append("the update's forward" + (", its LM head fused" if head_logps else ""))

    # 4) the micro-batch, and the heap's free pages handed back (CPU)
    micro = args.micro_batch_size or minibatch
    if not args.micro_batch_size:
        vocab_size = policy.get_output_embeddings().weight.shape[0]
        micro = auto_micro_batch(minibatch, args.max_new_tokens, vocab_size, device)
        if micro < minibatch:
            done.append(f"micro-batch {micro} of the minibatch's {minibatch} (the CPU: "
                        f"logits of at most {MICRO_BATCH_LOGITS:,} numbers a forward; "
                        f"--micro-batch-size sets it)")
    n_params = sum(p.numel() for p in policy.parameters())
    large = n_params >= TRIM_MIN_PARAMS or mode == "on"
    if device.type == "cpu" and large:
        install_trims(policy, optimizer, engine, each_backward=args.gradient_checkpointing)
        done.append("malloc_trim")

    return engine, forward, micro, ", ".join(done)


def _modules(m):
    """m's modules, or none (m None, or LoRA's AdaptersOff, which shares the policy's)."""
    if isinstance(m, torch.nn.Module):
        return m.modules()
    return []


@contextmanager
def forwards_replaced(pairs):
    """Within it, each (module, function) pair's module runs function as its
    forward; the forward it had again after. The function is an instance
    attribute, which nn.Module.__call__ finds before the class's method. They
    nest: a function may wrap the module's forward as it finds it (its class's,
    or an outer context's)."""
    before = [(module, vars(module).get("forward")) for module, _ in pairs]
    for module, forward in pairs:
        module.forward = forward
    try:
        yield
    finally:
        for module, forward in reversed(before):
            if forward is None:
                del module.forward
            else:
                module.forward = forward
