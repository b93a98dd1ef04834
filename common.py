"""Small helpers train.py needs and that are not a stage: rank-0 printing, one-line errors that stop every rank
together, flag ranges, the distributed set-up, the model load (FSDP2 / DDP, mixed precision), the model's
forward to completion logits and log-probs, the step's metrics over micro-batches and ranks, and DAPO's dynamic
sampling (the rounds of a step's rollouts when --dynamic-sampling is on).

    rank, world, master, ddp   from torchrun's environment (RANK, WORLD_SIZE); 0, 1, True, False alone
    print0(...)                print on rank 0 only
    fail(msg)                  "error: msg" and exit 2, on every rank (no rank is left waiting in a collective)
    all_ranks_ok(ok)           True iff every rank is ok (a MIN all-reduce)
    number(int, 1)             an argparse type: a finite number in a range, else one clear line
    setup(threads, dtype)      process group, device, threads; under torchrun, stop when the launcher dies
    in_background(fn, *args)   fn(*args) on a daemon thread -> a Future (train.py --async: the next batch)
    result_everywhere(future)  its result, or on every rank the exception it raised on any
    dynamic_sampling(...)      after each round of a step's rollouts: another round, or its informative groups

Mixed precision, as PyTorch users expect: the policy's weights, gradients and AdamW states are fp32 and only the
compute runs in --dtype (torch.autocast; FSDP2's MixedPrecisionPolicy casts the gathered weights and reduces
gradients in fp32). bf16 weights updated in place lose every update below half a bf16 ulp of the weight: one
step at lr 1e-6 moved 2.2% of the tiny model's weights. The frozen reference is stored in --dtype; the rollout
engine gets the weights in its own dtype at each sync.

LoRA (--lora-rank, through peft): the base is frozen in --dtype, only the fp32 adapters train; the reference is the
policy with its adapters off (AdaptersOff); a sync sends the merged weights of the adapted modules only
(sync_parameters), and a saved model is merged too, with its adapter beside it (merged_state_dict, load_adapter).
"""
import argparse
import dataclasses
import importlib
import logging
import math
import os
import random
import sys
import threading
import time
import warnings
from concurrent.futures import Future
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from advantage import total_rewards, zero_spread
from loss import selective_log_softmax
from reward import compute_rewards

rank = int(os.environ.get("RANK", 0))
world = int(os.environ.get("WORLD_SIZE", 1))
master = rank == 0
ddp = world > 1


def print0(*a, **kw):
    if master:
        print(*a, **kw, flush=True)


def fail(msg, everywhere=True):
    """Exit non-zero with one line that says what to change (printed once, or by the rank that hit it)."""
    if master or not everywhere:
        print(f"error{'' if everywhere else f' (rank {rank})'}: {msg}", flush=True)
    if everywhere and dist.is_initialized():  # every rank is here: none exits before the master's line is out
        dist.barrier()  # (torchrun stops the other ranks as soon as one exits)
    raise SystemExit(2)


def number(kind=float, low=None, high=None, low_open=False, why=""):
    """argparse type: a finite `kind` in [low, high] ((low, high] with low_open); None = unbounded. Refuses
    nan/inf, which would otherwise pass every comparison-based check silently."""
    bounds = (f"in {'(' if low_open else '['}{low}, {high}]" if low is not None and high is not None else
              f"{'>' if low_open else '>='} {low}" if low is not None else f"<= {high}")

    def parse(text):
        try:
            x = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}")
        if not math.isfinite(x) or (low is not None and (x <= low if low_open else x < low)) or (
                high is not None and x > high):
            raise argparse.ArgumentTypeError(f"must be {bounds}{why}, got {text}")
        return x
    return parse


def check_flags(args):
    """The rules between train.py's flags (argparse checks each flag's own range): one clear line each, the same
    verdict on every rank, before any heavy work."""
    n_local = args.prompts_per_step // max(1, world) * args.G  # completions per rank per step
    minibatch = args.minibatch_size or n_local
    micro = args.micro_batch_size or minibatch
    checks = [
        (args.prompts_per_step >= world, f"--prompts-per-step {args.prompts_per_step} < {world} ranks: every rank "
                                         f"needs a prompt"),
        (args.prompts_per_step % world == 0, f"--prompts-per-step {args.prompts_per_step} must be divisible by the "
                                             f"{world} ranks"),
        (args.eval_size >= world, f"--eval-size must be >= the {world} ranks (each evaluates a share), got "
                                  f"{args.eval_size}"),
        (not args.fsdp or world > 1, "--fsdp shards over ranks: launch with torchrun --nproc_per_node N (N >= 2)"),
        (not (args.fsdp and args.lora_rank), "--lora-rank does not work with --fsdp: drop --fsdp (LoRA's frozen base "
                                             "in --dtype and small adapters fit one GPU per rank under DDP)"),
        (args.vllm_mode == "colocate" or args.vllm_url, "--vllm-mode server needs --vllm-url http://HOST:PORT"),
        (not args.async_ or args.vllm_mode == "server", "--async overlaps a rollout server's generation with the "
         "update: add --vllm-mode server --vllm-url http://HOST:PORT (a colocated engine shares the trainer's device)"),
        (world % args.vllm_tp == 0, f"--vllm-tp {args.vllm_tp} must divide the {world} ranks"),
        (args.vllm_tp == 1 or (args.engine != "hf" and args.vllm_mode == "colocate"),
         "--vllm-tp applies to the colocated vLLM engine: drop it with --engine hf, or set the server's own TP"),
        (not (args.loss_impl == "triton" and args.importance_sampling_level == "sequence"),
         "--loss-impl triton supports --importance-sampling-level token only; use --loss-impl torch"),
        (args.model is None or os.path.isdir(args.model) or  # else it must look like a hub id: org/name
         (args.model.count("/") == 1 and not args.model.startswith((".", "/", "~")) and not os.path.exists(args.model)),
         f"--model {args.model!r}: no such directory (give a local save_pretrained folder or a hub id like org/name)"),
        (len(args.reward_weights) == len(args.rewards), f"--reward-weights has {len(args.reward_weights)} values for "
                                                        f"{len(args.rewards)} --rewards: give one per reward"),
        (any(args.reward_weights), "--reward-weights are all 0: every advantage would be 0 and nothing learned; give a "
                                   "reward a non-zero weight"),
        (n_local == 0 or not (n_local % minibatch or minibatch % micro),  # n_local 0: said above
         f"--micro-batch-size {micro} must divide --minibatch-size {minibatch}, which must divide the {n_local} "
         f"completions per rank per step (prompts-per-step / ranks * G)"),
        (args.dynamic_sampling != 1, "--dynamic-sampling 1 draws no second round, so it drops no group: give the most "
                                     "rounds a step may draw (>= 2), or 0 for off"),
        (not (args.async_ and args.dynamic_sampling), "--async samples one round ahead; --dynamic-sampling's extra "
                                                      "rounds would sample in step with the update: use one of them"),
        (args.eval_samples or not args.eval_k, "--eval-k needs --eval-samples n: pass@k is estimated from n sampled "
                                               "completions per held-out prompt"),
        (all(k <= args.eval_samples for k in args.eval_k or ()), f"--eval-k {' '.join(map(str, args.eval_k or ()))}: "
                                                                 f"each k must be <= --eval-samples {args.eval_samples}"),
    ]
    for ok, msg in checks:
        if not ok:
            fail(msg)


def cosine_lr(it, total, lr, warmup):
    """Linear warmup over `warmup` optimizer steps, then cosine from lr down to lr/10 at step `total`."""
    if it < warmup:
        return lr * (it + 1) / warmup
    progress = (it - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


_marks = []  # (phase, time it ended)


def mark(phase):
    """Note the end of a start-up phase (startup_line says how long each took)."""
    _marks.append((phase, time.time()))


def startup_line(t_launch):
    """"start-up 21.3 s: imports, data 6.1 s, models 0.4 s, engine 9.8 s, first evaluation 5.0 s" (rank 0's)."""
    t, parts = t_launch, []
    for phase, end in _marks:
        parts.append(f"{phase} {end - t:.1f} s")
        t = end
    return f"start-up {t - t_launch:.1f} s: " + ", ".join(parts)


def collective_device():
    """Where a tensor must live for a collective: the current GPU under NCCL, the CPU under gloo."""
    return f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"


def all_ranks_ok(ok):
    """True iff every rank is ok: a rank that hit an error must not leave the others waiting in a collective."""
    if not ddp:
        return ok
    flag = torch.tensor([int(ok)], device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def barrier():
    if ddp:
        dist.barrier()


def require(module, message):
    """Import an optional package, or fail with one line that says how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        fail(message)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(threads, dtype_name):
    """Process group (nccl on GPUs, gloo on CPU), device, torch threads -> (device, compute dtype). Also silences
    save_pretrained's per-shard progress bars, which would break the step bar (datasets': task.py), and makes a
    rollout server gone (server.py's ConnectionError, from any thread) end this rank with its one line."""
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    # vLLM's noise that asks nothing of the user: a Triton notice it logs before configuring its own logger (Python's
    # last-resort handler prints it), and a deprecation warning from its own import (vLLM 0.32)
    logging.getLogger("vllm").addHandler(logging.NullHandler())
    warnings.filterwarnings("ignore", r"`torch.distributed.reduce_op` is deprecated", FutureWarning)
    watch_launcher()
    one_line_errors(ConnectionError)
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if ddp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(threads)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    return device, dtype


def watch_launcher(poll_s=1.0):
    """Under torchrun (or another launcher that sets LOCAL_RANK), end this worker when its launcher dies: kill -9
    of the agent leaves the workers training on, unseen, into an out-dir a relaunch then finds locked. A daemon
    thread compares os.getppid() with its value at start; the exit is abrupt (os._exit), which loses at most the
    step in flight: checkpoints are atomic and a torn metrics line is dropped on resume."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return
    launcher = os.getppid()

    def watch():
        while os.getppid() == launcher:
            time.sleep(poll_s)
        try:
            print(f"error (rank {rank}): the launcher (pid {launcher}) is gone: stopping this worker", flush=True)
        finally:
            os._exit(3)
    threading.Thread(target=watch, name="watch_launcher", daemon=True).start()


def one_line_errors(*kinds):
    """An uncaught exception of exactly these classes ends this rank with "error (rank R): its message" and exit
    status 1, not a traceback: server.RemoteEngine's ConnectionError already says what is gone and what to do, and it
    can come from many calls (a generate, a sync, the --async batch's Future) that each rank makes on its own.
    Subclasses keep their traceback (a raw socket's ConnectionRefusedError from elsewhere says less)."""
    default = sys.excepthook

    def hook(kind, error, traceback):
        if kind in kinds:
            print(f"error (rank {rank}): {error}", flush=True)
        else:
            default(kind, error, traceback)
    sys.excepthook = hook


def in_background(fn, *args):
    """fn(*args) on a daemon thread -> a Future holding its result, or its exception (raised again by .result() in
    the caller's thread). A daemon, not a ThreadPoolExecutor's worker: those are joined at exit, so a run that stops
    for another reason would wait for the call in flight (up to the rollout server's timeout)."""
    future = Future()

    def run():
        try:
            future.set_result(fn(*args))
        except BaseException as e:
            future.set_exception(e)
    threading.Thread(target=run, name=f"in_background({getattr(fn, '__name__', fn)})", daemon=True).start()
    return future


def result_everywhere(future):
    """future.result(), with one verdict for all ranks: if it raised on any rank, every rank raises that exception
    (the first rank's), so that none is left waiting in the next collective and each says why. For a call each rank
    makes on its own (the --async batch: every rank's own request to the rollout server)."""
    try:
        result, error = future.result(), None
    except Exception as e:
        result, error = None, e
    if not all_ranks_ok(error is None):
        errors = [None] * world
        dist.all_gather_object(errors, error)
        raise next(e for e in errors if e is not None)
    return result


def load_model(path, dtype, device, fsdp=False, lora=None, frozen=False):
    """The trainable policy in fp32 (master weights: see the module docstring), a frozen model (the reference) in
    dtype, eval mode. Full weights on the CPU; with fsdp each decoder layer is then sharded over the ranks (FSDP2),
    so only this rank's shard moves to the device: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    lora (a peft LoraConfig, from lora.lora_config): the policy is the base model in dtype, frozen, with fp32 adapters.
    ValueError naming the folder when its weights do not load (missing, cut short, another shape)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if frozen or lora else torch.float32)
    except Exception as e:  # OSError (no weights), SafetensorError (cut short), RuntimeError (shapes), ...
        raise ValueError(f"model {path!r}: cannot load its weights ({str(e).strip().splitlines()[0]})") from None
    if fsdp:
        mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)  # compute in dtype, reduce fp32
        for layer in m.model.layers:
            fully_shard(layer, mp_policy=mixed)
        fully_shard(m, mp_policy=mixed)
    if lora:
        from lora import add_lora
    m = add_lora(m, lora) if lora else m.eval().requires_grad_(False) if frozen else m
    return m.to(device)


def unwrap(model):  # the module under a DDP wrapper (its parameter names lack the 'module.' prefix)
    return model.module if hasattr(model, "module") else model


def sequence_batch(prompt_ids, completion_ids, pad_id):
    """Left-pad prompts to a common length P and append the completions: (B, P+T) ids, mask, positions (CPU)."""
    P = max(len(p) for p in prompt_ids)
    prompts = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompt_ids])  # (B, P)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids])  # (B, P)
    input_ids = torch.cat([prompts, completion_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (B, P+T)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding must not shift RoPE positions
    return input_ids, attention_mask, position_ids


@contextmanager
def private_rng(seed):
    """Run the body on the global RNGs (torch CPU and CUDA device, random, numpy) seeded by seed, then restore them."""
    cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=cuda):
        torch.default_generator.manual_seed(seed)
        if cuda:
            torch.cuda.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def prompt_batch(prompt_ids, pad_id):
    """A rollout's prompts for the trainer's forwards, each distinct prompt once (its G completions share it, see
    completion_logits): left-padded ids (B, P), their mask (B, P), RoPE positions (B, P) and each completion's
    prompt row (N,). prompt_ids lists each completion's prompt, a group's consecutively (Rollout.prompt_ids)."""
    first = [i == 0 or p != prompt_ids[i - 1] for i, p in enumerate(prompt_ids)]
    prompt_row = torch.tensor(first).cumsum(0) - 1  # (N,)

    prompts = [p for p, f in zip(prompt_ids, first) if f]
    no_completions = torch.zeros(len(prompts), 0, dtype=torch.long)  # (B, 0)
    return (*sequence_batch(prompts, no_completions, pad_id), prompt_row)  # left-padded, as HFEngine's prompts


def completion_logits(model, prompts, rows, completion_ids, dtype=torch.float32):
    """Logits (n, T, V) that predict completion_ids (n, T), the completions of rows (a slice of the rollout).
    Prefix sharing: the G completions of a prompt share its forward. The prompt minus its last token runs once per
    distinct prompt; its KV cache is gathered to the n completions (a differentiable index) and each completion
    runs on top of it, fed [last prompt token, completion[:-1]]. That is B*(P-1) + n*T tokens instead of n*(P+T):
    2.3x fewer on the default task (G = 8, P = T = 4), the same logits and gradients to rounding
    (tests/test_prefix_sharing.py). FSDP2 models run one forward over whole sequences instead: a second forward
    before the backward breaks FSDP2's backward (its resharded weights, found on torch 2.13). Autocast to dtype."""
    prompt_ids, prompt_mask, positions, prompt_row = prompts  # (B, P) x3, (N,)
    row = prompt_row[rows]  # (n,) this micro-batch's prompt of each completion
    lo, hi = row[0].item(), row[-1].item() + 1  # a group's completions are consecutive: a range of prompts
    ids, mask, positions, row = prompt_ids[lo:hi], prompt_mask[lo:hi], positions[lo:hi], row - lo
    n, T = completion_ids.shape
    S = 0 if isinstance(model, FSDPModule) else ids.shape[1] - 1  # shared prefix length (FSDP2: none)
    with torch.autocast(completion_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        cache = None
        if S > 0:  # the prompts' shared prefix: its KV cache only (a 1-position LM head)
            cache = model(input_ids=ids[:, :S], attention_mask=mask[:, :S], position_ids=positions[:, :S],
                          use_cache=True, logits_to_keep=1).past_key_values
            cache.batch_select_indices(row)  # (b, ...) -> (n, ...) per layer
        tail = torch.arange(1, T, device=ids.device)  # completion[:-1] sits after the prompt's last position
        return model(input_ids=torch.cat([ids[row, S:], completion_ids[:, :-1]], 1),  # (n, P-S+T-1)
                     attention_mask=torch.cat([mask[row], torch.ones_like(completion_ids[:, :-1])], 1),  # (n, P+T-1)
                     position_ids=torch.cat([positions[row, S:], positions[row, -1:] + tail], 1),
                     past_key_values=cache, use_cache=False, logits_to_keep=T).logits  # (n, T, V)


@torch.no_grad()
def sequence_logps(model, prompts, completion_ids, temperature, micro, dtype=torch.float32):
    """Per-token log-probs (N, T) of the completions under model (the old policy's, the reference's), micro
    sequences per forward: like the update's, the logits alive at once are (micro, T, V), not (N, T, V)."""
    N = completion_ids.shape[0]
    return torch.cat([selective_log_softmax(completion_logits(model, prompts, slice(i, i + micro),
                                                              completion_ids[i:i + micro], dtype),
                                            completion_ids[i:i + micro], temperature)
                      for i in range(0, N, micro)])  # (N, T)


def score(funcs, rows, rollout, conversational, timeout):
    """Rewards (N, F) of a rollout (rows: its dataset row per completion), NaN where a function had no opinion. A reward
    that raised, exited or took over timeout seconds stops every rank (reward.compute_rewards names it)."""
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    ids = [c[:k] for c, k in zip(rollout.completion_ids.tolist(), rollout.completion_mask.sum(1).int().tolist())]
    texts = [[{"role": "assistant", "content": t}] for t in rollout.texts] if conversational else rollout.texts
    try:
        rewards, error = compute_rewards(funcs, [r["prompt"] for r in rows], texts, timeout,
                                         completion_ids=ids, **columns), None
    except BaseException as e:  # a reward that raised, exited or hung (reward.compute_rewards names it)
        rewards, error = None, e
    if not all_ranks_ok(error is None):
        fail(str(error) if error else "another rank's reward function failed (see its message)", everywhere=False)
    return rewards


def step_line(record, times=None):
    """The one line printed per step (metrics.jsonl holds every number); step 0 is the first evaluation alone."""
    parts = [f"step {record['step']}"] + ([] if times is None else [
        f"reward {record['reward_mean']:.3f}", f"loss {record['loss']:.4f}"] + (
        [f"kl {record['kl']:.4f}"] if "kl" in record else []) + [
        f"len {record['len_mean']:.1f}", " ".join(f"{k} {v:.2f}s" for k, v in times.items())])
    if "eval_greedy" in record:
        parts.append(f"held-out greedy {record['eval_greedy']:.3f} sampled {record['eval_sampled']:.3f}" + "".join(
            f" {k} {v:.3f}" for k, v in record.items() if k.startswith("pass@")))
    return " | ".join(parts)


def step_metrics(micro_metrics, grad_norms):
    """The step's logged numbers, unchanged by --micro-batch-size and the same on every rank: "loss" is the minibatch
    loss (the sum of its micro-batches' shares) averaged over the step's optimizer steps and over the ranks (as DDP
    averages gradients), grad_norm the mean over the optimizer steps, and every other metric (micro-batch token
    means) a token mean over the whole step on every rank, weighted by each micro-batch's "tokens"."""
    keys = [k for k in micro_metrics[0] if k not in ("loss", "tokens")]
    tokens = [m["tokens"] for m in micro_metrics]
    values = torch.tensor([sum(m[k] * t for m, t in zip(micro_metrics, tokens)) for k in keys] + [
        sum(tokens), sum(m["loss"] for m in micro_metrics) / len(grad_norms),
        torch.stack(grad_norms).float().mean().item()], dtype=torch.float64)
    if ddp:
        values = values.to(collective_device())
        dist.all_reduce(values)
        values = values.cpu() / torch.tensor([1.0] * (len(keys) + 1) + [world, world], dtype=torch.float64)
    return dict({k: (v / values[-3]).item() for k, v in zip(keys, values)}, loss=values[-2].item(),
                grad_norm=values[-1].item())


def dynamic_sampling(rounds, max_rounds, G, weights, pad_id):
    """DAPO's dynamic sampling (arXiv 2503.14476, sec. 3.2), called after each round of a step's rollouts: a group
    whose G weighted total rewards are all equal has advantage 0 and no gradient, so it is dropped, and more rounds
    of prompts are drawn until this rank holds its quota (its share of --prompts-per-step) of the others.
    rounds: this rank's rounds so far, [(rows, Rollout, rewards (quota*G, F))]; max_rounds: the bound (0: off).
    -> None when another round is due (on every rank alike), else ((rows, Rollout, rewards) of quota groups, the
    step's metrics: rounds drawn, groups generated and informative groups kept, over all ranks; {} when off).
    1. Each rank fills its own quota from its own rounds: the G completions of a prompt never leave their rank,
       and every rank ends with quota groups (static shapes: the rewards all-gather and DDP stay matched).
    2. A round is drawn on every rank while any rank is short (a MIN all-reduce), so a rank that is full still
       samples a round, and wastes it: the engines' call numbers and the prompt stream stay in step on every rank.
    3. At the bound a rank still short tops up with zero-spread groups of its last round (they add no gradient):
       the step trains on what there is, and ds_groups_informative < --prompts-per-step says so.
    4. Informative groups beyond the quota are dropped, not kept for the next step, where they would be
       off-policy and a checkpoint would have to hold them."""
    if max_rounds == 0:
        return rounds[0], {}
    quota, flat = len(rounds[0][0]) // G, [zero_spread(total_rewards(part[2], weights), G) for part in rounds]
    informative = [(part, g) for part, f in zip(rounds, flat) for g in (~f).nonzero().flatten().tolist()]
    if len(rounds) < max_rounds and not all_ranks_ok(len(informative) >= quota):
        return None
    top_up = [(rounds[-1], g) for g in flat[-1].nonzero().flatten().tolist()]  # (3.)
    kept = torch.tensor([min(len(informative), quota)], device=collective_device() if ddp else "cpu")
    if ddp:
        dist.all_reduce(kept)
    return take_groups((informative + top_up)[:quota], G, pad_id), dict(
        ds_rounds=len(rounds), ds_groups_generated=len(rounds) * quota * world, ds_groups_informative=int(kept))


def take_groups(picks, G, pad_id):
    """[((rows, Rollout, rewards), group index)] -> (rows, Rollout, rewards) of those groups, in that order. Rounds
    differ in their longest completion: (N, T) tensors are right-padded to the longest (pad id, mask 0)."""
    T = max(part[1].completion_ids.shape[1] for part, _ in picks)
    rows, rewards, fields = [], [], {}
    for (part_rows, rollout, part_rewards), g in picks:
        s = slice(g * G, (g + 1) * G)  # the group's G completions
        rows += part_rows[s]
        rewards.append(part_rewards[s])  # (G, F)
        for f in dataclasses.fields(rollout):
            x = getattr(rollout, f.name)[s]
            if isinstance(x, torch.Tensor) and x.dim() == 2:  # (G, T of its round) -> (G, T)
                x = torch.nn.functional.pad(x, (0, T - x.shape[1]), value=pad_id if f.name == "completion_ids" else 0)
            fields.setdefault(f.name, []).append(x)
    joined = {k: torch.cat(v) if isinstance(v[0], torch.Tensor) else sum(v, []) for k, v in fields.items()}
    return rows, type(rollout)(**joined), torch.cat(rewards)  # (N,), Rollout of N, (N, F)


def wrap_ddp(model, device):
    """DDP all-reduces gradients in backward (FSDP2 models reduce-scatter on their own)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
