"""Truncated sampling, replayed by the trainer: --top-k, --top-p, --min-p.

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

replayed_on(forward, ...) is how train.py attaches it, once at set-up: the
forward's logits come out truncated, for the old, reference and current
log-probs alike. kept_tokens is also the HF engine's filter (rollout.py), so
both sides keep the same set.

    python train.py --top-p 0.9 --top-k 50

Run the tests: python -m pytest -q tests/test_truncated_sampling.py
"""
import dataclasses

import torch

from model import CHUNK_ELEMENTS, truncates, upcast

# a filtered logit on the trainer's side: finite in bf16 and fp32, so that the
# kernel's sum p * logit is 0 there, not 0 * -inf = NaN; and -1e9 / T still
# underflows exp to 0
FILTERED = -1e9


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


def filtered_scores(scores, top_k=0, top_p=1.0, min_p=0.0):
    """The HF engine's filter (rollout.process_logits): (n, V) scores, -inf
    outside the kept set."""
    return scores.masked_fill(~kept_tokens(scores, top_k, top_p, min_p), -torch.inf)


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
            scores = upcast(flat[i:i + step], temperature)  # (rows, V)
            keep[i:i + step] = kept_tokens(scores, top_k, top_p, min_p)
    keep = keep.view(n, T, V)
    keep.scatter_(-1, ids.unsqueeze(-1), True)  # the sampled token, whatever rounding says
    return logits.masked_fill(~keep, FILTERED)  # (n, T, V)


def replayed_on(forward, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """forward (a model.Forward) whose logits are truncated to the sampler's
    kept set (truncate_logits): every log-prob, entropy and KL the trainer takes
    through it is over the truncated distribution."""
    plain_logits = forward.logits

    def logits(model, prompts, rows, completion_ids, dtype=torch.float32):
        full = plain_logits(model, prompts, rows, completion_ids, dtype)  # (n, T, V)
        return truncate_logits(full, completion_ids, temperature, top_k, top_p, min_p)

    return dataclasses.replace(forward, logits=logits)
