"""pass@k of the held-out evaluation (--eval-samples n, --eval-k): the chance
that at least one of k completions of a prompt passes, from n samples.

    python train.py --eval-samples 8 --eval-k 1 4 8

Run the tests: python -m pytest -q tests/test_pass_at_k.py
"""
import math


def pass_at_k(n, c, k):
    """P(at least one of k completions passes), unbiased from n >= k samples of
    which c passed (Chen et al. 2021, arXiv 2107.03374, eq. 1):
    1 - C(n-c, k) / C(n, k). Computed as their numpy snippet does, since the
    binomials overflow: 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, "
                         f"k={k}")

    # every k-subset holds a passing sample
    if n - c < k:
        return 1.0

    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
