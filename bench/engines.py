"""`python -m bench rollout`: vLLM against the HF engine (rollout.py's two engines;
the HF one with the decode loop fast.install gives it, fast.decode.FastHFEngine).

It measures tokens/s and the weight-sync cost.
"""
import gc
import os
import shutil
import statistics
import tempfile

import torch

from bench.shared import SHAPES, build_model, median_seconds, never_eos_tokenizer

# completions per prompt
G = 8
# completions per forward/backward in the update
MICRO = 16
VLLM_FIELDS = ["vllm_tok_s", "vllm_over_hf", "sync_ms", "sync_mb", "sync_ms_per_mb",
               "step_s", "sync_share"]


def default_runs(tiny, cuda):
    """{SHAPES name: [completion lengths]}: two sizes and two lengths.

    On a GPU the 0.5B shape too.
    """
    if tiny:
        return {"tiny": [16]}

    runs = {"tiny": [16, 128], "25M": [16, 128]}
    # the GPU goal: Qwen2.5-0.5B's shape (its 152k vocabulary left out) at 512 tokens
    if cuda:
        runs["0.5B-shape"] = [128, 512]
    return runs


def fmt(x, spec, scale=1):
    """x in spec, or "-" where there is no figure (no vLLM), right-aligned like one."""
    if x is None:
        return format("-", ">" + spec.split(".")[0])
    return format(x * scale, spec)


def start_vllm(name, path, dtype, memory):
    """-> (engine, None), or (None, the error) where vLLM fails to start.

    It fails to start, for example, where it is not installed.
    """
    from engines.vllm_engine import VLLMEngine

    try:
        return VLLMEngine(path, seed=0, dtype=dtype, max_model_len=1024, **memory), None
    # ImportError without vLLM (a GPU image without it): HF figures only
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        print(f"{name}: vLLM engine unavailable ({error}); HF engine only")
        return None, error


def make_update(model, optimizer, seqs, P, length):
    """The trainer's share of a step: forward, backward and AdamW on the batch seqs."""
    def update():
        for i in range(0, len(seqs), MICRO):
            logits = model(seqs[i : i + MICRO]).logits  # (micro, P + T, V)
            logits = logits[:, P - 1 : -1].float()  # (micro, T, V)
            ids = seqs[i : i + MICRO, P:, None]  # (micro, T, 1)
            logps = logits.log_softmax(-1).gather(-1, ids).squeeze(-1)  # (micro, T)
            # the batch's mean, in parts
            (logps.sum() / (len(seqs) * length)).backward()

        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return update


def sync_figures(engine, model, repeats, tokens, vllm_s, hf_s, update_s):
    """The vLLM row's fields.

    Tokens/s, the speed-up, the weight sync per call and per MB, its step share.
    """
    sync = [engine.sync_weights(model) for _ in range(repeats + 1)][1:]
    sync_s = statistics.median(s["seconds"] for s in sync)
    n_bytes = sync[0]["bytes"]
    step_s = vllm_s + update_s + sync_s

    return dict(vllm_tok_s=tokens / vllm_s, vllm_over_hf=hf_s / vllm_s,
                sync_ms=sync_s * 1e3, sync_mb=n_bytes / 1e6,
                sync_ms_per_mb=sync_s * 1e3 / (n_bytes / 1e6),
                step_s=step_s, sync_share=sync_s / step_s)


def kv_cache_memory(name, num_prompts, P, lengths, itemsize, vllm_memory):
    """The vLLM engine's memory setting: --vllm-memory, else a KV cache sized to the run.

    The KV cache holds the longest run twice over.
    """
    if vllm_memory:
        return dict(gpu_memory_utilization=vllm_memory)

    hidden, layers, heads, kv_heads, _ = SHAPES[name]
    kv_bytes = (2 * G * num_prompts * (P + max(lengths)) * layers * 2 * kv_heads
                * (hidden // heads) * itemsize)
    return dict(kv_cache_memory_bytes=max(kv_bytes, 16 << 20))


def bench_rollout(args, runs=None, num_prompts=None, vocab_size=None, vllm_memory=None,
                  rows=None):
    """vLLM against the HF engine on the same prompts, G = 8, plus the weight-sync cost.

    By default it runs at two model sizes and two completion lengths. The sync
    cost is per call, per MB, and as a share of a GRPO step. The step is
    estimated as rollout (vLLM) + one update (forward, backward, AdamW on the
    rollout batch) + sync. The bench models' EOS id lies outside their vocabulary
    (never_eos_tokenizer). So every completion runs to full length, and both
    engines do exactly the same work. CPU figures use --threads torch threads for
    both engines.

    runs: {SHAPES name: [completion lengths]}. vocab_size: None = the tokenizer's
    ~20 ids. vllm_memory: the engine's gpu_memory_utilization (None: a KV cache
    sized for the run).

    It prints the table and appends each row as a dict to rows (returned). Where
    vLLM fails to start, its fields are None and vllm_error says why; the HF
    figures still come. The last engine is closed at the end. close() ends vLLM's
    process-wide state (engines/vllm_engine.py, simplification 4), so earlier ones stay open.
    """
    import task
    from fast.decode import FastHFEngine

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cuda = torch.cuda.is_available()
    if cuda:
        device = "cuda"
        dtype = "bfloat16"
    else:
        device = "cpu"
        dtype = "float32"

    if not num_prompts and args.tiny:
        num_prompts = 2
    if not num_prompts:
        num_prompts = 32 if cuda else 8
    if runs is None:
        runs = default_runs(args.tiny, cuda)

    tokenizer = never_eos_tokenizer(vocab_size)
    vocab_size = tokenizer.eos_token_id
    sort_rows, _ = task.make_sort_dataset(num_train=num_prompts, num_test=1)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in sort_rows]
    P = len(prompts[0])
    one_length = all(len(p) == P for p in prompts)
    assert one_length, "the update below assumes prompts of one length"
    rows = [] if rows is None else rows

    # every prompt in one call, for both engines (HFEngine keeps one step's logits,
    # not all)
    def rollout(engine, length):
        r = engine.generate(prompts, G, length, temperature=1.0)
        full = len(r.prompt_ids) * length
        assert r.completion_mask.sum() == full, "a completion stopped early"

    def rollout_seconds(engine, length):
        # after a warm-up call of a few tokens: it only pays the one-time costs
        return median_seconds(lambda _: rollout(engine, length), args.repeats,
                              warmup=lambda: rollout(engine, min(length, 4)))

    print(f"device {device} ({dtype}), torch threads {torch.get_num_threads()}, "
          f"{num_prompts} prompts x G={G}, median of {args.repeats}")
    print(f"{'model':>10} {'params':>7} {'new tok':>7} | {'vLLM tok/s':>10} "
          f"{'HF tok/s':>9} {'vLLM/HF':>7} | {'sync ms':>7} {'ms/MB':>6} {'step s':>7} "
          f"{'sync/step':>9}")

    engine = None
    try:
        for name, lengths in runs.items():
            # an earlier model's engine stays open (see the docstring)
            engine = None
            model = build_model(name, tokenizer, device, getattr(torch, dtype),
                                vocab_size)
            params = sum(p.numel() for p in model.parameters())

            path = tempfile.mkdtemp(prefix=f"bench_rollout_{name}_")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            memory = kv_cache_memory(name, num_prompts, P, lengths, model.dtype.itemsize,
                                     vllm_memory)

            before = torch.cuda.memory_allocated() if cuda else 0
            engine, vllm_error = start_vllm(name, path, dtype, memory)
            engine_gb = None
            if cuda and engine:
                engine_gb = (torch.cuda.memory_allocated() - before) / 1e9
                print(f"{name}: the vLLM engine allocated {engine_gb:.2f} GB at start-up "
                      f"(weights + KV cache, {memory})")
            # the engine has read it
            shutil.rmtree(path)

            hf = FastHFEngine(model, tokenizer, seed=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            for length in lengths:
                # the update's batch: any ids cost the same as sampled ones (each
                # prompt G times)
                shape = (num_prompts * G, length)
                completions = torch.randint(vocab_size, shape)  # (N, T)
                repeated = torch.tensor(prompts).repeat_interleave(G, 0)  # (N, P)
                seqs = torch.cat([repeated, completions], 1)  # (N, P + T)
                update = make_update(model, optimizer, seqs.to(device), P, length)
                tokens = num_prompts * G * length

                vllm_s = rollout_seconds(engine, length) if engine else None
                hf_s = rollout_seconds(hf, length)
                update_s = median_seconds(lambda _: update(), args.repeats, warmup=update)
                v = dict.fromkeys(VLLM_FIELDS)
                if engine:
                    v = sync_figures(engine, model, args.repeats, tokens, vllm_s, hf_s,
                                     update_s)

                rows.append(dict(model=name, params_m=params / 1e6, new_tokens=length,
                                 prompts=num_prompts, G=G, hf_tok_s=tokens / hf_s,
                                 hf_prompts_per_call=num_prompts, update_s=update_s, **v,
                                 engine_gb=engine_gb, vllm_memory=vllm_memory,
                                 vllm_error=vllm_error))
                print(f"{name:>10} {params / 1e6:6.2f}M {length:>7} | "
                      f"{fmt(v['vllm_tok_s'], '10.0f')} {tokens / hf_s:9.0f} "
                      f"{fmt(v['vllm_over_hf'], '7.2f')} | {fmt(v['sync_ms'], '7.1f')} "
                      f"{fmt(v['sync_ms_per_mb'], '6.2f')} {fmt(v['step_s'], '7.3f')} "
                      f"{fmt(v['sync_share'], '8.1f', 100)}%")
    finally:
        if engine is not None:
            engine.close()
        engine = None
        hf = None
        model = None
        optimizer = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    print("vLLM/HF > 1: vLLM faster. step = vLLM rollout + one update + sync (no "
          "reference model, one update per rollout); sync bytes count tied embeddings "
          "twice (sent as embed_tokens and lm_head).", flush=True)
    return rows
