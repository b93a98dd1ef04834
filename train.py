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

Simplifications (each is a choice, not an accident):
1. Rollouts run in the training process (vLLM colocated, or HF generate). Each rank samples its own share
   of prompts and the G completions of a prompt stay on one rank. Rewards are all-gathered (they are tiny)
   so that advantages, "batch" scaling and the logged numbers are over the whole batch.
2. old_logps are recomputed by the trainer only when the update can go off-policy (mu > 1, several
   minibatches, or truncated importance sampling); otherwise the ratio is exactly 1 and only its gradient
   matters (then clipping never fires, as in nanochat's chat_rl.py).
3. The reference model (beta > 0) is the initial policy, frozen. The LR schedule is linear warmup then
   cosine to lr/10 over all optimizer steps.
4. A checkpoint holds everything a bit-exact resume needs: weights, optimizer, every RNG state per rank
   and the step (the data order is a pure function of seed and step).
"""
import argparse
import dataclasses
import glob
import json
import math
import os
import random
import shutil
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch/vLLM import: vLLM forces 1 thread otherwise
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # keep vLLM's engine core in this process
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every prefix-cache reset at INFO

import datasets
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils.logging import disable_progress_bar

import task
from advantage import compute_advantages
from loss import entropy_from_logits, grpo_loss, reduce_loss, selective_log_softmax
from reward import compute_rewards, get_reward_funcs
from rollout import make_engine

disable_progress_bar()  # save_pretrained's shard bars would break the step bar
datasets.disable_progress_bars()

# -----------------------------------------------------------------------------
parser = argparse.ArgumentParser(description="GRPO trainer (see the docstring at the top of train.py)")
# Model and data (defaults marked "task default" depend on whether the built-in task or --model is used)
parser.add_argument("--model", default=None, help="hub id or local dir; default: a tiny Qwen2 built from a config")
parser.add_argument("--dataset", default=None, help="hub id or .json/.jsonl/.csv/.parquet file; default: built-in task")
parser.add_argument("--dataset-config", default=None)
parser.add_argument("--split", default="train")
parser.add_argument("--eval-split", default="test", help="held-out split (local files: e.g. --split 'train[50:]' --eval-split 'train[:50]')")
parser.add_argument("--prompt-column", default="prompt")
parser.add_argument("--solution-column", default="solution")
parser.add_argument("--system-prompt", default=None, help="default: task.DEFAULT_SYSTEM_PROMPT (R1's); '' for none")
parser.add_argument("--task-digits", type=int, default=3, help="built-in task: digits per prompt")
# Rollouts
parser.add_argument("--G", type=int, default=8, help="completions per prompt (group size)")
parser.add_argument("--prompts-per-step", type=int, default=32, help="prompts per step, all ranks together")
parser.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are dropped (with a warning)")
parser.add_argument("--max-new-tokens", type=int, default=None, help="completion limit (task default: digits+1 / 512)")
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--top-p", type=float, default=1.0)
parser.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"], help="auto: vLLM when installed")
parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM memory fraction (of the GPU / NUMA RAM)")
parser.add_argument("--vllm-tp", type=int, default=1, help="colocated vLLM: tensor-parallel over this many ranks")
parser.add_argument("--vllm-mode", default="colocate", choices=["colocate", "server"], help="server: see --vllm-url")
parser.add_argument("--vllm-url", default=None, help="server mode: http://HOST:PORT of `python rollout.py serve`")
# Rewards
parser.add_argument("--rewards", nargs="+", default=None, help="built-in names, dotted paths or reward-model dirs")
parser.add_argument("--reward-weights", type=float, nargs="+", default=None, help="one weight per reward")
parser.add_argument("--scale-rewards", default="group", choices=["group", "batch", "none"])
# Optimization
parser.add_argument("--steps", type=int, default=700, help="GRPO steps (one rollout batch each)")
parser.add_argument("--lr", type=float, default=None, help="task default: 3e-4 tiny model / 1e-6 --model")
parser.add_argument("--warmup-steps", type=int, default=10)
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
parser.add_argument("--entropy-coef", type=float, default=None, help="entropy bonus (task default: 0.1 / 0)")
parser.add_argument("--tis-cap", type=float, default=0.0, help="truncated IS cap vs the sampler's logps (0: off)")
parser.add_argument("--loss-impl", default="auto", choices=["auto", "triton", "torch"], help="auto: Triton on CUDA")
# Evaluation, checkpoints, logging, runtime
parser.add_argument("--eval-every", type=int, default=50, help="held-out evaluation every N steps (0: end only)")
parser.add_argument("--eval-size", type=int, default=500, help="held-out prompts evaluated")
parser.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (and at the end)")
parser.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
parser.add_argument("--resume", default="auto", choices=["auto", "yes", "no"], help="auto: if out-dir has one")
parser.add_argument("--out-dir", default="out", help="metrics.jsonl, metrics.png, checkpoints, final model")
parser.add_argument("--wandb", default=None, help="also log to this wandb project")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (1 is fastest on small CPUs)")
parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="auto: bf16 on CUDA")
parser.add_argument("--fsdp", action="store_true", help="shard the policy (and reference) with FSDP2, per decoder layer")
args = parser.parse_args()

# -----------------------------------------------------------------------------
# Validate arguments before any heavy work: one clear line each, the same verdict on every rank
builtin_task = args.dataset is None
tiny = args.model is None
lr = args.lr if args.lr is not None else (3e-4 if tiny else 1e-6)
max_new_tokens = args.max_new_tokens if args.max_new_tokens is not None else (
    args.task_digits + 1 if builtin_task else 512)  # the built-in task's answer, then EOS
entropy_coef = args.entropy_coef if args.entropy_coef is not None else (0.1 if builtin_task else 0.0)
world = int(os.environ.get("WORLD_SIZE", 1))
rank = int(os.environ.get("RANK", 0))
master = rank == 0


def print0(*a, **kw):
    if master:
        print(*a, **kw, flush=True)


def fail(msg, everywhere=True):
    """Exit non-zero with one line that says what to change (printed once, or by the rank that hit it)."""
    if master or not everywhere:
        print(f"error{'' if everywhere else f' (rank {rank})'}: {msg}", flush=True)
    raise SystemExit(2)


checks = [
    (args.G >= 2, f"--G must be >= 2 (a group needs two completions to compare), got {args.G}"),
    (args.prompts_per_step >= world, f"--prompts-per-step {args.prompts_per_step} < {world} ranks: every rank needs a prompt"),
    (args.prompts_per_step % world == 0, f"--prompts-per-step {args.prompts_per_step} must be divisible by the {world} ranks"),
    (args.steps >= 1, f"--steps must be >= 1, got {args.steps}"),
    (args.num_iterations >= 1, f"--num-iterations (mu) must be >= 1, got {args.num_iterations}"),
    (max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {max_new_tokens}"),
    (args.max_prompt_len >= 1, f"--max-prompt-len must be >= 1, got {args.max_prompt_len}"),
    (args.temperature > 0, f"--temperature must be > 0 for GRPO sampling (greedy completions never differ), got {args.temperature}"),
    (0 < args.top_p <= 1, f"--top-p must be in (0, 1], got {args.top_p}"),
    (lr > 0, f"--lr must be > 0, got {lr}"),
    (args.epsilon_low >= 0 and args.epsilon_high >= 0, f"--epsilon-low/--epsilon-high must be >= 0, got {args.epsilon_low}/{args.epsilon_high}"),
    (args.beta >= 0, f"--beta must be >= 0, got {args.beta}"),
    (args.tis_cap >= 0, f"--tis-cap must be >= 0 (0 = off), got {args.tis_cap}"),
    (args.minibatch_size >= 0 and args.micro_batch_size >= 0, "--minibatch-size and --micro-batch-size must be >= 0"),
    (args.save_every >= 1 and args.keep_last >= 1, "--save-every and --keep-last must be >= 1"),
    (args.eval_size >= world, f"--eval-size must be >= the {world} ranks (each evaluates a share), got {args.eval_size}"),
    (not args.fsdp or world > 1, "--fsdp shards over ranks: launch with torchrun --nproc_per_node N (N >= 2)"),
    (args.vllm_mode == "colocate" or args.vllm_url, "--vllm-mode server needs --vllm-url http://HOST:PORT"),
    (args.vllm_tp >= 1 and world % args.vllm_tp == 0, f"--vllm-tp {args.vllm_tp} must divide the {world} ranks"),
    (args.vllm_tp == 1 or (args.engine != "hf" and args.vllm_mode == "colocate"),
     "--vllm-tp applies to the colocated vLLM engine: drop it with --engine hf, or set the server's own TP"),
    (not (args.loss_impl == "triton" and args.importance_sampling_level == "sequence"),
     "--loss-impl triton supports --importance-sampling-level token only; use --loss-impl torch"),
    (args.model is None or os.path.isdir(args.model) or  # else it must look like a hub id: org/name
     (args.model.count("/") == 1 and not args.model.startswith((".", "/", "~")) and not os.path.exists(args.model)),
     f"--model {args.model!r}: no such directory (give a local save_pretrained folder or a hub id like org/name)"),
]
for ok, msg in checks:
    if not ok:
        fail(msg)
n_local = args.prompts_per_step // world * args.G  # completions per rank per step
minibatch = args.minibatch_size or n_local
micro = args.micro_batch_size or minibatch
if n_local % minibatch or minibatch % micro:
    fail(f"--micro-batch-size {micro} must divide --minibatch-size {minibatch}, which must divide the "
         f"{n_local} completions per rank per step (prompts-per-step / ranks * G)")
reward_names = args.rewards or (["exact_match_reward", "task.position_reward"] if builtin_task
                                else ["think_format_reward", "accuracy_reward"])
reward_weights = args.reward_weights or ([1.0, 0.5] if builtin_task else [0.1, 1.0])
if args.rewards and not args.reward_weights:
    reward_weights = [1.0] * len(reward_names)
if len(reward_weights) != len(reward_names):
    fail(f"--reward-weights has {len(reward_weights)} values for {len(reward_names)} --rewards: give one per reward")
try:
    reward_funcs = get_reward_funcs(reward_names)
except ValueError as e:
    fail(str(e))
eval_func = get_reward_funcs(["exact_match_reward" if builtin_task else "accuracy_reward"])[0]
try:  # the out dir must be writable before hours of rollouts go into it
    os.makedirs(args.out_dir, exist_ok=True)
    open(os.path.join(args.out_dir, f".write_test_{rank}"), "w").close()
    os.remove(os.path.join(args.out_dir, f".write_test_{rank}"))
except OSError as e:
    fail(f"--out-dir {args.out_dir!r} is not writable ({e.strerror}): choose another --out-dir")
if args.wandb:
    try:
        import wandb
    except ImportError:
        fail("--wandb needs the wandb package: pip install wandb")

# -----------------------------------------------------------------------------
# Setup: distributed, data, model, reference, optimizer, rollout engine, checkpoint to resume from
ddp = world > 1
device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
if ddp:
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
if device.type == "cuda":
    torch.cuda.set_device(device)
torch.set_num_threads(args.threads)
dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
         "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
use_kernel = args.loss_impl == "triton" or (args.loss_impl == "auto" and device.type == "cuda"
                                            and args.importance_sampling_level == "token")
ckpt_root = os.path.join(args.out_dir, "checkpoints")
run_config = {k: v for k, v in vars(args).items()
              if k not in ("steps", "eval_every", "eval_size", "save_every", "keep_last", "resume", "out_dir",
                           "wandb", "threads", "engine", "vllm_memory", "vllm_url", "loss_impl", "micro_batch_size")}
run_config["world_size"] = world


def all_ranks_ok(ok):
    """True iff every rank is ok: a rank that hit an error must not leave the others waiting in a collective."""
    if not ddp:
        return ok
    flag = torch.tensor([int(ok)], device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def barrier():
    if ddp:
        dist.barrier()


checkpoints = sorted(glob.glob(os.path.join(ckpt_root, "step_*[0-9]")))  # ".tmp" = an interrupted write
resume_from = checkpoints[-1] if checkpoints and args.resume != "no" else None
if args.resume == "yes" and resume_from is None:
    fail(f"--resume yes: no checkpoint under {ckpt_root}")
if resume_from:
    saved = torch.load(os.path.join(resume_from, "trainer.pt"), weights_only=False)
    diff = {k: (saved["config"].get(k), v) for k, v in run_config.items() if saved["config"].get(k) != v}
    if diff:
        fail(f"{resume_from} was written by a different run configuration {diff} (saved, now): "
             f"use the same arguments, another --out-dir, or --resume no to start over")

if tiny and not resume_from:  # rank 0 builds and saves the tiny model; every rank and vLLM load it from disk
    model_path = os.path.join(args.out_dir, "init_model")
    if master:
        tokenizer = task.build_tokenizer()
        task.build_tiny_model(tokenizer, seed=args.seed).save_pretrained(model_path)
        tokenizer.save_pretrained(model_path)
    barrier()
else:
    model_path = os.path.join(resume_from, "model") if resume_from else args.model


try:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    context_len = AutoConfig.from_pretrained(model_path).max_position_embeddings
except OSError as e:  # a hub id that is not in the local cache while offline, a folder without a tokenizer, ...
    fail(f"--model {model_path!r}: cannot load its tokenizer ({str(e).splitlines()[0]})")
if builtin_task:
    train_rows, eval_rows = task.make_sort_dataset(args.task_digits, num_test=args.eval_size, seed=args.seed)
    conversational = False
else:
    try:
        load = lambda split: task.load_prompt_dataset(args.dataset, config=args.dataset_config, split=split,  # noqa: E731
                                                      prompt_column=args.prompt_column, solution_column=args.solution_column)
        train_rows, eval_rows = load(args.split), load(args.eval_split)[:args.eval_size]
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    conversational = bool(getattr(tokenizer, "chat_template", None))  # as task.render_prompts decides


def tokenize(rows, what):
    """Render and tokenize prompts; drop (and count) those over --max-prompt-len."""
    questions = [r["prompt"] for r in rows]
    if builtin_task:
        texts = questions
    else:
        texts, _ = task.render_prompts(tokenizer, questions, task.DEFAULT_SYSTEM_PROMPT if args.system_prompt is None
                                       else args.system_prompt)
    ids = task.encode_prompts(tokenizer, texts, conversational)  # (a chat template writes its own BOS)
    keep = [i for i, x in enumerate(ids) if len(x) <= prompt_limit]
    if not keep:
        fail(f"all {len(rows)} {what} prompts are longer than --max-prompt-len {prompt_limit} tokens: raise it "
             f"(the model's context of {context_len} must also hold --max-new-tokens {max_new_tokens})")
    if len(keep) < len(rows):
        print0(f"warning: dropped {len(rows) - len(keep)} of {len(rows)} {what} prompts longer than --max-prompt-len")
    return [rows[i] for i in keep], [ids[i] for i in keep]


prompt_limit = min(args.max_prompt_len, context_len - max_new_tokens)
train_rows, train_ids = tokenize(train_rows, "train")
eval_rows, eval_ids = tokenize(eval_rows, "held-out")
random.seed(args.seed + rank)
np.random.seed(args.seed + rank)
torch.manual_seed(args.seed + rank)


def load_model(path):
    """Full weights on the CPU; with --fsdp each decoder layer is then sharded over the ranks (FSDP2), so only
    this rank's shard moves to the device: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html"""
    m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if args.fsdp:
        for layer in m.model.layers:
            fully_shard(layer)
        fully_shard(m)
    return m.to(device)


raw_model = load_model(model_path)
ref_model = None
if args.beta > 0:  # the reference is the initial policy, frozen (simplification 3)
    ref_model = load_model(os.path.join(args.out_dir, "init_model") if tiny else args.model).eval().requires_grad_(False)
model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None) if ddp and not args.fsdp else raw_model
optimizer = torch.optim.AdamW(raw_model.parameters(), lr=lr, weight_decay=args.weight_decay)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered to full tensors (a collective with FSDP)
tp_group = None
if args.vllm_tp > 1:  # every rank creates every group (torch.distributed's rule), then keeps its own
    tp_group = [dist.new_group(list(range(g, g + args.vllm_tp))) for g in range(0, world, args.vllm_tp)][rank // args.vllm_tp]
try:
    engine = make_engine("server" if args.vllm_mode == "server" else args.engine, url=args.vllm_url,
                         model=raw_model, tokenizer=tokenizer, model_path=model_path,
                         seed=args.seed + rank // args.vllm_tp,  # a tensor-parallel group samples as one engine
                         dtype=str(dtype).removeprefix("torch."), gpu_memory_utilization=args.vllm_memory,
                         max_model_len=prompt_limit + max_new_tokens, tensor_parallel_size=args.vllm_tp)
except ImportError as e:
    fail(f"--engine {args.engine}: vLLM is not installed ({e}); pip install -r requirements-cpu.txt "
         f"(or requirements-gpu.txt), or use --engine hf")
if args.vllm_mode == "server":  # the server may hold other weights (a restart, a resumed run): start in step
    engine.sync_weights(model)
start_step, opt_step = 0, 0
if resume_from:  # RNG states last: engine start-up reseeds torch
    set_optimizer_state_dict(raw_model, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True))
    start_step, opt_step = saved["step"], saved["opt_step"]
    rng = torch.load(os.path.join(resume_from, f"rng_rank{rank}.pt"), weights_only=False)
    random.setstate(rng["python"]), np.random.set_state(rng["numpy"]), torch.set_rng_state(rng["torch"])
    engine.calls = rng["engine_calls"]
    if device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"])
    print0(f"resuming from {resume_from} (step {start_step}); --resume no or another --out-dir starts over")
print0(f"engine {type(engine).__name__}, {world} rank(s), device {device}, loss {'triton' if use_kernel else 'torch'}, "
       f"{sum(p.numel() for p in raw_model.parameters()) / 1e6:.2f}M params, {len(train_rows)} train prompts")
wandb_run = wandb.init(project=args.wandb, config=vars(args)) if args.wandb and master else None


def save_model(path, state_dict):
    raw_model.save_pretrained(path, state_dict=state_dict)  # safetensors: loadable by transformers and vLLM
    tokenizer.save_pretrained(path)


def save_checkpoint(step):
    """Write to a .tmp folder, then rename: a crash mid-write never leaves a half checkpoint as the latest."""
    path = os.path.join(ckpt_root, f"step_{step:06d}")
    if master:
        shutil.rmtree(path + ".tmp", ignore_errors=True)
        os.makedirs(path + ".tmp")
    barrier()
    rng = dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
               cuda=torch.cuda.get_rng_state() if device.type == "cuda" else None,
               engine_calls=engine.calls)  # the engines sample from a stream seeded by (seed, call number)
    torch.save(rng, os.path.join(path + ".tmp", f"rng_rank{rank}.pt"))
    model_state = get_model_state_dict(raw_model, options=FULL)  # every rank: FSDP gathers the shards
    optimizer_state = get_optimizer_state_dict(raw_model, optimizer, options=FULL)
    if master:
        save_model(os.path.join(path + ".tmp", "model"), model_state)
        torch.save(dict(optimizer=optimizer_state, step=step, opt_step=opt_step, config=run_config),
                   os.path.join(path + ".tmp", "trainer.pt"))
    barrier()
    if master:
        os.replace(path + ".tmp", path)
        for old in sorted(glob.glob(os.path.join(ckpt_root, "step_*[0-9]")))[:-args.keep_last]:
            shutil.rmtree(old)


def lr_at(it, total):
    if it < args.warmup_steps:
        return lr * (it + 1) / args.warmup_steps
    progress = (it - args.warmup_steps) / max(1, total - args.warmup_steps)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch_indices(step):
    """This rank's prompt indices for a step: shuffled once per epoch by the seed (same order on every rank)."""
    per_rank = args.prompts_per_step // world
    epoch, pos = divmod(step * args.prompts_per_step, len(train_rows))
    order = list(range(len(train_rows)))
    random.Random(args.seed * 1000 + epoch).shuffle(order)
    return [order[(pos + rank * per_rank + i) % len(order)] for i in range(per_rank)]


def sequence_batch(prompt_ids, completion_ids):
    """Left-pad prompts to a common length P and append the completions: (B, P+T) ids, mask, positions."""
    P, pad = max(len(p) for p in prompt_ids), tokenizer.pad_token_id
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
    return selective_log_softmax(completion_logits(m, *batch, completion_ids.shape[1]), completion_ids,
                                 args.temperature)  # (B, T)


def as_completions(texts):  # rewards see completions in the prompts' form
    return [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts


def score(funcs, rows, rollout):
    """Rewards (N, F) of a rollout, NaN where a function had no opinion. Errors stop every rank."""
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    ids = [c[: int(m.sum())].tolist() for c, m in zip(rollout.completion_ids, rollout.completion_mask)]
    try:
        rewards, error = compute_rewards(funcs, [r["prompt"] for r in rows], as_completions(rollout.texts),
                                         completion_ids=ids, **columns), None
    except (ValueError, RuntimeError, TypeError) as e:
        rewards, error = None, e
    if not all_ranks_ok(error is None):
        fail(str(error) if error else "another rank's reward function failed (see its message)", everywhere=False)
    return rewards


def generate(prompt_ids, G, temperature):
    """G completions per prompt. Under --vllm-tp the ranks of a group drive one engine together, so each passes
    the whole group's prompts (the same call on every member) and keeps its own slice of the completions."""
    if tp_group is None:
        return engine.generate(prompt_ids, G, max_new_tokens, temperature=temperature, top_p=args.top_p)
    everyone = [None] * args.vllm_tp
    dist.all_gather_object(everyone, prompt_ids, group=tp_group)
    out = engine.generate(sum(everyone, []), G, max_new_tokens, temperature=temperature, top_p=args.top_p)
    start = sum(map(len, everyone[:rank % args.vllm_tp])) * G
    mine = slice(start, start + len(prompt_ids) * G)
    return dataclasses.replace(out, **{f.name: getattr(out, f.name)[mine] for f in dataclasses.fields(out)})


@torch.no_grad()
def evaluate():
    """Held-out accuracy, greedy (temperature 0) and sampled, over all ranks."""
    rows, ids = eval_rows[rank::world], eval_ids[rank::world]
    totals = []
    for temperature in (0.0, args.temperature):
        out = generate(ids, 1, temperature)
        totals.append(torch.nan_to_num(score([eval_func], rows, out)[:, 0]).sum())
    totals = torch.stack(totals + [torch.tensor(float(len(rows)))]).to(device)  # (correct greedy, sampled, count)
    if ddp:
        dist.all_reduce(totals)
    return dict(eval_greedy=(totals[0] / totals[2]).item(), eval_sampled=(totals[1] / totals[2]).item())


# -----------------------------------------------------------------------------
# The GRPO loop
metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
if master:  # on resume keep the records up to the checkpoint, drop those of the lost steps
    kept = [l for l in open(metrics_path)] if resume_from and os.path.exists(metrics_path) else []
    kept = [l for l in kept if json.loads(l)["step"] <= start_step]
    metrics_file = open(metrics_path, "w")
    metrics_file.writelines(kept)
if not resume_from:
    record = dict(step=0, **evaluate())
    print0(f"step 0: held-out accuracy greedy {record['eval_greedy']:.3f} sampled {record['eval_sampled']:.3f}")
    if master:
        metrics_file.write(json.dumps(record) + "\n")
opt_steps_total = args.steps * args.num_iterations * (n_local // minibatch)
t_start = time.time()
for step in (bar := tqdm(range(start_step + 1, args.steps + 1), initial=start_step, total=args.steps,
                         disable=not master, dynamic_ncols=True)):
    times = {}
    # 1) sample G completions for each of this rank's prompts
    t0 = time.time()
    idx = batch_indices(step - 1)
    rows = [train_rows[i] for i in idx for _ in range(args.G)]  # (N,) the dataset row of each completion
    rollout = generate([train_ids[i] for i in idx], args.G, args.temperature)
    completion_ids = rollout.completion_ids.to(device)  # (N, T)
    completion_mask = rollout.completion_mask.to(device).float()  # (N, T)
    N, T = completion_ids.shape
    times["rollout"] = time.time() - t0

    # 2) rewards (N, F), gathered from every rank -> group-relative advantages (N,)
    t0 = time.time()
    rewards = score(reward_funcs, rows, rollout).to(device)  # (N, F)
    if ddp:
        gathered = [torch.empty_like(rewards) for _ in range(world)]
        dist.all_gather(gathered, rewards)
        rewards = torch.cat(gathered)  # (world*N, F)
    advantages, reward_stats = compute_advantages(rewards.cpu(), reward_weights, args.G, args.scale_rewards)
    advantages = advantages[rank * N:(rank + 1) * N].to(device)  # (N,) this rank's slice
    for f, name in enumerate(reward_names):  # "reward/0" -> "reward/exact_match_reward"
        reward_stats[f"reward/{getattr(reward_funcs[f], '__name__', name)}"] = reward_stats.pop(f"reward/{f}")
    times["reward"] = time.time() - t0

    # 3) mu passes of minibatch updates
    t0 = time.time()
    batch = sequence_batch(rollout.prompt_ids, rollout.completion_ids)
    off_policy = args.num_iterations > 1 or minibatch < N or args.tis_cap > 0
    model.eval()  # no dropout: the ratio must compare the same function
    old_logps = per_token_logps(raw_model, batch, completion_ids) if off_policy else None  # (N, T)
    ref_logps = per_token_logps(ref_model, batch, completion_ids) if ref_model is not None else None  # (N, T)
    sampling_logps = rollout.sampling_logps.to(device)  # (N, T)
    step_metrics = []
    for _ in range(args.num_iterations):
        for mb in range(0, N, minibatch):
            for g in optimizer.param_groups:
                g["lr"] = lr_at(opt_step, opt_steps_total)
            mb_tokens = completion_mask[mb:mb + minibatch].sum()
            num_items = None
            if args.loss_type == "dapo":  # tokens of the minibatch on all ranks / ranks, as DDP averages grads
                num_items = mb_tokens.clone()
                if ddp:
                    dist.all_reduce(num_items)
                num_items = num_items / world
            for mc in range(mb, mb + minibatch, micro):
                r = slice(mc, mc + micro)
                sel = lambda x: None if x is None else x[r]  # noqa: E731
                last_micro = mc + micro == mb + minibatch  # reduce gradients once per minibatch (nanoGPT's trick)
                if args.fsdp:
                    raw_model.set_requires_gradient_sync(last_micro)
                elif ddp:
                    model.require_backward_grad_sync = last_micro
                logits = completion_logits(model, *(x[r] for x in batch), T)  # (n, T, V)
                if use_kernel:
                    from kernels import fused_grpo_token_loss
                    is_weight = None
                    if args.tis_cap > 0:
                        is_weight = torch.exp(old_logps[r] - sampling_logps[r]).clamp(max=args.tis_cap)
                    per_token, _, stats = fused_grpo_token_loss(
                        logits, completion_ids[r], advantages[r], completion_mask[r], sel(old_logps), sel(ref_logps),
                        temperature=args.temperature, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
                        beta=args.beta, entropy_coef=entropy_coef, is_weight=is_weight)
                    loss = reduce_loss(per_token, completion_mask[r], args.loss_type, num_items, max_new_tokens)
                    m = completion_mask[r]
                    metrics = {k: ((v.float() * m).sum() / m.sum().clamp(min=1)).item() for k, v in stats.items()}
                else:
                    logps = selective_log_softmax(logits, completion_ids[r], args.temperature)  # (n, T)
                    entropies = entropy_from_logits(logits, args.temperature) if entropy_coef else None  # (n, T)
                    loss, metrics = grpo_loss(
                        logps, sel(old_logps), sel(ref_logps), advantages[r], completion_mask[r],
                        loss_type=args.loss_type, epsilon_low=args.epsilon_low, epsilon_high=args.epsilon_high,
                        beta=args.beta, num_items=num_items, max_completion_length=max_new_tokens,
                        importance_sampling_level=args.importance_sampling_level, entropies=entropies,
                        entropy_coef=entropy_coef, sampling_logps=sel(sampling_logps) if args.tis_cap else None,
                        tis_cap=args.tis_cap or None)
                # this micro-batch's share of the minibatch loss (dapo is already normalised by num_items)
                share = {"grpo": micro / minibatch, "dr_grpo": micro / minibatch, "dapo": 1.0,
                         "bnpo": (completion_mask[r].sum() / mb_tokens.clamp(min=1)).item()}[args.loss_type]
                (loss * share).backward()
                step_metrics.append(dict(metrics, loss=loss.item()))
            grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.grad_clip or float("inf"))
            grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm
            if not torch.isfinite(grad_norm):  # same value on every rank (gradients are all-reduced)
                last = sorted(glob.glob(os.path.join(ckpt_root, "step_*[0-9]")))
                fail(f"non-finite loss or gradient at step {step} (grad norm {grad_norm.item()}); weights left "
                     f"unchanged; last good checkpoint: {last[-1] if last else 'none'}. Lower --lr or check rewards")
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            opt_step += 1
    times["update"] = time.time() - t0

    # 4) push the new weights into the rollout engine
    times["sync"] = engine.sync_weights(model)["seconds"]

    # 5) log: one JSON record per step (rank 0), evaluate and checkpoint on schedule
    lengths = completion_mask.sum(1)  # (N,)
    mean = lambda key: sum(m[key] for m in step_metrics) / len(step_metrics)  # noqa: E731
    record = dict(step=step, **reward_stats, **{k: mean(k) for k in step_metrics[0]},
                  adv_mean=advantages.mean().item(), adv_abs_mean=advantages.abs().mean().item(),
                  grad_norm=grad_norm.item(), lr=lr_at(opt_step - 1, opt_steps_total),
                  sampled_entropy=-(sampling_logps * completion_mask).sum().item() / completion_mask.sum().item(),
                  len_mean=lengths.mean().item(), len_min=lengths.min().item(), len_max=lengths.max().item(),
                  truncated=1 - rollout.is_finished.float().mean().item(),
                  **{f"time_{k}": v for k, v in times.items()},
                  tokens_per_s=lengths.sum().item() * world / times["rollout"], elapsed=time.time() - t_start)
    if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
        record.update(evaluate())
    if master:
        metrics_file.write(json.dumps(record) + "\n")
        metrics_file.flush()
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", loss=f"{record['loss']:.4f}")
        line = (f"step {step} | reward {record['reward_mean']:.3f} | loss {record['loss']:.4f} | "
                + (f"kl {record['kl']:.4f} | " if "kl" in record else "") + f"len {record['len_mean']:.1f} | "
                + " ".join(f"{k} {times[k]:.2f}s" for k in times)
                + (f" | held-out greedy {record['eval_greedy']:.3f} sampled {record['eval_sampled']:.3f}"
                   if "eval_greedy" in record else ""))
        tqdm.write(line)  # above the bar: one line per step
        if wandb_run:
            wandb_run.log(record, step=step)
    if step % args.save_every == 0 or step == args.steps:
        save_checkpoint(step)

# -----------------------------------------------------------------------------
# The final policy (loadable by transformers and servable by vLLM), the plot, clean-up
final_state = get_model_state_dict(raw_model, options=FULL)
if master:
    metrics_file.close()
    save_dir = os.path.join(args.out_dir, "model")
    save_model(save_dir, final_state)
    evals = [r for r in map(json.loads, open(metrics_path)) if "eval_greedy" in r]
    if evals:
        print0(f"saved {save_dir}; held-out accuracy (greedy) {evals[0]['eval_greedy']:.3f} at step "
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
