"""LoRA, faster on the CPU: each adapted layer one matmul of its merged weight
W + scale * B A, while the HF engine samples (fast/decode.py) and while the
update's forward runs with gradients (fast/update.py). lora.py is the feature;
this file holds only its speed.

    merged_adapters(model)   the context that swaps the adapted layers' forwards
    MergedLoraLinear         the merged layer's forward and backward, by hand

Tests: tests/test_lora.py. Figures: docs/benchmarks.md ("The seventh pass").
"""
from functools import partial

import torch

from common import is_lora
from fast import forwards_replaced


def merged_adapters(model):
    """Within it, each adapted Linear of a LoRA policy on the CPU runs as one
    matmul of its merged weight W + scale * B A: the weights a sync sends the
    vLLM engine (sync_parameters), which samples from them too. With gradients,
    MergedLoraLinear gives A and B theirs. The HF engine's decode loop and
    train.py's update enter it; the adapters must not change inside (one
    optimizer step at most).

    Why: peft's layer adds two skinny matmuls (K = r) with wide outputs, a scale
    and an add to each base matmul, and their Python, forward and backward. A
    decode step has few rows (32 in bench real's recipe), and there they cost
    more than their FLOPs. The merged weights cost one copy of the adapted
    weights while the context lasts, computed on entry.
    The same log-probs and gradients to rounding (tests/test_lora.py).

    A layer runs as peft's where the merged weight would not give the same
    function: adapters disabled (AdaptersOff, the reference), LoRA dropout in a
    forward with gradients, autocast or an input in another dtype with
    gradients. Elsewhere (not LoRA, or a GPU, where the copy would take
    accelerator memory) the layers are left as they are.
    """
    layers = []
    if is_lora(model):
        from peft.tuners.lora import Linear

        layers = [m for m in model.modules()
                  if type(m) is Linear and m.get_base_layer().weight.device.type == "cpu"]
    return forwards_replaced([(layer, partial(_merged_forward, _Merged(layer)))
                              for layer in layers])


class _Merged:
    """What a merged layer's forward reads, looked up once, not at each call
    (bench real's rollout calls its 210 layers 64 times each): the peft layer,
    its base weight and bias, A, B, scale, its LoRA dropout, and the merged
    weight."""

    def __init__(self, layer):
        from scale.lora import ADAPTER

        base = layer.get_base_layer()
        self.layer = layer
        self.base_weight = base.weight  # (out, in)
        self.bias = base.bias
        self.lora_A = layer.lora_A[ADAPTER].weight  # (r, in)
        self.lora_B = layer.lora_B[ADAPTER].weight  # (out, r)
        self.scale = layer.scaling[ADAPTER]
        dropout = layer.lora_dropout[ADAPTER]
        self.dropout = dropout.p if isinstance(dropout, torch.nn.Dropout) else 0.0
        with torch.no_grad():
            self.weight = self.base_weight + layer.get_delta_weight(ADAPTER)  # (out, in)


def _merged_forward(merged, x, *args, **kwargs):
    # peft's Linear.forward takes (x, *args, **kwargs); the extras are for
    # mixed adapter batches, which the trainer never passes
    layer = merged.layer
    if layer.disable_adapters or layer.merged:
        return type(layer).forward(layer, x, *args, **kwargs)

    weight = merged.weight
    if not torch.is_grad_enabled():
        return torch.nn.functional.linear(x, weight, merged.bias)

    same_dtype = (x.dtype == weight.dtype == merged.lora_A.dtype
                  and not torch.is_autocast_enabled(x.device.type))
    if merged.dropout > 0 or not same_dtype:
        return type(layer).forward(layer, x, *args, **kwargs)
    return MergedLoraLinear.apply(x, weight, merged.bias, merged.lora_A, merged.lora_B,
                                  merged.scale)


class MergedLoraLinear(torch.autograd.Function):
    """y = x W'^T + bias, W' = W + scale B A given (merged_adapters), and the
    gradients of x, A and B (W' and the bias are frozen). With g = dL/dy:

        dx = g W'              one matmul, as the base layer's own
        dA = scale (g B)^T x
        dB = scale g^T (x A^T)

    peft's layer also computes (x A^T) B^T forward and (g B) A backward: (M, out)
    and (M, in) outputs of K = r matmuls, the slowest of the update's on the
    CPU. x A^T is computed in the backward, not saved: (M, r) costs little.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scale):
        ctx.save_for_backward(x, weight, lora_A, lora_B)
        ctx.scale = scale
        return torch.nn.functional.linear(x, weight, bias)  # (..., out)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lora_A, lora_B = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])  # (M, in)
        grad_rows = grad.reshape(-1, grad.shape[-1])  # (M, out)

        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = (grad_rows @ weight).view(x.shape)  # (..., in)

        grad_B_rows = (grad_rows @ lora_B) * ctx.scale  # (M, r)
        grad_A = grad_B_rows.t() @ rows  # (r, in)
        x_A = (rows @ lora_A.t()) * ctx.scale  # (M, r)
        grad_B = grad_rows.t() @ x_A  # (out, r)
        return grad_x, None, None, grad_A, grad_B, None
