"""What a run leaves behind, beside its checkpoints (checkpoint.py).

    metrics.py      the numbers of a micro-batch and of a step (metrics.jsonl)
    plot.py         metrics.png: python -m runlog.plot OUT_DIR
    completions.py  completions.jsonl (--log-completions) and its viewer
    report.py       the dashboards (--report-to, --wandb)
"""
