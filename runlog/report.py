"""
Dashboards, as TRL's `report_to`: each step's record (the line metrics.jsonl
gets) goes to wandb, trackio or tensorboard too, and a table of completions
where a caller logs one. train.py imports this file only with --report-to or
--wandb.

    python train.py --report-to trackio      # then: trackio show --project tinygrpo
    python train.py --report-to tensorboard  # then: tensorboard --logdir out/tensorboard
    python train.py --report-to wandb --project NAME
    python train.py --wandb NAME             # the same: --report-to wandb --project NAME
    python train.py --report-to trackio tensorboard    # several at once

In train.py:

    reporter = report.open(args, saved)   # every rank; None off rank 0
    reporter.log(record, step)            # each record of metrics.jsonl
    reporter.log_completions(rows, step)  # rows: dicts, one per completion
    reporter.close()

Where each keeps its runs: trackio in TRACKIO_DIR (default
~/.cache/huggingface/trackio: local, offline, no account; `trackio show`
serves the dashboard); tensorboard in <out-dir>/tensorboard; wandb where
`wandb login` / WANDB_MODE say.

Simplifications:
1. Rank 0 reports: the records are already over all ranks (train.py).
2. A backend gets the record as metrics.jsonl has it, nothing more: no model
   card, no parameter count, no gradients (TRL's callbacks add those).
   trackio adds its own CPU/GPU system metrics, as under TRL.
3. The run is named after --out-dir. A resumed run (train.py's checkpoint)
   continues trackio's run of that name, which keeps both points of a step
   redone after a crash (the same numbers: the resume is bit-exact);
   tensorboard drops the events after the checkpoint (purge_step), as
   metrics.jsonl drops its records; wandb starts a new run, as it did before
   --report-to.
4. tensorboard has no tables: the completions go in as a markdown table
   (add_text), one per logged step.
5. No "all" (TRL: every integration installed): name the backends.
"""
import json
import os

from common import master, require

# --report-to's choices (config.py) are these and "none"
BACKENDS = ("wandb", "trackio", "tensorboard")
# backend -> (the module to import, its pip package)
PACKAGES = {
    "wandb": ("wandb", "wandb"),
    "trackio": ("trackio", "trackio"),
    # torch's writer; it needs the tensorboard package for its protobufs
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
}


def backends(report_to, wandb_project):
    """--report-to's names and --wandb's project -> the backends, once each, in order.

    "none" reports nowhere (TRL's); --wandb PROJECT is --report-to wandb.
    """
    names = [name for name in report_to or [] if name != "none"]
    if wandb_project:
        names.append("wandb")

    return list(dict.fromkeys(names))


def open(args, saved=None):
    """The reporter of a run, or None: off rank 0, or with --report-to none.

    args: train.py's flags (their values are the run's config). saved: the
    resumed checkpoint's trainer state, or None for a new run. Every rank
    imports the packages first, so that a missing one stops all ranks with
    the same line.
    """
    names = backends(args.report_to, args.wandb)

    modules = {}
    for name in names:
        module, package = PACKAGES[name]
        flag = "--wandb" if name == "wandb" and args.wandb else f"--report-to {name}"
        modules[name] = require(module, f"{flag} needs the {package} package: "
                                        f"pip install {package}")

    if not names or not master:
        return None

    start_step = saved["step"] if saved else 0
    return Reporter(modules, args, start_step)


class Reporter:
    """One run in each backend: opened once (rank 0), then a record per step."""

    def __init__(self, modules, args, start_step):
        # the flags, less the server's key: a dashboard is no place for a secret
        config = {k: v for k, v in vars(args).items() if k != "vllm_api_key"}
        project = args.wandb or args.project
        name = os.path.normpath(args.out_dir)

        self.modules = modules  # for their Table classes and trackio.finish
        self.wandb = None
        self.trackio = None
        self.tensorboard = None

        if "wandb" in modules:
            self.wandb = modules["wandb"].init(project=project, name=name, config=config)

        if "trackio" in modules:
            # a new run, or the resumed one's (of the same name) continued
            resume = "allow" if start_step else "never"
            self.trackio = modules["trackio"].init(
                project=project, name=name, config=config, resume=resume)

        if "tensorboard" in modules:
            log_dir = os.path.join(args.out_dir, "tensorboard")
            # a resume: the events a crashed run wrote after its checkpoint go
            purge_step = start_step + 1 if start_step else None
            self.tensorboard = modules["tensorboard"].SummaryWriter(
                log_dir, purge_step=purge_step)
            self.tensorboard.add_text("config", code_block(config), start_step)

    def log(self, record, step):
        """One step's record (metrics.jsonl's line) at its step."""
        if self.wandb:
            self.wandb.log(record, step=step)

        if self.trackio:
            # "step" is trackio's own key (it would be renamed __step)
            self.trackio.log({k: v for k, v in record.items() if k != "step"}, step=step)

        if self.tensorboard:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tensorboard.add_scalar(key, value, step)
            # a dashboard follows the run live: each step on disk now, not every 120 s
            self.tensorboard.flush()

    def log_completions(self, rows, step):
        """A table of completions at a step: rows of dicts (step, prompt,
        completion, reward/<name>..., advantage, length, truncated), TRL's
        "completions" table. The columns: every key, in the order first seen."""
        columns = list(dict.fromkeys(key for row in rows for key in row))
        data = [[row.get(column) for column in columns] for row in rows]

        if self.wandb:
            table = self.modules["wandb"].Table(columns=columns, data=data)
            self.wandb.log({"completions": table}, step=step)

        if self.trackio:
            table = self.modules["trackio"].Table(columns=columns, data=data)
            self.trackio.log({"completions": table}, step=step)

        if self.tensorboard:
            self.tensorboard.add_text("completions", markdown_table(columns, data), step)
            self.tensorboard.flush()

    def close(self):
        """Flush and end every run (train.py, at the end)."""
        if self.wandb:
            self.wandb.finish()
        if self.trackio:
            self.modules["trackio"].finish()
        if self.tensorboard:
            self.tensorboard.close()


def markdown_table(columns, data):
    """Rows as a markdown table, the text tensorboard renders. A cell's | is
    escaped and its line breaks become <br>, which keep it one table row."""
    def cell(value):
        if isinstance(value, float):
            value = f"{value:.4g}"
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(map(cell, columns)) + " |",
             "|" + "---|" * len(columns)]
    for row in data:
        lines.append("| " + " | ".join(map(cell, row)) + " |")

    return "\n".join(lines)


def code_block(config):
    """The run's flags as indented JSON: a code block in tensorboard's markdown."""
    text = json.dumps(config, indent=1, default=str)
    return "\n".join("    " + line for line in text.splitlines())
