"""Small helpers train.py needs and that are not a stage: rank-0 printing, one-line errors that stop every rank
together, flag ranges, the distributed set-up, the model load (FSDP2 / DDP, mixed precision), the model's
forward to completion logits and log-probs, and the step's metrics over micro-batches and ranks.

    rank, world, master, ddp   from torchrun's environment (RANK, WORLD_SIZE); 0, 1, True, False alone
    print0(...)                print on rank 0 only
    fail(msg)                  "error: msg" and exit 2, on every rank (no rank is left waiting in a collective)
    all_ranks_ok(ok)           True iff every rank is ok (a MIN all-reduce)
    number(int, 1)             an argparse type: a finite number in a range, else one clear line
    setup(threads, dtype)      process group, device, threads; under torchrun, stop when the launcher dies

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
import importlib
import logging
import math
import os
import random
import threading
import time
import warnings

import torch
import torch.distributed as dist

from loss import selective_log_softmax

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
    import numpy as np
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(threads, dtype_name):
    """Process group (nccl on GPUs, gloo on CPU), device, torch threads -> (device, compute dtype). Also silences
    the per-shard progress bars of datasets and save_pretrained, which would break the step bar."""
    import datasets
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    datasets.disable_progress_bars()
    # vLLM's noise that asks nothing of the user: a Triton notice it logs before configuring its own logger (Python's
    # last-resort handler prints it), and a deprecation warning from its own import (vLLM 0.32)
    logging.getLogger("vllm").addHandler(logging.NullHandler())
    warnings.filterwarnings("ignore", r"`torch.distributed.reduce_op` is deprecated", FutureWarning)
    watch_launcher()
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


def load_model(path, dtype, device, fsdp=False, lora=None, frozen=False):
    """The trainable policy in fp32 (master weights: see the module docstring), a frozen model (the reference) in
    dtype, eval mode. Full weights on the CPU; with fsdp each decoder layer is then sharded over the ranks (FSDP2),
    so only this rank's shard moves to the device: https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html
    lora (a peft LoraConfig, from lora_config): the policy is the base model in dtype, frozen, with fp32 adapters.
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
    m = add_lora(m, lora) if lora else m.eval().requires_grad_(False) if frozen else m
    return m.to(device)


# -----------------------------------------------------------------------------
# LoRA (--lora-rank, arXiv:2106.09685): W x + scale * B A x, with only A (r, in) and B (out, r) trained and
# scale = alpha / r. B starts at 0, so the policy starts as the base model; the base weights never change.

ADAPTER = "default"  # peft's name for the one adapter we train
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # attention + MLP


def lora_config(args):
    """peft's LoraConfig for train.py's flags (alpha defaults to 2 x rank), or None without --lora-rank."""
    if not args.lora_rank:
        return None
    peft = require("peft", "--lora-rank needs the peft package: pip install peft")
    return peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                           lora_dropout=args.lora_dropout, target_modules=args.lora_targets)


class GradOnlyDropout(torch.nn.Dropout):
    """Dropout that acts only in forwards that build a graph: train.py runs the policy in eval mode (the ratio must
    compare the same function), so peft's nn.Dropout would never fire. This one drops in the update's forward and
    never in old/reference log-probs or generation (all under torch.no_grad)."""

    def forward(self, x):
        return torch.nn.functional.dropout(x, self.p, training=torch.is_grad_enabled())


def add_lora(model, config):
    """The model as a peft PeftModel: adapters on config.target_modules, everything else frozen. ValueError in one
    line when a target names no module of the model."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    try:
        model = get_peft_model(model, config)  # adapters in fp32 even on a bf16 base (autocast_adapter_dtype)
    except ValueError as e:
        targets = " ".join(sorted(config.target_modules))
        raise ValueError(f"--lora-targets {targets}: {str(e).strip().splitlines()[0]}") from None
    for layer in model.modules():
        if isinstance(layer, LoraLayer) and config.lora_dropout > 0:
            layer.lora_dropout[ADAPTER] = GradOnlyDropout(config.lora_dropout)
    return model


def is_lora(model):
    return hasattr(model, "peft_config")  # a peft PeftModel (unwrapped from DDP)


def load_reference(policy, path, dtype, device, fsdp):
    """The frozen reference (beta > 0): the initial model at path, in dtype; with LoRA, no second copy of the weights:
    the policy itself with its adapters off (AdaptersOff)."""
    return AdaptersOff(policy) if is_lora(policy) else load_model(path, dtype, device, fsdp, frozen=True)


class AdaptersOff:
    """The reference with LoRA: the policy's own network with its adapters disabled (peft's disable_adapter), i.e.
    the initial policy (B starts at 0) without a second copy of the weights. Called like a model."""

    def __init__(self, model):
        self.model = model

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


@torch.no_grad()
def sync_parameters(model):
    """What a weight sync sends of a model (unwrapped from DDP), as (checkpoint name, tensor): every parameter, tied
    ones under both names (see rollout.full_named_parameters), or a LoRA policy's lora_parameters, merged
    (W + scale * B A, computed as each is taken: one merged weight alive at a time)."""
    if not is_lora(model):
        yield from model.named_parameters(remove_duplicate=False)
        return
    for name, param, layer in lora_parameters(model):
        yield name, param if layer is None else param + layer.get_delta_weight(ADAPTER)


def lora_parameters(model):
    """What a weight sync sends for a LoRA policy (a PeftModel): (checkpoint name, base parameter, its LoRA layer or
    None), names as in a plain checkpoint ("model.layers.0.self_attn.q_proj.weight", not peft's
    "base_model.model. ... .base_layer.weight"). Only the modules that hold an adapted layer change, so only they
    are sent, all their weights (siblings, biases): vLLM fuses q/k/v and gate/up into one layer, and its layer-wise
    reload processes a layer that got only some of its weights with the rest uninitialised (vllm/model_executor/
    model_loader/reload/layerwise.py, 0.32: q_proj sent alone, even unchanged, left the engine's log-probs 0.84 off).
    The merged weight is base + layer.get_delta_weight (scale * B A)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    changed = tuple({name.rpartition(".")[0] + "." for name in adapted})  # e.g. "model.layers.0.self_attn."
    for name, param in base.named_parameters():
        if ".lora_" not in name and name.startswith(changed):
            module, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
            yield f"{module}.{leaf}", param, adapted.get(module) if leaf == "weight" else None


def load_adapter(model, path):
    """A saved adapter (PeftModel.save_pretrained's folder) into the LoRA policy, in place (AdamW keeps its
    parameters). ValueError when it does not fit the policy's adapters (another rank or targets)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(model, load_file(os.path.join(path, "adapter_model.safetensors")))
    wrong = result.unexpected_keys + [k for k in result.missing_keys if ".lora_" in k]
    if wrong:
        raise ValueError(f"{path}: the adapter does not fit the policy's ({len(wrong)} weights differ: {wrong[0]})")


@torch.no_grad()
def merged_state_dict(model, state_dict):
    """A LoRA policy's full state dict (get_model_state_dict's) -> a plain checkpoint's: peft's names undone, each
    adapted weight merged on its tensor's device with the sum the weight sync sends (so the saved model is what
    the engine samples from, bit for bit), in the base's dtype. One delta at a time: no second copy on the GPU."""
    layers = {name: layer for name, _, layer in lora_parameters(model) if layer is not None}
    merged = {}
    for key, tensor in state_dict.items():
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".lora_" not in name:
            delta = layers[name].get_delta_weight(ADAPTER).to(tensor.device) if name in layers else None
            merged[name] = tensor if delta is None else (tensor + delta).to(tensor.dtype)
    return merged


def completion_logits(model, input_ids, attention_mask, position_ids, T, dtype=torch.float32):
    """Logits that predict the T completion tokens: (B, T, V), a view with no copy (position t predicts token t).
    The forward runs under autocast to dtype: matmuls (and the logits) in bf16, weights untouched."""
    with torch.autocast(input_ids.device.type, dtype=dtype, enabled=dtype != torch.float32):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=T + 1).logits  # (B, T+1, V)
    return logits[:, :-1]  # (B, T, V)


@torch.no_grad()
def sequence_logps(model, batch, completion_ids, temperature, micro, dtype=torch.float32):
    """Per-token log-probs (N, T) of the completions under model (the old policy's, the reference's), micro
    sequences per forward: like the update's, the logits alive at once are (micro, T+1, V), not (N, T+1, V)."""
    N, T = completion_ids.shape
    return torch.cat([selective_log_softmax(completion_logits(model, *(x[i:i + micro] for x in batch), T, dtype),
                                            completion_ids[i:i + micro], temperature)
                      for i in range(0, N, micro)])  # (N, T)


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


def wrap_ddp(model, device):
    """DDP all-reduces gradients in backward (FSDP2 models reduce-scatter on their own)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
