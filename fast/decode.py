"""The HF engine's decode loop, faster on the CPU: the same completions and
log-probs as rollout.HFEngine's plain loop for the same uniforms, to rounding
(tests/test_fast.py; bit for bit against the loop it replaced: test_decode.py).

    FastHFEngine          rollout.HFEngine with this sample loop
    draw_tokens(scores)   one token a row by a two-level inverse CDF (the same
                          uniforms as the plain sampler's)

What the loop does that the plain one does not:
1. Each prompt's forward once for its n completions; on the CPU in fp32 its
   keys and values stay once too, and a decode step attends to them by cascade
   attention (fast/attention.py, SharedPrefix).
2. A preallocated cache that returns its filled slots only (no torch.cat a step).
3. The LM head in tiles of its weight (tiled_head), a token drawn by a
   two-level CDF (draw_tokens).
4. Rows that end leave the batch (leave_batch).
5. LoRA: each adapted layer one matmul of its merged weight (fast/lora.py).
Figures: docs/benchmarks.md (the passes of the CPU work, bench decode).
"""
import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common import all_ranks_ok, private_rng, unwrap
from fast import forwards_replaced
from fast.attention import GQA_ATTENTION, SharedPrefix
from fast.lora import merged_adapters
from model import sequence_batch
from rollout import HFEngine, as_lists, process_logits


class FastHFEngine(HFEngine):
    """rollout.HFEngine, its sample loop this file's."""

    @torch.no_grad()
    def sample(self, prompt_ids, n, max_new_tokens, rng_seed, temperature=1.0, **filters):
        model = unwrap(self.model)
        greedy = temperature == 0
        B = len(prompt_ids)
        no_completions = torch.zeros(B, 0, dtype=torch.long)  # (B, 0)
        batch = sequence_batch(prompt_ids, no_completions, self.pad_id)
        # (B, P) x3, left-padded
        ids, mask, positions = (x.to(model.device) for x in batch)
        # (N,) each completion's prompt
        rows = torch.arange(B, device=ids.device).repeat_interleave(n)
        eos = torch.tensor(self.eos_ids, device=ids.device)

        # FSDP2 all-gathers every forward: the ranks stop together
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        synced = dist.is_initialized() and sharded
        if synced:
            agree = all_ranks_ok
        else:
            agree = bool

        was_training = model.training
        tokens = []
        logps = []
        model.eval()
        enabled = self.dtype != torch.float32
        autocast = torch.autocast(model.device.type, self.dtype, enabled)
        # LoRA on the CPU: each adapted layer one matmul of its merged weight
        with private_rng(rng_seed), autocast, merged_adapters(model):
            # 1) prefill: each prompt once (HF generate would run it n times)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        use_cache=True, logits_to_keep=1)
            logits = out.logits[rows, -1]  # (N, V)

            # 2) copy the KV cache to its n completions, in a buffer that holds
            # every new token (no torch.cat a step)
            P = ids.shape[1]
            # FSDP2: a rank steps on until the longest-running rank ends
            steps = max_new_tokens
            if synced:
                from scale.fsdp import most_on_any_rank

                steps = most_on_any_rank(max_new_tokens, ids.device)
            # on the CPU in fp32, a prompt's keys and values are kept once for
            # its n rows (SharedPrefix); else each row gets a copy
            filled_only = full_attention(out.past_key_values)
            prefix = None
            if filled_only and shares_prefix(model, self.dtype):
                prefix = SharedPrefix(out.past_key_values, mask.bool(), rows)
                cache = preallocated_cache(model, None, rows, steps, filled_only)
            else:
                cache = preallocated_cache(model, out.past_key_values, rows, P + steps,
                                           filled_only)
            # (N, P) the tokens so far, a real token in place of each pad
            seen = torch.where(mask.bool(), ids, ids[:, -1:])[rows]
            # (N, P + steps): a new token's slot is unmasked as it enters
            full_mask = torch.zeros(len(rows), P + steps, dtype=mask.dtype, device=ids.device)
            full_mask[:, :P] = mask[rows]
            last = positions[rows, -1:]  # (N, 1) the last prompt position
            done = torch.zeros_like(rows, dtype=torch.bool)  # (N,)
            lengths = torch.zeros_like(rows)  # (N,) tokens up to the first EOS

            # 3) decode one token a step, the LM head in tiles. `active`: the
            # rows still in the batch (leave_batch)
            active = torch.arange(len(rows), device=ids.device)  # (A,)
            with tiled_head(model, self.dtype):
                for t in itertools.count():
                    # under FSDP2 a rank past its last token steps on
                    if t < max_new_tokens:
                        scores = process_logits(logits.float(), seen, temperature,
                                                **filters)  # (A, V)
                        # a uniform for each of the N rows, in the batch or not:
                        # a row's draws do not depend on when the others end
                        uniforms = None
                        if not greedy:
                            uniforms = torch.rand(len(rows), 1, dtype=torch.float64,
                                                  device=ids.device)[active]  # (A, 1)
                        token, logp = draw_tokens(scores, greedy, uniforms)  # (A,) each
                        ended = done[active]  # (A,)
                        token = token.masked_fill(ended, self.pad_id)

                        tokens.append(torch.full_like(rows, self.pad_id).index_copy_(
                            0, active, token))  # (N,)
                        logps.append(logp.new_zeros(len(rows)).index_copy_(
                            0, active, logp))  # (N,)
                        lengths[active] += ~ended
                        done[active] = ended | torch.isin(token, eos)
                        if filters.get("repetition_penalty", 1) != 1:
                            seen = torch.cat([seen, token[:, None]], 1)  # (A, S+1)

                    if agree(t + 1 >= max_new_tokens or bool(done.all())):
                        break

                    keep = leave_batch(done[active])
                    if keep is not None:
                        active = active[keep]  # (A',)
                        cache.reorder_cache(keep)
                        if prefix is not None:
                            prefix.keep(keep)
                        token, seen, full_mask, last = (x[keep] for x in
                                                        (token, seen, full_mask, last))

                    full_mask[:, P + t] = 1
                    step_mask = full_mask  # (A, P + steps)
                    extra = {}
                    if prefix is not None:
                        # the completions' own slots, all attended; the prompts'
                        # come from the prefix
                        step_mask = full_mask[:, None, None, P:P + t + 1].bool()  # (A, 1, 1, t+1)
                        extra = dict(shared_prefix=prefix)
                    elif filled_only:
                        step_mask = full_mask[:, None, None, :P + t + 1].bool()  # (A, 1, 1, P+t+1)
                    logits = model(input_ids=token[:, None], attention_mask=step_mask,
                                   past_key_values=cache, position_ids=last + t + 1,
                                   use_cache=True, **extra).logits[:, -1]  # (A, V)
        model.train(was_training)

        return as_lists(tokens, logps, lengths, done)


# tokens per block of draw_tokens' two-level CDF
CDF_BLOCK = 256


def draw_tokens(scores, greedy=False, uniforms=None):
    """One token per row from p = softmax(scores), by inverse CDF, or the argmax
    if greedy. (N, V) -> (N,) tokens and (N,) their log-probs log p. scores are
    overwritten (with exp(scores - max)): the decode loop's own, not needed after.
    uniforms (N, 1) fp64 in [0, 1): the rows' draws, else drawn here.

    One uniform u per row, scaled to the row's total mass, picks the first token
    whose cumulative probability exceeds it: token v with probability p_v
    (https://en.wikipedia.org/wiki/Inverse_transform_sampling). torch's
    multinomial draws an exponential per logit instead, 8 % of a decode step
    here.

    The CDF has two levels: the blocks' masses (CDF_BLOCK tokens each), then
    the tokens of the one block u falls in, each cumulated in fp64. A single
    cumulative sum over V picks the same token but where u lies within rounding
    (~1e-7 of a block's mass) of a boundary, at several times the cost (a
    sequential scan of V numbers a row). A token of probability 0 (filtered,
    -inf) spans an empty interval and is never drawn. tests/test_decode.py
    checks the frequencies against p, and the tokens against one cumulative sum.
    """
    N, V = scores.shape
    top = scores.amax(-1, keepdim=True)  # (N, 1)
    # log p = s - max - log(sum exp(s - max)): s - max of the chosen token
    if greedy:
        token = scores.argmax(-1)  # (N,)
        chosen_minus_top = scores.gather(1, token[:, None]) - top  # (N, 1)

    weights = scores.sub_(top).exp_()  # (N, V) unnormalised p, in place
    block_mass = _block_sums(weights).double()  # (N, blocks)
    block_cdf = block_mass.cumsum(-1)  # (N, blocks)
    total = block_cdf[:, -1:]  # (N, 1)

    if not greedy:
        if uniforms is None:
            uniforms = torch.rand(N, 1, dtype=torch.float64, device=scores.device)
        token = _inverse_cdf(weights, block_cdf, uniforms * total)  # (N,)
        # exp(s - max) of the drawn token: > 0, so its log is s - max to rounding
        chosen_minus_top = weights.gather(1, token[:, None]).log()  # (N, 1)

    logp = chosen_minus_top.double() - total.log()  # (N, 1)
    return token, logp[:, 0].to(scores.dtype)


def _block_sums(weights):
    """(N, V) -> (N, blocks): the sum of each CDF_BLOCK tokens, the last block
    those left over."""
    N, V = weights.shape
    full = V // CDF_BLOCK * CDF_BLOCK
    sums = weights[:, :full].reshape(N, -1, CDF_BLOCK).sum(-1)  # (N, V // CDF_BLOCK)
    if full < V:
        rest = weights[:, full:].sum(-1, keepdim=True)  # (N, 1)
        sums = torch.cat([sums, rest], 1)
    return sums


def _inverse_cdf(weights, block_cdf, u):
    """The token u (N, 1) in [0, total mass) picks in each row: first its block,
    then the token in it."""
    V = weights.shape[1]
    size = min(CDF_BLOCK, V)

    # the first block whose cumulative mass exceeds u. u < total, so one
    # exists and has mass; where rounding puts u at the total, the last block
    # of mass (the first whose sum is the total)
    block = torch.searchsorted(block_cdf, u, right=True)  # (N, 1)
    last_block = (block_cdf < block_cdf[:, -1:]).sum(-1, keepdim=True)  # (N, 1)
    block = torch.minimum(block, last_block)
    before = block_cdf.gather(1, (block - 1).clamp(min=0))  # (N, 1)
    before = torch.where(block > 0, before, 0.0)
    # u's place in the block, >= 0 as block_cdf[block - 1] <= u
    u_in = u - before  # (N, 1)

    # the block's tokens (the last block's padding: weight 0)
    offsets = torch.arange(size, device=weights.device)
    index = block * CDF_BLOCK + offsets  # (N, size)
    block_weights = weights.gather(1, index.clamp(max=V - 1)) * (index < V)  # (N, size)
    cdf = block_weights.double().cumsum(-1)  # (N, size)
    token = torch.searchsorted(cdf, u_in, right=True)  # (N, 1)

    # the first sum past u_in has mass; rounding can leave u_in at or past the
    # block's last sum (no such token): then its last token of mass
    past = token >= size  # (N, 1)
    if past.any():
        last = (block_weights > 0).cumsum(-1).argmax(-1, keepdim=True)  # (N, 1)
        token = torch.where(past, last, token)
    return (index.gather(1, token))[:, 0]  # (N,)


def preallocated_cache(model, prefill_cache, rows, length, filled_only):
    """The prompts' KV cache (B rows), copied to the completions' rows (N,) of
    a StaticCache of `length` positions. prefill_cache None: an empty cache,
    for the completions' own keys and values (SharedPrefix holds the prompts').

    Each decode step writes its token's keys and values in place; a growing
    DynamicCache would copy the whole cache a step (torch.cat). filled_only
    (every layer full attention): a layer returns its filled slots only (the
    prompt and the tokens so far), so that attention reads no unfilled ones;
    the decode step's mask is then (A, 1, 1, filled), 4D, which transformers
    passes on as it is. Else (sliding-window layers have their own lengths)
    attention runs over all `length` slots, the unfilled ones masked.
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    class DecodeLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            # under autocast the prompt's keys can come out fp32 (RoPE's fp32
            # tables) and a decode step's bf16: stored in the first one's
            # dtype, as torch.cat would promote them
            if self.is_initialized:
                key_states = key_states.to(self.keys.dtype)
                value_states = value_states.to(self.values.dtype)
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if not filled_only:
                return keys, values
            filled = int(self.cumulative_length)
            return keys[:, :, :filled], values[:, :, :filled]

    cache = StaticCache(config=model.config, max_cache_len=length)
    # (a sliding-window layer keeps its own class)
    cache.layers = [DecodeLayer(max_cache_len=length) if type(layer) is StaticLayer else layer
                    for layer in cache.layers]
    for i, layer in enumerate(getattr(prefill_cache, "layers", [])):
        # (N, H_kv, P, d) each
        cache.update(layer.keys[rows], layer.values[rows], i)
    return cache


def full_attention(prefill_cache):
    """Whether every layer of a prefill's DynamicCache attends to the whole
    sequence (no sliding window)."""
    from transformers.cache_utils import DynamicLayer

    return all(type(layer) is DynamicLayer for layer in prefill_cache.layers)


def shares_prefix(model, dtype):
    """Whether the HF engine's decode steps (of a full-attention model) attend
    through SharedPrefix: our grouped attention (the CPU's,
    sdpa_gqa_attention), and fp32 (no autocast: the prompts' and the
    completions' keys in one dtype)."""
    return model.config._attn_implementation == GQA_ATTENTION and dtype == torch.float32


def leave_batch(ended):
    """Which rows the HF engine's next decode step keeps: (A,) bool, the rows
    that have ended -> (A',) the indices of those that have not, or None to keep
    them all.

    An ended row still costs a step its share of every matmul and of attention
    (4 in 10 of bench real's rows end early). Dropping rows copies the KV cache
    of those kept, so it waits until an eighth of the batch has ended. The
    last rows stay (a rank under FSDP2 steps on until all ranks end).
    """
    count = int(ended.sum())
    if count == 0 or count == len(ended) or 8 * count < len(ended):
        return None
    return (~ended).nonzero()[:, 0]  # (A',)


# the LM head's weight rows per matmul while the HF engine decodes on CPU
HEAD_TILE_ROWS = 2048
# the fewest rows a decode step's head runs in tiles for (fewer: the plain head)
HEAD_TILE_MIN_ROWS = 16


def tiled_head(model, engine_dtype):
    """While the HF engine decodes on CPU in fp32: the LM head as weight tiles
    times the hidden states, W[i : i + HEAD_TILE_ROWS] @ x^T.

    Why: a decode step has few rows (16 in the real recipe) and a head of
    V x d weights (49,152 x 576 for SmolLM2). MKL runs x @ W^T at that shape
    well below its rate on tiles of W, each of which it reuses from cache.
    Each logit is still one d-long dot product: the same bits where MKL sums
    it in the same order. Its kernel for a handful of rows (2-11 here) orders
    it otherwise, a rounding apart that moves SmolLM2's log-probs by up to
    3e-5: a step with fewer than HEAD_TILE_MIN_ROWS rows (rows that ended
    have left the batch) keeps the plain head. Tests: tests/test_decode.py;
    figures: docs/benchmarks.md ("The real model against TRL, side by side").

    Elsewhere (a GPU, autocast, a head with a bias or sharded by FSDP2, LoRA
    on the head, a vocabulary of one tile) the head is left as it is.
    """
    head = model.get_output_embeddings()
    tileable = (type(head) is torch.nn.Linear and head.bias is None
                and not isinstance(head.weight, DTensor)
                and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32
                and engine_dtype == torch.float32
                # one tile would be the plain head
                and len(head.weight) > HEAD_TILE_ROWS)
    if not tileable:
        return forwards_replaced([])

    def forward(x):  # (..., d)
        rows = x.reshape(-1, x.shape[-1])  # (n, d)
        # mm(out=) has no backward: the sampler runs without gradients
        if torch.is_grad_enabled() or len(rows) < HEAD_TILE_MIN_ROWS:
            return torch.nn.Linear.forward(head, x)

        weight = head.weight  # (V, d)
        logits = x.new_empty(len(weight), len(rows))  # (V, n)
        for start in range(0, len(weight), HEAD_TILE_ROWS):
            tile = slice(start, start + HEAD_TILE_ROWS)
            torch.mm(weight[tile], rows.t(), out=logits[tile])
        # contiguous, as the sampler's reductions over V expect (and sum in
        # the same order)
        return logits.t().contiguous().reshape(*x.shape[:-1], len(weight))  # (..., V)

    return forwards_replaced([(head, forward)])
