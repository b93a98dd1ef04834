"""--gradient-checkpointing: each decoder layer's activations dropped after the
forward and recomputed in the backward. model.load_model applies it once, at load.

Tests: python -m pytest -q tests/test_prefix_sharing.py -k recompute
"""
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from model import decoder_layers, full_attention


def recompute_layers(model):
    """Checkpoint every decoder layer of model: its activations are dropped after
    the forward and recomputed in the backward (about a third more update
    compute; the saved activations of a micro-batch fall to each layer's input).

    transformers' own switch (gradient_checkpointing_enable) drops the KV cache,
    which fast/update.py's shared prompt prefix needs. Here each layer keeps it:
    the caches it passes are replayable, their update giving the same result
    when the backward replays a layer.
    Non-reentrant checkpointing (https://pytorch.org/docs/stable/checkpoint.html).
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers that "
                         f"transformers can checkpoint")
    # a sliding-window layer's cache appends on every update: a replay of
    # fast/update.py's shared prefix would append the prompt twice
    if not full_attention(model):
        raise ValueError("--gradient-checkpointing needs full-attention layers (the "
                         "backward replays each layer's KV cache); this model has "
                         "sliding-window ones")
    # our own wrapper, not transformers' switch: that one only acts in train
    # mode, and train.py runs the policy in eval mode (no dropout in the ratio)
    for layer in layers:
        layer.forward = partial(_checkpointed, layer.forward)
        layer.recomputed = True  # model.is_recomputed reads it (fast/update.py)
    return len(layers)


def _checkpointed(forward, *args, **kwargs):
    """forward(*args, **kwargs), its activations recomputed in backward; a
    plain call where nothing will be differentiated (old log-probs, rollouts)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
