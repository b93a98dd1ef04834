"""Variants of the default algorithm, each behind its flag.

    adaptive_entropy.py  Skywork-OR1's entropy controller (--adaptive-entropy)
    dynamic_sampling.py  DAPO's dynamic sampling: drop the groups with no signal,
                         draw more rounds (--dynamic-sampling N)
    gdpo.py              GDPO: each reward z-scored in its group before the sum
                         (--reward-aggregation normalize_then_sum)
"""
