"""Attention, faster on the CPU: transformers' "sdpa" with the grouped KV heads
passed as they are, and the HF engine's decode attention over each prompt's
keys and values once for all its completions (SharedPrefix).

    register_gqa_attention()   transformers' registry name of sdpa_gqa_attention
    SharedPrefix               a decode step's cascade attention (fast/decode.py)

fast.install switches the policy and the reference to it (the CPU).
Tests: tests/test_decode.py, tests/test_prefix_sharing.py.
"""
import torch


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
