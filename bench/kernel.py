"""`python -m bench kernel [--tiny]`: the fused GRPO loss (kernels/grpo.py)
against loss.py in PyTorch, torch.compile of it, and Liger-Kernel's
triton_grpo_loss."""
import itertools
import os
import warnings

import torch

from bench.shared import median_seconds

TEMPERATURE = 0.9
EPS_LOW = 0.2
EPS_HIGH = 0.28
BETAS = (0.0, 0.04)  # each shape runs without and with the KL term
# spec sheets' HBM bandwidth, GB/s, by a part of the device name (the first
# match counts)
SPEC_GBPS = (
    ("H200", 4800),
    ("H100 PCIe", 2000),
    ("H100", 3350),
    ("B200", 8000),
    ("A100-SXM4-80GB", 2039),
    ("A100", 1555),
)


def peak_gb(fn):
    """The memory one call allocates beyond what was already allocated (the
    inputs); NaN on CPU."""
    if not torch.cuda.is_available():
        return float("nan")

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 1e9


def peak_gbps(args):
    """-> (memory bandwidth in GB/s, where it comes from): --peak-gbps, a spec
    sheet, or a copy."""
    if args.peak_gbps:
        return args.peak_gbps, "--peak-gbps"

    name = torch.cuda.get_device_name()
    for key, gbps in SPEC_GBPS:
        if key in name:
            return gbps, f"spec sheet for {name}"

    # an unknown GPU: a device copy measures it
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    seconds = median_seconds(lambda _: x.clone(), args.repeats, cuda_events=True)
    return 2 * x.numel() / seconds / 1e9, f"measured copy bandwidth on {name}"


def loss_methods(cuda):
    """[(name, loss fn, whether it takes the logits with the last position)].

    Every loss is "bnpo".
    """
    from kernels import fused_grpo_token_loss
    from loss import LossSettings, grpo_loss, reduce_loss
    from model import selective_log_softmax

    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except ImportError:
        triton_grpo_loss = None

    # loss.py's settings by beta, built before torch.compile sees the loss
    settings = {}
    for beta in BETAS:
        settings[beta] = LossSettings(loss_type="bnpo", epsilon_low=EPS_LOW,
                                      epsilon_high=EPS_HIGH, beta=beta,
                                      temperature=TEMPERATURE)

    # the reference, loss.py
    def torch_loss(logits, ids, advantages, mask, old_logps, ref_logps, beta):
        logps = selective_log_softmax(logits, ids, TEMPERATURE)  # (B, T)
        return grpo_loss(logps, old_logps, ref_logps, advantages, mask, settings[beta])[0]

    # for torch.compile: no row chunks
    def unchunked_loss(logits, ids, advantages, mask, old_logps, ref_logps, beta):
        logps = (logits.float() / TEMPERATURE).log_softmax(-1)
        logps = logps.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
        return grpo_loss(logps, old_logps, ref_logps, advantages, mask, settings[beta])[0]

    def our_loss(logits, ids, advantages, mask, old_logps, ref_logps, beta,
                 inplace=False):
        per_token, _, _ = fused_grpo_token_loss(logits, ids, advantages, mask, old_logps,
                                                ref_logps, settings=settings[beta],
                                                inplace_backward=inplace)
        return reduce_loss(per_token, mask, "bnpo")

    # takes the (B, T + 1, V) logits; inplace=True, its default
    def liger_loss(logits_with_last, ids, advantages, mask, old_logps, ref_logps, beta):
        positional = (logits_with_last, old_logps, ref_logps, ids, advantages, mask,
                      TEMPERATURE, beta, EPS_LOW, EPS_HIGH, True)
        try:
            out = triton_grpo_loss(*positional, loss_type="bnpo", reduce=True)[0]
        except TypeError:
            # an older Liger: no loss_type; reduces like "grpo" or returns the
            # per-token loss
            out = triton_grpo_loss(*positional)[0]

        if out.dim() == 0:
            return out
        return reduce_loss(out, mask, "bnpo")

    def our_loss_inplace(*inputs):
        return our_loss(*inputs, inplace=True)

    methods = [("torch (loss.py)", torch_loss, 0),
               ("torch.compile", torch.compile(unchunked_loss), 0)]
    if triton_grpo_loss is not None and cuda:
        methods.append(("liger", liger_loss, 1))
    methods += [("ours", our_loss, 0), ("ours in-place", our_loss_inplace, 0)]

    if triton_grpo_loss is None:
        print("liger-kernel is not installed: its rows are skipped "
              "(pip install liger-kernel)")
    return methods


def make_inputs(N, V, T, beta, device):
    """-> bf16 logits (B, T + 1, V), and (ids, advantages, mask, old and ref
    log-probs, beta)."""
    from model import selective_log_softmax

    g = torch.Generator(device=device).manual_seed(0)
    B = N // T
    base = torch.randn(B, T + 1, V, device=device, generator=g)
    base = base.mul_(3).bfloat16()  # (B, T + 1, V)
    ids = torch.randint(V, (B, T), device=device, generator=g)  # (B, T)
    lengths = torch.randint(T // 2, T + 1, (B, 1), device=device, generator=g)
    mask = (torch.arange(T, device=device) < lengths).float()  # (B, T)
    advantages = torch.randn(B, device=device, generator=g)  # (B,)

    with torch.no_grad():
        logps = selective_log_softmax(base[:, :-1], ids, TEMPERATURE)  # (B, T)
    old_logps = logps + 0.2 * torch.randn(B, T, device=device, generator=g)
    ref_logps = None
    if beta:
        ref_logps = logps + 0.2 * torch.randn(B, T, device=device, generator=g)

    return base, (ids, advantages, mask, old_logps, ref_logps, beta)


def time_methods(methods, base, inputs, repeats, shape, rows):
    """Each method's (fwd, bwd, total seconds, peak GB, |dloss|) on one shape.

    A method that fails gets a row in rows with its error, and the others go on.
    shape: (N, V, beta), for those rows.
    """
    N, V, beta = shape
    cuda = torch.cuda.is_available()

    def timed(fn, setup=None):
        return median_seconds(fn, repeats, setup=setup, cuda_events=True)

    results = {}
    ref_value = None
    for name, fn, keep_last in methods:
        # a fresh, contiguous copy
        leaf = (base if keep_last else base[:, :-1]).clone().requires_grad_()

        try:
            # before any in-place backward overwrites the leaf
            value = fn(leaf, *inputs).item()
            if ref_value is None:
                ref_value = value

            memory = peak_gb(lambda: torch.autograd.grad(fn(leaf, *inputs), leaf))
            t_fwd = timed(lambda _: fn(leaf, *inputs))
            t_bwd = timed(lambda loss: torch.autograd.grad(loss, leaf),
                          setup=lambda: fn(leaf, *inputs))
            t_total = timed(lambda _: torch.autograd.grad(fn(leaf, *inputs), leaf))
            results[name] = (t_fwd, t_bwd, t_total, memory, abs(value - ref_value))

        # e.g. out of memory: report it, go on with the others
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:80]}"
            print(f"{N:>6} {V:>7} {beta:>5} {name:<16} failed: {error}")
            rows.append(dict(N=N, V=V, beta=beta, method=name,
                             error=f"{type(e).__name__}: {str(e)[:300]}"))

        # free it before the next method
        leaf = None
        if cuda:
            torch.cuda.empty_cache()

    return results


def report(results, shape, rows):
    """Print one shape's rows, with each time over ours, and append them."""
    N, V, beta = shape
    ours_total = results["ours"][2] if "ours" in results else float("nan")

    for name, (t_fwd, t_bwd, t_total, memory, dloss) in results.items():
        print(f"{N:>6} {V:>7} {beta:>5} {name:<16} {1e3 * t_fwd:>9.3f} "
              f"{1e3 * t_bwd:>9.3f} {1e3 * t_total:>9.3f} {memory:>8.3f} "
              f"{t_total / ours_total:>7.2f} {dloss:>8.1e}")
        rows.append(dict(N=N, V=V, beta=beta, method=name, fwd_ms=1e3 * t_fwd,
                         bwd_ms=1e3 * t_bwd, total_ms=1e3 * t_total, peak_gb=memory,
                         x_ours=t_total / ours_total, dloss=dloss))


def report_roofline(results, N, V, bandwidth, source, rows):
    """Ours against the memory roofline: print it, and add it to ours' rows."""
    for name in ("ours", "ours in-place"):
        if name not in results:
            continue

        # bf16: 2 bytes read, read again and written per logit
        gbps = 6 * N * V / results[name][2] / 1e9
        pct = 100 * gbps / bandwidth if bandwidth else None
        roof = f", {pct:.0f} % of roofline" if bandwidth else ""
        print(f"{'':>20} {name}: {gbps:.3g} GB/s{roof}")

        # the row just appended
        row = next(r for r in rows[::-1] if r["method"] == name)
        row.update(gbps=gbps, roofline_gbps=bandwidth, roofline_source=source,
                   roofline_pct=pct)


def bench_kernel(args, sizes=None, rows=None):
    """Forward, backward and total medians, peak extra memory, each one's time
    over ours, and ours against the memory roofline of 6 * N * V bytes.

    That is bf16: the forward reads the logits, the backward reads them again
    and writes dlogits. All losses use loss_type "bnpo"; |dloss| is each one's
    distance to loss.py's value. "in-place" writes dlogits over the logits, as
    Liger's default. torch.compile gets loss.py's math without its row chunks:
    Inductor fuses log_softmax and gather by itself, and tracing the chunk loop
    would unroll up to 74 checkpointed chunks.

    sizes: [(N, V)] (default: the six GPU shapes, or one tiny one). Prints the
    table and appends each row as a dict to rows (returned). A method that
    fails (e.g. out of memory) gets a row with its error, and the others go on.
    """
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        raise SystemExit("python -m bench kernel needs a GPU; on CPU run "
                         "`python -m bench kernel --tiny` (the Triton interpreter)")
    if not cuda:
        # must precede the first import of triton
        os.environ.setdefault("TRITON_INTERPRET", "1")
        # numpy warns on the inf/NaN of branches tl.where discards (intended,
        # see kernels/grpo.py)
        warnings.filterwarnings("ignore", category=RuntimeWarning,
                                module="triton.runtime.interpreter")

    methods = loss_methods(cuda)
    device = "cuda" if cuda else "cpu"
    T = 16 if args.tiny else 1024
    if sizes is None and args.tiny:
        sizes = [(64, 3000)]
    if sizes is None:
        sizes = [(n, v) for v in (32000, 151936) for n in (4096, 16384, 32768)]
    rows = [] if rows is None else rows

    # one compile per shape and beta: 12, not the default 8
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)

    bandwidth = None
    source = None
    if cuda:
        bandwidth, source = peak_gbps(args)
        print(f"{torch.cuda.get_device_name()}, roofline {bandwidth:.0f} GB/s ({source})")
    else:
        print("CPU, Triton interpreter: checks the script; times are not kernel speed")
    print(f"{'N':>6} {'V':>7} {'beta':>5} {'method':<16} {'fwd ms':>9} {'bwd ms':>9} "
          f"{'total ms':>9} {'peak GB':>8} {'x ours':>7} {'|dloss|':>8}")

    for (N, V), beta in itertools.product(sizes, BETAS):
        base, inputs = make_inputs(N, V, T, beta, device)
        results = time_methods(methods, base, inputs, args.repeats, (N, V, beta), rows)
        report(results, (N, V, beta), rows)
        report_roofline(results, N, V, bandwidth, source, rows)
        del base

    return rows
