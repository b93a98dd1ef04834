"""
The prompts a run trains on. Load a dataset, render each question through the
model's chat template, encode it, and draw the stream of prompts step after step.

    load_rows(dataset, ...)            -> (train, held-out rows): the task or a dataset
    load_prompt_dataset(name_or_path)  a hub id, dataset folder or local files -> rows
                                       (.jsonl here; the rest: data_sources/)
    prepare_prompts(tokenizer, rows)   render, encode, drop the too long ones
                                       -> (rows, ids, conversational)
    batch_indices(...)                 this rank's rows for the next prompts of the stream

A row is {"prompt", "solution", other columns}. Every other column reaches the
reward functions as a keyword argument. Tests: python -m pytest -q tests/test_data.py

Simplifications:
1. A local file loads as datasets' single split "train", and slices like
   "train[:100]" work. Hold out a test set as its own file. .jsonl files,
   whole or sliced by integers, are read without datasets (_load_json_lines).
2. Rows keep the dataset's prompt (the question), not the rendered text. Rewards,
   including reward models with their own chat template, see the question as the
   dataset wrote it (as in TRL).
3. The data order is a pure function of (seed, prompts consumed): a resumed run
   draws what the uninterrupted one would.
"""
import functools
import glob
import json
import os
import random
import re

from task import make_sort_dataset


def batch_indices(num_rows, consumed, per_step, rank, world, seed):
    """This rank's row indices for the next per_step prompts of the stream.

    `consumed` prompts were drawn before: step * per_step without
    --dynamic-sampling, which draws several such rounds per step. The rows are
    shuffled once per epoch by the seed, in the same order on every rank. It is a
    pure function of (seed, consumed), so a resumed run draws what the
    uninterrupted one would.

    Global draw g (consumed + rank's offset + i) is position g % num_rows of epoch
    g // num_rows's permutation. A batch that crosses an epoch boundary ends the
    old epoch, then starts the new one, and every epoch draws each prompt exactly
    once.
    """
    per_rank = per_step // world
    # this rank's first global draw
    first = consumed + rank * per_rank
    draws = range(first, first + per_rank)

    return [epoch_order(num_rows, seed, g // num_rows)[g % num_rows] for g in draws]


# Shuffling 20,000 rows in Python costs ~6 ms: once per epoch, not once per step.
@functools.lru_cache(maxsize=2)
def epoch_order(num_rows, seed, epoch):
    order = list(range(num_rows))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return tuple(order)


# DeepSeek-R1 (arXiv 2501.12948) Table 1, without its <answer> tags.
# think_format_reward wants "<think>...</think>answer", and reasoning_accuracy_reward
# reads the answer after "</think>".
DEFAULT_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the "
    "Assistant solves it. The Assistant first thinks about the reasoning process in the "
    "mind and then provides the user with the answer. The reasoning process is enclosed "
    "within <think> </think> tags and followed by the final answer, i.e., <think> "
    "reasoning process here </think> final answer here")


# The keywords every reward function already gets (tool_calls: with --tools).
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "tool_calls",
                    "environment_rewards")


def load_prompt_dataset(name_or_path, *, config=None, split="train",
                        prompt_column="prompt", solution_column="solution"):
    """A dataset -> a list of row dicts.

    The dataset is a hub id (with config and split), a local dataset folder, or
    local .json/.jsonl/.csv/.parquet file(s): a path, a glob, or a list of them.
    The prompt column is renamed "prompt" and the solution column "solution"
    (None: the dataset has no golds). Every other column is kept, and reaches the
    reward functions as a keyword argument. GSM8K:

        load_prompt_dataset("openai/gsm8k", config="main", prompt_column="question",
                            solution_column="answer")
    """
    if isinstance(name_or_path, (str, os.PathLike)):
        paths = [name_or_path]
    else:
        paths = list(name_or_path)
    paths = [os.fspath(p) for p in paths]
    exts = {os.path.splitext(p)[1].lower() for p in paths}

    # JSON lines, whole or an integer slice: read here, without datasets
    # (_load_json_lines)
    lines_slice = _JSON_LINES_SPLIT.fullmatch(split)
    if exts == {".jsonl"} and lines_slice:
        start, stop = (int(x) if x else None for x in lines_slice.groups())
        rows, columns = _load_json_lines(paths, name_or_path, slice(start, stop))
        return _prompt_rows(rows, columns, name_or_path, split, prompt_column,
                            solution_column)

    # other files and splits, a hub id or a dataset folder: HF datasets
    # (data_sources/hf_datasets.py)
    from data_sources.hf_datasets import load_with_datasets

    ds = load_with_datasets(paths, exts, config, split, name_or_path)
    return _prompt_rows(ds, ds.column_names, name_or_path, split, prompt_column,
                        solution_column)


def _prompt_rows(ds, columns, name_or_path, split, prompt_column, solution_column):
    """A loaded dataset (datasets', or _load_json_lines's rows) and its columns ->
    its rows, the prompt and solution columns renamed and checked."""
    where = f"dataset {name_or_path!r} (split {split!r})"
    if len(ds) == 0:
        raise ValueError(f"{where} is empty")

    renames = {prompt_column: "prompt"}
    if solution_column:
        renames[solution_column] = "solution"
    _check_columns(columns, renames, where)

    rows = [{renames.get(k, k): v for k, v in row.items()} for row in ds]
    bad = [i for i, r in enumerate(rows) if not _is_prompt(r["prompt"])]
    if bad:
        more = f" (and {len(bad) - 1} more rows)" if len(bad) > 1 else ""
        prompt = rows[bad[0]]["prompt"]
        raise ValueError(f"{where}: row {bad[0]} has prompt {prompt!r:.80} in column "
                         f"{prompt_column!r}{more}: a prompt must be a non-empty string "
                         "or a conversation (a list of {'role', 'content'} messages)")
    return rows


def check_files_exist(paths):
    """FileNotFoundError naming each path or glob that matches no file."""
    missing = [p for p in paths if not glob.glob(p)]
    if missing:
        raise FileNotFoundError(f"dataset file not found: {', '.join(missing)}")


# the splits of local .jsonl files read without datasets: "train", "train[a:b]"
# (a Python slice of the rows, as datasets takes it; a percent goes to datasets)
_JSON_LINES_SPLIT = re.compile(r"train(?:\[(-?\d*):(-?\d*)\])?")


def _load_json_lines(paths, name_or_path, rows_slice):
    """Local .jsonl files, each line one row, read with json -> (the rows_slice
    of the rows, a dict each; the columns of all rows).

    Why not datasets: importing it and its Arrow tables keeps ~80 MB resident
    for the whole run, on a 135M model's 3 GB (docs/benchmarks.md). The rows are
    the ones datasets gives: the files in sorted order per pattern, blank lines
    skipped, a column a row lacks set to None. Unlike datasets, a column's
    values keep the types JSON gave them (datasets casts a column of ints and
    floats to floats).
    """
    check_files_exist(paths)
    rows = [row for pattern in paths for path in sorted(glob.glob(pattern))
            for row in json_lines(path)]

    not_objects = [i for i, row in enumerate(rows) if not isinstance(row, dict)]
    if not_objects:
        raise ValueError(f"cannot read dataset {name_or_path!r}: row {not_objects[0]} is "
                         f"{rows[not_objects[0]]!r:.80}, not a JSON object: fix the file")
    if not rows:
        raise ValueError(f"cannot load split 'train' of {name_or_path!r}: no rows (empty "
                         "files have no rows)")

    # every column, in the order rows first name them (dicts keep insertion order)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    kept = [{column: row.get(column) for column in columns} for row in rows[rows_slice]]
    return kept, columns


def _check_columns(columns, renames, where):
    """ValueError unless the mapped columns exist and no other column clashes.

    A column clashes with "prompt" or "solution", or with a keyword that reward
    functions already get.
    """
    for column, role in renames.items():
        if column not in columns:
            hint = ""
            if role != "prompt":
                hint = "; pass solution_column=None if it has no gold answers"
            raise ValueError(f"{where} has no {role} column {column!r}; "
                             f"its columns are {columns}{hint}")

    for column in set(columns) - set(renames):
        if column in set(renames.values()) or column in RESERVED_COLUMNS:
            raise ValueError(f"{where}: column {column!r} would clash with the "
                             f"{column!r} keyword that reward functions get; drop or "
                             "rename it (or map it with prompt_column/solution_column)")


def json_lines(path):
    """The JSON value of each non-blank line of a .jsonl file; ValueError naming
    the file and line of one that is not JSON."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except ValueError as e:
                raise ValueError(f"dataset file {path}: line {n} is not valid "
                                 f"JSON ({e}): fix or remove it") from None


def _is_prompt(p):
    """A non-empty string, or a non-empty list of {"role", "content"} messages."""
    if isinstance(p, str):
        return p.strip() != ""
    if not isinstance(p, list) or len(p) == 0:
        return False
    return all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in p)


def render_prompts(tokenizer, questions, system_prompt=DEFAULT_SYSTEM_PROMPT, tools=None):
    """Questions -> (prompt_texts, conversational).

    A question is a string, or a conversation as a list of {"role", "content"}.
    With a chat template: system + user messages, rendered with the generation
    prompt, conversational=True; tools, one list of JSON schemas per question,
    go to the template's tools=. Without one: plain text in the R1-Zero style,
    "{system_prompt}\n\nUser: {question}\nAssistant:", conversational=False. Only
    the question is left when system_prompt is None or empty.
    """
    if getattr(tokenizer, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if tools is None:
            tools = [None] * len(questions)

        texts = []
        for q, schemas in zip(questions, tools, strict=True):
            messages = [{"role": "user", "content": q}] if isinstance(q, str) else list(q)
            # a conversation that brings its own system prompt keeps it
            if messages[0]["role"] != "system":
                messages = system + messages
            # `or None`: some templates write their tools preamble for tools=[]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                 tokenize=False, tools=schemas or None)
            texts.append(text)
        return texts, True

    if any(not isinstance(q, str) for q in questions):
        raise ValueError("the dataset's prompts are conversations but the tokenizer has "
                         "no chat template: use a chat model, or a dataset whose prompts "
                         "are strings")
    if not system_prompt:
        return list(questions), False
    return [f"{system_prompt}\n\nUser: {q}\nAssistant:" for q in questions], False


def encode_prompts(tokenizer, prompt_texts, conversational):
    """Rendered prompts -> lists of token ids.

    A chat template already writes BOS where its model wants one (Llama 3's
    <|begin_of_text|>). So its text is encoded with add_special_tokens=False, or
    BOS comes twice (huggingface/open-r1#462). Plain text keeps the tokenizer's own
    BOS (huggingface/trl#3520: dropping it garbles Gemma's output).
    """
    # One tokenizer call for the distinct texts (the built-in task: 20,000 prompts,
    # ~800 distinct).
    distinct = list(dict.fromkeys(prompt_texts))
    encoded = tokenizer(distinct, add_special_tokens=not conversational)["input_ids"]
    ids = dict(zip(distinct, encoded))

    # shared lists: nothing writes into a prompt's ids
    return [ids[text] for text in prompt_texts]


def prompt_limit(max_prompt_len, max_new_tokens, context_len):
    """The longest prompt the model's context leaves room for next to --max-new-tokens.

    ValueError when there is none.
    """
    if max_new_tokens >= context_len:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt "
                         f"in the model's context of {context_len} tokens: lower it")
    return min(max_prompt_len, context_len - max_new_tokens)


def load_rows(dataset, *, digits, eval_size, seed, config, split, eval_split,
              prompt_column, solution_column):
    """-> (train rows, held-out rows).

    They are the built-in task when dataset is None, else the dataset's two splits.
    """
    if dataset is None:
        return make_sort_dataset(digits, num_test=eval_size, seed=seed)

    columns = dict(prompt_column=prompt_column, solution_column=solution_column)
    train = load_prompt_dataset(dataset, config=config, split=split, **columns)
    held_out = load_prompt_dataset(dataset, config=config, split=eval_split, **columns)
    return train, held_out[:eval_size]


def prepare_prompts(tokenizer, rows, system_prompt, max_len, what, raw=False, log=print,
                    min_rows=1, tools_of=None):
    """Rows -> (kept rows, their token ids, conversational).

    1. Render: the chat template and the system prompt, or plain text. raw keeps
       the question as it is, as the built-in task wants. tools_of(row): the
       JSON schemas its prompt shows.
    2. Encode.
    3. Drop the prompts over max_len tokens.
    ValueError when fewer than min_rows are left (train.py: each rank evaluates a
    share of the held-out ones).
    """
    # None: the default system prompt ('' is none)
    if system_prompt is None:
        system_prompt = DEFAULT_SYSTEM_PROMPT

    questions = [r["prompt"] for r in rows]
    tools = None
    if tools_of is not None:
        tools = [tools_of(r) for r in rows]
    if raw:
        texts = questions
        conversational = False
    else:
        texts, conversational = render_prompts(tokenizer, questions, system_prompt, tools)

    # (a chat template writes its own BOS)
    ids = encode_prompts(tokenizer, texts, conversational)

    keep = [i for i, x in enumerate(ids) if len(x) <= max_len]
    if not keep:
        raise ValueError(f"all {len(rows)} {what} prompts are longer than "
                         f"--max-prompt-len {max_len} tokens: raise it (the model's "
                         "context must also hold --max-new-tokens)")
    if len(keep) < min_rows:
        raise ValueError(f"{len(keep)} of {len(rows)} {what} prompts fit in "
                         f"--max-prompt-len {max_len} tokens, fewer than the {min_rows} "
                         "ranks that each need one: raise --max-prompt-len or add "
                         "prompts")
    if len(keep) < len(rows):
        dropped = len(rows) - len(keep)
        log(f"warning: dropped {dropped} of {len(rows)} {what} prompts longer than "
            "--max-prompt-len")

    return [rows[i] for i in keep], [ids[i] for i in keep], conversational
