"""
GRPO (Group Relative Policy Optimization, DeepSeekMath arXiv:2402.03300, as used for DeepSeek-R1):
for each prompt sample G completions, score them with rule rewards, and push up the log-probability of
completions that beat their group's mean, with a PPO-style clipped ratio and an optional KL to a reference:

    A_i = (r_i - mean(r_group)) / std(r_group)
    L   = -mean_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i) + beta * KL_k3(pi || pi_ref)

Run (no GPU, no network: builds a tiny model and the built-in "max of digits" task, see task.py):
    python train.py                                   # 1 process
    torchrun --standalone --nproc_per_node 2 train.py --G 8
On a GPU node with a hub model (see README for the full recipe):
    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen2.5-0.5B-Instruct ...

Simplifications (each is a choice, not an accident):
1. Rollouts run in the training process (vLLM colocated, or HF generate); each rank samples its own share
   of prompts, and the G completions of a prompt stay on one rank, so group statistics need no gather.
   Rewards are gathered anyway (they are tiny) so that "batch" scaling and the logged numbers are global.
2. old_logps are recomputed by the trainer only when the update can go off-policy (mu > 1, several
   minibatches, or truncated importance sampling); otherwise the ratio is exactly 1 and only its gradient
   matters (then clipping never fires, as in nanochat's chat_rl.py).
3. Prompts are tokenized as plain text (the built-in task has no chat template).
"""
import argparse
import json
import math
import os
import random
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch/vLLM import: vLLM forces 1 thread otherwise
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep vLLM's engine core in this process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import task
from advantage import compute_advantages
from loss import entropy_from_logits, grpo_loss, reduce_loss, selective_log_softmax
from reward import compute_rewards, get_reward_funcs
from rollout import make_engine

# -----------------------------------------------------------------------------
parser = argparse.ArgumentParser(description="GRPO trainer (see the docstring at the top of train.py)")
# Model and data
parser.add_argument("--model", default=None, help="hub id or local dir; default: a tiny Qwen2 built from a config")
parser.add_argument("--task-digits", type=int, default=3, help="built-in task: number of digits in a prompt")
# Rollouts
parser.add_argument("--G", type=int, default=8, help="completions per prompt (group size)")
parser.add_argument("--prompts-per-step", type=int, default=32, help="prompts per step, all ranks together")
parser.add_argument("--max-prompt-len", type=int, default=256, help="prompts longer than this are dropped")
parser.add_argument("--max-new-tokens", type=int, default=2, help="completion length limit")
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--top-p", type=float, default=1.0)
parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"], help="rollout engine")
parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM memory fraction (GPU: of the GPU)")
# Rewards
parser.add_argument("--rewards", nargs="+", default=None, help="reward names or dotted paths (default: task's)")
parser.add_argument("--reward-weights", type=float, nargs="+", default=None, help="one weight per reward")
parser.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"])
# Optimization
parser.add_argument("--steps", type=int, default=400, help="GRPO steps (one rollout batch each)")
parser.add_argument("--lr", type=float, default=3e-4)
parser.add_argument("--warmup-steps", type=int, default=10, help="linear warmup, then cosine decay to lr/10")
parser.add_argument("--weight-decay", type=float, default=0.0)
parser.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0: off)")
parser.add_argument("--num-iterations", type=int, default=1, help="mu: passes over each rollout batch")
parser.add_argument("--minibatch-size", type=int, default=0, help="completions per optimizer step per rank (0: all)")
parser.add_argument("--micro-batch-size", type=int, default=0, help="completions per forward/backward (0: minibatch)")
# Loss
parser.add_argument("--loss-type", default="grpo", choices=["grpo", "bnpo", "dr_grpo", "dapo"])
parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
parser.add_argument("--epsilon-low", type=float, default=0.2)
parser.add_argument("--epsilon-high", type=float, default=0.2)
parser.add_argument("--importance-sampling-level", default="token", choices=["token", "sequence"])
parser.add_argument("--entropy-coef", type=float, default=None, help="entropy bonus (default 0.1 on the built-in task, else 0)")
parser.add_argument("--tis-cap", type=float, default=0.0, help="truncated importance sampling cap vs sampler logps (0: off)")
parser.add_argument("--loss-impl", default="auto", choices=["auto", "triton", "torch"], help="auto: Triton kernel on CUDA")
# Evaluation, logging, runtime
parser.add_argument("--eval-every", type=int, default=20, help="held-out evaluation every N steps (0: only at the end)")
parser.add_argument("--eval-size", type=int, default=500, help="held-out prompts evaluated")
parser.add_argument("--out-dir", default="out", help="metrics.jsonl and the saved model go here")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (1 is fastest on small CPUs)")
parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
args = parser.parse_args()

# -----------------------------------------------------------------------------
# Setup: distributed, seeds, model, reference, optimizer, rollout engine
ddp = "RANK" in os.environ  # launched by torchrun
if ddp:
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
master = rank == 0
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
torch.set_num_threads(args.threads)


def print0(*a, **kw):
    if master:
        print(*a, **kw, flush=True)


def fail(msg):  # every rank checks the same things, so every rank exits: no hang
    print0(f"error: {msg}")
    raise SystemExit(2)


builtin_task = args.model is None
entropy_coef = args.entropy_coef if args.entropy_coef is not None else (0.1 if builtin_task else 0.0)
use_kernel = args.loss_impl == "triton" or (args.loss_impl == "auto" and device.type == "cuda")
if args.G < 2:
    fail(f"--G must be >= 2 (group statistics need two completions), got {args.G}")
if args.prompts_per_step % world:
    fail(f"--prompts-per-step ({args.prompts_per_step}) must be divisible by the number of ranks ({world})")
if use_kernel and args.importance_sampling_level == "sequence":
    fail("--loss-impl triton supports --importance-sampling-level token only; use --loss-impl torch")
random.seed(args.seed + rank)
torch.manual_seed(args.seed + rank)
os.makedirs(args.out_dir, exist_ok=True)
dtype = getattr(torch, args.dtype)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402  (after thread setup)

if builtin_task:
    # rank 0 builds the tiny model and saves it, so that every rank and vLLM load the same weights from disk
    model_path = os.path.join(args.out_dir, "init_model")
    if master:
        tokenizer = task.build_tokenizer()
        task.build_tiny_model(tokenizer, seed=args.seed).save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
    if ddp:
        dist.barrier()
    train_rows, eval_rows = task.make_max_digit_dataset(args.task_digits, num_test=args.eval_size, seed=args.seed)
    reward_names = args.rewards or ["exact_match_reward", "task.digit_format_reward"]
    reward_weights = args.reward_weights or ([1.0, 0.1] if args.rewards is None else [1.0] * len(reward_names))
else:
    model_path = args.model
    raise SystemExit("error: --model needs --dataset (issue 9), not built yet")
if len(reward_weights) != len(reward_names):
    fail(f"--reward-weights has {len(reward_weights)} values for {len(reward_names)} --rewards")
reward_funcs = get_reward_funcs(reward_names)
tokenizer = AutoTokenizer.from_pretrained(model_path)
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
ref_model = None
if args.beta > 0:  # the reference is the initial policy, frozen
    ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval().requires_grad_(False)
raw_model = model
if ddp:
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
engine = make_engine(args.engine, model=raw_model, tokenizer=tokenizer, model_path=model_path, seed=args.seed + rank,
                     dtype=args.dtype, gpu_memory_utilization=args.vllm_memory,
                     max_model_len=args.max_prompt_len + args.max_new_tokens)
print0(f"rollout engine: {type(engine).__name__}, ranks: {world}, device: {device}, loss: {'triton' if use_kernel else 'torch'}")

# prompts: drop (and count) those over the limit, then a fixed shuffled order per epoch
def tokenize(rows):
    ids = [tokenizer(r["prompt"])["input_ids"] for r in rows]
    keep = [i for i, x in enumerate(ids) if len(x) <= args.max_prompt_len]
    if not keep:
        fail(f"every prompt is longer than --max-prompt-len {args.max_prompt_len}")
    if len(keep) < len(rows):
        print0(f"warning: dropped {len(rows) - len(keep)} of {len(rows)} prompts longer than --max-prompt-len")
    return [rows[i] for i in keep], [ids[i] for i in keep]


train_rows, train_ids = tokenize(train_rows)
eval_rows, eval_ids = tokenize(eval_rows)
per_rank = args.prompts_per_step // world


def batch_indices(step):
    """This rank's prompt indices for a step: epoch-shuffled with the run's seed (same order on every rank)."""
    epoch, pos = divmod(step * args.prompts_per_step, len(train_rows))
    order = list(range(len(train_rows)))
    random.Random(args.seed * 1000 + epoch).shuffle(order)
    start = pos + rank * per_rank
    return [order[(start + i) % len(order)] for i in range(per_rank)]


def lr_at(it, total):
    if it < args.warmup_steps:
        return args.lr * (it + 1) / args.warmup_steps
    progress = (it - args.warmup_steps) / max(1, total - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def sequence_batch(prompt_ids, completion_ids):
    """Left-pad prompts to a common length P and append the completions: (B, P+T) ids, mask, positions."""
    P = max(len(p) for p in prompt_ids)
    pad = tokenizer.pad_token_id
    prompts = torch.tensor([[pad] * (P - len(p)) + p for p in prompt_ids])  # (B, P)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids])  # (B, P)
    input_ids = torch.cat([prompts, completion_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, torch.ones_like(completion_ids)], dim=1)  # (B, P+T)
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # left padding must not shift RoPE positions
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


def completion_logits(m, input_ids, attention_mask, position_ids, T):
    """Logits that predict the T completion tokens: (B, T, V), a view with no copy."""
    logits = m(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
               logits_to_keep=T + 1).logits  # (B, T+1, V)
    return logits[:, :-1]  # (B, T, V): position t predicts completion token t


@torch.no_grad()
def per_token_logps(m, batch, completion_ids):
    logits = completion_logits(m, *batch, completion_ids.shape[1])
    return selective_log_softmax(logits, completion_ids, args.temperature)  # (B, T)


@torch.no_grad()
def evaluate():
    """Held-out accuracy (the first reward function, i.e. correctness), greedy and sampled, all ranks."""
    rows, ids = eval_rows[rank::world], eval_ids[rank::world]
    scores = []
    for temperature in (0.0, args.temperature):
        out = engine.generate(ids, 1, args.max_new_tokens, temperature=temperature)
        r = compute_rewards(reward_funcs[:1], [r["prompt"] for r in rows], out.texts,
                            **{k: [r[k] for r in rows] for k in rows[0] if k != "prompt"})
        scores.append(torch.nan_to_num(r[:, 0]).sum())
    totals = torch.stack(scores + [torch.tensor(float(len(rows)))])
    if ddp:
        dist.all_reduce(totals)
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


# -----------------------------------------------------------------------------
# The GRPO loop
metrics_file = open(os.path.join(args.out_dir, "metrics.jsonl"), "w") if master else None
acc_greedy, acc_sampled = evaluate()
print0(f"step 0: held-out accuracy greedy {acc_greedy:.3f} sampled {acc_sampled:.3f}")
history = [dict(step=0, eval_greedy=acc_greedy, eval_sampled=acc_sampled, elapsed=0.0)]
t_start = time.time()
opt_steps_total = args.steps * args.num_iterations
opt_step = 0
for step in (bar := tqdm(range(1, args.steps + 1), disable=not master, dynamic_ncols=True)):
    times = {}
    # 1) sample G completions for each of this rank's prompts
    t0 = time.time()
    idx = batch_indices(step - 1)
    rows = [train_rows[i] for i in idx for _ in range(args.G)]  # (N,) the row of each completion
    rollout = engine.generate([train_ids[i] for i in idx], args.G, args.max_new_tokens,
                              temperature=args.temperature, top_p=args.top_p)
    completion_ids = rollout.completion_ids.to(device)  # (N, T)
    completion_mask = rollout.completion_mask.to(device).float()  # (N, T)
    N, T = completion_ids.shape
    times["rollout"] = time.time() - t0

    # 2) rewards (N, F), gathered from every rank so advantages and logs see the whole batch
    t0 = time.time()
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    trimmed_ids = [ids[: int(m.sum())].tolist() for ids, m in zip(rollout.completion_ids, rollout.completion_mask)]
    rewards = compute_rewards(reward_funcs, [r["prompt"] for r in rows], rollout.texts,
                              completion_ids=trimmed_ids, **columns)  # (N, F), NaN = no opinion
    if ddp:
        gathered = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(gathered, rewards)
        rewards = torch.cat(gathered)  # (world*N, F)
    advantages, reward_stats = compute_advantages(rewards, torch.tensor(reward_weights), args.G, args.scale_rewards)
    for f, name in enumerate(reward_names):  # "reward/0" -> "reward/exact_match_reward"
        reward_stats[f"reward/{name.split('.')[-1]}"] = reward_stats.pop(f"reward/{f}")
    advantages = advantages[rank * N:(rank + 1) * N].to(device)  # (N,) this rank's slice
    times["reward"] = time.time() - t0

    # 3) mu passes of minibatch updates
    t0 = time.time()
    batch = sequence_batch(rollout.prompt_ids, rollout.completion_ids)
    minibatch = args.minibatch_size or N
    micro = args.micro_batch_size or minibatch
    off_policy = args.num_iterations > 1 or minibatch < N or args.tis_cap > 0
    model.eval()  # no dropout: the ratio must compare the same function
    old_logps = per_token_logps(raw_model, batch, completion_ids) if off_policy else None  # (N, T)
    ref_logps = per_token_logps(ref_model, batch, completion_ids) if ref_model is not None else None  # (N, T)
    sampling_logps = rollout.sampling_logps.to(device) if args.tis_cap > 0 else None  # (N, T)
    # dapo normalises by the tokens of the whole minibatch over all ranks; DDP averages gradients over ranks
    step_metrics = []
    for _ in range(args.num_iterations):
        for mb in range(0, N, minibatch):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(opt_step, opt_steps_total)
            mb_rows = slice(mb, min(mb + minibatch, N))
            mb_tokens = completion_mask[mb_rows].sum()
            num_items = None
            if args.loss_type == "dapo":
                num_items = mb_tokens.clone()
                if ddp:
                    dist.all_reduce(num_items)
                num_items = num_items / world
            for mc in range(mb_rows.start, mb_rows.stop, micro):
                r = slice(mc, min(mc + micro, mb_rows.stop))
                last = r.stop == mb_rows.stop
                if ddp:
                    model.require_backward_grad_sync = last  # all-reduce once per minibatch (nanoGPT's trick)
                logits = completion_logits(model, *(x[r] for x in batch), T)  # (n, T, V)
                sel = lambda x: None if x is None else x[r]  # noqa: E731
                if use_kernel:
                    from kernels import fused_grpo_token_loss
                    is_weight = None
                    if args.tis_cap > 0:
                        is_weight = torch.exp(old_logps[r] - sampling_logps[r]).clamp(max=args.tis_cap)
                    per_token, logps, stats = fused_grpo_token_loss(
                        logits, completion_ids[r], advantages[r], completion_mask[r], sel(old_logps), sel(ref_logps),
                        temperature=args.temperature, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
                        beta=args.beta, entropy_coef=entropy_coef, is_weight=is_weight)
                    loss = reduce_loss(per_token, completion_mask[r], args.loss_type, num_items, args.max_new_tokens)
                    m = completion_mask[r]
                    metrics = {k: ((v.float() * m).sum() / m.sum().clamp(min=1)).item() for k, v in stats.items()}
                else:
                    logps = selective_log_softmax(logits, completion_ids[r], args.temperature)  # (n, T)
                    entropies = entropy_from_logits(logits, args.temperature) if entropy_coef else None  # (n, T)
                    loss, metrics = grpo_loss(
                        logps, sel(old_logps), sel(ref_logps), advantages[r], completion_mask[r],
                        loss_type=args.loss_type, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
                        beta=args.beta, num_items=num_items, max_completion_length=args.max_new_tokens,
                        importance_sampling_level=args.importance_sampling_level, entropies=entropies,
                        entropy_coef=entropy_coef, sampling_logps=sel(sampling_logps), tis_cap=args.tis_cap or None)
                # a micro-batch's share of the minibatch loss (dapo is already normalised by num_items)
                n_rows, n_mb = r.stop - r.start, mb_rows.stop - mb_rows.start
                share = {"grpo": n_rows / n_mb, "dr_grpo": n_rows / n_mb, "dapo": 1.0,
                         "bnpo": (completion_mask[r].sum() / mb_tokens.clamp(min=1)).item()}[args.loss_type]
                (loss * share).backward()
                step_metrics.append(dict(metrics, loss=loss.item()))
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            opt_step += 1
    times["update"] = time.time() - t0

    # 4) push the new weights into the rollout engine
    sync = engine.sync_weights(model)
    times["sync"] = sync["seconds"]

    # 5) log: one line per step, one JSON record per step
    lengths = completion_mask.sum(1)  # (N,)
    record = dict(step=step, **{k: round(v, 4) for k, v in reward_stats.items()},
                  loss=sum(m["loss"] for m in step_metrics) / len(step_metrics),
                  **{k: sum(m[k] for m in step_metrics) / len(step_metrics) for k in step_metrics[0] if k != "loss"},
                  adv_abs_mean=advantages.abs().mean().item(), grad_norm=grad_norm.item(),
                  sampled_entropy=-(rollout.sampling_logps.to(device) * completion_mask).sum().item() / completion_mask.sum().item(),
                  len_mean=lengths.mean().item(), len_min=lengths.min().item(), len_max=lengths.max().item(),
                  truncated=1 - rollout.is_finished.float().mean().item(), lr=lr_at(opt_step - 1, opt_steps_total),
                  **{f"time_{k}": v for k, v in times.items()}, tokens_per_s=lengths.sum().item() * world / times["rollout"],
                  elapsed=time.time() - t_start)
    if step % max(args.eval_every, 1) == 0 and args.eval_every or step == args.steps:
        record["eval_greedy"], record["eval_sampled"] = evaluate()
        print0(f"step {step}: held-out accuracy greedy {record['eval_greedy']:.3f} "
               f"sampled {record['eval_sampled']:.3f} ({record['elapsed']:.0f}s)")
    if master:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}")
    history.append(record)

# -----------------------------------------------------------------------------
# Save the final policy (loadable by transformers and vLLM) and clean up
if master:
    save_dir = os.path.join(args.out_dir, "model")
    raw_model.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    print0(f"saved {save_dir}; held-out accuracy {history[0]['eval_greedy']:.3f} -> {history[-1]['eval_greedy']:.3f} "
           f"(greedy) in {time.time() - t_start:.0f}s")
    metrics_file.close()
if hasattr(engine, "close"):
    engine.close()  # before destroy_process_group: vLLM's shutdown still uses the group
if ddp and dist.is_initialized():
    dist.destroy_process_group()
