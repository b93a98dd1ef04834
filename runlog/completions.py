"""
Completions to read: with --log-completions N, every N-th step's completions, all
ranks', one JSON line each in <out-dir>/completions.jsonl; a few printed above the
progress bar; the table handed to the tracker (--report-to). And a viewer for the file.

    python train.py --log-completions 10       # every 10th step's completions
    python -m runlog.completions show out             # page through them, step by step
    python -m runlog.completions show out --last --max-reward 0 --truncated

A line: step, prompt, completion, reward (the weighted total, as the advantage
sees it), reward/<name> per reward function (train.py's names; null where it
said None), advantage, length, truncated, and the columns reward functions logged
with log_extra, under their own names. TRL's log_completions (GRPOConfig) is a
switch that logs the same table (and a parquet file) every logging_steps; here N
is the interval itself. `python -m completions show out` runs the viewer too.

train.py calls it behind `if args.log_completions:` only:
    open_log(out_dir, keep_until)   rank 0: the file, cut back to a resumed step
    step_rows(...)                  this rank's completions of the step -> rows
    log(file, step, rows)           a collective: all ranks' rows to rank 0, which
                                    writes them, prints a few, hands them to the tracker

Tests: python -m pytest -q tests/test_completions.py

Simplifications:
1. The prompt is the dataset's (the question; a conversation as "role: content"
   lines), not the rendered text: the system prompt and chat template, the same
   for every row, are in run.json.
2. The completion is rollout.texts: its tokens decoded without EOS and special
   tokens; with --tools the tool outputs are in it, as the policy read them.
   length counts the policy's tokens (len_mean's), not the tool outputs'.
3. Every completion of the step, not a sample (TRL logs them all too). The
   console shows PRINTED of them, drawn by a generator seeded by the step (TRL:
   num_completions_to_print at random), so the run's RNGs are untouched.
4. The rows go to rank 0 as Python objects (all_gather_object): a step's text
   is small beside its rollout. They are written before the step's metrics
   record and checkpoint, so that a checkpoint's steps are always whole in the
   file; a resume cuts the file back to its step, as metrics.jsonl.
5. The viewer reads the whole file and imports no torch: it starts at once.
"""
import argparse
import json
import math
import os
import pydoc
import random
import sys

FILE = "completions.jsonl"
# completions printed per logged step (TRL's num_completions_to_print)
PRINTED = 4
# characters of a prompt or completion on the console's one line
WIDTH = 32
# a row's own fields, which a log_extra column may not take
FIELDS = ("step", "prompt", "completion", "reward", "advantage", "length", "truncated")


# -----------------------------------------------------------------------------
# Writing, in train.py

def open_log(out_dir, keep_until, log=print):
    """Rank 0: completions.jsonl open for appending, cut back to step keep_until
    (a resumed run's step; None: a new run, emptied). Other ranks: None.

    checkpoint.open_metrics does the cut: later records (redone) and torn lines
    (a kill mid-write) are dropped, saying so. A file that is not there starts
    empty without a word: the flag may have been off until this resume.
    """
    # imported here, not at the top: the viewer runs without torch
    from checkpoint import open_metrics
    from common import master

    if not master:
        return None

    path = os.path.join(out_dir, FILE)
    if not os.path.exists(path):
        keep_until = None
    return open_metrics(path, keep_until, log=log)


def step_logger(out_dir, every, keep_until, weights, names, reporter=None, reward_logs=None):
    """train.py's step logger for --log-completions N: every N-th step's rows to
    completions.jsonl (opened here, cut back to keep_until: open_log), before
    the step's record and checkpoint, so that a checkpoint's steps are whole in
    the file. reward_logs: reward_extras.RewardLogs, whose log_extra columns go
    with their rows, or None."""
    file = open_log(out_dir, keep_until)

    def log_completions(step, record, rows, rollout, rewards, advantages):
        if step % every == 0:  # a collective
            extra_columns = None
            if reward_logs is not None:
                extra_columns = reward_logs.columns_of(rows)
            lengths = rollout.completion_mask.sum(1)  # (N,)
            mine = step_rows(step, rows, rollout, rewards, advantages, lengths, weights,
                             names, extra_columns)
            log(file, step, mine, reporter)

    return log_completions


def prompt_text(prompt):
    """A row's prompt -> text: a string as it is, a conversation as its messages."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def finite(x):
    """x, or None where it is NaN or infinite (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def step_rows(step, rows, rollout, rewards, advantages, lengths, weights, names,
              extra_columns=None):
    """This rank's N completions of the step -> N rows (completions.jsonl's lines).

    rows: the data rows, one per completion; rewards (N, F) this rank's, NaN where
    a function said None; advantages (N,); lengths (N,) the policy's tokens;
    weights (F,), names (F,): the rewards'; extra_columns: {column: N values}
    from log_extra, or None. A column named as a row's own field stops the run.
    """
    N = len(rows)
    extra_columns = extra_columns or {}

    for column, values in extra_columns.items():
        if column in FIELDS or column.startswith("reward/"):
            from common import fail

            # on this rank: the others stop when torchrun sees it exit
            fail(f"a reward function logged a log_extra column {column!r}, a field of "
                 f"completions.jsonl's own ({', '.join(FIELDS)}, reward/<name>): rename "
                 f"the column", everywhere=False)
        if len(values) != N:
            raise ValueError(f"log_extra column {column!r} has {len(values)} values for "
                             f"{N} completions")

    # imported here, not at the top: the viewer runs without torch
    from advantage import total_rewards

    scores = rewards.tolist()  # (N, F)
    # the weighted sum of the rewards given, as the advantage sees it; NaN: none given
    totals = total_rewards(rewards, weights).tolist()  # (N,)
    advantages = advantages.tolist()  # (N,)
    lengths = lengths.tolist()  # (N,)
    finished = rollout.is_finished.tolist()  # (N,)

    out = []
    for i in range(N):
        row = dict(step=step, prompt=prompt_text(rows[i]["prompt"]),
                   completion=rollout.texts[i], reward=finite(totals[i]))
        for name, r in zip(names, scores[i]):
            row[f"reward/{name}"] = finite(r)
        row["advantage"] = advantages[i]
        row["length"] = int(lengths[i])
        row["truncated"] = not finished[i]
        for column, values in extra_columns.items():
            row[column] = finite(values[i])
        out.append(row)

    return out


def gather(rows):
    """Every rank's rows, in rank order, on rank 0 (None elsewhere). A collective.

    A column some rank's rows lack (a log_extra column logged on one rank) is
    null in the others', so that the table has one set of columns.
    """
    import torch.distributed as dist

    from common import ddp, master, world

    if ddp:
        parts = [None] * world
        dist.all_gather_object(parts, rows)
        rows = [r for part in parts for r in part]

    if not master:
        return None

    columns = dict.fromkeys(k for r in rows for k in r)
    return [{k: r.get(k) for k in columns} for r in rows]


def log(file, step, rows, reporter=None):
    """A collective: all ranks' rows of the step -> rank 0 writes them to file
    (one JSON line each, flushed), prints a few above the progress bar, and hands
    them to reporter.log_completions(rows, step) (report.py) where it has one."""
    from tqdm import tqdm

    rows = gather(rows)
    if rows is None:
        return

    # flushed before the step's record and checkpoint: lines a kill cuts short are
    # of a step no checkpoint holds yet, which a resume drops and redoes
    file.write("".join(json.dumps(r, default=str) + "\n" for r in rows))
    file.flush()

    tqdm.write(table(rows, step))
    if reporter is not None and hasattr(reporter, "log_completions"):
        reporter.log_completions(rows, step)


# -----------------------------------------------------------------------------
# The console's table

def one_line(text, width=WIDTH):
    """text quoted on one line ("\\n" for a newline), at most width characters
    inside the quotes: its middle cut out ("..."), since a completion's answer is
    at its end. The quotes show an empty or blank completion."""
    body = json.dumps(text, ensure_ascii=False)[1:-1]
    if len(body) > width:
        head = (width - 3) // 2
        tail = width - 3 - head
        body = body[:head] + "..." + body[len(body) - tail:]

    return f'"{body}"'


def number(x):
    return "-" if x is None else f"{x:.2f}"


def cell(x):
    """A log_extra value in the table: text quoted and short, a number to 2 places."""
    if isinstance(x, str):
        return one_line(x, WIDTH // 2)
    if isinstance(x, float):
        return number(x)
    return str(x)


def table(rows, step, k=PRINTED):
    """k of a step's rows as a small text table: prompt, completion (each on one
    line), each reward, advantage, log_extra's columns (TRL's order). The k are
    drawn by a generator seeded by the step: the same every time, and the run's
    RNGs untouched."""
    picks = sorted(random.Random(step).sample(range(len(rows)), min(k, len(rows))))

    names = [c for c in rows[0] if c.startswith("reward/")]
    extras = [c for c in rows[0] if c not in FIELDS and c not in names]  # log_extra's
    header = ["prompt", "completion", "reward", *(n[len("reward/"):] for n in names),
              "advantage", *extras]

    lines = [header]
    for i in picks:
        r = rows[i]
        lines.append([one_line(r["prompt"]), one_line(r["completion"]),
                      number(r["reward"]), *(number(r[n]) for n in names),
                      f"{r['advantage']:+.2f}", *(cell(r[c]) for c in extras)])

    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    text = [f"completions of step {step} ({len(picks)} of {len(rows)}; all in {FILE}):"]
    for line in lines:
        # the texts to the left, the numbers to the right
        cells = [x.ljust(w) if c < 2 else x.rjust(w)
                 for c, (x, w) in enumerate(zip(line, widths))]
        text.append("  " + "  ".join(cells).rstrip())

    return "\n".join(text)


# -----------------------------------------------------------------------------
# The viewer: python -m runlog.completions show OUT_DIR [--step K | --last] [filters]

def fail(msg):
    """One line on stderr, exit 2 (common.fail's format, without its torch)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def read_rows(path):
    """completions.jsonl -> (its rows, the torn lines skipped: a kill mid-write)."""
    rows = []
    torn = 0
    for line in open(path):
        try:
            rows.append(json.loads(line))
        except ValueError:
            torn += 1

    return rows, torn


def steps_text(steps):
    """[1, 2, 3, 5] -> "1-3, 5"."""
    runs = []
    for s in sorted(steps):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])

    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def keep(row, a):
    """Whether the viewer's filters (a: its flags) let row through."""
    reward = row.get("reward")
    if a.min_reward is not None and (reward is None or reward < a.min_reward):
        return False
    if a.max_reward is not None and (reward is None or reward > a.max_reward):
        return False
    return not (a.truncated and not row.get("truncated"))


def render(step, rows, shown):
    """One step's shown rows as text: each prompt once, then its completions in full.

    rows: the step's rows; shown: the indices (in the step) that passed the filters.
    """
    out = [f"=== step {step}: {len(shown)} of {len(rows)} completions ==="]
    prompt = None
    for i in shown:
        r = rows[i]
        if r["prompt"] != prompt:
            prompt = r["prompt"]
            out += ["", "prompt:", *("    " + line for line in prompt.splitlines())]

        rewards = ", ".join(f"{k[len('reward/'):]} {number(v)}" for k, v in r.items()
                            if k.startswith("reward/"))
        cut = ", truncated" if r.get("truncated") else ""
        out.append(f"  [{i}] reward {number(r.get('reward'))} ({rewards}), advantage "
                   f"{r['advantage']:+.3f}, length {r.get('length')}{cut}")

        for line in (r["completion"] or "(empty)").splitlines():
            out.append("      " + line)
        for k, v in r.items():
            if k not in FIELDS and not k.startswith("reward/"):
                out.append(f"      ({k}: {v})")

    return "\n".join(out) + "\n\n"


def show(argv):
    p = argparse.ArgumentParser(prog="python -m runlog.completions show",
                                description="page through an out-dir's completions.jsonl")
    p.error = fail
    p.add_argument("out_dir", help="a run's --out-dir (train.py --log-completions N)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="this step only")
    which.add_argument("--last", action="store_true", help="the last step logged only")
    p.add_argument("--min-reward", type=float, help="completions whose reward is >= this")
    p.add_argument("--max-reward", type=float, help="completions whose reward is <= this")
    p.add_argument("--truncated", action="store_true",
                   help="only completions cut at --max-new-tokens")
    a = p.parse_args(argv)

    if not os.path.isdir(a.out_dir):
        fail(f"{a.out_dir!r} is not a folder: give a run's --out-dir")
    path = os.path.join(a.out_dir, FILE)
    if not os.path.exists(path):
        fail(f"{path} does not exist: run train.py with --log-completions N "
             f"(every N-th step's completions)")

    rows, torn = read_rows(path)
    by_step = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    if not by_step:
        fail(f"{path} holds no completions yet")

    steps = sorted(by_step)
    if a.last:
        steps = steps[-1:]
    if a.step is not None:
        if a.step not in by_step:
            fail(f"no step {a.step} in {path} (logged: {steps_text(by_step)})")
        steps = [a.step]

    text = ""
    for step in steps:
        shown = [i for i, r in enumerate(by_step[step]) if keep(r, a)]
        if shown:
            text += render(step, by_step[step], shown)

    if not text:
        text = "no completion passes the filters\n"
    if torn:
        text += f"({torn} torn line(s) skipped: a run killed or still writing)\n"

    # a terminal gets a pager ($PAGER, else less); a pipe or a file, the text
    if sys.stdout.isatty():
        pydoc.pager(text)
    else:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        # `| head`: the reader left
        except BrokenPipeError:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    if sys.argv[1:2] != ["show"]:
        fail("usage: python -m runlog.completions show OUT_DIR [--step K | --last] "
             "[--min-reward X] [--max-reward X] [--truncated]")
    show(sys.argv[2:])
