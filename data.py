"""
The prompts a run trains on: load a dataset, render each question through the model's chat template,
encode it, and draw the stream of prompts step after step.

    load_rows(dataset, ...)            -> (train, held-out rows): the built-in task or a dataset
    load_prompt_dataset(name_or_path)  a hub id, dataset folder or local files -> rows
    prepare_prompts(tokenizer, rows)   render, encode, drop too long -> (rows, ids, conversational)
    batch_indices(...)                 this rank's rows for the next prompts of the stream

A row is {"prompt", "solution", other columns}; every other column reaches the reward functions as a
keyword argument. Tests: python -m pytest -q tests/test_data.py

Simplifications:
1. A local file loads as datasets' single split "train" (slices like "train[:100]" work); hold out a
   test set as its own file.
2. Rows keep the dataset's prompt (the question), not the rendered text: rewards, including reward
   models with their own chat template, see the question as the dataset wrote it (as in TRL).
3. The data order is a pure function of (seed, prompts consumed): a resumed run draws what the
   uninterrupted one would.
"""
import functools
import glob
import json
import os
import random

from common import cause
from task import make_sort_dataset


def batch_indices(num_rows, consumed, per_step, rank, world, seed):
    """This rank's row indices for the next per_step prompts of the stream, after `consumed` prompts
    were drawn (step * per_step without --dynamic-sampling, which draws several such rounds per
    step): the rows are shuffled once per epoch by the seed (the same order on every rank), a pure
    function of (seed, consumed) so that a resumed run draws what the uninterrupted one would.
    Global draw g (consumed + rank's offset + i) is position g % num_rows of epoch g // num_rows's
    permutation: a batch that crosses an epoch boundary ends the old epoch, then starts the new one,
    and every epoch draws each prompt exactly once."""
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


# DeepSeek-R1 (arXiv 2501.12948) Table 1, without its <answer> tags: think_format_reward wants
# "<think>...</think>answer", and reasoning_accuracy_reward reads the answer after "</think>".
DEFAULT_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant "
    "solves it. The Assistant first thinks about the reasoning process in the mind and then "
    "provides the user with the answer. The reasoning process is enclosed within <think> </think> "
    "tags and followed by the final answer, i.e., <think> reasoning process here </think> final "
    "answer here")


_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


# The keywords every reward function already gets (tool_calls: with --tools).
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "tool_calls")


def load_prompt_dataset(name_or_path, *, config=None, split="train", prompt_column="prompt",
                        solution_column="solution"):
    """A hub dataset id (with config and split), a local dataset folder, or local .json/.jsonl/.csv/
    .parquet file(s) (a path, a glob, or a list of them) -> list of row dicts with the prompt column
    renamed "prompt" and the solution column "solution" (None: the dataset has no golds); every
    other column is kept and reaches the reward functions as a keyword argument. GSM8K:
    load_prompt_dataset("openai/gsm8k", config="main", prompt_column="question",
    solution_column="answer")"""
    # imported here: it costs a second that the built-in task does not need
    import datasets

    # per-shard bars would break the step bar
    datasets.disable_progress_bars()
    paths = [name_or_path] if isinstance(name_or_path, (str, os.PathLike)) else list(name_or_path)
    paths = [os.fspath(p) for p in paths]
    exts = {os.path.splitext(p)[1].lower() for p in paths}
    if exts <= set(_LOADERS):
        # local files
        missing = [p for p in paths if not glob.glob(p)]
        if missing:
            raise FileNotFoundError(f"dataset file not found: {', '.join(missing)}")
        if len({_LOADERS[e] for e in exts}) > 1:
            raise ValueError(f"dataset files mix formats {sorted(exts)}: "
                             "use one of json/jsonl, csv, parquet")
        _check_json_lines(paths)
        # datasets raises StopIteration on an empty .jsonl, ValueError on "[]" or an unknown split
        try:
            ds = datasets.load_dataset(_LOADERS[exts.pop()], data_files=paths, split=split)
        except (StopIteration, ValueError) as e:
            raise ValueError(f"cannot load split {split!r} of {name_or_path!r}: "
                             f"{str(e) or 'no rows'} (local files are one split, 'train', and "
                             "slices like 'train[:100]' work; empty files have no rows)") from e
        except Exception as e:
            # a malformed file: datasets' DatasetGenerationError, pyarrow's errors
            raise ValueError(f"cannot read dataset {name_or_path!r}: {cause(e)}: "
                             "fix the file") from None
    elif len(paths) == 1 and not os.path.isfile(paths[0]):
        # a hub id or a local dataset folder
        try:
            ds = datasets.load_dataset(paths[0], config, split=split)
        except Exception as e:
            # not a dataset folder, offline (HF_HUB_OFFLINE=1, no network), unknown config/split
            if os.path.isdir(paths[0]):
                what = "the folder"
            else:
                what = ("the hub id (offline? HF_HUB_OFFLINE=1 or no network reads only the "
                        "local cache)")
            raise ValueError(f"cannot load dataset {paths[0]!r} ({cause(e)}): check {what}, "
                             "or give .json/.jsonl/.csv/.parquet file(s)") from None
    else:
        raise ValueError(f"cannot load dataset {name_or_path!r}: give a hub id, a dataset folder "
                         f"or files ending in {', '.join(_LOADERS)}")
    where = f"dataset {name_or_path!r} (split {split!r})"
    if len(ds) == 0:
        raise ValueError(f"{where} is empty")
    renames = {prompt_column: "prompt"}
    if solution_column:
        renames[solution_column] = "solution"
    for column, role in renames.items():
        if column not in ds.column_names:
            hint = ""
            if role != "prompt":
                hint = "; pass solution_column=None if it has no gold answers"
            raise ValueError(f"{where} has no {role} column {column!r}; "
                             f"its columns are {ds.column_names}{hint}")
    for column in set(ds.column_names) - set(renames):
        if column in set(renames.values()) or column in RESERVED_COLUMNS:
            raise ValueError(f"{where}: column {column!r} would clash with the {column!r} keyword "
                             "that reward functions get; drop or rename it (or map it with "
                             "prompt_column/solution_column)")
    rows = [{renames.get(k, k): v for k, v in row.items()} for row in ds]
    bad = [i for i, r in enumerate(rows) if not _is_prompt(r["prompt"])]
    if bad:
        more = f" (and {len(bad) - 1} more rows)" if len(bad) > 1 else ""
        raise ValueError(f"{where}: row {bad[0]} has prompt {rows[bad[0]]['prompt']!r:.80} "
                         f"in column {prompt_column!r}{more}: a prompt must be a non-empty string "
                         "or a conversation (a list of {'role', 'content'} messages)")
    return rows


def _check_json_lines(paths):
    """A .jsonl line that is not JSON -> ValueError naming the file and line (datasets names
    neither)."""
    for pattern in paths:
        if not pattern.lower().endswith(".jsonl"):
            continue
        for path in sorted(glob.glob(pattern)):
            with open(path, encoding="utf-8", errors="replace") as lines:
                for n, line in enumerate(lines, 1):
                    if not line.strip():
                        continue
                    try:
                        json.loads(line)
                    except ValueError as e:
                        raise ValueError(f"dataset file {path}: line {n} is not valid JSON ({e}): "
                                         "fix or remove it") from None


def _is_prompt(p):
    """A non-empty string, or a non-empty list of {"role", "content"} messages."""
    if isinstance(p, str):
        return p.strip() != ""
    if not isinstance(p, list) or len(p) == 0:
        return False
    return all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in p)


def gsm8k_gold(answer):
    """The final number of a GSM8K answer: "...so she has 72 left.\n#### 72" -> "72" (commas
    dropped)."""
    if "####" not in answer:
        raise ValueError(f"not a GSM8K answer (no '####' marker): {answer!r:.80}")
    return answer.split("####")[-1].strip().split("\n")[0].replace(",", "")


def render_prompts(tokenizer, questions, system_prompt=DEFAULT_SYSTEM_PROMPT):
    """Questions (strings, or conversations as lists of {"role", "content"}) -> (prompt_texts,
    conversational). With a chat template: system + user messages, rendered with the generation
    prompt, conversational=True. Without one: plain text, "{system_prompt}\n\nUser:
    {question}\nAssistant:" in the R1-Zero style (only the question when system_prompt is None or
    empty), conversational=False."""
    if getattr(tokenizer, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        texts = []
        for q in questions:
            messages = [{"role": "user", "content": q}] if isinstance(q, str) else list(q)
            # a conversation that brings its own system prompt keeps it
            if messages[0]["role"] != "system":
                messages = system + messages
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False))
        return texts, True
    if any(not isinstance(q, str) for q in questions):
        raise ValueError("the dataset's prompts are conversations but the tokenizer has no chat "
                         "template: use a chat model, or a dataset whose prompts are strings")
    if not system_prompt:
        return list(questions), False
    return [f"{system_prompt}\n\nUser: {q}\nAssistant:" for q in questions], False


def encode_prompts(tokenizer, prompt_texts, conversational):
    """Rendered prompts -> lists of token ids. A chat template already writes BOS where its model
    wants one (Llama 3's <|begin_of_text|>), so its text is encoded with add_special_tokens=False,
    or BOS comes twice (huggingface/open-r1#462); plain text keeps the tokenizer's own BOS
    (huggingface/trl#3520: dropping it garbles Gemma's output)."""
    # One tokenizer call for the distinct texts (the built-in task: 20,000 prompts, ~800 distinct).
    distinct = list(dict.fromkeys(prompt_texts))
    encoded = tokenizer(distinct, add_special_tokens=not conversational)["input_ids"]
    ids = dict(zip(distinct, encoded))
    # shared lists: nothing writes into a prompt's ids
    return [ids[text] for text in prompt_texts]


def prompt_limit(max_prompt_len, max_new_tokens, context_len):
    """The longest prompt the model's context leaves room for next to --max-new-tokens; ValueError
    when none."""
    if max_new_tokens >= context_len:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the "
                         f"model's context of {context_len} tokens: lower it")
    return min(max_prompt_len, context_len - max_new_tokens)


def load_rows(dataset, *, digits, eval_size, seed, config, split, eval_split, prompt_column,
              solution_column):
    """-> (train rows, held-out rows): the built-in task when dataset is None, else the dataset's
    two splits."""
    if dataset is None:
        return make_sort_dataset(digits, num_test=eval_size, seed=seed)
    train = load_prompt_dataset(dataset, config=config, split=split, prompt_column=prompt_column,
                                solution_column=solution_column)
    held_out = load_prompt_dataset(dataset, config=config, split=eval_split,
                                   prompt_column=prompt_column, solution_column=solution_column)
    return train, held_out[:eval_size]


def prepare_prompts(tokenizer, rows, system_prompt, max_len, what, raw=False, log=print,
                    min_rows=1):
    """Rows -> (kept rows, their token ids, conversational): render (chat template + system prompt,
    or plain text; raw: the question as it is, as the built-in task wants), encode, drop prompts
    over max_len tokens. ValueError when fewer than min_rows are left (train.py: each rank
    evaluates a share of the held-out ones)."""
    # None: the default system prompt ('' is none)
    if system_prompt is None:
        system_prompt = DEFAULT_SYSTEM_PROMPT
    questions = [r["prompt"] for r in rows]
    if raw:
        texts = questions
        conversational = False
    else:
        texts, conversational = render_prompts(tokenizer, questions, system_prompt)
    # (a chat template writes its own BOS)
    ids = encode_prompts(tokenizer, texts, conversational)
    keep = [i for i, x in enumerate(ids) if len(x) <= max_len]
    if not keep:
        raise ValueError(f"all {len(rows)} {what} prompts are longer than --max-prompt-len "
                         f"{max_len} tokens: raise it (the model's context must also hold "
                         "--max-new-tokens)")
    if len(keep) < min_rows:
        raise ValueError(f"{len(keep)} of {len(rows)} {what} prompts fit in --max-prompt-len "
                         f"{max_len} tokens, fewer than the {min_rows} ranks that each need one: "
                         "raise --max-prompt-len or add prompts")
    if len(keep) < len(rows):
        dropped = len(rows) - len(keep)
        log(f"warning: dropped {dropped} of {len(rows)} {what} prompts longer than "
            "--max-prompt-len")
    return [rows[i] for i in keep], [ids[i] for i in keep], conversational
