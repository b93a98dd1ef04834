"""The update's forward, faster: the same logits, log-probs and gradients as
model.py's plain forward, to rounding (tests/test_fast.py, test_prefix_sharing.py).
fast.install hands these to train.py in model.Forward's place.

    completion_logits(model, ...)   model.completion_logits with the prompt's forward
                                    shared by its completions
    completion_logps(model, ...)    the update's log-probs, LM head and log-prob fused
                                    (CPU, fp32), the per-position modules on real tokens only
    selective_log_softmax(...)      model.selective_log_softmax, its backward by hand,
    entropy_from_logits(...)        a chunk of rows at a time

What each trick saves, measured: docs/benchmarks.md (the passes of the CPU work).
Simplifications:
1. FSDP2 models run one forward over whole sequences instead of sharing the
   prompt's prefix: a second forward before the backward breaks FSDP2's backward
   (its resharded weights).
2. The memory tricks (backward_apart, sparse_embedding_grads, tied_head_apart)
   are off under DDP, whose hooks expect one dense gradient a weight a backward.
"""
import contextlib
from contextlib import contextmanager
from functools import partial

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from common import unwrap
from fast import forwards_replaced
from fast.lora import merged_adapters
from model import CHUNK_ELEMENTS, decoder_layers, is_recomputed, upcast


# -----------------------------------------------------------------------------
# The forward: each prompt once for its completions

def completion_logits(model, prompts, rows, completion_ids, dtype=torch.float32, kept=None):
    """Logits (n, T, V) that predict completion_ids (n, T), autocast to dtype.

    completion_ids are the completions of `rows`, a slice of the rollout.
    kept (n, T) bool, optional: the positions whose logits count. The MLPs and
    attention projections then skip the others (packed_positions), whose logits
    are not the model's.
    Prefix sharing: the G completions of a prompt share its forward. That is
    B*(P-1) + n*T tokens instead of n*(P+T), with the same logits and gradients
    to rounding (tests/test_prefix_sharing.py). FSDP2 models run whole sequences
    (fast/update.py, simplification 2).
    """
    prompt_ids, prompt_mask, positions, prompt_row = prompts  # (B, P) x3, (N,)
    row = prompt_row[rows]  # (n,) the prompt of each completion of this micro-batch

    # a group's completions are consecutive: this micro-batch's prompts are a range
    lo = row[0].item()
    hi = row[-1].item() + 1
    ids = prompt_ids[lo:hi]
    mask = prompt_mask[lo:hi]
    positions = positions[lo:hi]
    row = row - lo

    n, T = completion_ids.shape
    # the shared prefix's length
    if isinstance(model, FSDPModule):
        S = 0
    else:
        S = ids.shape[1] - 1

    device_type = completion_ids.device.type
    autocast = torch.autocast(device_type, dtype=dtype, enabled=dtype != torch.float32)
    # LoRA on the CPU, with gradients: each adapted layer one matmul of its
    # merged weight (fast/lora.py). The lookups' gradients go into .grad row by
    # row (sparse_embedding_grads)
    merged = contextlib.nullcontext()
    if torch.is_grad_enabled():
        merged = merged_adapters(unwrap(model))
    with autocast, merged, sparse_embedding_grads(model), rms_norms_by_hand(model):
        # 1) the prompts minus their last token, once each: their KV cache
        # (a 1-position LM head)
        cache = None
        if S > 0:
            prefix = replayable_cache(model, PrefixLayer)
            model(input_ids=ids[:, :S], attention_mask=mask[:, :S],
                  position_ids=positions[:, :S], past_key_values=prefix, use_cache=True,
                  logits_to_keep=1)

            # the prefix's backward apart from the completions' (backward_apart)
            if torch.is_grad_enabled() and not isinstance(model, DistributedDataParallel):
                backward_apart(prefix.layers)

            # 2) the cache, gathered to the n completions (a differentiable index)
            cache = replayable_cache(model, ExtendLayer)
            for i, layer in enumerate(prefix.layers):
                if isinstance(layer, PrefixLayer):
                    cache.layers[i].hold(layer.keys[row], layer.values[row])  # (n, H_kv, S, d)
                else:
                    # a sliding-window layer: transformers' own, gathered in place
                    layer.batch_select_indices(row)
                    cache.layers[i] = layer

        # 3) each completion on top of it, fed [last prompt token, completion[:-1]]
        # completion[:-1] follows the prompt's last position
        tail = torch.arange(1, T, device=ids.device)
        input_ids = torch.cat([ids[row, S:], completion_ids[:, :-1]], 1)  # (n, P-S+T-1)
        ones = torch.ones_like(completion_ids[:, :-1])  # (n, T-1)
        attention_mask = torch.cat([mask[row], ones], 1)  # (n, P+T-1)
        prefix_positions = positions[row, S:]  # (n, P-S)
        completion_positions = positions[row, -1:] + tail  # (n, T-1)
        position_ids = torch.cat([prefix_positions, completion_positions], 1)  # (n, ...)

        # a tied LM head's gradient goes into .grad at once (tied_head_apart)
        forward = model
        if torch.is_grad_enabled() and not isinstance(model, DistributedDataParallel):
            forward = tied_head_apart(model)

        # the MLPs and projections on the kept positions only: input position
        # t predicts completion token t (the prefix shared; FSDP2 runs whole
        # sequences)
        packing = contextlib.nullcontext()
        if kept is not None and input_ids.shape[1] == T:
            packing = packed_positions(model, kept)
        with packing:
            return forward(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids, past_key_values=cache,
                           use_cache=False, logits_to_keep=T).logits  # (n, T, V)


def replayable_cache(model, layer_class):
    """A DynamicCache for model whose full-attention layers are layer_class
    (PrefixLayer or ExtendLayer); a sliding-window layer keeps transformers'
    own class, which a replay cannot repeat (recompute_layers refuses it)."""
    cache = DynamicCache(config=unwrap(model).config)
    cache.layers = [layer_class() if type(layer) is DynamicLayer else layer
                    for layer in cache.layers]
    return cache


class _HeldLayer:
    """Keys and values a cache layer holds: (b, H_kv, S, d) each."""

    is_sliding = False

    def hold(self, keys, values):
        self.keys = keys
        self.values = values
        self.dtype = keys.dtype
        self.device = keys.device
        self.is_initialized = True


class PrefixLayer(_HeldLayer, DynamicLayer):
    """The prompt prefix's layer: update stores the keys and values it is given
    (the cache starts empty) and returns them. A replay stores them again: the
    same tensors' recomputation, not a second append."""

    def update(self, key_states, value_states, *args, **kwargs):
        self.hold(key_states, value_states)
        return key_states, value_states


class ExtendLayer(_HeldLayer, DynamicLayer):
    """The completions' layer over a held prefix: update returns prefix + new
    keys and values, and stores nothing (the completions' own are not needed
    after their forward), so a replay sees the same prefix."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys = torch.cat([self.keys, key_states], dim=-2)  # (n, H_kv, S+q, d)
        values = torch.cat([self.values, value_states], dim=-2)  # (n, H_kv, S+q, d)
        return keys, values


# -----------------------------------------------------------------------------
# Memory: each gradient into .grad as soon as it is computed

def completion_logps(model, prompts, rows, completion_ids, completion_mask, temperature):
    """Log-probs (n, T) of completion_ids under model, fp32, 0 at padding: the
    model's forward as completion_logits's, then the LM head and the log-prob
    fused (HeadLogps) over the positions completion_mask keeps.

    Why: the update's logits (n, T, V) are its largest tensors on the CPU.
    Here only one (k, V) buffer of the k real tokens exists, inside HeadLogps:
    no head work on padding, and no logits-sized temporaries. The same
    log-probs and gradients to rounding (tests/test_prefix_sharing.py).
    Only where fusable_head(model); the loss must need nothing but the
    log-probs (no entropy, no truncated sampling).
    """
    kept = completion_mask.bool()  # (n, T)
    with head_off(model):
        hidden = completion_logits(model, prompts, rows, completion_ids,
                                   kept=kept)  # (n, T, d)

    weight = model.get_output_embeddings().weight  # (V, d)
    kept_logps = HeadLogps.apply(hidden[kept], weight, completion_ids[kept],
                                 temperature)  # (k,)
    logps = torch.zeros(completion_ids.shape, dtype=kept_logps.dtype,
                        device=kept_logps.device)  # (n, T)
    return logps.index_put((kept,), kept_logps)  # (n, T)


def backward_apart(layers):
    """Cut the prefix's keys and values out of the completions' graph: each
    layer's keys and values are swapped for leaves, and once the completions'
    backward has given all the leaves' gradients, a second backward takes them
    through the prefix's forward.

    Why: every weight is used twice, by the prefix's forward and by the
    completions'. In one graph, autograd holds each weight's first gradient
    until the second arrives, so a whole second set of gradients (the model's
    size) lives at the backward's peak. Apart, each gradient is added to .grad
    as soon as it is computed. The sum is the same, to rounding. Not under DDP:
    its hooks expect one gradient a weight a backward.
    """
    prefix_kv = []
    leaves = []
    for layer in layers:
        keys = getattr(layer, "keys", None)
        if keys is None or not keys.requires_grad:
            continue
        prefix_kv += [layer.keys, layer.values]
        layer.keys = layer.keys.detach().requires_grad_()
        layer.values = layer.values.detach().requires_grad_()
        leaves += [layer.keys, layer.values]
    if not leaves:
        return

    def backward_prefix(grads):
        # the hook's closure holds the leaves' AccumulateGrad nodes, which hold
        # the leaves, which hold the hook: a cycle through C++ that Python's gc
        # cannot see, and with it the prefix's graph. Unhooked once this
        # backward is done (not inside the hook, which the engine is running)
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(handle.remove)

        # a leaf the loss does not reach has no gradient
        reached = [(kv, g) for kv, g in zip(prefix_kv, grads) if g is not None]
        if reached:
            torch.autograd.backward([kv for kv, _ in reached], [g for _, g in reached])

    handle = torch.autograd.graph.register_multi_grad_hook(leaves, backward_prefix)


@contextmanager
def sparse_embedding_grads(model):
    """Within it, the input embedding's backward gives a sparse gradient (the
    looked-up rows only), added to a dense .grad in place.

    Why: the dense backward of a lookup is a (V, d) tensor, zero but for the
    rows looked up, which is then added to .grad: 113 MB for SmolLM2-135M, alive
    at the end of each backward, where the update's peak is. .grad is made
    dense first (zeros, if None), so that every gradient is summed into it in
    place and AdamW sees a dense one. The sum is the same, to rounding
    (https://pytorch.org/docs/stable/generated/torch.nn.Embedding.html, sparse).
    Not under DDP (its buckets are dense) or FSDP2 (sharded weights); no-op for
    a frozen embedding or without grad.
    """
    # (a reference, LoRA's AdaptersOff included, runs without grad)
    distributed = isinstance(model, (DistributedDataParallel, FSDPModule))
    if not torch.is_grad_enabled() or distributed:
        yield
        return
    embedding = model.get_input_embeddings()
    weight = getattr(embedding, "weight", None)
    if weight is None or not weight.requires_grad or not isinstance(embedding, torch.nn.Embedding):
        yield
        return

    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    was_sparse = embedding.sparse
    embedding.sparse = True
    try:
        yield
    finally:
        embedding.sparse = was_sparse


def tied_head_apart(model):
    """model's forward with a tied LM head's weight as a leaf of its own, whose
    gradient a hook adds to the shared weight's .grad as soon as it is computed.

    Why: autograd sums all of a leaf's gradients before it hands them to .grad.
    A tied weight's head gradient (V, d) is computed first, at the top of the
    backward, and waited in a buffer until the embedding's came at its end:
    113 MB of SmolLM2-135M's peak. The sum is the same, to rounding. Not under
    DDP (its hooks are on the shared weight) or FSDP2 (sharded weights). An
    untied or frozen head: model itself.
    """
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    tied = weight is not None and weight is model.get_input_embeddings().weight
    if not tied or not weight.requires_grad or isinstance(model, FSDPModule):
        return model

    def into_grad(leaf):
        if weight.grad is None:
            weight.grad = leaf.grad
        else:
            weight.grad.add_(leaf.grad)
        leaf.grad = None

    leaf = weight.detach().requires_grad_()
    leaf.register_post_accumulate_grad_hook(into_grad)
    name = next(name for name, module in model.named_modules() if module is head)

    def forward(**kwargs):
        return torch.func.functional_call(model, {f"{name}.weight": leaf}, kwargs=kwargs,
                                          tie_weights=False)
    return forward


# -----------------------------------------------------------------------------
# The per-position modules on real tokens, the norms' backward by hand

def fusable_head(model):
    """Can completion_logps run on model? A plain bias-free fp32 Linear head on
    the CPU, with the model itself as the trainer holds it (not DDP- or
    FSDP2-wrapped, no LoRA on the head)."""
    if isinstance(model, (DistributedDataParallel, FSDPModule)):
        return False
    head = model.get_output_embeddings()
    return (type(head) is torch.nn.Linear and head.bias is None
            and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32)


def head_off(model):
    """Within it, model's LM head is the identity: its forward's "logits" are
    the final hidden states (..., d)."""
    return forwards_replaced([(model.get_output_embeddings(), lambda x: x)])


# a decoder layer's attention projections by their names in Llama, Qwen2/3 and
# Mistral: each maps a position to a position, as the MLP does
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def packed_positions(model, kept):
    """Within it, each decoder layer's MLP and attention projections
    (ATTENTION_PROJECTIONS) run on the positions kept marks ((n, L) bool) of an
    (n, L, ...) input, and give 0 at the others. Inputs of another shape run as
    they are. Only attention itself sees every position.

    Why: a micro-batch's completions are padded to its longest, and those
    modules (all of a Llama or Qwen layer's weights) would multiply the padding
    too: a seventh of bench real's positions. A padded position comes after
    every real one of its row, so no real position attends to it (its keys and
    values are 0 here): the kept positions' outputs are the same, to rounding
    (tests/test_prefix_sharing.py). A no-op where the layers are recomputed in
    the backward (--gradient-checkpointing): the replay runs after the context
    ends, and must repeat the forward's shapes.
    """
    modules = []
    for layer in decoder_layers(model):
        if is_recomputed(layer):
            continue
        attention = getattr(layer, "self_attn", None)
        candidates = [getattr(layer, "mlp", None)]
        candidates += [getattr(attention, name, None) for name in ATTENTION_PROJECTIONS]
        modules += [m for m in candidates if isinstance(m, torch.nn.Module)]

    index = kept.flatten().nonzero()[:, 0]  # (k,) the kept positions of n * L
    # m.forward: the class's, or merged_adapters' (LoRA)
    return forwards_replaced([(m, partial(_packed_forward, m.forward, kept.shape, index))
                              for m in modules])


def _packed_forward(forward, shape, index, x):  # x (n, L, d)
    if x.shape[:2] != shape:
        return forward(x)
    rows = x.reshape(-1, x.shape[-1])  # (n * L, d)
    out = forward(rows.index_select(0, index))  # (k, d_out)
    packed = out.new_zeros(len(rows), out.shape[-1])  # (n * L, d_out)
    return packed.index_copy(0, index, out).view(*x.shape[:-1], out.shape[-1])  # (n, L, d_out)


# transformers' RMSNorms that compute weight * (x * rsqrt(mean(x^2) + eps)) in fp32
RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def rms_norms_by_hand(model):
    """Within it, each RMSNorm of model (RMS_NORMS) runs RMSNormFunction in a
    forward with gradients of an fp32 input (no autocast); else its own
    forward. A no-op without gradients, under FSDP2 (sharded weights), and
    where layers are recomputed in the backward (--gradient-checkpointing): the
    replay runs after the context ends, and must save what the forward saved.
    """
    # no backward to run (the reference, an AdaptersOff, is never trained)
    if not torch.is_grad_enabled() or not isinstance(model, torch.nn.Module):
        return forwards_replaced([])
    recomputed = any(is_recomputed(layer) for layer in decoder_layers(model))
    if isinstance(model, FSDPModule) or recomputed:
        return forwards_replaced([])

    norms = [m for m in model.modules() if type(m).__name__ in RMS_NORMS]
    return forwards_replaced([(norm, partial(_rms_norm_forward, norm)) for norm in norms])


def _rms_norm_forward(norm, x):
    by_hand = (torch.is_grad_enabled() and x.dtype == norm.weight.dtype == torch.float32
               and not torch.is_autocast_enabled(x.device.type))
    if not by_hand:
        return type(norm).forward(norm, x)
    return RMSNormFunction.apply(x, norm.weight, norm.variance_epsilon)


class RMSNormFunction(torch.autograd.Function):
    """y = w * (x * r), r = rsqrt(mean(x^2) + eps) over the last dimension,
    the forward's bits those of transformers' RMSNorm, its backward by hand:

        dx = r * (g w - x * r^2 * mean(x * g w))
        dw = the sum over positions of g * x * r

    Why: autograd's backward of transformers' forward is a dozen elementwise
    ops over the (n, L, d) activations, each a pass over memory, 61 times a
    forward for SmolLM2; this one is five. Gradients equal to rounding
    (tests/test_prefix_sharing.py).
    """

    @staticmethod
    def forward(ctx, x, weight, eps):  # (..., d), (d,)
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (x * rstd)  # (..., d)

    @staticmethod
    def backward(ctx, grad):  # (..., d)
        x, weight, rstd = ctx.saved_tensors
        grad_normed = grad * weight  # (..., d)
        dot = (grad_normed * x).mean(-1, keepdim=True)  # (..., 1)
        grad_x = (grad_normed - x * (rstd * rstd * dot)) * rstd  # (..., d)

        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * x * rstd).reshape(-1, x.shape[-1]).sum(0)  # (d,)
        return grad_x, grad_weight, None


# -----------------------------------------------------------------------------
# Log-probs and entropies by chunks of rows, their backward by hand

# rows per logsumexp call: its (rows, V) temporaries stay small (12 MB at V = 49,152)
LOGSUMEXP_ROWS = 64


def _row_logsumexp(z):
    """logsumexp over the last dimension of z (..., V), LOGSUMEXP_ROWS rows at a
    time: torch.logsumexp holds a z-sized temporary (z - max, exponentiated)."""
    rows = z.reshape(-1, z.shape[-1])  # (k, V), a view of a contiguous z
    lse = torch.empty(len(rows), dtype=z.dtype, device=z.device)  # (k,)
    for start in range(0, len(rows), LOGSUMEXP_ROWS):
        chunk = slice(start, start + LOGSUMEXP_ROWS)
        lse[chunk] = torch.logsumexp(rows[chunk], dim=-1)
    return lse.view(z.shape[:-1])  # (...)


def _log_prob_grad_(z, lse, ids, grad, temperature):
    """z (..., V) = logits / T, turned in place into the gradient of
    logp = z[id] - lse with respect to the logits, times grad (...):

        (onehot(id) - softmax(z)) * grad / T
    """
    scaled = (grad / temperature).unsqueeze(-1)  # (..., 1)
    z.sub_(lse.unsqueeze(-1)).exp_().mul_(-scaled)  # -softmax(z) * grad / T
    return z.scatter_add_(-1, ids.unsqueeze(-1), scaled)  # (..., V)


class ChosenLogps(torch.autograd.Function):
    """log softmax(logits / T)[id] over the last dimension, with its backward
    written out:

        d logp / d logits = (onehot(id) - softmax(logits / T)) / T

    Why not autograd's: through division, logsumexp and gather it holds four
    logits-sized temporaries in the backward (the softmax, its product, the
    gather's zeros, their sum), each (n, V) fp32. Here the gradient is one
    buffer, filled in place. On the CPU that is a fifth less time and half the
    peak memory of this step (docs/benchmarks.md, "The log-prob's backward").
    The same numbers to rounding: tests/test_loss.py.
    """

    @staticmethod
    def forward(ctx, logits, ids, temperature):  # (..., V), (...)
        z = upcast(logits, temperature)  # (..., V)
        lse = _row_logsumexp(z)  # (...)
        chosen = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (...)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        return chosen - lse  # (...)

    @staticmethod
    def backward(ctx, grad):  # (...)
        logits, ids, lse = ctx.saved_tensors
        z = upcast(logits, ctx.temperature)  # (..., V), the one new buffer
        grad_logits = _log_prob_grad_(z, lse, ids, grad, ctx.temperature)  # (..., V)
        return grad_logits.to(logits.dtype), None, None


def _chosen_logps(rows, ids, temperature):
    return ChosenLogps.apply(rows, ids, temperature)  # (n,)


class HeadLogps(torch.autograd.Function):
    """The LM head and the log-prob in one op, for the update on the CPU:

        logp = log softmax(h W^T / T)[id]
        d logp / d h = g W,  d logp / d W = g^T h,  g = (onehot(id) - softmax) / T

    hidden (k, d): the final hidden states of the k positions that count (no
    padding); weight (V, d): the head's. The op owns its (k, V) logits, so
    forward divides them in place and backward turns them into g in place: one
    logits-sized buffer in all, where the head, then ChosenLogps, hold two or
    three. The head's weight gradient is added to weight.grad in place (no
    (V, d) temporary) and is not handed back to autograd; the weight must be
    the parameter itself (not under DDP or FSDP2). Used by completion_logps;
    the same numbers to rounding: tests/test_prefix_sharing.py.
    """

    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature):  # (k, d), (V, d), (k,)
        z = (hidden @ weight.t()).div_(temperature)  # (k, V)
        lse = _row_logsumexp(z)  # (k,)
        chosen = z.gather(1, ids.unsqueeze(1)).squeeze(1)  # (k,)

        ctx.save_for_backward(hidden, weight, ids, lse)
        ctx.z = z
        ctx.temperature = temperature
        return chosen - lse  # (k,)

    @staticmethod
    def backward(ctx, grad):  # (k,)
        hidden, weight, ids, lse = ctx.saved_tensors
        g = _log_prob_grad_(ctx.z, lse, ids, grad, ctx.temperature)  # (k, V), in z's buffer
        del ctx.z

        grad_hidden = g @ weight  # (k, d)
        if weight.requires_grad:
            if weight.grad is None:
                weight.grad = g.t() @ hidden  # (V, d)
            else:
                weight.grad.addmm_(g.t(), hidden)
        return grad_hidden, None, None, None


def _entropy(rows, temperature):
    logp = upcast(rows, temperature).log_softmax(-1)  # (n, V)
    p = logp.exp()  # (n, V)
    # 0 * log 0 = 0, not NaN, at -inf logits
    return -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)  # (n,)


def _by_row_chunks(fn, logits, *row_args, chunk_rows=None):
    """fn over chunks of logits (B, T, V) -> (B, T).

    Each chunk holds at most chunk_rows positions (default: as many as fit in
    CHUNK_ELEMENTS fp32 numbers): whole sequences while one fits, else pieces of
    one sequence. Slices are views (reshape would copy a non-contiguous input).

    With several chunks, each is checkpointed under autograd: its fp32
    intermediates are recomputed in backward, so no fp32 copy of more than one
    chunk exists. A single chunk runs plainly: checkpointing it would cost time
    and save nothing the bound does not already allow.
    """
    B, T, V = logits.shape
    step = chunk_rows or max(1, CHUNK_ELEMENTS // V)
    if B * T <= step:
        return fn(logits, *row_args)  # (B, T)

    # k whole sequences per chunk
    if T <= step:
        k = step // T
        chunks = [[x[i:i + k] for x in (logits, *row_args)] for i in range(0, B, k)]
    # pieces of one sequence
    else:
        pieces = [[c for row in x.unbind(0) for c in row.split(step)]
                  for x in (logits, *row_args)]
        chunks = list(zip(*pieces))

    save_nothing = torch.is_grad_enabled() and logits.requires_grad
    if save_nothing:
        out = [checkpoint(fn, *c, use_reentrant=False) for c in chunks]
    else:
        out = [fn(*c) for c in chunks]
    return torch.cat([o.reshape(-1) for o in out]).view(B, T)


def selective_log_softmax(logits, ids, temperature=1.0, chunk_rows=None):
    """log softmax(logits / temperature)[ids]: (B, T, V), (B, T) -> (B, T) in fp32.

    fp64 logits give fp64. It must use the sampling temperature, or the ratio is
    off-policy.
    """
    fn = partial(_chosen_logps, temperature=temperature)
    return _by_row_chunks(fn, logits, ids, chunk_rows=chunk_rows)


def entropy_from_logits(logits, temperature=1.0, chunk_rows=None):
    """Entropy -sum_v p_v log p_v of p = softmax(logits / temperature).

    (B, T, V) -> (B, T) in fp32.
    """
    fn = partial(_entropy, temperature=temperature)
    return _by_row_chunks(fn, logits, chunk_rows=chunk_rows)
