"""
Benchmarks, one mode per stage; every figure is a ratio against a baseline measured in the same run.

    python bench.py rollout          # vLLM vs HF generate tokens/s, weight-sync time (CPU or GPU)
    python bench.py kernel           # fused Triton GRPO loss vs PyTorch / torch.compile / Liger (GPU)
    python bench.py kernel --tiny    # the same script on tiny shapes under TRITON_INTERPRET=1 (CPU)
    python bench.py memory           # peak RSS of one update step per --micro-batch-size, V = 151,936 (CPU)
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def bench_rollout(args):
    """vLLM against HF generate (rollout.py's two engines) on the same prompts, G = 8, at two model sizes and
    two completion lengths, plus the weight-sync cost: per call, per MB, and as a share of a GRPO step
    estimated as rollout (vLLM) + one update (forward, backward, AdamW on the rollout batch) + sync.
    The bench models' EOS id lies outside their vocabulary, so every completion runs to full length and
    both engines do exactly the same work. CPU figures use --threads torch threads for both engines."""
    import shutil
    import tempfile

    from transformers import Qwen2Config, Qwen2ForCausalLM

    import task
    from rollout import HFEngine, VLLMEngine

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    G, num_prompts = 8, (2 if args.tiny else 32 if cuda else 8)
    # name: (hidden, layers, heads, kv heads, intermediate), completion lengths
    runs = {"tiny": ((128, 2, 4, 4, 256), [16] if args.tiny else [16, 128]),  # task.build_tiny_model's shape
            "25M": ((512, 8, 8, 8, 1408), [16, 128])}
    if args.tiny:
        del runs["25M"]
    elif cuda:  # the GPU goal: Qwen2.5-0.5B's shape (its 152k vocabulary left out) at 512 tokens
        runs["0.5B-shape"] = ((896, 24, 14, 2, 4864), [128, 512])
    tokenizer = task.build_tokenizer()
    vocab = len(tokenizer)
    tokenizer.add_special_tokens({"eos_token": "<never>"})  # id == vocab: the model cannot sample it
    rows, _ = task.make_sort_dataset(num_train=num_prompts, num_test=1)
    prompts = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    P = max(len(p) for p in prompts)

    def median_seconds(fn):  # after one warm-up call
        fn()
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    print(f"device {device} ({dtype}), torch threads {torch.get_num_threads()}, {num_prompts} prompts x G={G}, "
          f"median of {args.repeats}")
    print(f"{'model':>10} {'params':>7} {'new tok':>7} | {'vLLM tok/s':>10} {'HF tok/s':>9} {'vLLM/HF':>7} | "
          f"{'sync ms':>7} {'ms/MB':>6} {'step s':>7} {'sync/step':>9}")
    for name, ((hidden, layers, heads, kv_heads, inter), lengths) in runs.items():
        config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                             max_position_embeddings=1024, tie_word_embeddings=True,
                             eos_token_id=None, pad_token_id=tokenizer.pad_token_id)  # EOS: the tokenizer's
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config).to(device=device, dtype=getattr(torch, dtype))
        params = sum(p.numel() for p in model.parameters())
        path = tempfile.mkdtemp(prefix=f"bench_rollout_{name}_")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        head_dim = hidden // heads  # KV cache for the longest run, twice over
        kv_bytes = 2 * G * num_prompts * (P + max(lengths)) * layers * 2 * kv_heads * head_dim * model.dtype.itemsize
        # not closed: close() tears down vLLM's process-wide state (rollout.py simplification 6)
        vllm = VLLMEngine(path, seed=0, dtype=dtype, max_model_len=1024, kv_cache_memory_bytes=max(kv_bytes, 16 << 20))
        shutil.rmtree(path)  # the engine has read it
        hf = HFEngine(model, tokenizer, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for length in lengths:
            def rollout(engine):
                r = engine.generate(prompts, G, length, temperature=1.0)
                assert r.completion_mask.sum() == len(prompts) * G * length, "a completion stopped early"
                return r
            r = rollout(vllm)
            seqs = torch.cat([torch.tensor(r.prompt_ids), r.completion_ids], 1).to(device)  # (N, P + T), P equal

            def update():  # the trainer's share of a step: forward, backward and AdamW on the rollout batch
                logits = model(seqs).logits[:, P - 1 : -1].float()  # (N, T, V)
                logps = logits.log_softmax(-1).gather(-1, seqs[:, P:, None]).squeeze(-1)  # (N, T)
                logps.mean().backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

            tokens = len(prompts) * G * length
            vllm_s, hf_s = median_seconds(lambda: rollout(vllm)), median_seconds(lambda: rollout(hf))
            update_s = median_seconds(update)
            sync = [vllm.sync_weights(model) for _ in range(args.repeats + 1)][1:]
            sync_s, n_bytes = statistics.median(s["seconds"] for s in sync), sync[0]["bytes"]
            step_s = vllm_s + update_s + sync_s
            print(f"{name:>10} {params / 1e6:6.2f}M {length:>7} | {tokens / vllm_s:10.0f} {tokens / hf_s:9.0f} "
                  f"{hf_s / vllm_s:7.2f} | {sync_s * 1e3:7.1f} {sync_s * 1e3 / (n_bytes / 1e6):6.2f} "
                  f"{step_s:7.3f} {100 * sync_s / step_s:8.1f}%", flush=True)
    print("vLLM/HF > 1: vLLM faster. step = vLLM rollout + one update + sync (no reference model, one update per "
          "rollout); sync bytes count tied embeddings twice (sent as embed_tokens and lm_head).")


def bench_kernel(args):
    """Fused GRPO loss (kernels/grpo.py) against loss.py in PyTorch, torch.compile of it, and Liger-Kernel's
    triton_grpo_loss (when installed): forward, backward and total medians, peak extra memory, each one's
    time over ours, and ours against the memory roofline of 6 * N * V bytes (bf16: the forward reads the
    logits, the backward reads them again and writes dlogits). All losses use loss_type "bnpo"; |dloss| is
    each one's distance to loss.py's value. "in-place" writes dlogits over the logits, as Liger's default.
    torch.compile gets loss.py's math without its row chunks: Inductor fuses log_softmax and gather by
    itself, and tracing the chunk loop would unroll up to 74 checkpointed chunks."""
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
    sizes = [(64, 3000)] if args.tiny else [(n, v) for v in (32000, 151936) for n in (4096, 16384, 32768)]
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
        bandwidth = None
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
            leaf = None  # free it before the next method
            if cuda:
                torch.cuda.empty_cache()
        ours_total = results["ours"][2] if "ours" in results else float("nan")
        for name, (t_fwd, t_bwd, t_total, memory, dloss) in results.items():
            print(f"{N:>6} {V:>7} {beta:>5} {name:<16} {1e3 * t_fwd:>9.3f} {1e3 * t_bwd:>9.3f} {1e3 * t_total:>9.3f} "
                  f"{memory:>8.3f} {t_total / ours_total:>7.2f} {dloss:>8.1e}")
        for name in ("ours", "ours in-place"):
            if name in results:
                gbps = 6 * N * V / results[name][2] / 1e9  # bf16: 2 bytes read, read, written per logit
                roof = f", {100 * gbps / bandwidth:.0f} % of roofline" if bandwidth else ""
                print(f"{'':>20} {name}: {gbps:.3g} GB/s{roof}")
        del base


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
        logits_mb = micro * (args.new_tokens + 1) * 151_936 * 2 / 2**20  # bf16 (micro, T+1, V)
        print(f"{micro:>5} {n:>11} | {r['before']:13.0f} {r['peak']:12.0f} {r['peak'] - r['before']:9.0f} "
              f"{logits_mb:26.0f}", flush=True)


def _memory_step(args):  # one setting of bench_memory, in its own process
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests"))
    from transformers import AutoModelForCausalLM

    from common import completion_logits, sequence_logps
    from loss import minibatch_tokens, policy_loss
    from real_shapes import qwen_like
    from rollout import sequence_batch

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
    batch = sequence_batch(prompts, completion_ids, 0)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak: only the step counts
    before = rss("VmRSS")
    old = sequence_logps(model, batch, completion_ids, 1.0, args.micro, bf16)  # (N, T)
    ref = sequence_logps(ref_model, batch, completion_ids, 1.0, args.micro, bf16)  # (N, T)
    tokens = minibatch_tokens(mask)
    for i in range(0, args.completions, args.micro):
        r = slice(i, i + args.micro)
        logits = completion_logits(model, *(x[r] for x in batch), T, bf16)  # (micro, T, V)
        loss, _ = policy_loss(logits, completion_ids[r], advantages[r], mask[r], old[r], ref[r], beta=0.04,
                              minibatch_size=args.completions, minibatch_tokens=tokens)
        loss.backward()
        del logits, loss
    optimizer.step()
    print(json.dumps(dict(before=before, peak=rss("VmHWM"))))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["rollout", "kernel", "memory", "_memory_step"])
    parser.add_argument("--tiny", action="store_true", help="small shapes, CPU-runnable (checks the script itself)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (median reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--peak-gbps", type=float, default=None, help="memory bandwidth for the roofline (GPU)")
    parser.add_argument("--new-tokens", type=int, default=64, help="memory: completion length")
    parser.add_argument("--micro", type=int, default=2, help=argparse.SUPPRESS)  # _memory_step: one setting
    parser.add_argument("--completions", type=int, default=16, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"rollout": bench_rollout, "kernel": bench_kernel, "memory": bench_memory, "_memory_step": _memory_step}[args.mode](args)
