"""`python -m bench decode`: the HF engine's decode on SmolLM2-135M-Instruct, on CPU.

Two figures, each against a baseline measured in the same run, on 1 thread:
1. FastHFEngine.sample (fast/decode.py, the HF engine as fast.install runs
   it on the CPU) with the LM head in tiles (fast.decode.tiled_head) against
   the plain head. The rollout of the side-by-side recipe (bench trl --real):
   4 word problems with the R1 system prompt, G 4, 64 new tokens, T 0.7. The
   two alternate --repeats times (default 5), and must give the same
   completions and log-probs.
2. A decode step's matrix products, at this recipe's 16 rows and at bench
   real's 32: every layer weight once, read from RAM as in a decode step
   ("cold"); one weight again and again, from cache ("hot"); the head plain
   and tiled; and the 2048^3 product that bench real's compute floor is built
   on. The last column is a lower bound on the rollout against that floor: a
   decode step's products alone (cold layers, tiled head) over the time the
   floor's rate gives them. Nothing else in a step (attention, norms, the
   sampler) is counted.
"""
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from bench.real import PROBLEMS, TRAIN_FLAGS, flag, machine_floor, real_model_or_exit
from bench.shared import median_seconds

PROMPTS = 4
G = 4
NEW_TOKENS = 64
TEMPERATURE = 0.7
# bench real's decode batch: its prompts a step times G
BENCH_REAL_ROWS = int(flag(TRAIN_FLAGS, "--prompts-per-step")) * int(flag(TRAIN_FLAGS, "--G"))


def plain_head(model, engine_dtype):
    """fast.decode.tiled_head's stand-in that leaves the head as it is."""
    return contextlib.nullcontext()


def sample_both_ways(engine, prompts, repeats):
    """-> ({"plain": [s], "tiled": [s]}, whether every sample matched the first)."""
    import fast.decode

    tiled_head = fast.decode.tiled_head
    heads = dict(plain=plain_head, tiled=tiled_head)
    seconds = dict(plain=[], tiled=[])
    first = None
    same = True

    try:
        for _ in range(repeats):
            for name, head in heads.items():
                fast.decode.tiled_head = head
                t0 = time.perf_counter()
                # (completions, log-probs, finished), the same seed each time
                result = engine.sample(prompts, G, NEW_TOKENS, rng_seed=1,
                                       temperature=TEMPERATURE)
                seconds[name].append(time.perf_counter() - t0)

                first = first or result
                same = same and result[:2] == first[:2]
    finally:
        fast.decode.tiled_head = tiled_head

    return seconds, same


def product_rates(model, rows, repeats):
    """GFLOP/s of a decode step's products at `rows` rows, and the FLOPs of
    its layers and head -> dict."""
    from fast.decode import tiled_head

    head = model.get_output_embeddings()
    layers = [m.weight for m in model.modules()
              if isinstance(m, torch.nn.Linear) and m is not head]
    x = {d: torch.randn(rows, d) for d in {w.shape[1] for w in layers}}
    flops = 2 * rows * sum(w.numel() for w in layers)

    def cold(_):
        for w in layers:
            F.linear(x[w.shape[1]], w)

    # the largest layer weight, as many times as there are layers
    big = max(layers, key=torch.Tensor.numel)

    def hot(_):
        for _ in layers:
            F.linear(x[big.shape[1]], big)

    hidden = torch.randn(rows, 1, head.weight.shape[1])  # (rows, 1, d)

    def head_call(_):
        head(hidden)

    def tiled(_):
        with tiled_head(model, torch.float32):
            head(hidden)

    head_flops = 2 * rows * head.weight.numel()
    # as the sampler runs (the tiled head is the plain one under autograd)
    with torch.no_grad():
        return dict(
            layers_cold=flops / median_seconds(cold, repeats) / 1e9,
            layer_hot=2 * rows * big.numel() * len(layers) / median_seconds(hot, repeats) / 1e9,
            head_plain=head_flops / median_seconds(head_call, repeats) / 1e9,
            head_tiled=head_flops / median_seconds(tiled, repeats) / 1e9,
            layer_flops=flops,
            head_flops=head_flops,
        )


def products_bound(rates, floor):
    """A decode step's products (product_rates' dict; the layers cold, the
    head tiled) -> their milliseconds, and how many times the floor's they
    take."""
    layers_s = rates["layer_flops"] / (rates["layers_cold"] * 1e9)
    head_s = rates["head_flops"] / (rates["head_tiled"] * 1e9)
    floor_s = (rates["layer_flops"] + rates["head_flops"]) / (floor * 1e9)
    return dict(ms=1e3 * (layers_s + head_s), x_floor=(layers_s + head_s) / floor_s)


def bench_decode(args):
    real_model = real_model_or_exit("bench decode")
    from data import render_prompts
    from fast.attention import register_gqa_attention
    from fast.decode import FastHFEngine
    from model import load_model, load_tokenizer

    torch.set_num_threads(args.threads)
    repeats = args.repeats
    path = real_model.smollm2_dir()
    model = load_model(path, torch.float32, torch.device("cpu")).eval()
    # the CPU's grouped-KV attention, as fast.install sets it
    model.set_attn_implementation(register_gqa_attention())
    tokenizer, _ = load_tokenizer(path)

    rows = real_model.make_word_problems(PROMPTS, seed=0, **PROBLEMS)
    texts, _ = render_prompts(tokenizer, [row["prompt"] for row in rows])
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    print(f"bench decode: {path}, {PROMPTS} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens x G {G} x {NEW_TOKENS} new tokens, "
          f"T {TEMPERATURE}, {args.threads} thread(s), {repeats} repeats", flush=True)

    # 1) the whole rollout, plain and tiled head in turn
    engine = FastHFEngine(model, tokenizer, seed=0)
    # the first call pays one-time costs
    engine.sample(prompts, G, 2, rng_seed=0, temperature=TEMPERATURE)
    seconds, same = sample_both_ways(engine, prompts, repeats)
    plain = statistics.median(seconds["plain"])
    tiled = statistics.median(seconds["tiled"])
    print("\n| FastHFEngine.sample | median s | each run, s |\n|---|---|---|")
    for name in ("plain", "tiled"):
        runs = " ".join(f"{s:.2f}" for s in seconds[name])
        print(f"| {name} head | {statistics.median(seconds[name]):.2f} | {runs} |")
    # this machine's speed drifts between runs: each pair ran back to back
    ratios = [p / t for p, t in zip(seconds["plain"], seconds["tiled"])]
    faster = sum(r > 1 for r in ratios)
    print(f"\nplain / tiled: {plain / tiled:.2f}x of the medians, "
          f"{statistics.median(ratios):.2f}x the median pair; tiled faster in {faster} of "
          f"{repeats} pairs; the same completions and log-probs: {'yes' if same else 'NO'}")

    # 2) the products of one decode step, at this recipe's rows and bench real's
    floor = machine_floor(args.threads, False, repeats)["float32"]
    print(f"\nbench real's compute floor (2048^3 product): {floor:.1f} GFLOP/s")
    print("\n| rows | layers, cold (GFLOP/s) | a layer, hot | head, plain | head, tiled "
          "| a step's products, ms | x the floor's time |")
    print("|---|---|---|---|---|---|---|")
    for rows in (PROMPTS * G, BENCH_REAL_ROWS):
        rates = product_rates(model, rows, repeats)
        bound = products_bound(rates, floor)
        print(f"| {rows} | {rates['layers_cold']:.1f} | {rates['layer_hot']:.1f} "
              f"| {rates['head_plain']:.1f} | {rates['head_tiled']:.1f} "
              f"| {bound['ms']:.1f} | {bound['x_floor']:.2f} |")

    if not same:
        raise SystemExit("the tiled head changed the samples")
