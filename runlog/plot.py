"""
Plot a run's metrics.jsonl against step: reward, held-out accuracy (and pass@k
with --eval-samples), KL and completion length.

    python -m runlog.plot out    # writes out/metrics.png

train.py also writes it at the end of a run.

matplotlib is an optional dependency: train.py skips the plot, with a note,
when it is missing.
"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def plot_metrics(metrics_path, png_path=None):
    """metrics.jsonl -> a PNG of four panels, by default metrics.png beside it.

    Returns the PNG's path.
    """
    records = [json.loads(line) for line in open(metrics_path)]
    png_path = png_path or os.path.join(os.path.dirname(metrics_path), "metrics.png")
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))

    logged = {k for r in records for k in r if k.startswith("pass@")}
    # pass@1, pass@2, ... in the order of k
    passes = sorted(logged, key=lambda k: int(k[5:]))
    panels = [("reward", ["reward_mean"]),
              ("held-out accuracy", ["eval_greedy", "eval_sampled", *passes]),
              ("KL to reference", ["kl"]),
              ("completion length (tokens)", ["len_mean"])]

    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                marker = "o" if key.startswith(("eval", "pass@")) else None
                ax.plot(*zip(*points), marker=marker, label=key)

        if not ax.lines:
            note = "not logged (needs --beta > 0)" if keys == ["kl"] else "not logged"
            ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(keys) > 1 and ax.lines:
            ax.legend()

    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m runlog.plot OUT_DIR  (the folder that holds metrics.jsonl)")
    print(plot_metrics(os.path.join(sys.argv[1], "metrics.jsonl")))
