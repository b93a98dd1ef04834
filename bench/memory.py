"""`python -m bench memory`: the peak RSS of one update step, one process per
setting. `python -m bench lora`: the trainer's memory with and without LoRA,
from parameter sizes."""
import json
import os
import subprocess
import sys
import tempfile

import torch

from bench.shared import QWEN_VOCAB, ROOT

# (micro-batch size, completions) settings of `memory`
SETTINGS = ((2, 16), (8, 16), (2, 32))
# Qwen2.5's public config.json values: (hidden, intermediate, layers, heads,
# KV heads, vocab, tied)
QWEN_CONFIGS = {
    "Qwen2.5-1.5B": (1536, 8960, 28, 12, 2, 151_936, True),
    "Qwen2.5-7B": (3584, 18944, 28, 28, 4, 152_064, False),
}


def bench_memory(args):
    """Peak RSS of one update step of a Qwen2.5-like model at bf16 compute, as
    train.py runs it (--fast auto: fast/update.py's forward).

    The model is tests/real_shapes.py's: V = 151,936, tied, hidden 64. The step
    computes old and reference log-probs, then forward, backward and AdamW over
    the minibatch in micro-batches. Each (micro-batch size, minibatch) setting
    runs in a fresh process, and the peak is the step's alone: VmHWM is reset
    through /proc/self/clear_refs after set-up. The claim it checks: the peak
    grows with --micro-batch-size, not with the number of completions.
    """
    print(f"Qwen2.5-like model (V = 151,936), bf16 compute, {args.new_tokens} new tokens "
          f"after a 32-token prompt")
    print(f"{'micro':>5} {'completions':>11} | {'RSS before MB':>13} "
          f"{'step peak MB':>12} {'growth MB':>9} {'logits of a micro-batch MB':>26}")

    for micro, n in SETTINGS:
        cmd = [sys.executable, "-m", "bench", "_memory_step", "--micro", str(micro),
               "--completions", str(n), "--new-tokens", str(args.new_tokens),
               "--threads", str(args.threads)]
        proc = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        r = json.loads(proc.stdout.splitlines()[-1])

        # bf16 (micro, T, V)
        logits_mb = micro * args.new_tokens * QWEN_VOCAB * 2 / 2**20
        print(f"{micro:>5} {n:>11} | {r['before']:13.0f} {r['peak']:12.0f} "
              f"{r['peak'] - r['before']:9.0f} {logits_mb:26.0f}", flush=True)


def rss(field):
    """MB, from /proc/self/status: VmRSS now, VmHWM the peak since the last
    reset."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def memory_step(args):
    """One setting of bench_memory, in its own process.

    Prints {"before": MB, "peak": MB}.
    """
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from transformers import AutoModelForCausalLM

    from batch import UpdateBatch
    from fast import update
    from loss import LossSettings, minibatch_tokens, policy_loss
    from model import Forward, prompt_batch, sequence_logps
    from real_shapes import qwen_like

    bf16 = torch.bfloat16
    T = args.new_tokens
    n = args.completions
    micro = args.micro

    with tempfile.TemporaryDirectory() as path:
        # the fp32 policy in memory, bf16 on disk
        model = qwen_like(path)
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=bf16)
        ref_model = ref_model.eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)

    g = torch.Generator().manual_seed(0)
    # ids inside the tokenizer
    prompt_ids = torch.randint(4, 100, (n, 32), generator=g).tolist()
    completion_ids = torch.randint(4, 100, (n, T), generator=g)  # (N, T)
    mask = torch.ones(n, T)  # (N, T)
    advantages = torch.randn(n, generator=g)  # (N,)
    prompts = prompt_batch(prompt_ids, 0)  # (B, P) x3, (N,)

    # reset the peak: only the step counts
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS")

    # fast.install's forward where the loss needs the logits (bf16: no fused head)
    forward = Forward(logits=update.completion_logits, logps=update.selective_log_softmax,
                      entropies=update.entropy_from_logits)
    old = sequence_logps(forward, model, prompts, completion_ids, 1.0, micro, bf16)  # (N, T)
    ref = sequence_logps(forward, ref_model, prompts, completion_ids, 1.0, micro,
                         bf16)  # (N, T)
    batch = UpdateBatch(completion_ids=completion_ids, completion_mask=mask,
                        advantages=advantages, sampling_logps=None, old_logps=old,
                        ref_logps=ref)
    settings = LossSettings(beta=0.04)
    tokens = minibatch_tokens(mask)

    for i in range(0, n, micro):
        r = slice(i, i + micro)
        # (micro, T, V)
        logits = forward.logits(model, prompts, r, completion_ids[r], bf16)
        # the torch path's log-probs, as train.py's backward_micro takes them
        logps = forward.logps(logits, completion_ids[r], settings.temperature)  # (micro, T)
        loss, _ = policy_loss(logits, batch.select(r), settings, minibatch_size=n,
                              minibatch_tokens=tokens, logps=logps)
        loss.backward()
        del logits, logps, loss
    optimizer.step()

    print(json.dumps(dict(before=before, peak=rss("VmHWM"))))


def gb(params, per=None):
    """GB of these parameters at their own element size, or at `per` bytes each."""
    return sum(p.numel() * (per or p.element_size()) for p in params) / 1e9


def trainer_memory(config, rank):
    """A Qwen2 of config on the meta device, trained in full (rank 0) or with
    LoRA adapters of this rank.

    -> {name: value}: the parameters (B), the trained ones (M), then GB of the
    weights, gradients, AdamW's moments, their total, and the total with the
    reference model.
    """
    from peft import LoraConfig
    from transformers import Qwen2ForCausalLM

    from config import LORA_TARGETS
    from scale.lora import add_lora

    with torch.device("meta"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if rank else torch.float32)
        if rank:
            lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS)
            model = add_lora(model, lora)

    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    weights = gb(params)
    grads = gb(trained)
    adam = gb(trained, 8)  # AdamW: 2 fp32 moments
    total = weights + grads + adam
    # the bf16 reference of a full fine-tune; LoRA's is its base, no copy
    ref = 0.0 if rank else gb(params, 2)

    return dict(n_params=sum(p.numel() for p in params) / 1e9,
                n_trained=sum(p.numel() for p in trained) / 1e6,
                weights=weights, grads=grads, adam=adam, total=total,
                with_ref=total + ref)


def bench_lora(args):
    """Trainer memory with and without LoRA (--lora-rank) for Qwen2.5-shaped
    models built on the meta device (no download, no memory).

    Weights, gradients and AdamW's two moments in GB, summed from the
    parameters' own sizes and dtypes as train.py builds them on a GPU. Full
    fine-tuning: the fp32 policy. LoRA: the frozen base in --dtype auto = bf16,
    and fp32 adapters on the 7 attention and MLP projections; only they have
    gradients and AdamW state. The last column adds the bf16 reference a full
    fine-tune needs for --beta > 0 (LoRA's is its base with the adapters off: no
    copy). Activations and logits (one micro-batch's: see `python -m bench
    memory`) come on top.
    """
    from transformers import Qwen2Config

    print(f"{'model':<13} {'training':<13} {'params B':>8} {'trained M':>9} | "
          f"{'weights':>7} {'grads':>6} {'AdamW':>6} {'total GB':>8} | "
          f"{'+ ref (beta > 0)':>16}")

    for name, (hidden, inter, layers, heads, kv, vocab, tied) in QWEN_CONFIGS.items():
        config = Qwen2Config(hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, vocab_size=vocab,
                             num_attention_heads=heads, num_key_value_heads=kv,
                             tie_word_embeddings=tied)
        for rank in (0, 16, 64):
            m = trainer_memory(config, rank)
            training = f"LoRA r={rank}" if rank else "full"
            print(f"{name:<13} {training:<13} {m['n_params']:8.2f} "
                  f"{m['n_trained']:9.1f} | {m['weights']:7.1f} {m['grads']:6.2f} "
                  f"{m['adam']:6.2f} {m['total']:8.1f} | {m['with_ref']:16.1f}",
                  flush=True)
