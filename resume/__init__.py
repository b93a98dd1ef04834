"""Resuming a run from its out-dir: checkpoints.py (checkpoint.py writes what it reads)."""
