"""`python -m bench decode`: the HF engine's decode on SmolLM2-135M-Instruct, on CPU.

Two figures, each against a baseline measured in the same run, on 1 thread:
1. HFEngine.sample with the LM head in tiles (rollout.tiled_head) against the
   plain head. The rollout of the side-by-side recipe (bench trl --real):
   4 word problems with the R1 system prompt, G 4, 64 new tokens, T 0.7. The
   two alternate --repeats times (default 5), and must give the same
   completions and log-probs.
2. A decode step's matrix products at its 16 rows: every layer weight once,
   read from RAM as in a decode step ("cold"); one weight again and again,
   from cache ("hot"); the head plain and tiled; and the 2048^3 product that
   bench real's compute floor is built on.
"""
import contextlib
import statistics
import time

import torch
import torch.nn.functional as F

from bench.real import PROBLEMS, machine_floor, real_model_or_exit
from bench.shared import median_seconds

PROMPTS = 4
G = 4
NEW_TOKENS = 64
TEMPERATURE = 0.7


def plain_head(model, engine_dtype):
    """rollout.tiled_head's stand-in that leaves the head as it is."""
    return contextlib.nullcontext()


def sample_both_ways(engine, prompts, repeats):
    """-> ({"plain": [s], "tiled": [s]}, whether every sample matched the first)."""
    import rollout

    tiled_head = rollout.tiled_head
    heads = dict(plain=plain_head, tiled=tiled_head)
    seconds = dict(plain=[], tiled=[])
    first = None
    same = True

    try:
        for _ in range(repeats):
            for name, head in heads.items():
                rollout.tiled_head = head
                t0 = time.perf_counter()
                # (completions, log-probs, finished), the same seed each time
                result = engine.sample(prompts, G, NEW_TOKENS, rng_seed=1,
                                       temperature=TEMPERATURE)
                seconds[name].append(time.perf_counter() - t0)

                first = first or result
                same = same and result[:2] == first[:2]
    finally:
        rollout.tiled_head = tiled_head

    return seconds, same


def product_rates(model, rows, repeats):
    """GFLOP/s of a decode step's products at `rows` rows -> dict."""
    from rollout import tiled_head

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
        )


def bench_decode(args):
    real_model = real_model_or_exit("bench decode")
    from data import render_prompts
    from model import load_model, load_tokenizer
    from rollout import HFEngine

    torch.set_num_threads(args.threads)
    repeats = args.repeats
    path = real_model.smollm2_dir()
    model = load_model(path, torch.float32, torch.device("cpu")).eval()
    tokenizer, _ = load_tokenizer(path)

    rows = real_model.make_word_problems(PROMPTS, seed=0, **PROBLEMS)
    texts, _ = render_prompts(tokenizer, [row["prompt"] for row in rows])
    prompts = tokenizer(texts, add_special_tokens=False)["input_ids"]
    print(f"bench decode: {path}, {PROMPTS} prompts of {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens x G {G} x {NEW_TOKENS} new tokens, "
          f"T {TEMPERATURE}, {args.threads} thread(s), {repeats} repeats", flush=True)

    # 1) the whole rollout, plain and tiled head in turn
    engine = HFEngine(model, tokenizer, seed=0)
    # the first call pays one-time costs
    engine.sample(prompts, G, 2, rng_seed=0, temperature=TEMPERATURE)
    seconds, same = sample_both_ways(engine, prompts, repeats)
    plain = statistics.median(seconds["plain"])
    tiled = statistics.median(seconds["tiled"])
    print("\n| HFEngine.sample | median s | each run, s |\n|---|---|---|")
    for name in ("plain", "tiled"):
        runs = " ".join(f"{s:.2f}" for s in seconds[name])
        print(f"| {name} head | {statistics.median(seconds[name]):.2f} | {runs} |")
    # this machine's speed drifts between runs: each pair ran back to back
    ratios = [p / t for p, t in zip(seconds["plain"], seconds["tiled"])]
    faster = sum(r > 1 for r in ratios)
    print(f"\nplain / tiled: {plain / tiled:.2f}x of the medians, "
          f"{statistics.median(ratios):.2f}x the median pair; tiled faster in {faster} of "
          f"{repeats} pairs; the same completions and log-probs: {'yes' if same else 'NO'}")

    # 2) the products of one decode step
    rates = product_rates(model, PROMPTS * G, repeats)
    floor = machine_floor(args.threads, False, repeats)["float32"]
    print(f"\n| a decode step's products, {PROMPTS * G} rows | GFLOP/s |\n|---|---|")
    print(f"| the layers' weights, each once (cold, from RAM) | {rates['layers_cold']:.1f} |")
    print(f"| the largest layer weight again and again (hot) | {rates['layer_hot']:.1f} |")
    print(f"| the head, plain | {rates['head_plain']:.1f} |")
    print(f"| the head, tiled | {rates['head_tiled']:.1f} |")
    print(f"| 2048^3 (bench real's compute floor) | {floor:.1f} |")

    if not same:
        raise SystemExit("the tiled head changed the samples")
