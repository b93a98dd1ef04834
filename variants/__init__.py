"""Variants of the default algorithm, each behind its flag.

    adaptive_entropy.py  Skywork-OR1's entropy controller (--adaptive-entropy)
"""
