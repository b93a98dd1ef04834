"""`python -m bench update`: the update's forward + backward.

Prefix-shared against whole sequences.
"""
import statistics
import time

import torch

# (prompt, completion) lengths measured
LENGTHS = ((4, 4), (16, 4), (4, 16))


def bench_update(args):
    """The update's forward + backward, prefix-shared against whole sequences.

    The forward is fast.update.completion_logits, the loss a logsumexp. The batch is the
    default task's: 32 prompts x G = 8, 4-token prompts and completions, the tiny
    model. The prefix-shared forward runs against the plain forward over whole
    (prompt + completion) sequences, interleaved, median of --repeats each.
    """
    from fast.update import completion_logits
    from model import prompt_batch, sequence_batch
    from task import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)
    g = torch.Generator().manual_seed(0)

    for P, T in LENGTHS:
        groups = [torch.randint(3, 15, (P,), generator=g).tolist() for _ in range(32)]
        # (N,) each prompt G = 8 times, as Rollout.prompt_ids
        prompts = [p for p in groups for _ in range(8)]
        completion_ids = torch.randint(3, 15, (len(prompts), T), generator=g)  # (N, T)
        whole = sequence_batch(prompts, completion_ids, 0)
        shared = prompt_batch(prompts, 0)

        def plain():
            return model(input_ids=whole[0], attention_mask=whole[1],
                         position_ids=whole[2], logits_to_keep=T + 1).logits[:, :-1]

        def prefix():
            rows = slice(0, len(prompts))
            return completion_logits(model, shared, rows, completion_ids)

        times = {"whole": [], "shared": []}
        for _ in range(args.repeats or 7):
            for name, forward in (("whole", plain), ("shared", prefix)):
                model.zero_grad()
                t0 = time.perf_counter()
                forward().logsumexp(-1).sum().backward()
                times[name].append(time.perf_counter() - t0)

        whole_s = statistics.median(times["whole"])
        shared_s = statistics.median(times["shared"])
        print(f"P {P:>2} T {T:>2} N {len(prompts)}: whole sequences "
              f"{whole_s * 1e3:6.1f} ms, prefix-shared {shared_s * 1e3:6.1f} ms, "
              f"ratio {whole_s / shared_s:.2f}x", flush=True)
