"""LoRA (--lora-rank, arXiv 2106.09685): only low-rank adapters train.

The policy computes W x + scale * B A x, with only A (r, in) and B (out, r)
trained and scale = alpha / r. B starts at 0, so the policy starts as the base
model. The base weights never change. peft, imported only with --lora-rank,
adds the adapters. This file holds what the trainer needs around them:

    lora_config(rank, alpha, ...)  peft's LoraConfig from the flags' values, or None
    add_lora(model, config)     the model as a PeftModel, base frozen (model.load_model)
    AdaptersOff(policy)         the reference for --beta > 0: the policy, adapters off
    sync_parameters(model)      what a weight sync sends (rollout.full_named_parameters):
                                the adapted modules' merged weights
    merged_state_dict           the final model/, merged
    load_adapter                the adapter a resume loads

Its speed on the CPU (each adapted layer one matmul of its merged weight while
the HF engine samples and the update runs) is fast/lora.py's.

Run: python train.py --lora-rank 16   (README: LoRA)

Simplifications:
1. One adapter ("default"). --fsdp is refused (config.check_flags): a frozen
   base in --dtype plus small adapters fit one GPU per rank under DDP.
2. A sync sends whole adapted modules (all of q/k/v/o, gate/up/down of a
   block), not just the changed matrices: vLLM fuses them (see lora_parameters).
"""
import os

import torch

from common import is_lora, require

ADAPTER = "default"  # peft's name for the one adapter we train


def lora_config(rank, alpha, dropout, targets):
    """peft's LoraConfig for --lora-rank, --lora-alpha, --lora-dropout, --lora-targets.

    alpha None defaults to 2 x rank. rank 0 (no --lora-rank) gives None.
    """
    if not rank:
        return None

    peft = require("peft", "--lora-rank needs the peft package: pip install peft")
    return peft.LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, lora_dropout=dropout,
                           target_modules=targets)


class GradOnlyDropout(torch.nn.Dropout):
    """Dropout that acts only in forwards that build a graph.

    The trainer runs the policy in eval mode (the ratio must compare the same
    function), so peft's nn.Dropout would never fire. This one drops in the
    update's forward, and never in old or reference log-probs or in generation
    (all under torch.no_grad).
    """

    def forward(self, x):
        return torch.nn.functional.dropout(x, self.p, training=torch.is_grad_enabled())


def add_lora(model, config):
    """The model as a peft PeftModel: adapters on config.target_modules, the rest frozen.

    ValueError in one line when a target names no module of the model, or names
    one that holds a tied weight.
    """
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    try:
        # adapters in fp32 even on a bf16 base (autocast_adapter_dtype)
        model = get_peft_model(model, config)
    except ValueError as e:
        targets = " ".join(sorted(config.target_modules))
        first_line = str(e).strip().splitlines()[0]
        raise ValueError(f"--lora-targets {targets}: {first_line}") from None

    # a tied weight (Qwen's lm_head and embed_tokens) -> the modules that hold it
    base = model.get_base_model()
    owners = {}
    for name, module in base.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name.replace(".base_layer", ""))

    for name, layer in base.named_modules():
        if not isinstance(layer, LoraLayer):
            continue
        tied = owners.get(id(layer.get_base_layer().weight), set())
        # merged, the two would part: a tied checkpoint holds one of them
        if len(tied) > 1:
            others = " ".join(sorted(tied - {name}))
            raise ValueError(f"--lora-targets: {name} shares its weight with {others} "
                             f"(tie_word_embeddings): a merged adapter cannot be saved "
                             f"or synced into a tied model; target other modules")

    for layer in model.modules():
        if isinstance(layer, LoraLayer) and config.lora_dropout > 0:
            layer.lora_dropout[ADAPTER] = GradOnlyDropout(config.lora_dropout)
    return model


class AdaptersOff:
    """The reference with LoRA: the policy's own network with its adapters disabled.

    That is peft's disable_adapter, i.e. the initial policy (B starts at 0),
    without a second copy of the weights. Called like a model.
    """

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return self.model.parameters()

    @property
    def config(self):
        # the policy's: completion_logits builds its KV caches from it
        return self.model.config

    def __call__(self, **inputs):
        with self.model.disable_adapter():
            return self.model(**inputs)


@torch.no_grad()
def sync_parameters(model):
    """What a weight sync sends of a model (unwrapped from DDP).

    -> (checkpoint name, tensor) pairs: every parameter, tied ones under both
    names (see full_named_parameters). For a LoRA policy, its lora_parameters
    merged, W + scale * B A, each computed as it is taken: one merged weight is
    alive at a time.
    """
    if not is_lora(model):
        yield from model.named_parameters(remove_duplicate=False)
        return

    for name, param, layer in lora_parameters(model):
        if layer is None:
            yield name, param
        else:
            yield name, param + layer.get_delta_weight(ADAPTER)


def lora_parameters(model):
    """What a weight sync sends for a LoRA policy (a PeftModel).

    -> (checkpoint name, base parameter, its LoRA layer or None), named as in a
    plain checkpoint: "model.layers.0.mlp.up_proj.weight", not peft's
    "base_model.model. ... .base_layer.weight". The merged weight is
    base + layer.get_delta_weight (scale * B A).

    Only the modules that hold an adapted layer change, so only they are sent, but
    all their weights (siblings, biases). vLLM fuses q/k/v and gate/up into one
    layer, and its layer-wise reload processes a layer that got only some of its
    weights with the rest uninitialised
    (vllm/model_executor/model_loader/reload/layerwise.py, 0.32). q_proj sent
    alone, even unchanged, left the engine's log-probs 0.84 off.
    """
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    # e.g. "model.layers.0.self_attn."
    changed = tuple({_parent(name) + "." for name in adapted})

    for name, param in base.named_parameters():
        if ".lora_" not in name and name.startswith(changed):
            module, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
            if leaf == "weight":
                layer = adapted.get(module)
            else:
                layer = None
            yield f"{module}.{leaf}", param, layer


def _parent(name):
    """The module whose weights a sync sends for an adapted module.

    Its parent ("model.layers.0.mlp" for "model.layers.0.mlp.up_proj"), or the
    module itself at the top level ("lm_head").
    """
    parent, dot, _ = name.rpartition(".")
    if dot:
        return parent
    return name


def load_adapter(model, path):
    """A saved adapter (PeftModel.save_pretrained's folder) into the LoRA policy.

    In place: AdamW keeps its parameters.

    ValueError when the adapter does not fit the policy's adapters (another rank
    or other targets).
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = load_file(os.path.join(path, "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, weights)

    wrong = result.unexpected_keys + [k for k in result.missing_keys if ".lora_" in k]
    if wrong:
        raise ValueError(f"{path}: the adapter does not fit the policy's "
                         f"({len(wrong)} weights differ: {wrong[0]})")


@torch.no_grad()
def save_adapter(model, path, state_dict):
    """checkpoint.save_model of a LoRA policy: its adapter to path/adapter
    (adapter_model.safetensors + its config) -> (the base model, state_dict
    merged under plain names), for save_pretrained to write as the engine
    samples it."""
    model.save_pretrained(os.path.join(path, "adapter"))
    return model.get_base_model(), merged_state_dict(model, state_dict)


def merged_state_dict(model, state_dict):
    """A LoRA policy's full state dict (get_model_state_dict's) -> a plain checkpoint's.

    peft's names are undone, and each adapted weight is merged on its tensor's
    device with the sum the weight sync sends, in the base's dtype: the saved
    model is what the engine samples from, bit for bit. One delta at a time: no
    second copy on the GPU.
    """
    layers = {name: layer for name, _, layer in lora_parameters(model)
              if layer is not None}
    merged = {}

    for key, tensor in state_dict.items():
        name = key.removeprefix("base_model.model.").replace(".base_layer.", ".")
        if ".lora_" in name:
            continue

        if name in layers:
            delta = layers[name].get_delta_weight(ADAPTER).to(tensor.device)
            merged[name] = (tensor + delta).to(tensor.dtype)
        else:
            merged[name] = tensor
    return merged
