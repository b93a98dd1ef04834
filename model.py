"""The policy as the trainer sees it.

Load a model folder (checked), wrap it for DDP or shard it with FSDP2, and run
the forward that turns a rollout into the logits and log-probs the loss needs.

    load_tokenizer(path)           -> (tokenizer, context length); ValueError: unusable
    load_model(path, dtype, ...)   the policy (fp32 weights) or a frozen model (in dtype)
    load_reference(policy, ...)    the frozen reference for --beta > 0
    prompt_batch(prompt_ids, pad)  a rollout's distinct prompts, left-padded
    completion_logits(model, ...)  (n, T, V) logits of the completions
    selective_log_softmax(logits, ids)  log softmax(logits / temperature)[ids], fp32
    entropy_from_logits(logits)    (n, T) entropies, fp32
    Forward                        those three, which fast.install can swap (fast/update.py)
    truncates(top_k, top_p, min_p)  whether a filter is on (sampling/truncation.py replays it)
    sequence_logps(forward, ...)   (N, T) log-probs of the completions, by micro-batch

Mixed precision, as PyTorch users expect: the policy's weights, gradients and
AdamW states are fp32, and only the compute runs in --dtype (torch.autocast).
Under FSDP2, MixedPrecisionPolicy casts the gathered weights and reduces the
gradients in fp32. bf16 weights updated in place would lose every update below
half a bf16 ulp of the weight. The frozen reference is stored in --dtype.

Simplifications:
1. Full weights load on the CPU first. With FSDP2 (scale/fsdp.py) each decoder
   layer is then sharded, so only this rank's shard moves to the device.
2. The update's forward runs each completion with its whole prompt, as one
   sequence. fast/update.py runs a prompt once for its G completions.
"""
import glob
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from common import cause, is_lora


# -----------------------------------------------------------------------------
# Loading: the folder's checks, the tokenizer, the policy and the reference

def load_tokenizer(path):
    """-> (tokenizer, the model's context length).

    ValueError naming the folder when it is not a usable model: no weights,
    weights cut short, no tokenizer (transformers 5 then builds an empty one
    instead of failing), more tokens than the embedding has rows, or neither a pad
    nor an EOS token.
    """
    from transformers import AutoConfig, AutoTokenizer

    if os.path.isdir(path):
        _check_weights(path)

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        config = AutoConfig.from_pretrained(path)
    # OSError: a hub id not in the local cache while offline, no config.json
    except Exception as e:
        raise ValueError(f"--model {path!r}: cannot load its tokenizer or config "
                         f"({cause(e)})") from None

    text_config = config.get_text_config()
    vocab = getattr(text_config, "vocab_size", None)
    context = getattr(text_config, "max_position_embeddings", None)
    checks = [
        (len(tokenizer) > 1,
         f"has no tokenizer (the one loaded has {len(tokenizer)} token): "
         f"save the model's tokenizer into the folder (tokenizer.save_pretrained)"),
        (vocab is None or len(tokenizer) <= vocab,
         f"its tokenizer has {len(tokenizer)} tokens but the model's embedding "
         f"has {vocab} rows (vocab_size): use the tokenizer the model was trained with"),
        (tokenizer.pad_token_id is not None or tokenizer.eos_token_id is not None,
         "its tokenizer has neither a pad nor an EOS token: completions could not end "
         "(set eos_token)"),
        (context is not None,
         "its config gives no context length (max_position_embeddings)"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"--model {path!r}: {msg}")

    return tokenizer, context


def pad_id(tokenizer):
    """The id that pads a batch: the tokenizer's pad token, else its EOS."""
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    return tokenizer.eos_token_id


def _check_weights(path):
    """A local model folder has weights, and its safetensors files are whole."""
    from safetensors import safe_open

    files = glob.glob(os.path.join(path, "*.safetensors"))
    files += glob.glob(os.path.join(path, "*.bin"))
    if not files:
        raise ValueError(f"--model {path!r}: no weights (*.safetensors or *.bin) in "
                         f"the folder: save the model there (save_pretrained), "
                         f"or give a hub id")

    # sharded: every shard the index names
    for index in glob.glob(os.path.join(path, "*.index.json")):
        shards = json.load(open(index)).get("weight_map", {}).values()
        for shard in sorted(set(shards)):
            if not os.path.exists(os.path.join(path, shard)):
                raise ValueError(f"--model {path!r}: shard {shard} named in "
                                 f"{os.path.basename(index)} is missing")

    for f in files:
        try:
            if f.endswith(".safetensors"):
                safe_open(f, "pt").keys()
            # torch.save's zip format: the index sits at the end
            elif open(f, "rb").read(2) == b"PK":
                import zipfile
                zipfile.ZipFile(f).close()
        # SafetensorError ("incomplete metadata, not fully covered"), BadZipFile
        except Exception as e:
            raise ValueError(f"--model {path!r}: {os.path.basename(f)} is damaged or cut "
                             f"short ({e}): copy or save the model again") from None


def load_model(path, dtype, device, fsdp=False, lora=None, frozen=False, recompute=False):
    """The trainable policy in fp32, or a frozen model (the reference) in dtype.

    A frozen model is in eval mode. fsdp: shard each decoder layer over the ranks
    (scale/fsdp.py). lora, a peft LoraConfig (scale/lora.py's lora_config): the
    base model in dtype, frozen, with fp32 adapters. recompute: checkpoint each
    decoder layer (scale/recompute.py). ValueError naming the folder when its
    weights do not load (missing, cut short, another shape).
    """
    from transformers import AutoModelForCausalLM

    if frozen or lora:
        weights_dtype = dtype
    else:
        weights_dtype = torch.float32
    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=weights_dtype)
    # OSError (no weights), SafetensorError (cut short), RuntimeError (shapes)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0]
        raise ValueError(f"model {path!r}: cannot load its weights "
                         f"({first_line})") from None

    if recompute:  # --gradient-checkpointing
        from scale.recompute import recompute_layers

        recompute_layers(m)
    if fsdp:  # --fsdp
        from scale.fsdp import shard

        shard(m, dtype)

    if lora:
        from scale.lora import add_lora

        m = add_lora(m, lora)
    elif frozen:
        m = m.eval().requires_grad_(False)
    return m.to(device)


def load_reference(policy, path, dtype, device, fsdp):
    """The frozen reference (beta > 0): the initial model at path, in dtype.

    With LoRA there is no second copy of the weights: the reference is the policy
    itself with its adapters off (lora.AdaptersOff).
    """
    if is_lora(policy):
        from scale.lora import AdaptersOff

        return AdaptersOff(policy)
    return load_model(path, dtype, device, fsdp, frozen=True)


def wrap_ddp(model, device):
    """DDP all-reduces gradients in backward.

    FSDP2 models reduce-scatter on their own.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if device.type == "cuda":
        device_ids = [device.index]
    else:
        device_ids = None
    return DDP(model, device_ids=device_ids)


# -----------------------------------------------------------------------------
# The forward: a rollout -> logits and log-probs of its completions

def sequence_batch(prompt_ids, completion_ids, pad_id):
    """Left-pad prompts to a common length P and append the completions.

    -> (B, P+T) ids, mask and RoPE positions, on the CPU.
    """
    P = max(len(p) for p in prompt_ids)
    prompts = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompt_ids])  # (B, P)
    prompt_mask = [[0] * (P - len(p)) + [1] * len(p) for p in prompt_ids]
    prompt_mask = torch.tensor(prompt_mask)  # (B, P)

    input_ids = torch.cat([prompts, completion_ids], dim=1)  # (B, P+T)
    completion_mask = torch.ones_like(completion_ids)  # (B, T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+T)
    # left padding must not shift the RoPE positions
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)  # (B, P+T)
    return input_ids, attention_mask, position_ids


class PromptBatch(NamedTuple):
    """A rollout's distinct prompts, left-padded (prompt_batch)."""

    ids: torch.Tensor  # (B, P)
    mask: torch.Tensor  # (B, P)
    positions: torch.Tensor  # (B, P) RoPE's
    row: torch.Tensor  # (N,) each completion's prompt: its row of ids

    def to(self, device):
        return PromptBatch(*(x.to(device) for x in self))


def prompt_batch(prompt_ids, pad_id):
    """A rollout's prompts for the trainer's forwards, each distinct prompt once.

    A prompt's G completions share it (see completion_logits). prompt_ids lists
    each completion's prompt, a group's consecutively (Rollout.prompt_ids).
    -> a PromptBatch: left-padded ids (B, P), their mask (B, P), RoPE positions
    (B, P) and each completion's prompt row (N,).
    """
    first = [i == 0 or p != prompt_ids[i - 1] for i, p in enumerate(prompt_ids)]
    prompt_row = torch.tensor(first).cumsum(0) - 1  # (N,)

    prompts = [p for p, f in zip(prompt_ids, first) if f]
    no_completions = torch.zeros(len(prompts), 0, dtype=torch.long)  # (B, 0)
    return PromptBatch(*sequence_batch(prompts, no_completions, pad_id), prompt_row)


def completion_logits(model, prompts, rows, completion_ids, dtype=torch.float32):
    """Logits (n, T, V) that predict completion_ids (n, T), autocast to dtype.

    completion_ids are the completions of `rows`, a slice of the rollout. One
    forward over each completion's prompt and its tokens but the last: position
    P-1+t predicts completion token t.
    """
    prompt_ids, prompt_mask, positions, prompt_row = prompts  # (B, P) x3, (N,)
    row = prompt_row[rows]  # (n,) the prompt of each completion
    n, T = completion_ids.shape

    # [prompt, completion[:-1]]; the completion's positions follow the prompt's last
    input_ids = torch.cat([prompt_ids[row], completion_ids[:, :-1]], 1)  # (n, P+T-1)
    ones = torch.ones_like(completion_ids[:, :-1])  # (n, T-1)
    attention_mask = torch.cat([prompt_mask[row], ones], 1)  # (n, P+T-1)
    tail = torch.arange(1, T, device=completion_ids.device)  # (T-1,)
    position_ids = torch.cat([positions[row], positions[row, -1:] + tail], 1)  # (n, P+T-1)

    autocast = torch.autocast(completion_ids.device.type, dtype=dtype,
                              enabled=dtype != torch.float32)
    with autocast:
        return model(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, use_cache=False,
                     logits_to_keep=T).logits  # (n, T, V)


def upcast(logits, temperature):
    # bf16 logits are upcast before dividing, so the result does not depend on
    # bf16 rounding. fp64 stays fp64 so that gradcheck can run on these functions.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return logits.to(dtype) / temperature  # (..., V)


def selective_log_softmax(logits, ids, temperature=1.0):
    """log softmax(logits / temperature)[ids]: (n, T, V), (n, T) -> (n, T) in fp32.

    It must use the sampling temperature, or the ratio is off-policy.
    """
    logps = upcast(logits, temperature).log_softmax(-1)  # (n, T, V)
    return logps.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (n, T)


def entropy_from_logits(logits, temperature=1.0):
    """Entropy -sum_v p_v log p_v of p = softmax(logits / temperature).

    (n, T, V) -> (n, T) in fp32.
    """
    logp = upcast(logits, temperature).log_softmax(-1)  # (n, T, V)
    p = logp.exp()  # (n, T, V)
    # 0 * log 0 = 0, not NaN, at -inf logits
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)  # (n, T)


@dataclass(frozen=True)
class Forward:
    """The functions the trainer's forwards go through: the plain ones above.
    fast.install gives train.py equals that run faster (fast/update.py), the
    same numbers to rounding (tests/test_fast.py).

    head_logps, when set, replaces logits then logps where the loss needs
    nothing else: (model, prompts, rows, completion_ids, completion_mask,
    temperature) -> (n, T) log-probs, the LM head fused in. distinct_rows, when
    set, picks the rows to train: (prompt_row, completion_ids, completion_mask,
    advantages) -> (n,) rows, (n,) the rows each stands for (fast/dedup.py).
    """

    logits: Callable = completion_logits
    logps: Callable = selective_log_softmax
    entropies: Callable = entropy_from_logits
    head_logps: Callable | None = None
    distinct_rows: Callable | None = None


# -----------------------------------------------------------------------------
# The decoder layers, which --gradient-checkpointing (scale/recompute.py) and
# fast/update.py act on

def decoder_layers(model):
    """model's decoder layers: the modules transformers can checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def full_attention(model):
    """Whether every layer of model attends to the whole sequence (no sliding
    window): the layers of its DynamicCache are all transformers' plain ones."""
    cache = DynamicCache(config=model.config)
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def is_recomputed(layer):
    """Whether scale/recompute.py checkpointed this decoder layer."""
    return getattr(layer, "recomputed", False)


# -----------------------------------------------------------------------------
# Truncated sampling: is a filter on? (sampling/truncation.py replays it)

# fp32 elements per chunk of rows that a full-vocabulary op runs on (256 MiB):
# bounds the transient upcast copy (sampling/truncation.py, fast/update.py)
CHUNK_ELEMENTS = 2**26


def truncates(top_k=0, top_p=1.0, min_p=0.0):
    """Is any filter on? (0, 1.0 and 0.0 are off: nothing is dropped.)"""
    return (top_k or 0) > 0 or top_p < 1.0 or min_p > 0.0


@torch.no_grad()
def sequence_logps(forward, model, prompts, completion_ids, temperature, micro,
                   dtype=torch.float32):
    """Per-token log-probs (N, T) of the completions under model, through
    forward (a Forward).

    model is the old policy or the reference. micro sequences go in each forward:
    as in the update, the logits alive at once are (micro, T, V).
    """
    logps = []
    for i in range(0, completion_ids.shape[0], micro):
        ids = completion_ids[i:i + micro]  # (micro, T)
        rows = slice(i, i + micro)
        logits = forward.logits(model, prompts, rows, ids, dtype)  # (micro, T, V)
        logps.append(forward.logps(logits, ids, temperature))  # (micro, T)
    return torch.cat(logps)  # (N, T)
