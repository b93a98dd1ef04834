"""The policy as the trainer sees it.

Load a model folder (checked), wrap it for DDP or shard it with FSDP2, and run
the forward that turns a rollout into the logits and log-probs the loss needs.

    load_tokenizer(path)           -> (tokenizer, context length); ValueError: unusable
    load_model(path, dtype, ...)   the policy (fp32 weights) or a frozen model (in dtype)
    load_reference(policy, ...)    the frozen reference for --beta > 0
    prompt_batch(prompt_ids, pad)  a rollout's distinct prompts, left-padded
    completion_logits(model, ...)  (n, T, V) logits of the completions, prefix shared
    selective_log_softmax(logits, ids)  log softmax(logits / temperature)[ids], fp32
    kept_tokens(scores, ...)       the tokens top-k / top-p / min-p keep (both engines)
    truncate_logits(logits, ids, ...)  the sampler's support replayed on the trainer's logits
    sequence_logps(model, ...)     (N, T) log-probs of the completions, by micro-batch
    completion_logps(model, ...)   the update's log-probs, LM head and log-prob fused (CPU, fp32),
                                   the per-position modules on the real tokens only
                                   (packed_positions)
    SharedPrefix                   the HF engine's decode attention, each prompt's keys once (CPU)
    auto_micro_batch(...)          completions per forward when --micro-batch-size is 0

Mixed precision, as PyTorch users expect: the policy's weights, gradients and
AdamW states are fp32, and only the compute runs in --dtype (torch.autocast).
Under FSDP2, MixedPrecisionPolicy casts the gathered weights and reduces the
gradients in fp32. bf16 weights updated in place would lose every update below
half a bf16 ulp of the weight. The frozen reference is stored in --dtype.

Truncated sampling (TRL issue #6789): with top-k, top-p or min-p on, the
sampler's log-prob is over the kept set, renormalized. A full-vocabulary
log-prob would bias every ratio against it by the kept mass S (mean ratio ~0.8
at top-p 0.8). So whenever a knob is on, truncate_logits runs the sampler's
filter (kept_tokens) on each model's own logits and sets the tokens it drops to
FILTERED: the old, reference and current log-probs, the entropies and the KL
are all over the truncated distribution. The sampled token is always kept (the
trainer's rounding may put it just past the boundary). The repetition penalty
is not replayed (it needs each position's seen tokens): the trainer's log-probs
are unpenalized, and train.py says so at start-up.

Simplifications:
1. Full weights load on the CPU first. With FSDP2 each decoder layer is then
   sharded, so only this rank's shard moves to the device
   (https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html).
2. FSDP2 models run one forward over whole sequences instead of sharing the
   prompt's prefix: a second forward before the backward breaks FSDP2's backward
   (its resharded weights).
"""
import contextlib
import glob
import json
import os
from contextlib import contextmanager
from functools import partial

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from common import cause, forwards_replaced, unwrap
from lora import AdaptersOff, add_lora, is_lora


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
    (simplification 1). lora, a peft LoraConfig (lora.lora_config): the base
    model in dtype, frozen, with fp32 adapters. recompute: checkpoint each
    decoder layer (recompute_layers). ValueError naming the folder when its
    weights do not load (missing, cut short, another shape).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    if frozen or lora:
        weights_dtype = dtype
    else:
        weights_dtype = torch.float32
    attention = {}
    if torch.device(device).type == "cpu":
        attention = dict(attn_implementation=register_gqa_attention())
    try:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=weights_dtype, **attention)
    # OSError (no weights), SafetensorError (cut short), RuntimeError (shapes)
    except Exception as e:
        first_line = str(e).strip().splitlines()[0]
        raise ValueError(f"model {path!r}: cannot load its weights "
                         f"({first_line})") from None

    if recompute:
        recompute_layers(m)
    if fsdp:
        # compute in dtype, reduce gradients in fp32
        mixed = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        for layer in m.model.layers:
            fully_shard(layer, mp_policy=mixed)
        fully_shard(m, mp_policy=mixed)

    if lora:
        m = add_lora(m, lora)
    elif frozen:
        m = m.eval().requires_grad_(False)
    return m.to(device)


# sdpa_gqa_attention's name in transformers' registry of attention functions
GQA_ATTENTION = "tinygrpo_sdpa_gqa"


def sdpa_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       is_causal=None, shared_prefix=None, **kwargs):
    """transformers' "sdpa" attention, with the grouped KV heads passed as they
    are (enable_gqa) even under a padding mask. With shared_prefix (the HF
    engine's decode steps), key and value are the completions' own, and the
    prompts' come from it (SharedPrefix.attend).

    transformers repeats each KV head for its query heads first wherever there
    is a mask, because CUDA's fused kernels take no mask with GQA. On CPU that
    copy costs a fifth of a decode step (SmolLM2: 3 KV heads for 9 query heads),
    and the update saves the repeated copies for backward. The same numbers:
    tests/test_decode.py.
    query (b, H, q, d), key and value (b, H_kv, k, d) -> ((b, q, H, d), None).
    """
    if shared_prefix is not None:
        return shared_prefix.attend(module.layer_idx, query, key, value, scaling), None

    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    # a mask, or a single query (decode), is never causal here
    is_causal = bool(is_causal and attention_mask is None and query.shape[2] > 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling,
        is_causal=is_causal, enable_gqa=key.shape[1] != query.shape[1])  # (b, H, q, d)
    return out.transpose(1, 2).contiguous(), None


class SharedPrefix:
    """A decode step's attention over each prompt's keys and values once for
    all its rows (cascade attention), then over each row's own completion.

        softmax([q Kp, q Kc]) [Vp; Vc] = (a Op + b Oc) / (a lp + b lc)

    where Op = exp(q Kp - mp) Vp and lp its sum of weights over the prompt,
    Oc and lc over the completion, and a = exp(mp - m), b = exp(mc - m) rescale
    both to the larger maximum m
    (https://arxiv.org/abs/2205.14135, the online softmax's merge).

    Why: a prompt's G rows share its keys and values. Copied to every row, each
    decode step reads them G times (bench real: 110 prompt slots of a row's
    ~140, for 8 rows). Here a prompt's rows are one matmul against its keys.

    prefill_cache: the prompts' cache (B rows, (B, H_kv, P, d) a layer);
    prompt_mask (B, P) bool, 0 at left padding; prompt_of (A,) each decode
    row's prompt, ascending (a prompt's rows consecutive). keep drops rows.
    The same outputs as attention over the whole row, to rounding
    (tests/test_decode.py).
    """

    def __init__(self, prefill_cache, prompt_mask, prompt_of):
        self.keys = [layer.keys for layer in prefill_cache.layers]  # (B, H_kv, P, d) each
        self.values = [layer.values for layer in prefill_cache.layers]
        # 0 where a prompt token is, -inf at its left padding
        bias = torch.zeros(prompt_mask.shape, dtype=self.keys[0].dtype,
                           device=prompt_mask.device)  # (B, P)
        self.bias = bias.masked_fill(~prompt_mask, -torch.inf)[:, None, None]  # (B, 1, 1, P)
        self._place(prompt_of)

    def keep(self, rows):
        """Only these rows (A',) of the batch go on."""
        self._place(self.prompt_of[rows])

    def _place(self, prompt_of):
        # each prompt's rows in a (B, n) grid, n its most rows: slot is a row's
        # place in it, rows a slot's row (an empty slot repeats row 0; its
        # output is never read)
        self.prompt_of = prompt_of  # (A,)
        B = len(self.keys[0])
        counts = torch.bincount(prompt_of, minlength=B)  # (B,)
        first = counts.cumsum(0) - counts  # (B,) each prompt's first row
        self.n = int(counts.max())
        rank = torch.arange(len(prompt_of), device=prompt_of.device) - first[prompt_of]  # (A,)
        self.slot = prompt_of * self.n + rank  # (A,)
        self.rows = torch.zeros(B * self.n, dtype=torch.long, device=prompt_of.device)
        self.rows[self.slot] = torch.arange(len(prompt_of), device=prompt_of.device)

    def attend(self, layer, query, keys, values, scaling):
        """query (A, H, 1, d); keys and values (A, H_kv, L, d): the completions'
        filled slots -> (A, 1, H, d)."""
        A, H, _, d = query.shape
        B, H_kv, P, _ = self.keys[layer].shape
        g = H // H_kv  # query heads a KV head
        q = query.view(A, H_kv, g, d)  # (A, H_kv, g, d), head h * g + i reads KV head h

        # 1) the prompts: a prompt's rows in one matmul, (B, H_kv, n * g, d)
        grid = q[self.rows].view(B, self.n, H_kv, g, d).transpose(1, 2).reshape(
            B, H_kv, self.n * g, d)
        scores = torch.matmul(grid, self.keys[layer].transpose(-1, -2))  # (B, H_kv, n*g, P)
        scores = scores.mul_(scaling).add_(self.bias)
        prompt_out, prompt_max, prompt_sum = _partial_softmax(scores, self.values[layer])

        # back to the rows: (A, H_kv, g, ...)
        def by_row(x):  # (B, H_kv, n * g, k) -> (A, H_kv, g, k)
            k = x.shape[-1]
            x = x.view(B, H_kv, self.n, g, k).transpose(1, 2).reshape(B * self.n, H_kv, g, k)
            return x[self.slot]
        prompt_out, prompt_max, prompt_sum = map(by_row, (prompt_out, prompt_max, prompt_sum))

        # 2) each row's own completion
        scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scaling)  # (A, H_kv, g, L)
        own_out, own_max, own_sum = _partial_softmax(scores, values)

        # 3) both, rescaled to the larger maximum
        top = torch.maximum(prompt_max, own_max)  # (A, H_kv, g, 1)
        a = (prompt_max - top).exp_()
        b = (own_max - top).exp_()
        out = (prompt_out * a + own_out * b) / (prompt_sum * a + own_sum * b)  # (A, H_kv, g, d)
        return out.view(A, 1, H, d)


def _partial_softmax(scores, values):
    """softmax(scores) values, unnormalised: -> (exp(scores - max) values, max,
    sum of exp(scores - max)); scores (..., L) are overwritten."""
    top = scores.amax(-1, keepdim=True)  # (..., 1)
    weights = scores.sub_(top).exp_()  # (..., L)
    return torch.matmul(weights, values), top, weights.sum(-1, keepdim=True)


def register_gqa_attention():
    """Register sdpa_gqa_attention with transformers (once) -> its name, for
    from_pretrained(attn_implementation=...). Its masks are sdpa's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, sdpa_gqa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GQA_ATTENTION, sdpa_mask)
    return GQA_ATTENTION


def load_reference(policy, path, dtype, device, fsdp):
    """The frozen reference (beta > 0): the initial model at path, in dtype.

    With LoRA there is no second copy of the weights: the reference is the policy
    itself with its adapters off (lora.AdaptersOff).
    """
    if is_lora(policy):
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


def prompt_batch(prompt_ids, pad_id):
    """A rollout's prompts for the trainer's forwards, each distinct prompt once.

    A prompt's G completions share it (see completion_logits). prompt_ids lists
    each completion's prompt, a group's consecutively (Rollout.prompt_ids).
    -> left-padded ids (B, P), their mask (B, P), RoPE positions (B, P) and each
    completion's prompt row (N,).
    """
    first = [i == 0 or p != prompt_ids[i - 1] for i, p in enumerate(prompt_ids)]
    prompt_row = torch.tensor(first).cumsum(0) - 1  # (N,)

    prompts = [p for p, f in zip(prompt_ids, first) if f]
    no_completions = torch.zeros(len(prompts), 0, dtype=torch.long)  # (B, 0)
    return (*sequence_batch(prompts, no_completions, pad_id), prompt_row)


def completion_logits(model, prompts, rows, completion_ids, dtype=torch.float32, kept=None):
    """Logits (n, T, V) that predict completion_ids (n, T), autocast to dtype.

    completion_ids are the completions of `rows`, a slice of the rollout.
    kept (n, T) bool, optional: the positions whose logits count. The MLPs and
    attention projections then skip the others (packed_positions), whose logits
    are not the model's.
    Prefix sharing: the G completions of a prompt share its forward. That is
    B*(P-1) + n*T tokens instead of n*(P+T), with the same logits and gradients
    to rounding (tests/test_prefix_sharing.py). FSDP2 models run whole sequences
    (simplification 2).
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
    # the lookups' gradients go into .grad row by row (sparse_embedding_grads)
    with autocast, sparse_embedding_grads(model), rms_norms_by_hand(model):
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
        if _is_recomputed(layer):
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
    recomputed = any(_is_recomputed(layer) for layer in decoder_layers(model))
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
# Recomputed activations (--gradient-checkpointing) and the caches a replay can repeat

def decoder_layers(model):
    """model's decoder layers: the modules transformers can checkpoint."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def recompute_layers(model):
    """Checkpoint every decoder layer of model: its activations are dropped after
    the forward and recomputed in the backward (about a third more update
    compute; the saved activations of a micro-batch fall to each layer's input).

    transformers' own switch (gradient_checkpointing_enable) drops the KV cache,
    which the shared prompt prefix needs (completion_logits). Here each layer
    keeps it: the caches completion_logits passes are replayable_cache's, whose
    update gives the same result when the backward replays a layer.
    Non-reentrant checkpointing (https://pytorch.org/docs/stable/checkpoint.html).
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no decoder layers that "
                         f"transformers can checkpoint")
    # a sliding-window layer's cache appends on every update: a replay would
    # append the prompt twice
    cache = replayable_cache(model, PrefixLayer)
    if not all(isinstance(layer, PrefixLayer) for layer in cache.layers):
        raise ValueError("--gradient-checkpointing needs full-attention layers (the "
                         "backward replays each layer's KV cache); this model has "
                         "sliding-window ones")
    # our own wrapper, not transformers' switch: that one only acts in train
    # mode, and train.py runs the policy in eval mode (no dropout in the ratio)
    for layer in layers:
        layer.forward = partial(_checkpointed, layer.forward)
    return len(layers)


def _is_recomputed(layer):
    """Whether recompute_layers checkpointed this decoder layer."""
    forward = vars(layer).get("forward")
    return isinstance(forward, partial) and forward.func is _checkpointed


def _checkpointed(forward, *args, **kwargs):
    """forward(*args, **kwargs), its activations recomputed in backward; a
    plain call where nothing will be differentiated (old log-probs, rollouts)."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


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


# log-probs and entropies from logits, a chunk of rows at a time
# fp32 elements per row chunk (256 MiB): bounds the transient upcast copy
CHUNK_ELEMENTS = 2**26

# the most logits one forward of the update makes on the CPU: 2^25 fp32
# numbers (128 MiB), auto_micro_batch
MICRO_BATCH_LOGITS = 2**25


def auto_micro_batch(minibatch, max_new_tokens, vocab_size, device):
    """Completions per forward and backward for --micro-batch-size 0.

    On a GPU: the whole minibatch. On the CPU: the largest divisor of the
    minibatch whose (n, max_new_tokens, vocab_size) logits stay within
    MICRO_BATCH_LOGITS numbers, at least 1. Why: there the update of a real
    vocabulary's logits is bound by their memory traffic, and a whole minibatch
    of them is both slower and far larger than a few rows at a time
    (docs/benchmarks.md, "The micro-batch on the CPU"). A small vocabulary (the
    default toy) keeps the whole minibatch.
    """
    if torch.device(device).type != "cpu":
        return minibatch
    fits = max(1, MICRO_BATCH_LOGITS // (max_new_tokens * vocab_size))
    return max(n for n in range(1, min(fits, minibatch) + 1) if minibatch % n == 0)


def _upcast(rows, temperature):
    # bf16 logits are upcast before dividing, so the result does not depend on
    # bf16 rounding. fp64 stays fp64 so that gradcheck can run on these functions.
    dtype = torch.promote_types(rows.dtype, torch.float32)
    return rows.to(dtype) / temperature  # (n, V)


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
        z = _upcast(logits, temperature)  # (..., V)
        lse = _row_logsumexp(z)  # (...)
        chosen = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (...)
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature = temperature
        return chosen - lse  # (...)

    @staticmethod
    def backward(ctx, grad):  # (...)
        logits, ids, lse = ctx.saved_tensors
        z = _upcast(logits, ctx.temperature)  # (..., V), the one new buffer
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
    logp = _upcast(rows, temperature).log_softmax(-1)  # (n, V)
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


# -----------------------------------------------------------------------------
# Truncated sampling: the sampler's kept set, on the sampler's and the trainer's logits

# a filtered logit on the trainer's side: finite in bf16 and fp32, so that the
# kernel's sum p * logit is 0 there, not 0 * -inf = NaN; and -1e9 / T still
# underflows exp to 0
FILTERED = -1e9


def truncates(top_k=0, top_p=1.0, min_p=0.0):
    """Is any filter on? (0, 1.0 and 0.0 are off: nothing is dropped.)"""
    return (top_k or 0) > 0 or top_p < 1.0 or min_p > 0.0


def kept_tokens(scores, top_k=0, top_p=1.0, min_p=0.0):
    """(n, V) scores (logits / temperature, fp32) -> (n, V) bool, True where kept.

    vLLM 0.32's order (v1/sample/sampler.py): min-p on the whole distribution,
    then top-k, then top-p over what is left (ops/topk_topp_sampler.py,
    apply_top_k_top_p_pytorch). Ties with the k-th score are kept. The one
    filter both engines and the trainer apply.
    """
    n, V = scores.shape
    keep = torch.ones_like(scores, dtype=torch.bool)  # (n, V)

    # drop a token less likely than min_p x the likeliest one
    if min_p > 0:
        probs = scores.softmax(-1)  # (n, V)
        floor = min_p * probs.amax(-1, keepdim=True)  # (n, 1)
        keep = probs >= floor

    if 0 < (top_k or 0) < V:
        kth = scores.topk(top_k).values[:, -1:]  # (n, 1)
        keep = keep & (scores >= kth)

    # drop the least likely tokens while they hold at most 1 - top_p of the mass
    if top_p < 1.0:
        ordered, order = scores.masked_fill(~keep, -torch.inf).sort(-1)  # (n, V) ascending
        tail_mass = ordered.softmax(-1).cumsum(-1)  # (n, V)
        drop = tail_mass <= 1 - top_p
        drop[:, -1] = False  # the likeliest stays
        dropped = torch.empty_like(drop).scatter_(1, order, drop)  # (n, V) unsorted
        keep = keep & ~dropped
    return keep


def truncate_logits(logits, ids, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The sampler's kept set, replayed on the trainer's logits (see the top).

    (n, T, V) logits, (n, T) the sampled ids -> (n, T, V) logits that are
    FILTERED outside the set kept_tokens keeps at each position, with the
    sampled token always in it. log softmax over them is the truncated,
    renormalized log-prob; entropies and the KL are then over the truncated
    distribution too. With every filter off, the logits themselves. The mask is
    a constant: gradients flow through the kept logits only. Costs one (n, T, V)
    copy of the logits and a bool mask, and top-p a sort over V per position.
    """
    if not truncates(top_k, top_p, min_p):
        return logits

    n, T, V = logits.shape
    flat = logits.detach().reshape(n * T, V)  # (n*T, V)
    keep = torch.empty(n * T, V, dtype=torch.bool, device=logits.device)  # (n*T, V)
    step = max(1, CHUNK_ELEMENTS // V)
    with torch.no_grad():
        for i in range(0, n * T, step):
            scores = _upcast(flat[i:i + step], temperature)  # (rows, V)
            keep[i:i + step] = kept_tokens(scores, top_k, top_p, min_p)
    keep = keep.view(n, T, V)
    keep.scatter_(-1, ids.unsqueeze(-1), True)  # the sampled token, whatever rounding says
    return logits.masked_fill(~keep, FILTERED)  # (n, T, V)


@torch.no_grad()
def sequence_logps(model, prompts, completion_ids, temperature, micro,
                   dtype=torch.float32, top_k=0, top_p=1.0, min_p=0.0):
    """Per-token log-probs (N, T) of the completions under model.

    model is the old policy or the reference. micro sequences go in each forward:
    as in the update, the logits alive at once are (micro, T, V). top_k, top_p,
    min_p: the sampler's filters, replayed (truncate_logits).
    """
    logps = []
    for i in range(0, completion_ids.shape[0], micro):
        ids = completion_ids[i:i + micro]  # (micro, T)
        rows = slice(i, i + micro)
        logits = completion_logits(model, prompts, rows, ids, dtype)  # (micro, T, V)
        logits = truncate_logits(logits, ids, temperature, top_k, top_p, min_p)
        logps.append(selective_log_softmax(logits, ids, temperature))  # (micro, T)
    return torch.cat(logps)  # (N, T)
