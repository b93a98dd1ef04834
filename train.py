"""
GRPO (Group Relative Policy Optimization, DeepSeekMath arXiv:2402.03300, as used for DeepSeek-R1):
for each prompt sample G completions, score them with rule rewards, and push up the log-probability of
completions that beat their group's mean, with a PPO-style clipped ratio and an optional KL to a reference:

    A_i = (r_i - mean(r_group)) / std(r_group)
    L   = -mean_t min(rho_t A_i, clip(rho_t, 1-eps_low, 1+eps_high) A_i) + beta * KL_k3(pi || pi_ref)

Run (no GPU, no network: builds a tiny model and the built-in "sort the digits" task, see task.py):
    python train.py                                            # 1 process
    torchrun --standalone --nproc_per_node 2 train.py --G 8    # 2 ranks (gloo on CPU, nccl on GPUs)
    python plot.py out                                         # re-draw out/metrics.png
A hub model on GSM8K, 8 GPUs (README has the full recipe):
    torchrun --nproc_per_node 8 train.py --model Qwen/Qwen2.5-1.5B-Instruct --dataset openai/gsm8k \\
        --dataset-config main --prompt-column question --solution-column answer

The stages: rollout.py (sample) -> reward.py (score) -> advantage.py (group z-score) -> loss.py (PPO-clip loss,
kernels/ on GPUs) -> rollout.py (sync weights). checkpoint.py saves and resumes; common.py holds small helpers.

Simplifications (each is a choice, not an accident):
1. Rollouts run in the training process (vLLM colocated, or rollout.HFEngine). Each rank samples its own share
   of prompts and the G completions of a prompt stay on one rank. Rewards are all-gathered (they are tiny)
   so that advantages, "batch" scaling and the logged numbers are over the whole batch.
2. old_logps are recomputed by the trainer only when the update can go off-policy (mu > 1, several
   minibatches, or truncated importance sampling); otherwise the ratio is exactly 1 and only its gradient
   matters (then clipping never fires, as in nanochat's chat_rl.py). --async: against the sampler's (README).
3. The reference model (beta > 0) is the initial policy, frozen (with --lora-rank: the policy, adapters off). The
   LR schedule is linear warmup then cosine to lr/10 over all optimizer steps.
4. A checkpoint holds everything a bit-exact resume needs (checkpoint.py); the data order is a pure function
   of seed and prompts consumed (one --prompts-per-step a round: one round a step, more with --dynamic-sampling).
5. Mixed precision: --dtype is the compute dtype (autocast); the policy and AdamW stay fp32, the reference and the
   rollout engine hold --dtype weights (common.py). Old and reference log-probs run micro-batch by micro-batch.
"""
import argparse
import json
import os
import time
t_launch = time.time()  # start-up phases are timed from here: see the "start-up" line

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch/vLLM import: vLLM forces 1 thread otherwise
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep vLLM's engine core in this process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM's ~20 start-up warnings ask nothing of the user

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

import checkpoint
import task
from advantage import SCALE_REWARDS, compute_advantages
from common import (barrier, check_flags, completion_logits, cosine_lr, ddp, dynamic_sampling, fail,
                    in_background, load_model, mark, master, number, print0, prompt_batch, rank, require,
                    result_everywhere, score, seed_all, sequence_logps, setup, startup_line, step_line, step_metrics,
                    world, wrap_ddp)
from lora import LORA_TARGETS, load_reference, lora_config
from loss import IS_LEVELS, LOSS_TYPES, minibatch_tokens, policy_loss, resolve_impl
from reward import get_reward_funcs, pass_at_k
from rollout import make_engine, pad_id

# -----------------------------------------------------------------------------
parser = argparse.ArgumentParser(description="GRPO trainer (see the docstring at the top of train.py)")
parser.error = fail  # one line ("error: argument --G: must be >= 2 ..."), not the 50-flag usage block
add, int_, pos = parser.add_argument, number(int, 1), number(float, 0, low_open=True)
# Model and data (a default of None is the task's: task.defaults, for the built-in task or a --dataset)
add("--model", default=None, help="hub id or local dir; default: a tiny Qwen2 built from a config")
add("--dataset", default=None, help="hub id or .json/.jsonl/.csv/.parquet file; default: built-in task")
add("--dataset-config", default=None)
add("--split", default="train")
add("--eval-split", default="test", help="held-out split (local files: e.g. --split 'train[50:]' --eval-split 'train[:50]')")
add("--prompt-column", default="prompt")
add("--solution-column", default="solution")
add("--system-prompt", default=None, help="default: task.DEFAULT_SYSTEM_PROMPT (R1's); '' for none")
add("--task-digits", type=number(int, 1, 6), default=3, help="built-in task: digits per prompt")
# Rollouts
add("--G", type=number(int, 2, why=" (a group needs two completions to compare)"), default=8, help="completions per prompt")
add("--prompts-per-step", type=int_, default=32, help="prompts per step, all ranks together")
add("--dynamic-sampling", type=number(int, 0), default=0, metavar="ROUNDS",
    help="DAPO: replace groups of equal rewards by new prompts, at most ROUNDS rounds a step (0: off)")
add("--max-prompt-len", type=int_, default=512, help="longer prompts are dropped (with a warning)")
add("--max-new-tokens", type=int_, default=None, help="completion limit (task default: digits+1 / 512)")
add("--temperature", type=number(float, 0, low_open=True, why=" for GRPO sampling (greedy completions never differ)"), default=1.0)
add("--top-p", type=number(float, 0, 1, low_open=True), default=1.0)
add("--engine", default="auto", choices=["auto", "vllm", "hf"], help="auto: vLLM when installed")
add("--vllm-memory", type=number(float, 0, 1, low_open=True), default=0.3, help="vLLM memory fraction (of the GPU / NUMA RAM)")
add("--vllm-tp", type=int_, default=1, help="colocated vLLM: tensor-parallel over this many ranks")
add("--vllm-mode", default="colocate", choices=["colocate", "server"], help="server: see --vllm-url")
add("--vllm-url", default=None, help="server mode: http://HOST:PORT of `python server.py`")
add("--async", dest="async_", action="store_true", help="server mode: sample the next batch during this update")
# Rewards
add("--rewards", nargs="+", default=None, help="built-in names, dotted paths or reward-model dirs")
add("--reward-weights", type=number(float), nargs="+", default=None, help="one weight per reward")
add("--scale-rewards", default="group", choices=SCALE_REWARDS)
add("--eval-reward", default=None, help="held-out accuracy's reward, like --rewards (task default: exact match / accuracy)")
add("--reward-timeout", type=number(float, 0, 1800, low_open=True), default=300,  # under gloo's 1800 s, NCCL's 600
    help="seconds a reward function may take on a batch; more ends the run, naming it")
# Optimization
add("--steps", type=int_, default=700, help="GRPO steps (one rollout batch each)")
add("--lr", type=pos, default=None, help="task default: 3e-4 tiny model / 1e-6 --model")
add("--warmup-steps", type=number(int, 0), default=10)
add("--weight-decay", type=number(float, 0), default=0.0)
add("--grad-clip", type=number(float, 0), default=1.0, help="max grad norm (0: off)")
add("--num-iterations", type=int_, default=1, help="mu: passes over each rollout batch")
add("--minibatch-size", type=number(int, 0), default=0, help="completions per optimizer step per rank (0: all)")
add("--micro-batch-size", type=number(int, 0), default=0, help="completions per forward/backward (0: minibatch)")
add("--lora-rank", type=number(int, 0), default=0, help="train LoRA adapters of this rank, base frozen (0: full)")
add("--lora-alpha", type=pos, default=None, help="LoRA scale = alpha / rank (default alpha: 2 x rank)")
add("--lora-dropout", type=number(float, 0, 1), default=0.0, help="dropout on the adapters' input, in the update")
add("--lora-targets", nargs="+", default=LORA_TARGETS, help="the modules that get adapters")
# Loss
add("--loss-type", default="grpo", choices=LOSS_TYPES)
add("--beta", type=number(float, 0), default=0.0, help="KL coefficient (0: no reference model)")
add("--epsilon-low", type=number(float, 0), default=0.2)
add("--epsilon-high", type=number(float, 0), default=0.2)
add("--importance-sampling-level", default="token", choices=IS_LEVELS)
add("--entropy-coef", type=number(float, 0), default=None, help="entropy bonus (task default: 0.1 / 0)")
add("--tis-cap", type=number(float, 0), default=0.0, help="truncated IS cap vs the sampler's logps (0: off)")
add("--loss-impl", default="auto", choices=["auto", "triton", "torch"], help="auto: Triton on CUDA")
# Evaluation, checkpoints, logging, runtime
add("--eval-every", type=number(int, 0), default=50, help="held-out evaluation every N steps (0: end only)")
add("--eval-size", type=int_, default=500, help="held-out prompts evaluated")
add("--eval-samples", type=number(int, 0), default=0, help="sampled completions per held-out prompt: pass@k (0: 1, off)")
add("--eval-k", type=int_, nargs="+", default=None, help="pass@k for each k <= --eval-samples n (default: 1 and n)")
add("--save-every", type=int_, default=100, help="checkpoint every N steps (and at the end)")
add("--keep-last", type=int_, default=2, help="checkpoints kept")
add("--resume", default="auto", choices=["auto", "yes", "no"], help="auto: continue the out-dir's run if any")
add("--out-dir", default="out", help="metrics.jsonl, metrics.png, checkpoints, final model")
add("--wandb", default=None, help="also log to this wandb project")
add("--seed", type=number(int, 0), default=0)
add("--threads", type=int_, default=1, help="torch CPU threads per rank (1 is fastest on small CPUs)")
add("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="compute dtype, weights stay fp32; auto: bf16 on CUDA")
add("--fsdp", action="store_true", help="shard the policy (and reference) with FSDP2, per decoder layer")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# Validate the rest before any heavy work: one clear line each, the same verdict on every rank
run_config = checkpoint.run_config(args, world)  # before the task defaults fill in: as the user gave them
builtin_task, tiny = args.dataset is None, args.model is None
for k, v in task.defaults(builtin_task, tiny, args.task_digits, args.rewards, args.lora_rank > 0).items():
    if getattr(args, k, None) is None:
        setattr(args, k, v)
check_flags(args)  # the rules between flags (common.py); argparse checked each flag's own range
args.eval_k = sorted(set(args.eval_k or [1, args.eval_samples])) if args.eval_samples else []
n_local = args.prompts_per_step // world * args.G  # completions per rank per step
minibatch = args.minibatch_size or n_local  # completions per optimizer step
micro = args.micro_batch_size or minibatch  # completions per forward/backward
ckpt_root = os.path.join(args.out_dir, "checkpoints")
device, dtype = setup(args.threads, args.dtype)  # the process group first: the out-dir lock's verdict reaches all
try:
    reward_funcs, (eval_func,) = get_reward_funcs(args.rewards), get_reward_funcs([args.eval_reward])
    checkpoint.check_out_dir(args.out_dir)  # one run per out-dir: locked until this run ends (or dies)
    resume_from, saved = checkpoint.resume_point(args.out_dir, args.resume, run_config, log=print0)
except ValueError as e:
    fail(str(e))
wandb = require("wandb", "--wandb needs the wandb package: pip install wandb") if args.wandb else None

# -----------------------------------------------------------------------------
# Setup: data, model, reference, optimizer, rollout engine, the resumed state
loss_impl = resolve_impl(args.loss_impl, device, args.importance_sampling_level)
model_path = (os.path.join(resume_from, "model") if resume_from else
              os.path.join(args.out_dir, "init_model") if tiny else args.model)
if tiny and not resume_from and master:  # rank 0 builds and saves the tiny model; every rank and vLLM load it
    task.save_tiny_model(model_path, seed=args.seed)
barrier()
try:
    tokenizer, context_len = task.load_tokenizer(model_path)
    train_rows, eval_rows = task.load_rows(
        args.dataset, digits=args.task_digits, eval_size=args.eval_size, seed=args.seed, config=args.dataset_config,
        split=args.split, eval_split=args.eval_split, prompt_column=args.prompt_column, solution_column=args.solution_column)
    prompt_limit = task.prompt_limit(args.max_prompt_len, args.max_new_tokens, context_len)
    (train_rows, train_ids, conversational), (eval_rows, eval_ids, _) = (task.prepare_prompts(
        tokenizer, rows, args.system_prompt, prompt_limit, what, raw=builtin_task, log=print0, min_rows=least)
        for rows, what, least in ((train_rows, "train", 1), (eval_rows, "held-out", world)))
    mark("imports, data")
    seed_all(args.seed + rank)
    init_path = os.path.join(args.out_dir, "init_model") if tiny else args.model  # the reference; LoRA's base
    raw_model = load_model(init_path if args.lora_rank else model_path, dtype, device, args.fsdp, lora_config(args))
except (ValueError, FileNotFoundError) as e:
    fail(str(e))
ref_model = None
if args.beta > 0:  # the reference is the initial policy, frozen (simplification 3); LoRA: adapters off, no copy
    ref_model = load_reference(raw_model, init_path, dtype, device, args.fsdp)
model = wrap_ddp(raw_model, device) if ddp and not args.fsdp else raw_model
optimizer = torch.optim.AdamW([p for p in raw_model.parameters() if p.requires_grad], lr=args.lr,
                              weight_decay=args.weight_decay)  # LoRA: the adapters only
mark("models")
try:
    engine = make_engine("server" if args.vllm_mode == "server" else args.engine, url=args.vllm_url,
                         model=raw_model, tokenizer=tokenizer, model_path=model_path,
                         seed=args.seed + rank // args.vllm_tp,  # a tensor-parallel group samples as one engine
                         dtype=str(dtype).removeprefix("torch."), gpu_memory_utilization=args.vllm_memory,
                         max_model_len=prompt_limit + args.max_new_tokens, tensor_parallel_size=args.vllm_tp)
except ImportError as e:
    fail(f"--engine {args.engine}: vLLM is not installed ({e}); pip install -r requirements-cpu.txt, or use --engine hf")
start_step, opt_step, consumed, ahead = 0, 0, 0, None  # consumed: prompts drawn (task.batch_indices); ahead: --async
if resume_from:  # RNG states last: engine start-up reseeds torch
    start_step, opt_step, consumed, ahead = checkpoint.restore(resume_from, saved, raw_model, optimizer, engine, device)
    print0(f"resuming from {resume_from} (step {start_step}); another --out-dir starts a new run")
if args.vllm_mode == "server":  # the server may hold other weights (a restart, a resumed run): start in step
    engine.sync_weights(model, version=start_step)  # the weights after start_step updates; each sync then adds 1
mark("engine")
n_trained = sum(p.numel() for p in optimizer.param_groups[0]["params"])  # LoRA: the adapters'
print0(f"engine {type(engine).__name__}, {world} rank(s), device {device}, loss {loss_impl}, "
       f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M params ({n_trained / 1e6:.3g}M trained), "
       f"{len(train_rows)} train prompts")
wandb_run = wandb.init(project=args.wandb, config=vars(args)) if args.wandb and master else None


def sample(consumed):
    """-> this rank's share of the next prompts (a row per completion), their G completions each, the server's weight
    version (None off server mode), seconds."""
    t0, idx = time.time(), task.batch_indices(len(train_rows), consumed, args.prompts_per_step, rank, world, args.seed)
    rollout = engine.generate([train_ids[i] for i in idx], args.G, args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p)
    return [train_rows[i] for i in idx for _ in range(args.G)], rollout, getattr(engine, "weight_version", None), \
        time.time() - t0


@torch.no_grad()
def evaluate():
    """Held-out accuracy, greedy (temperature 0) and sampled (mean of n = --eval-samples or 1 per prompt), and pass@k
    of those n (reward.pass_at_k: a completion passes when its eval reward is >= 1), over all ranks."""
    rows, ids, n = eval_rows[rank::world], eval_ids[rank::world], args.eval_samples or 1
    def rewards(temperature, g):  # (prompts, g): the eval reward of g completions per prompt
        rollout = engine.generate(ids, g, args.max_new_tokens, temperature=temperature, top_p=args.top_p)
        rewards = score([eval_func], [r for r in rows for _ in range(g)], rollout, conversational, args.reward_timeout)
        return rewards[:, 0].nan_to_num().view(-1, g)
    greedy, sampled = rewards(0.0, 1), rewards(args.temperature, n)
    passes = [sum(pass_at_k(n, int(c), k) for c in (sampled >= 1).sum(1)) for k in args.eval_k]
    totals = torch.tensor([greedy.sum(), sampled.mean(1).sum(), *passes, len(rows)], device=device)  # sums, count
    if ddp:
        dist.all_reduce(totals)
    return dict(eval_greedy=(totals[0] / totals[-1]).item(), eval_sampled=(totals[1] / totals[-1]).item(),
                **{f"pass@{k}": (p / totals[-1]).item() for k, p in zip(args.eval_k, totals[2:])})


# -----------------------------------------------------------------------------
# The GRPO loop
metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
metrics_file = checkpoint.open_metrics(metrics_path, start_step if resume_from else None) if master else None
if not resume_from:
    record = dict(step=0, **evaluate())
    print0(step_line(record))
    if master:
        metrics_file.write(json.dumps(record) + "\n")
    mark("first evaluation")
print0(startup_line(t_launch))
opt_steps_total = args.steps * args.num_iterations * (n_local // minibatch)
t_start = time.time()
for step in (bar := tqdm(range(start_step + 1, args.steps + 1), initial=start_step, total=args.steps,
                         disable=not master, dynamic_ncols=True)):
    times, rounds, batch = dict(rollout=0.0, reward=0.0), [], None
    # 1) sample G completions for each of this rank's next prompts (--async: sampled while the last step trained), and
    #    score them; --dynamic-sampling: drop groups of equal rewards, draw more rounds of prompts until each rank holds
    #    its share of others (DAPO; common.py)
    while batch is None:
        rows, rollout, sampler_version, seconds = ahead or sample(consumed)
        consumed, ahead, t1 = consumed + args.prompts_per_step, None, time.time()
        if args.async_ and step < args.steps:  # --async: ask for the next batch now, and score and train meanwhile
            ahead = in_background(sample, consumed)
        rewards = score(reward_funcs, rows, rollout, conversational, args.reward_timeout)  # (N, F)
        rounds.append((rows, rollout, rewards))
        times["rollout"], times["reward"] = times["rollout"] + seconds, times["reward"] + time.time() - t1
        batch = dynamic_sampling(rounds, args.dynamic_sampling, args.G, args.reward_weights, pad_id(tokenizer))
    (rows, rollout, rewards), sampling_stats = batch
    completion_ids = rollout.completion_ids.to(device)  # (N, T)
    completion_mask = rollout.completion_mask.to(device).float()  # (N, T)
    N, T = completion_ids.shape

    # 2) rewards (N, F), gathered from every rank -> group-relative advantages (N,)
    t0 = time.time()
    rewards = rewards.to(device)  # (N, F)
    if ddp:
        gathered = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(gathered, rewards)
        rewards = torch.cat(gathered)  # (world*N, F)
    advantages, reward_stats = compute_advantages(rewards.cpu(), args.reward_weights, args.G, args.scale_rewards)
    advantages = advantages[rank * N:(rank + 1) * N].to(device)  # (N,) this rank's slice
    for f, fn in enumerate(reward_funcs):  # "reward/0" -> "reward/exact_match_reward"
        reward_stats[f"reward/{getattr(fn, '__name__', args.rewards[f])}"] = reward_stats.pop(f"reward/{f}")
    times["reward"] += time.time() - t0

    # 3) mu passes of minibatch updates
    t0 = time.time()
    prompts = [x.to(device) for x in prompt_batch(rollout.prompt_ids, pad_id(tokenizer))]  # (B, P) x3, (N,): pad, else EOS
    off_policy = args.num_iterations > 1 or minibatch < N or args.tis_cap > 0
    model.eval()  # no dropout: the ratio must compare the same function
    by_micro = dict(temperature=args.temperature, micro=micro, dtype=dtype)  # forwards of micro sequences, as below
    sampling_logps = rollout.sampling_logps.to(device)  # (N, T)
    old_logps = (sampling_logps if args.async_ and not args.tis_cap else  # --async: the behaviour policy's (README)
                 sequence_logps(raw_model, prompts, completion_ids, **by_micro) if off_policy else None)  # (N, T)
    ref_logps = sequence_logps(ref_model, prompts, completion_ids, **by_micro) if ref_model is not None else None  # (N, T)
    micro_metrics, grad_norms = [], []
    for _ in range(args.num_iterations):
        for mb in range(0, N, minibatch):
            for g in optimizer.param_groups:
                g["lr"] = cosine_lr(opt_step, opt_steps_total, args.lr, args.warmup_steps)
            mb_tokens = minibatch_tokens(completion_mask[mb:mb + minibatch])  # all ranks' / ranks: DDP averages
            for mc in range(mb, mb + minibatch, micro):
                r = slice(mc, mc + micro)
                last_micro = mc + micro == mb + minibatch  # reduce gradients once per minibatch (nanoGPT's trick)
                if args.fsdp:
                    raw_model.set_requires_gradient_sync(last_micro)
                elif ddp:
                    model.require_backward_grad_sync = last_micro
                logits = completion_logits(model, prompts, r, completion_ids[r], dtype)  # (n, T, V) in dtype
                loss, metrics = policy_loss(
                    logits, completion_ids[r], advantages[r], completion_mask[r],
                    *(None if x is None else x[r] for x in (old_logps, ref_logps, sampling_logps)),
                    minibatch_size=minibatch, minibatch_tokens=mb_tokens, loss_type=args.loss_type,
                    temperature=args.temperature, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
                    beta=args.beta, entropy_coef=args.entropy_coef, tis_cap=args.tis_cap,
                    importance_sampling_level=args.importance_sampling_level,
                    max_completion_length=args.max_new_tokens, impl=loss_impl)
                loss.backward()
                micro_metrics.append(metrics)
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf"))
            grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
            if not torch.isfinite(grad_norm):  # same value on every rank (gradients are all-reduced)
                last, _ = checkpoint.find(ckpt_root)
                fail(f"non-finite loss or gradient at step {step} (grad norm {grad_norm.item()}); weights left "
                     f"unchanged; last good checkpoint: {last or 'none'}. Lower --lr or check rewards")
            grad_norms.append(grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            opt_step += 1
    times["update"] = time.time() - t0

    # 4) push the new weights into the rollout engine (--async: between generations, once the next batch is in)
    if ahead:
        t0 = time.time()
        ahead, times["wait"] = result_everywhere(ahead), time.time() - t0  # how long the trainer waited for it
    times["sync"] = engine.sync_weights(model)["seconds"]

    # 5) log: one JSON record per step (rank 0), evaluate and checkpoint on schedule
    lengths = completion_mask.sum(1)  # (N,)
    record = dict(step=step, **reward_stats, **sampling_stats, **step_metrics(micro_metrics, grad_norms),  # all ranks
                  adv_mean=advantages.mean().item(), adv_abs_mean=advantages.abs().mean().item(),
                  lr=cosine_lr(opt_step - 1, opt_steps_total, args.lr, args.warmup_steps),
                  sampled_entropy=-(sampling_logps * completion_mask).sum().item() / completion_mask.sum().item(),
                  len_mean=lengths.mean().item(), len_min=lengths.min().item(), len_max=lengths.max().item(),
                  truncated=1 - rollout.is_finished.float().mean().item(),
                  **({} if sampler_version is None else dict(  # server mode: which weights sampled and trained it
                      sampler_version=sampler_version, policy_version=step - 1, staleness=step - 1 - sampler_version)),
                  **({"mem_peak_gb": torch.cuda.max_memory_allocated() / 2**30} if device.type == "cuda" else {}),
                  **{f"time_{k}": v for k, v in times.items()},
                  tokens_per_s=lengths.sum().item() * world / times["rollout"], elapsed=time.time() - t_start)
    if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
        record.update(evaluate())
    if master:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}")
        tqdm.write(step_line(record, times))  # above the bar
        if wandb_run:
            wandb_run.log(record, step=step)
    if step % args.save_every == 0 or step == args.steps:
        checkpoint.save(ckpt_root, step, raw_model, optimizer, engine, tokenizer,
                        dict(step=step, opt_step=opt_step, prompts_consumed=consumed, config=run_config),
                        args.keep_last, device, ahead)

# -----------------------------------------------------------------------------
# The final policy (loadable by transformers and servable by vLLM), the plot, clean-up
final_state = checkpoint.get_model_state_dict(raw_model, options=checkpoint.FULL)
if master:
    metrics_file.close()
    checkpoint.save_model(raw_model, os.path.join(args.out_dir, "model"), final_state, tokenizer)
    evals = [r for r in map(json.loads, open(metrics_path)) if "eval_greedy" in r]
    if evals:
        print0(f"saved {args.out_dir}/model; held-out accuracy (greedy) {evals[0]['eval_greedy']:.3f} at step "
               f"{evals[0]['step']} -> {evals[-1]['eval_greedy']:.3f} at step {evals[-1]['step']}")
    try:
        import plot
        print0(f"plot: {plot.plot_metrics(metrics_path)}")
    except ImportError as e:
        print0(f"no plot ({e}): pip install matplotlib")
barrier()  # rank 0 was saving and plotting: tear down together, or a rank can exit mid-handshake
engine.close()  # before destroy_process_group: vLLM's shutdown uses the group (and may destroy it)
if ddp and dist.is_initialized():
    dist.destroy_process_group()
