"""LoRA (--lora-rank, arXiv:2106.09685): the policy is W x + scale * B A x, with only A (r, in) and B (out, r) trained
and scale = alpha / r. B starts at 0, so the policy starts as the base model; the base weights never change. peft
(imported only when --lora-rank is on) adds the adapters; this file holds what train.py needs around them:

    lora_config(args)           peft's LoraConfig from the flags, or None
    add_lora(model, config)     the model as a PeftModel, base frozen (common.load_model calls it)
    load_reference(policy, ...) the reference for --beta > 0: with LoRA the policy itself, adapters off (no 2nd copy)
    sync_parameters(model)      what a weight sync sends: every parameter, or the adapted modules' merged weights
    full_named_parameters(...)  those as full tensors (FSDP2: gathered) in the engine's dtype, one at a time
    merged_state_dict, load_adapter   the final merged model/ and the adapter a resume loads (checkpoint.py)

Run: python train.py --lora-rank 16   (README: LoRA). Simplifications:
1. One adapter ("default"); --fsdp is refused (common.check_flags): a frozen base in --dtype plus small adapters fit
   one GPU per rank under DDP.
2. A sync sends whole adapted modules (all of q/k/v/o, gate/up/down of a block), not just the changed matrices:
   vLLM fuses them (see lora_parameters).
"""
import os

import torch
from torch.distributed.tensor import DTensor

from common import load_model, require, unwrap

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

    def parameters(self):
        return self.model.parameters()

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


@torch.no_grad()
def sync_parameters(model):
    """What a weight sync sends of a model (unwrapped from DDP), as (checkpoint name, tensor): every parameter, tied
    ones under both names (see full_named_parameters), or a LoRA policy's lora_parameters, merged
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


def full_named_parameters(model, counter, dtype=None):
    """(name, full tensor in dtype, else its own) one parameter at a time, in module order (LoRA: the adapted
    modules only, merged: sync_parameters). FSDP2 parameters are DTensors: full_tensor() all-gathers one
    when vLLM asks for it (a collective: every rank must call sync_weights). Tied weights go under both names, as
    in an HF state_dict: vLLM 0.32's layer-wise reload refreshes a layer once all its weights arrived, and with
    tie_word_embeddings the LM head is its own layer; sent only as embed_tokens, the logits kept the old ones."""
    for name, param in sync_parameters(unwrap(model)):
        tensor = param.detach()
        tensor = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).to(dtype or param.dtype)
        counter["bytes"] += tensor.numel() * tensor.element_size()
        yield name, tensor
