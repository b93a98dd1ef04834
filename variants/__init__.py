"""Variants of the default algorithm, each behind its flag.

    objectives.py        loss.py's other policy objectives (--loss-type cispo, sapo,
                         vespo), --delta's cap on the clip, GSPO's sequence ratio
                         (--importance-sampling-level sequence)
    reductions.py        loss.py's other normalisations (--loss-type bnpo, dr_grpo,
                         dapo, luspo; cispo, sapo and vespo borrow one)
    token_weights.py     w_t, the loss's token weight: --is-correction,
                         --off-policy-mask, --top-entropy-quantile, --mask-truncated
    adaptive_entropy.py  Skywork-OR1's entropy controller (--adaptive-entropy)
    dynamic_sampling.py  DAPO's dynamic sampling: drop the groups with no signal,
                         draw more rounds (--dynamic-sampling N)
    gdpo.py              GDPO: each reward z-scored in its group before the sum
                         (--reward-aggregation normalize_then_sum)
"""
