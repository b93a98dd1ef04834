"""Rollout engines beyond rollout.py's plain HF loop.

    server.py            RemoteEngine: vLLM's own server on other machines (--vllm-mode server)
    worker_extension.py  the weight reload that server runs, and the key on every route
    staleness.py         the batches drawn ahead of the trainer (--max-staleness, --async)
"""
