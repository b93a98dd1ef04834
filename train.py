"""
GRPO (Group Relative Policy Optimization, DeepSeekMath arXiv:2402.03300, as in
DeepSeek-R1). For each prompt, sample G completions and score them with rule
rewards. Then push up the log-probability of the completions that beat their
group's mean, with a PPO-style clipped ratio and an optional KL penalty:

    A_i = (r_i - mean(r_group)) / std(r_group)
    L   = -mean_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i)
          + beta * KL_k3(pi || pi_ref)

Run (no GPU, no network: a tiny model and the built-in "sort the digits" task,
see task.py):
    python train.py                                            # 1 process
    torchrun --standalone --nproc_per_node 2 train.py --G 8    # 2 ranks
    python -m runlog.plot out                                         # re-draw out/metrics.png
(gloo on CPU, nccl on GPUs.) A hub model on GSM8K, 8 GPUs (README: the GPU
recipe):
    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen2.5-1.5B-Instruct \\
        --dataset openai/gsm8k --dataset-config main \\
        --prompt-column question --solution-column answer

Every knob is a flag in config.py (`python train.py --help`); None takes
config.defaults' recipe. The stages:
    rollout.py (sample) -> reward.py (score) -> advantage.py (group z-score)
    -> batch.py (old and reference log-probs, masks) -> loss.py (PPO-clip
    loss; kernels/ on GPUs) -> rollout.py (sync weights).
model.py holds the forward, data.py the prompts, checkpoint.py saving (and
resume/ resuming), runlog/metrics.py the logged numbers.

Simplifications (each is a choice, not an accident):
1. Rollouts run in the training process (vLLM colocated, or rollout.HFEngine).
   Each rank samples its own share of prompts, and the G completions of a
   prompt stay on one rank. Rewards are all-gathered (they are tiny), so
   advantages and the logged numbers are over the whole batch.
2. old_logps are recomputed by the trainer only when the update can go
   off-policy: mu > 1, several minibatches, or --is-correction. Otherwise the
   ratio is exactly 1 and only its gradient matters: clipping never fires, as
   in nanochat's chat_rl.py. With --max-staleness N >= 1 (--async: 1) they
   are the sampler's (README: --async).
3. The reference model (beta > 0) is the initial policy, frozen (LoRA: the
   policy with its adapters off); with --sync-ref-every N it moves toward the
   policy every N optimizer steps (TR-DPO). The LR schedule is a linear warmup,
   then a cosine to lr/10 over all optimizer steps.
4. A checkpoint holds everything a bit-exact resume needs (checkpoint.py). The
   data order is a pure function of the seed and the prompts consumed
   (--prompts-per-step a step; more with --dynamic-sampling).
5. Mixed precision: --dtype is the compute dtype (autocast). The policy and
   AdamW stay fp32; the reference and the rollout engine hold --dtype weights
   (model.py).
"""
import json
import math
import os
import resource
import sys
import time

t_launch = time.time()  # the start-up phases are timed from here: see the "start-up" line
# before torch and vLLM import: vLLM forces 1 thread otherwise
os.environ.setdefault("OMP_NUM_THREADS", "1")
# keep vLLM's engine core in this process
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's ~20 start-up warnings ask nothing of the user
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import checkpoint
import config
import data
import task
from advantage import compute_advantages
from batch import UpdateBatch
from common import (barrier, ddp, fail, mark, master,
                    print0, rank, seed_all, setup, startup_line,
                    step_line, world)
from loss import LossSettings, choose_impl, kept_mask, minibatch_tokens, policy_loss
from runlog.metrics import step_metrics
from model import (Forward, load_model, load_reference, load_tokenizer, pad_id, prompt_batch,
                   sequence_logps, truncates, wrap_ddp)
from reward import (
    extras_named,
    get_reward_funcs,
    get_soft_overlong_punishment,
    score,
)
from rollout import make_engine, pick_engine

# -----------------------------------------------------------------------------
# The flags (config.py), then the rules between them, before any heavy work
if config.speaks_trl(sys.argv[1:]):  # TRL's names (trl_compat/trl_names.py, docs/trl.md)
    from trl_compat import trl_names

    args = trl_names.parse_args(sys.argv[1:])
else:
    args = config.parse_args()
# the flags as the user gave them: before the recipe fills in
run_config = checkpoint.run_config(args, world)
config.fill_defaults(args)
config.check_flags(args)  # one clear line each, the same verdict on every rank
config.resolve_aliases(args)  # --tis-cap C: --is-correction token_truncate --is-max C
eval_k = []  # pass@k for these k (--eval-samples)
if args.eval_samples:
    from runlog.pass_at_k import pass_at_k  # evaluate() calls it once eval_k has a k

    eval_k = sorted(set(args.eval_k or [1, args.eval_samples]))
builtin_task = args.dataset is None
tiny = args.model is None
n_local = args.prompts_per_step // world * args.G  # completions per rank per step
minibatch = args.minibatch_size or n_local  # completions per optimizer step
ckpt_root = os.path.join(args.out_dir, "checkpoints")
# the process group first: the out-dir lock's verdict reaches every rank
device, dtype = setup(args.threads, args.dtype)
try:
    reward_funcs = get_reward_funcs(args.rewards)
    if args.overlong_buffer:
        # a completion that runs to the limit is punished, not just cut (DAPO,
        # https://arxiv.org/abs/2503.14476 eq. 13)
        reward_funcs.append(get_soft_overlong_punishment(args.max_new_tokens,
                                                         args.overlong_buffer))
        args.reward_weights = args.reward_weights + [1.0]
    # None: an --environment's own reward, else final_number_reward (after its
    # probe, below: tools/multiturn.py)
    eval_func = None
    if args.eval_reward:
        (eval_func,) = get_reward_funcs([args.eval_reward])
    # one run per out-dir: locked until it ends (or dies)
    checkpoint.check_out_dir(args.out_dir)
    resume_from, saved = checkpoint.resume_point(args.out_dir, args.resume, run_config,
                                                 log=print0)
except ValueError as e:
    fail(str(e))
# --report-to, --wandb: the dashboards (report.py). Every rank checks their
# packages before the heavy work; rank 0 reports
reporter = None
if args.report_to or args.wandb:
    from runlog import report

    reporter = report.open(args, saved)

# -----------------------------------------------------------------------------
# Setup: data, model, reference, optimizer, rollout engine, the resumed state
loss_impl, loss_why = choose_impl(args.loss_impl, device, args.importance_sampling_level,
                                  args.loss_type)
# the loss's hyperparameters, the same for every micro-batch: each field is the
# flag of its name; .impl is the loss's path from here on
loss_settings = LossSettings.from_flags(args, loss_impl)
if loss_impl == "triton":  # held to loss.py on this run's settings first (kernels/check.py)
    from kernels.check import checked_settings

    loss_settings, loss_why = checked_settings(args.loss_impl, loss_why, loss_settings, device)
# the sampler's filters
truncation = dict(top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
sampling = dict(**truncation, repetition_penalty=args.repetition_penalty)

# the initial model, which the reference is; and the policy now
init_path = args.model
if tiny:
    init_path = os.path.join(args.out_dir, "init_model")
model_path = init_path
if resume_from:
    model_path = os.path.join(resume_from, "model")
# rank 0 builds the tiny model; every rank and vLLM load it
if tiny and not resume_from and master:
    task.save_tiny_model(model_path, seed=args.seed)
barrier()
try:
    tokenizer, context_len = load_tokenizer(model_path)
    if args.chat_template:
        with open(args.chat_template) as f:
            tokenizer.chat_template = f.read()

    # --tools, --environment: each environment's tools, probed in a process of
    # its own, and its reward, of weight 1 (tools.py)
    environments = None
    tools_of = None  # a row -> its tools' schemas, for the prompt
    if config.uses_tools(args):
        from tools import multiturn as tools

        environments = tools.load_environments(args, tokenizer)
        tools_of = environments.tools_of
        reward_funcs, eval_func = tools.with_environment_rewards(environments, args,
                                                                 reward_funcs, eval_func)
    if not reward_funcs:
        raise ValueError("no reward: pass --rewards, or an --environment whose class "
                         "defines get_reward")
    # each reward's name in the records (reward/<name>); --rewards' word for one
    # without a __name__
    reward_names = [getattr(fn, "__name__", None) or args.rewards[f]
                    for f, fn in enumerate(reward_funcs)]

    train_rows, eval_rows = data.load_rows(
        args.dataset, digits=args.task_digits, eval_size=args.eval_size, seed=args.seed,
        config=args.dataset_config, split=args.split, eval_split=args.eval_split,
        prompt_column=args.prompt_column, solution_column=args.solution_column)
    if getattr(args, "trl_epochs", None):  # TRL's num_train_epochs: --steps from the rows
        from trl_compat import trl_names

        trl_names.resolve_epochs(args, len(train_rows))
    prompt_limit = data.prompt_limit(args.max_prompt_len, args.max_new_tokens,
                                     context_len)
    # the built-in task's prompts stay raw; a dataset's go through the chat template
    prepare = dict(system_prompt=args.system_prompt, max_len=prompt_limit,
                   raw=builtin_task, log=print0, tools_of=tools_of)
    train_rows, train_ids, conversational = data.prepare_prompts(
        tokenizer, train_rows, what="train", min_rows=1, **prepare)
    eval_rows, eval_ids, _ = data.prepare_prompts(
        tokenizer, eval_rows, what="held-out", min_rows=world, **prepare)
    mark("imports, data")
    seed_all(args.seed + rank)
    # LoRA trains adapters on the initial model (a resume loads its adapter:
    # resume/checkpoints.py's restore)
    lora = None
    if args.lora_rank:
        from scale.lora import lora_config

        lora = lora_config(args.lora_rank, args.lora_alpha, args.lora_dropout,
                           args.lora_targets)
    policy_path = init_path if args.lora_rank else model_path
    raw_model = load_model(policy_path, dtype, device, args.fsdp, lora,
                           recompute=args.gradient_checkpointing)
except (ValueError, FileNotFoundError) as e:
    fail(str(e))
ref_model = None
if args.beta > 0:  # train.py, simplification 3
    ref_model = load_reference(raw_model, init_path, dtype, device, args.fsdp)
model = raw_model  # what the forwards call: DDP's wrapper, or FSDP2's sharded model
if ddp and not args.fsdp:
    model = wrap_ddp(raw_model, device)
# completions per forward/backward (--fast: a few rows of a real vocabulary's
# logits on the CPU)
micro = args.micro_batch_size or minibatch
# the update's forward: logits, log-probs, entropies (model.py; --fast swaps in
# faster equals)
forward = Forward()
# LoRA: the adapters only
trained = [p for p in raw_model.parameters() if p.requires_grad]
# fused: one kernel for all tensors, not a loop of small ops (FSDP2's DTensors: the loop)
optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay,
                              fused=not args.fsdp)
mark("models")


def max_engine_rows():
    """The most rows one generate call of this rank's engine samples."""
    per_rank = -(-len(eval_rows) // world) * (args.eval_samples or 1)
    return max(n_local, per_rank) * args.vllm_tp


# the longest row an engine call holds: prompt and new tokens
row_tokens = max(map(len, train_ids + eval_ids)) + args.max_new_tokens


engine_kind, engine_why = pick_engine(args.engine, raw_model, args.vllm_tp)
if args.vllm_mode == "server":  # a rollout server on other machines (server.py)
    from engines.server import Access, RemoteEngine

    # it waits for the server, then checks it serves this model and these rows
    engine = RemoteEngine(args.vllm_url, tokenizer, seed=args.seed + rank,
                          access=Access.from_args(args), model_config=raw_model.config,
                          max_len=row_tokens, partial_rollouts=args.partial_rollouts)
    engine_why = "--vllm-mode server"
else:
    try:
        engine = make_engine(
            engine_kind,
            model=raw_model,
            tokenizer=tokenizer,
            model_path=model_path,
            # a tensor-parallel group samples as one engine
            seed=args.seed + rank // args.vllm_tp,
            dtype=str(dtype).removeprefix("torch."),
            gpu_memory_utilization=args.vllm_memory,
            max_model_len=prompt_limit + args.max_new_tokens,
            tensor_parallel_size=args.vllm_tp,
            # the largest call: a step's completions, or the sampled evaluation's
            # (a tensor-parallel group samples its ranks' rows together)
            max_rows=max_engine_rows(),
            row_tokens=row_tokens,
        )
    except ImportError as e:
        fail(f"--engine {args.engine}: vLLM is not installed ({e}); pip install -r "
             f"requirements-cpu.txt, or use --engine hf")


# --fast (the default, auto): the speed machinery of fast/, installed once
fast_note = "the plain path"
if args.fast != "off":
    import fast

    engine, forward, micro, fast_note = fast.install(
        args.fast, args=args, model=model, reference=ref_model, engine=engine,
        optimizer=optimizer, device=device, dtype=dtype, loss_impl=loss_settings.impl,
        minibatch=minibatch)
# --top-k, --top-p, --min-p: the trainer replays the sampler's filters on its own
# logits, so that its log-probs are over the same truncated support
# (sampling/truncation.py)
if truncates(**truncation):
    from sampling.truncation import replayed_on

    forward = replayed_on(forward, args.temperature, **truncation)
# --tools: the multi-turn loop around the engine (tools/multiturn.py); the rows go to
# generate for the environments' resets
tool_rows = environments is not None
if tool_rows:
    engine = tools.with_tools(engine, tokenizer, environments, args)

start_step = 0
opt_step = 0
consumed = 0  # prompts drawn so far (data.batch_indices)
pending = None  # server mode's batches drawn ahead, from the checkpoint
# --sync-ref-every: the reference moves (TR-DPO), so the checkpoints hold it
moving_reference = ref_model if args.sync_ref_every else None
if resume_from:  # RNG states last: the engine's start-up reseeds torch
    from resume.checkpoints import restore

    start_step, opt_step, consumed, pending = restore(
        resume_from, saved, raw_model, optimizer, engine, device, moving_reference)
    print0(f"resuming from {resume_from} (step {start_step}); "
           f"another --out-dir starts a new run")
# the server may hold other weights (a restart, a resumed run): send the
# weights after start_step updates
if args.vllm_mode == "server":
    engine.sync_weights(model, version=start_step)
mark("engine")

n_params = sum(p.numel() for p in raw_model.parameters()) / 1e6
n_trained = sum(p.numel() for p in trained) / 1e6
print0(f"engine {type(engine).__name__} ({engine_why}), {world} rank(s) x "
       f"{torch.get_num_threads()} thread(s), device {device}, "
       f"loss {loss_settings.impl} ({loss_why}), {n_params:.2f}M params "
       f"({n_trained:.3g}M trained), {len(train_rows)} train prompts")
print0(f"--fast {args.fast}: {fast_note}")
# vLLM on CPU: the KV cache sized to the work (engines/vllm_engine.py, simplification 5)
inner = getattr(engine, "engine", engine)
kv_bytes = getattr(inner, "kv_cache_bytes", None)
if kv_bytes:
    print0(f"vLLM KV cache {kv_bytes / 2**30:.2f} GiB of RAM: {inner.kv_rows} rows x "
           f"{row_tokens} tokens (the longest prompt + --max-new-tokens), +25% for the "
           f"prefix cache, at most --vllm-memory {args.vllm_memory:g} of RAM")
if args.repetition_penalty != 1:
    print0("--repetition-penalty: the sampler's log-probs are penalized, the trainer's are "
           "not (model.py): the IS ratio counts the penalty as off-policy")


def sample(consumed):
    """This rank's share of the next prompts, and G completions of each.

    -> (the rows, one per completion; the rollout; the server's weight version,
    None off server mode; seconds).
    """
    t0 = time.time()
    idx = data.batch_indices(len(train_rows), consumed, args.prompts_per_step, rank,
                             world, args.seed)
    prompt_ids = [train_ids[i] for i in idx]

    extra = {}
    if tool_rows:
        extra = dict(rows=[train_rows[i] for i in idx])
    rollout = engine.generate(prompt_ids, args.G, args.max_new_tokens,
                              temperature=args.temperature, **sampling, **extra)

    rows = [train_rows[i] for i in idx for _ in range(args.G)]
    return rows, rollout, getattr(engine, "weight_version", None), time.time() - t0


def sample_and_score(consumed):
    """One round: sample (the prompts at offset consumed), then score.

    -> ((the rows, the rollout, rewards (N, F)), the prompts drawn, the round's
    numbers for the record: the server's weight version, if any). Adds its
    seconds to the step's times.
    """
    rows, rollout, version, seconds = sample(consumed)
    t0 = time.time()
    rewards = score(reward_funcs, rows, rollout, conversational, args.reward_timeout,
                    reward_logs)  # (N, F)
    if reward_logs:  # log_extra's columns go with their rows (dynamic sampling keeps rows)
        rows = reward_logs.with_columns(rows)
    times["rollout"] += seconds
    times["reward"] += time.time() - t0

    stats = {}
    if version is not None:  # server mode: which weights sampled it
        stats["sampler_version"] = version
    return (rows, rollout, rewards), args.prompts_per_step, stats


@torch.no_grad()
def evaluate():
    """Held-out accuracy over all ranks, greedy and sampled, and pass@k.

    Greedy is temperature 0. Sampled is the mean of n = --eval-samples (or 1)
    completions per prompt, and pass@k is over those n: a completion passes at
    reward >= 1. Both decode with training's sampling flags: greedy ignores
    top-k, top-p and min-p (they never drop the likeliest token), not the
    repetition penalty, as in vLLM.
    """
    rows = eval_rows[rank::world]  # this rank's share
    ids = eval_ids[rank::world]
    n = args.eval_samples or 1

    def rewards(temperature, g):
        """(prompts, g): the eval reward of g completions per prompt, and
        (prompts, g): which were cut at --max-new-tokens."""
        extra = {}
        if tool_rows:
            extra = dict(rows=rows)
        rollout = engine.generate(ids, g, args.max_new_tokens, temperature=temperature,
                                  **sampling, **extra)
        rows_g = [r for r in rows for _ in range(g)]
        rewards = score([eval_func], rows_g, rollout, conversational, args.reward_timeout,
                        eval_logs)
        truncated = ~rollout.is_finished.view(-1, g)
        return rewards[:, 0].nan_to_num().view(-1, g), truncated

    greedy, greedy_truncated = rewards(0.0, 1)  # (prompts, 1)
    sampled, _ = rewards(args.temperature, n)  # (prompts, n)
    correct = (sampled >= 1).sum(1)  # (prompts,) of the n
    passes = [sum(pass_at_k(n, int(c), k) for c in correct) for k in eval_k]

    # sums over this rank's prompts, then the count; fp64, so that 475 / 500
    # is 0.95 and not fp32's 0.94999999 (which missed a >= 0.95 threshold)
    sums = [greedy.sum(), greedy_truncated.sum(), sampled.mean(1).sum(), *passes, len(rows)]
    totals = torch.tensor(sums, device=device, dtype=torch.float64)
    if ddp:
        dist.all_reduce(totals)

    means = (totals[:-1] / totals[-1]).tolist()
    # a greedy answer cut at the length limit: a policy that never stops can
    # still end on the right number
    result = dict(eval_greedy=means[0], eval_greedy_truncated=means[1],
                  eval_sampled=means[2])
    result.update({f"pass@{k}": p for k, p in zip(eval_k, means[3:])})
    if eval_logs:  # its reward's log_metric values, as eval_NAME (a collective)
        result.update(eval_logs.step_metrics(result))
    return result


def cosine_lr(it, total, lr, warmup):
    """Linear warmup over `warmup` optimizer steps, then a cosine from lr to
    lr/10 at step `total`."""
    if it < warmup:
        return lr * (it + 1) / warmup
    progress = (it - warmup) / max(1, total - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def group_advantages(rewards):
    """This rank's rewards (N, F) -> (its (N,) advantages, the step's reward numbers).

    The rewards of every rank are gathered first: the groups' and the batch's
    statistics are over the whole batch (train.py, simplification 1).
    """
    N = rewards.shape[0]
    rewards = rewards.to(device)  # (N, F)
    if ddp:
        gathered = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(gathered, rewards)
        rewards = torch.cat(gathered)  # (world*N, F)
    advantages, reward_stats = compute_advantages(rewards.cpu(), args.reward_weights,
                                                  args.G, args.scale_rewards,
                                                  aggregation=args.reward_aggregation)
    advantages = advantages[rank * N:(rank + 1) * N].to(device)  # (N,) this rank's slice
    for f, name in enumerate(reward_names):  # "reward/0" -> "reward/exact_match_reward"
        reward_stats[f"reward/{name}"] = reward_stats.pop(f"reward/{f}")
    return advantages, reward_stats


def prepare_update(rollout, prompts, advantages):
    """-> (UpdateBatch: the step's N rows on the device, as the loss sees them;
    (n,) the rows to train).

    Old and reference log-probs, the step's masks and the distinct rows, each
    only where a flag asks for it. prompts: model.prompt_batch's, on the device.
    """
    completion_ids = rollout.completion_ids.to(device)  # (N, T)
    completion_mask = rollout.completion_mask.to(device).float()  # (N, T)
    sampling_logps = rollout.sampling_logps.to(device)  # (N, T)
    N = completion_ids.shape[0]
    by_micro = dict(temperature=args.temperature, micro=micro, dtype=dtype)

    # the ratio's denominator; None: on-policy, the ratio is 1 (train.py, simplification 2)
    is_corrected = loss_settings.is_correction != "off"  # against the sampler's log-probs
    old_logps = None  # (N, T)
    if args.max_staleness and not is_corrected:  # the behaviour policy's (README: --async)
        old_logps = sampling_logps
    elif args.num_iterations > 1 or minibatch < N or is_corrected:  # off-policy
        old_logps = sequence_logps(forward, raw_model, prompts, completion_ids, **by_micro)

    ref_logps = None  # (N, T)
    if ref_model is not None:
        ref_logps = sequence_logps(forward, ref_model, prompts, completion_ids, **by_micro)

    # the step's masks: the truncated completions, the high-entropy tokens of all ranks
    truncated = None  # (N,)
    if args.mask_truncated:
        truncated = ~rollout.is_finished.to(device)
    high_entropy = None  # (N, T)
    # from the policy before this update (variants/high_entropy.py)
    if args.top_entropy_quantile < 1:
        from variants.high_entropy import step_mask

        kept = kept_mask(completion_mask, truncated)  # (N, T)
        high_entropy = step_mask(forward, raw_model, prompts, completion_ids, kept,
                                 args.top_entropy_quantile, **by_micro)

    # the rows to train: all (n = N); --fast: one of each set of identical
    # completions, weighed by its count (fast/dedup.py). Only with one forward a
    # step: ranks could run unequal numbers of forwards, each a collective under
    # DDP and FSDP2. And not where the sampler's per-row log-probs enter the loss.
    rows_to_train = torch.arange(N, device=device)  # (n,)
    counts = None  # (N,)
    uses_sampler = args.max_staleness or is_corrected or args.off_policy_mask is not None
    if forward.distinct_rows and micro == N and not uses_sampler:
        rows_to_train, row_counts = forward.distinct_rows(prompts.row, completion_ids,
                                                          completion_mask, advantages)
        counts = torch.zeros(N, device=device)
        counts[rows_to_train] = row_counts

    batch = UpdateBatch(
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        advantages=advantages,
        sampling_logps=sampling_logps,
        old_logps=old_logps,
        ref_logps=ref_logps,
        truncated=truncated,
        high_entropy=high_entropy,
        counts=counts,
    )
    return batch, rows_to_train


def backward_micro(batch, prompts, rows, mb_tokens, last, settings):
    """Forward, loss and backward of one micro-batch (its rows of batch) -> its metrics.

    mb_tokens: its minibatch's token count (loss.minibatch_tokens). settings: the
    loss's (loss_settings, or the optimizer step's under --adaptive-entropy).
    """
    # reduce gradients once per minibatch, after its last micro-batch (nanoGPT's trick)
    if args.fsdp:
        raw_model.set_requires_gradient_sync(last)
    elif ddp:
        model.require_backward_grad_sync = last

    micro_batch = batch.select(rows)
    ids = micro_batch.completion_ids  # (n, T)
    mask = micro_batch.completion_mask  # (n, T)
    # the current log-probs from the logits (the kernel computes its own), or
    # the LM head fused in where the loss needs nothing else (--fast)
    logits = None  # (n, T, V)
    logps = None  # (n, T)
    entropies = None  # (n, T)
    if forward.head_logps:
        logps = forward.head_logps(model, prompts, rows, ids, mask, args.temperature)
    else:
        logits = forward.logits(model, prompts, rows, ids, dtype)
        if settings.entropy_coef:
            entropies = forward.entropies(logits, args.temperature)
        if loss_settings.impl == "torch":
            logps = forward.logps(logits, ids, args.temperature)
    loss, metrics = policy_loss(logits, micro_batch, settings, minibatch_size=minibatch,
                                minibatch_tokens=mb_tokens, logps=logps,
                                entropies=entropies)

    # --adaptive-entropy measures at every step; the loss does only while the bonus is on
    if entropy_control:
        metrics["entropy"] = entropy_control.measure(forward, logits, micro_batch, args.temperature)

    # the logits (n, T, V) live on only in the loss's graph, which frees them
    # once their gradient is computed, not after the whole backward
    del logits
    loss.backward()
    return metrics


def optimizer_step(step):
    """Clip the minibatch's gradient and apply it -> the norm before clipping.

    A non-finite norm ends the run before the weights change.
    """
    max_norm = args.grad_clip or math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), max_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()

    # the same verdict on every rank: the gradients are all-reduced
    if not torch.isfinite(grad_norm):
        last, _ = checkpoint.find(ckpt_root)
        fail(f"non-finite loss or gradient at step {step} "
             f"(grad norm {grad_norm.item()}); weights left unchanged; "
             f"last good checkpoint: {last or 'none'}. Lower --lr or check rewards")

    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def update(batch, prompts, rows_to_train, step):
    """mu passes over the step's rows, an optimizer step per minibatch, each
    accumulated micro-batch by micro-batch -> (the micro-batches' metrics, the
    optimizer steps' gradient norms). Advances opt_step, the run's count."""
    global opt_step
    N = batch.completion_ids.shape[0]
    micro_metrics = []
    grad_norms = []
    for _ in range(args.num_iterations):
        for mb in range(0, N, minibatch):
            lr = cosine_lr(opt_step, opt_steps_total, args.lr, args.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # --adaptive-entropy: the coefficient as the last optimizer step left it
            settings = loss_settings
            if entropy_control:
                settings = entropy_control.settings(loss_settings)
            # all ranks' unmasked tokens / ranks: DDP averages the gradients
            mb_batch = batch.select(slice(mb, mb + minibatch))
            mb_tokens = minibatch_tokens(mb_batch.completion_mask, mb_batch.truncated)
            # the micro-batches of the minibatch's rows (its distinct ones, if any)
            micro_rows = rows_to_train[mb:mb + minibatch].split(micro)
            for i, rows in enumerate(micro_rows):
                last = i == len(micro_rows) - 1
                micro_metrics.append(backward_micro(batch, prompts, rows, mb_tokens, last,
                                                    settings))
            grad_norms.append(optimizer_step(step))
            opt_step += 1
            for attached in after_optimizer_step:  # --adaptive-entropy, --sync-ref-every
                attached(opt_step)
    return micro_metrics, grad_norms


def trainer_state(step):
    """What a resume needs beside the weights, the optimizer and the RNGs."""
    state = dict(step=step, opt_step=opt_step, prompts_consumed=consumed, config=run_config)
    if entropy_control:  # --adaptive-entropy's coefficient and last entropy
        state.update(entropy_coef=entropy_control.coef,
                     last_entropy=entropy_control.last_entropy)
    return state


def batch_metrics(batch, rollout, advantages, rows_to_train):
    """The step's batch in numbers: advantages, lengths, the sampler's entropy."""
    N = advantages.shape[0]
    lengths = batch.completion_mask.sum(1)  # (N,)
    sampled_logps = (batch.sampling_logps * batch.completion_mask).sum().item()
    return dict(adv_mean=advantages.mean().item(),
                adv_abs_mean=advantages.abs().mean().item(),
                # 1 - the share of duplicates the update left out
                rows_trained=len(rows_to_train) / N,
                sampled_entropy=-sampled_logps / lengths.sum().item(),
                len_mean=lengths.mean().item(),
                len_min=lengths.min().item(),
                len_max=lengths.max().item(),
                truncated=1 - rollout.is_finished.float().mean().item())


def resources(tokens):
    """Peak memory, the step's seconds by phase, and tokens sampled a second."""
    out = {}
    if device.type == "cuda":
        out["mem_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    # this process's peak resident memory: the trainer and an in-process engine
    # (Linux: kilobytes)
    out["rss_peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    out.update({f"time_{k}": v for k, v in times.items()})
    out["tokens_per_s"] = tokens * world / times["rollout"]
    out["elapsed"] = time.time() - t_start
    return out


# -----------------------------------------------------------------------------
# The optional features, each attached once to what the loop calls, behind its flag
opt_steps_total = args.steps * args.num_iterations * (n_local // minibatch)
# the step's seconds by phase, emptied each step: sample_and_score and the sync add theirs
times = {}
sync_weights = engine.sync_weights
entropy_control = None  # --adaptive-entropy's Controller
after_optimizer_step = []  # fn(opt_step), after each optimizer step
step_loggers = []  # fn(step, record, rows, rollout, rewards, advantages), after the evaluation
reward_logs = None  # TRL's reward extras: what training's reward calls logged
eval_logs = None  # and the evaluation's

# --dynamic-sampling N: drop the groups of equal rewards and draw more rounds
# until each rank holds its share of others (variants/dynamic_sampling.py)
if args.dynamic_sampling:
    from variants.dynamic_sampling import with_dynamic_sampling

    sample_and_score = with_dynamic_sampling(sample_and_score, args.dynamic_sampling, args.G,
                                             args.reward_weights, pad_id(tokenizer),
                                             args.reward_aggregation)
# --vllm-sleep: the engine's weights and KV cache freed from the step's sampling
# to the sync, leaving room for the update (engines/vllm_sleep.py)
if args.vllm_sleep:
    from engines import vllm_sleep

    sample_and_score, sync_weights = vllm_sleep.attach(sample_and_score, engine)
# --max-staleness N, --async (N = 1): server mode's batches drawn up to N weight
# versions ahead of the trainer, while it updates: sample takes one drawn ahead,
# and a resumed run first trains those its checkpoint holds (engines/staleness.py)
sampler = None
if args.max_staleness is not None:
    from engines import staleness

    sampler, sample, sync_weights = staleness.attach(sample, engine, times, args, start_step,
                                                     pending, consumed)
# server mode: which weights sampled the batch, which trained on it
if args.vllm_mode == "server":
    from engines.staleness import version_logger

    step_loggers.append(version_logger(sampler, device))
# --tools: tool_calls_mean, tool_error_rate, tool_seconds
if tool_rows:
    step_loggers.append(lambda step, record, rows, rollout, *_: record.update(
        tools.tool_metrics(rollout)))
# --adaptive-entropy: Skywork-OR1's controller of the entropy bonus
# (variants/adaptive_entropy.py)
if args.adaptive_entropy:
    from variants import adaptive_entropy

    entropy_control = adaptive_entropy.attach(args, saved if resume_from else None,
                                              after_optimizer_step, step_loggers)
# --sync-ref-every N: TR-DPO's reference, moved toward the policy every N
# optimizer steps (variants/trdpo.py)
if args.sync_ref_every:
    from variants import trdpo

    after_optimizer_step.append(trdpo.every(args.sync_ref_every, ref_model, raw_model,
                                            args.ref_mixup_alpha))
# TRL's reward extras (trl_compat/reward_extras.py): trainer_state, log_metric and
# log_extra, for the reward functions that name them; what training's and
# evaluation's calls logged (training's in each step's record)
if any(extras_named(fn) for fn in [*reward_funcs, eval_func]):
    from trl_compat import reward_extras

    reward_logs, eval_logs = reward_extras.open_logs(
        step_loggers, progress=lambda: (opt_step, consumed), train_prompts=len(train_rows),
        batch_prompts=args.prompts_per_step, max_steps=opt_steps_total)
# --log-completions N: every N-th step's completions to completions.jsonl, cut
# back as metrics.jsonl on a resume (runlog/completions.py); before the step's
# record and checkpoint, so that a checkpoint's steps are whole in the file
if args.log_completions:
    from runlog.completions import step_logger

    step_loggers.append(step_logger(args.out_dir, args.log_completions,
                                    start_step if resume_from else None, args.reward_weights,
                                    reward_names, reporter, reward_logs))

# -----------------------------------------------------------------------------
# The GRPO loop: the first evaluation, then a step at a time
metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
metrics_file = None
if master:
    append_after = start_step if resume_from else None  # a resume keeps the steps before
    metrics_file = checkpoint.open_metrics(metrics_path, append_after)
if not resume_from:
    record = dict(step=0, **evaluate())
    print0(step_line(record))
    if master:
        metrics_file.write(json.dumps(record) + "\n")
    if reporter:
        reporter.log(record, 0)
    mark("first evaluation")
print0(startup_line(t_launch))

t_start = time.time()
bar = tqdm(range(start_step + 1, args.steps + 1), initial=start_step, total=args.steps,
           disable=not master, dynamic_ncols=True)
for step in bar:
    times.clear()  # the step's seconds by phase (a feature's sync adds its own)
    times.update(rollout=0.0, reward=0.0)

    # 1) sample G completions for each of this rank's next prompts, and score them
    (rows, rollout, rewards), prompts_drawn, sample_stats = sample_and_score(consumed)  # (N, F)
    consumed += prompts_drawn

    # 2) rewards (N, F), gathered from every rank -> group-relative advantages (N,)
    t0 = time.time()
    advantages, reward_stats = group_advantages(rewards)  # (N,)
    times["reward"] += time.time() - t0

    # 3) old and reference log-probs, then mu passes of minibatch updates
    t0 = time.time()
    # (B, P) x3 and (N,): the distinct prompts, left-padded (model.prompt_batch)
    prompts = prompt_batch(rollout.prompt_ids, pad_id(tokenizer)).to(device)
    model.eval()  # no dropout: the ratio must compare the same function
    batch, rows_to_train = prepare_update(rollout, prompts, advantages)  # (N, ...), (n,)
    micro_metrics, grad_norms = update(batch, prompts, rows_to_train, step)
    times["update"] = time.time() - t0

    # 4) push the new weights into the rollout engine
    times["sync"] = sync_weights(model)["seconds"]

    # 5) log one JSON record per step (rank 0); evaluate and checkpoint on schedule
    record = dict(step=step, **reward_stats, **sample_stats)
    record.update(step_metrics(micro_metrics, grad_norms))  # over all micro-batches and ranks
    record.update(batch_metrics(batch, rollout, advantages, rows_to_train))
    record["lr"] = cosine_lr(opt_step - 1, opt_steps_total, args.lr, args.warmup_steps)
    record.update(resources(batch.completion_mask.sum().item()))
    if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
        record.update(evaluate())
    for log_feature in step_loggers:  # each feature's numbers (attached above)
        log_feature(step, record, rows, rollout, rewards, advantages)

    if master:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}",
                        loss=f"{record['loss']:.4f}")
        tqdm.write(step_line(record, times))  # above the bar
        if reporter:
            reporter.log(record, step)

    if step % args.save_every == 0 or step == args.steps:
        checkpoint.save(ckpt_root, step, raw_model, optimizer, engine, tokenizer,
                        trainer_state(step), args.keep_last, device,
                        sampler and sampler.state_dict(), moving_reference)

# -----------------------------------------------------------------------------
# The final policy (loadable by transformers, servable by vLLM), the plot, clean-up
final_state = checkpoint.get_model_state_dict(raw_model, options=checkpoint.FULL)
if master:
    metrics_file.close()
    model_dir = os.path.join(args.out_dir, "model")
    checkpoint.save_model(raw_model, model_dir, final_state, tokenizer)
    evals = [r for r in map(json.loads, open(metrics_path)) if "eval_greedy" in r]
    if evals:
        first, last = evals[0], evals[-1]
        print0(f"saved {args.out_dir}/model; held-out accuracy (greedy) "
               f"{first['eval_greedy']:.3f} at step {first['step']} -> "
               f"{last['eval_greedy']:.3f} at step {last['step']}")
    try:
        from runlog import plot
        print0(f"plot: {plot.plot_metrics(metrics_path)}")
    except ImportError as e:
        print0(f"no plot ({e}): pip install matplotlib")
    if reporter:
        reporter.close()
# rank 0 was saving and plotting: tear down together, or a rank exits mid-handshake
barrier()
# before destroy_process_group: vLLM's shutdown uses the group (and may destroy it)
engine.close()
if ddp and dist.is_initialized():
    dist.destroy_process_group()
