"""The sampler's settings that the trainer must replay on its side:
truncation.py (--top-k, --top-p, --min-p), attached at set-up when one is on."""
