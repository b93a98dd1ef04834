"""
The built-in task and tiny model: what `train.py` trains when no --model / --dataset is given.

Task "sort the digits": the prompt is K random digits and '>' (e.g. `739>`), the answer is the same digits
sorted largest first (`973`) followed by EOS. The reward is checkable by a rule, a random policy scores
1/1000, and a 0.3M-parameter model learns it from scratch with GRPO on a 2-core CPU in a few minutes:
the first answer digit (the max) comes first, then the rest, helped by a per-position shaping reward.

Real datasets (GSM8K and the like): load_prompt_dataset -> rows {"prompt", "solution", other columns},
render_prompts -> the texts the policy sees (chat template + R1 system prompt), encode_prompts -> ids.

    python task.py          # prints a few prompts, the tokenizer round trip and the model size
    python -m pytest -q tests/test_data.py

Simplifications:
1. Prompts are drawn with their largest digit even over 0-9. Drawing digits uniformly skews the max
   towards 9 (P(max=9) = 27%), and a policy stuck on "9..." never learns prompts of small digits.
2. Train and held-out prompts are disjoint strings, except for max digit 0 and 1, which have only 1 and
   7 possible prompts (for K=3): those strings appear in both splits.
3. A character-level tokenizer (one token per character, EOS doubles as padding) built in memory with
   `tokenizers` as a byte-level BPE with no merges, saved like any HF tokenizer so vLLM and `AutoTokenizer`
   load it from the model folder and tokenize exactly as the built one does.
   `build_tokenizer(TEXT_CHARS, CHAT_TEMPLATE)` is its chat variant for tests of real-data runs: printable
   ASCII, ChatML (Qwen2.5's format) with <|im_start|>/<|im_end|> as single tokens, <|im_end|> as EOS.
4. A local file loads as datasets' single split "train" (slices like "train[:100]" work); hold out a
   test set as its own file.
5. Rows keep the dataset's prompt (the question), not the rendered text: rewards, including reward
   models with their own chat template, see the question as the dataset wrote it (as in TRL).
"""
import functools
import glob
import json
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHARS = list("0123456789>+-=*/ ")  # everything the built-in task can print; extend for a new task
TEXT_CHARS = [chr(i) for i in range(32, 127)] + ["\n"]  # printable ASCII and newline: word problems
EOS, UNK = "<eos>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (  # ChatML, the format of Qwen2.5-Instruct, without tool calls
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}")


def build_tokenizer(chars=CHARS, chat_template=None):
    """One token per character; id 0 is EOS (also used as pad), id 1 UNK. With a chat template,
    <|im_start|> and <|im_end|> are single tokens (ids 2, 3) and <|im_end|> is EOS (the end of the
    assistant's turn ends a completion, as in Qwen2.5-Instruct); id 0 stays the pad.
    Stored as a byte-level BPE with no merges, i.e. Qwen2's format: transformers 5 reloads a folder whose
    config says qwen2 as a Qwen2Tokenizer (tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS),
    which imposes byte-level pre-tokenization; any other vocabulary loses spaces and newlines on reload."""
    if any(not " " <= c <= "~" and c != "\n" for c in chars):
        raise ValueError("build_tokenizer takes printable ASCII characters and newline only")
    byte_char = lambda c: c if c > " " else chr(256 + ord(c))  # noqa: E731  GPT-2's byte alphabet: " " -> "Ġ"
    specials = [EOS, UNK] + ([IM_START, IM_END] if chat_template else [])
    vocab = {tok: i for i, tok in enumerate(specials + [byte_char(c) for c in chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges: one token per byte
    tok.add_special_tokens(specials)  # matched whole, never split into characters
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END if chat_template else EOS, pad_token=EOS,
                                   unk_token=UNK, chat_template=chat_template)


def build_tiny_model(tokenizer, seed=0, hidden_size=128, num_layers=2, num_heads=4, max_len=64):
    """A randomly initialised Qwen2 from a config (hidden 128, 2 layers: ~0.3M parameters).
    head_dim = hidden_size / num_heads must be >= 32: vLLM's CPU attention rejects 16."""
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=max_len, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path, seed=0):
    """The default run's starting point, as a save_pretrained folder (vLLM and every rank load it from disk)."""
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_sort_dataset(num_digits=3, num_train=20000, num_test=500, test_frac=0.2, seed=0):
    """Returns (train, test): lists of {"prompt": "739>", "solution": "973"}, the max digit even over 0-9."""
    rng = random.Random(seed)
    by_answer = {a: [] for a in range(10)}  # every possible prompt string, bucketed by its answer
    for n in range(10 ** num_digits):
        s = str(n).zfill(num_digits)
        by_answer[int(max(s))].append(s)
    train_strings, test_strings = {}, {}
    for a, strings in by_answer.items():
        rng.shuffle(strings)
        k = int(len(strings) * test_frac)
        # too few strings to split (answers 0 and 1): share them, see simplification 2
        train_strings[a], test_strings[a] = (strings[k:], strings[:k]) if k >= 1 else (strings, strings)

    def draw(pool, n):
        rows = []
        for _ in range(n):
            a = rng.randrange(10)
            digits = rng.choice(pool[a])
            rows.append({"prompt": digits + ">", "solution": "".join(sorted(digits, reverse=True))})
        return rows

    return draw(train_strings, num_train), draw(test_strings, num_test)


def position_reward(completions, solution, **kw):
    """The default task's shaping reward (weight 0.5 beside exact match 1.0): the fraction of answer positions
    that are right, over the longer of answer and completion ("973" vs "97": 2/3; vs "9731": 3/4). Exact match
    alone is too sparse to start from (1 in 1000 at random); this rewards getting the max first, then more."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(a == b for a, b in zip(t, s)) / max(len(t), len(s)) for t, s in zip(texts, solution, strict=True)]


def defaults(builtin_task, tiny_model, digits, rewards=None, lora=False):
    """The recipe behind every flag train.py leaves at None: the built-in task's (tiny model from scratch: a high lr,
    an entropy bonus, exact match + position shaping), or R1's for a dataset (format 0.1 + accuracy 1.0).
    Rewards given without weights weigh 1 each. LoRA (--lora-rank) trains with a 10x higher lr."""
    if builtin_task:
        recipe = dict(max_new_tokens=digits + 1, entropy_coef=0.1,  # the answer, then EOS
                      rewards=["exact_match_reward", position_reward], reward_weights=[1.0, 0.5],
                      eval_reward="exact_match_reward")
    else:
        recipe = dict(max_new_tokens=512, entropy_coef=0.0, rewards=["think_format_reward", "accuracy_reward"],
                      reward_weights=[0.1, 1.0], eval_reward="accuracy_reward")
    lr = (3e-4 if tiny_model else 1e-6) * (10 if lora else 1)  # LoRA's best lr: ~10x full fine-tuning's (see README)
    return recipe | dict(lr=lr) | (dict(reward_weights=[1.0] * len(rewards)) if rewards else {})


def batch_indices(num_rows, consumed, per_step, rank, world, seed):
    """This rank's row indices for the next per_step prompts of the stream, after `consumed` prompts were drawn
    (step * per_step without --dynamic-sampling, which draws several such rounds per step): the rows are shuffled
    once per epoch by the seed (the same order on every rank), a pure function of (seed, consumed) so that a
    resumed run draws what the uninterrupted one would.
    Global draw g (consumed + rank's offset + i) is position g % num_rows of epoch g // num_rows's permutation:
    a batch that crosses an epoch boundary ends the old epoch, then starts the new one, and every epoch draws
    each prompt exactly once."""
    per_rank = per_step // world
    first = consumed + rank * per_rank  # this rank's first global draw
    return [epoch_order(num_rows, seed, g // num_rows)[g % num_rows] for g in range(first, first + per_rank)]


@functools.lru_cache(maxsize=2)  # shuffling 20,000 rows in Python costs ~6 ms: once per epoch, not once per step
def epoch_order(num_rows, seed, epoch):
    order = list(range(num_rows))
    random.Random(seed * 1000 + epoch).shuffle(order)
    return tuple(order)


# -----------------------------------------------------------------------------
# Real datasets: load, render through the chat template, encode

# DeepSeek-R1 (arXiv 2501.12948) Table 1, without its <answer> tags: think_format_reward wants
# "<think>...</think>answer", and reasoning_accuracy_reward reads the answer after "</think>".
DEFAULT_SYSTEM_PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the user with the "
    "answer. The reasoning process is enclosed within <think> </think> tags and followed by the final answer, "
    "i.e., <think> reasoning process here </think> final answer here")
_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids")  # keywords every reward function already gets


def load_prompt_dataset(name_or_path, *, config=None, split="train", prompt_column="prompt",
                        solution_column="solution"):
    """A hub dataset id (with config and split), a local dataset folder, or local .json/.jsonl/.csv/
    .parquet file(s) (a path, a glob, or a list of them) -> list of row dicts with the prompt column
    renamed "prompt" and the solution column "solution" (None: the dataset has no golds); every other
    column is kept and reaches the reward functions as a keyword argument.
    GSM8K: load_prompt_dataset("openai/gsm8k", config="main", prompt_column="question", solution_column="answer")"""
    import datasets  # here: its import costs a second that the built-in task does not need

    datasets.disable_progress_bars()  # per-shard bars would break the step bar

    paths = [name_or_path] if isinstance(name_or_path, (str, os.PathLike)) else list(name_or_path)
    paths = [os.fspath(p) for p in paths]
    exts = {os.path.splitext(p)[1].lower() for p in paths}
    if exts <= set(_LOADERS):  # local files
        missing = [p for p in paths if not glob.glob(p)]
        if missing:
            raise FileNotFoundError(f"dataset file not found: {', '.join(missing)}")
        if len({_LOADERS[e] for e in exts}) > 1:
            raise ValueError(f"dataset files mix formats {sorted(exts)}: use one of json/jsonl, csv, parquet")
        _check_json_lines(paths)
        try:  # datasets raises StopIteration on an empty .jsonl, ValueError on "[]" or an unknown split
            ds = datasets.load_dataset(_LOADERS[exts.pop()], data_files=paths, split=split)
        except (StopIteration, ValueError) as e:
            raise ValueError(f"cannot load split {split!r} of {name_or_path!r}: {str(e) or 'no rows'} (local files are "
                             f"one split, 'train', and slices like 'train[:100]' work; empty files have no rows)") from e
        except Exception as e:  # a malformed file: datasets' DatasetGenerationError, pyarrow's errors
            raise ValueError(f"cannot read dataset {name_or_path!r}: {_cause(e)}: fix the file") from None
    elif len(paths) == 1 and not os.path.isfile(paths[0]):  # hub id or local dataset folder
        try:
            ds = datasets.load_dataset(paths[0], config, split=split)
        except Exception as e:  # not a dataset folder, offline (HF_HUB_OFFLINE=1, no network), unknown config/split
            what = "the folder" if os.path.isdir(paths[0]) else "the hub id (offline? HF_HUB_OFFLINE=1 or no network " \
                                                                "reads only the local cache)"
            raise ValueError(f"cannot load dataset {paths[0]!r} ({_cause(e)}): check {what}, or give .json/.jsonl/.csv/"
                             f".parquet file(s)") from None
    else:
        raise ValueError(f"cannot load dataset {name_or_path!r}: give a hub id, a dataset folder or files ending "
                         f"in {', '.join(_LOADERS)}")
    where = f"dataset {name_or_path!r} (split {split!r})"
    if len(ds) == 0:
        raise ValueError(f"{where} is empty")
    renames = {prompt_column: "prompt"} | ({solution_column: "solution"} if solution_column else {})
    for column, role in renames.items():
        if column not in ds.column_names:
            hint = "" if role == "prompt" else "; pass solution_column=None if it has no gold answers"
            raise ValueError(f"{where} has no {role} column {column!r}; its columns are {ds.column_names}{hint}")
    for column in set(ds.column_names) - set(renames):
        if column in set(renames.values()) or column in RESERVED_COLUMNS:
            raise ValueError(f"{where}: column {column!r} would clash with the {column!r} keyword that reward "
                             f"functions get; drop or rename it (or map it with prompt_column/solution_column)")
    rows = [{renames.get(k, k): v for k, v in row.items()} for row in ds]
    bad = [i for i, r in enumerate(rows) if not _is_prompt(r["prompt"])]
    if bad:
        raise ValueError(f"{where}: row {bad[0]} has prompt {rows[bad[0]]['prompt']!r:.80} in column {prompt_column!r}"
                         f"{f' (and {len(bad) - 1} more rows)' if len(bad) > 1 else ''}: a prompt must be a non-empty "
                         f"string or a conversation (a list of {{'role', 'content'}} messages)")
    return rows


def _cause(e):
    """An exception in a few words: its type and first line, and those of its cause (datasets wraps pyarrow's)."""
    text = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    return text + (f" <- {_cause(e.__cause__)}" if e.__cause__ is not None else "")


def _check_json_lines(paths):
    """A .jsonl line that is not JSON -> ValueError naming the file and line (datasets names neither)."""
    for path in (f for p in paths if p.lower().endswith(".jsonl") for f in sorted(glob.glob(p))):
        for n, line in enumerate(open(path, encoding="utf-8", errors="replace"), 1):
            try:
                line.strip() and json.loads(line)
            except ValueError as e:
                raise ValueError(f"dataset file {path}: line {n} is not valid JSON ({e}): fix or remove it") from None


def _is_prompt(p):
    """A non-empty string, or a non-empty list of {"role", "content"} messages."""
    if isinstance(p, str):
        return p.strip() != ""
    return isinstance(p, list) and len(p) > 0 and all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in p)


def gsm8k_gold(answer):
    """The final number of a GSM8K answer: "...so she has 72 left.\n#### 72" -> "72" (commas dropped)."""
    if "####" not in answer:
        raise ValueError(f"not a GSM8K answer (no '####' marker): {answer!r:.80}")
    return answer.split("####")[-1].strip().split("\n")[0].replace(",", "")


def render_prompts(tokenizer, questions, system_prompt=DEFAULT_SYSTEM_PROMPT):
    """Questions (strings, or conversations as lists of {"role", "content"}) -> (prompt_texts, conversational).
    With a chat template: system + user messages, rendered with the generation prompt, conversational=True.
    Without one: plain text, "{system_prompt}\n\nUser: {question}\nAssistant:" in the R1-Zero style (only the
    question when system_prompt is None or empty), conversational=False."""
    if getattr(tokenizer, "chat_template", None):
        system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        texts = []
        for q in questions:
            messages = [{"role": "user", "content": q}] if isinstance(q, str) else list(q)
            if messages[0]["role"] != "system":  # a conversation that brings its own system prompt keeps it
                messages = system + messages
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        return texts, True
    if any(not isinstance(q, str) for q in questions):
        raise ValueError("the dataset's prompts are conversations but the tokenizer has no chat template: "
                         "use a chat model, or a dataset whose prompts are strings")
    return [f"{system_prompt}\n\nUser: {q}\nAssistant:" if system_prompt else q for q in questions], False


def encode_prompts(tokenizer, prompt_texts, conversational):
    """Rendered prompts -> lists of token ids. A chat template already writes BOS where its model wants
    one (Llama 3's <|begin_of_text|>), so its text is encoded with add_special_tokens=False, or BOS comes
    twice (open-r1 PR 462); plain text keeps the tokenizer's own BOS (TRL issue 3520: dropping it garbles
    Gemma's output)."""
    distinct = list(dict.fromkeys(prompt_texts))  # the built-in task: 20,000 prompts, ~800 distinct
    ids = dict(zip(distinct, tokenizer(distinct, add_special_tokens=not conversational)["input_ids"]))  # one call
    return [ids[text] for text in prompt_texts]  # (shared lists: nothing writes into a prompt's ids)


def load_tokenizer(path):
    """-> (tokenizer, the model's context length). ValueError naming the folder when it is not a usable model: no
    weights, weights cut short, no tokenizer (transformers 5 then builds an empty one instead of failing), a
    tokenizer with more tokens than the model's embedding has rows, or neither a pad nor an EOS token."""
    from transformers import AutoConfig, AutoTokenizer
    if os.path.isdir(path):
        _check_weights(path)
    try:
        tokenizer, config = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path)
    except Exception as e:  # OSError: a hub id not in the local cache while offline, no config.json; ValueError: ...
        raise ValueError(f"--model {path!r}: cannot load its tokenizer or config ({_cause(e)})") from None
    vocab, context = (getattr(config.get_text_config(), k, None) for k in ("vocab_size", "max_position_embeddings"))
    checks = [(len(tokenizer) > 1, f"has no tokenizer (the one loaded has {len(tokenizer)} token): save the "
                                   f"model's tokenizer into the folder (tokenizer.save_pretrained)"),
              (vocab is None or len(tokenizer) <= vocab, f"its tokenizer has {len(tokenizer)} tokens but the model's "
               f"embedding has {vocab} rows (vocab_size): use the tokenizer the model was trained with"),
              (tokenizer.pad_token_id is not None or tokenizer.eos_token_id is not None,
               "its tokenizer has neither a pad nor an EOS token: completions could not end (set eos_token)"),
              (context is not None, "its config gives no context length (max_position_embeddings)")]
    for ok, msg in checks:
        if not ok:
            raise ValueError(f"--model {path!r}: {msg}")
    return tokenizer, context


def _check_weights(path):
    """A local model folder has weights, and its safetensors files are whole (their header covers the file)."""
    from safetensors import safe_open
    files = glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "*.bin"))
    if not files:
        raise ValueError(f"--model {path!r}: no weights (*.safetensors or *.bin) in the folder: save the model there "
                         f"(save_pretrained), or give a hub id")
    for index in glob.glob(os.path.join(path, "*.index.json")):  # sharded: every shard it names is there
        for shard in sorted(set(json.load(open(index)).get("weight_map", {}).values())):
            if not os.path.exists(os.path.join(path, shard)):
                raise ValueError(f"--model {path!r}: shard {shard} named in {os.path.basename(index)} is missing")
    for f in files:
        try:
            if f.endswith(".safetensors"):
                safe_open(f, "pt").keys()
            elif open(f, "rb").read(2) == b"PK":  # torch.save's zip format: the index sits at the end
                import zipfile
                zipfile.ZipFile(f).close()
        except Exception as e:  # SafetensorError: "incomplete metadata, file not fully covered"; BadZipFile
            raise ValueError(f"--model {path!r}: {os.path.basename(f)} is damaged or cut short ({e}): copy or save "
                             f"the model again") from None


def prompt_limit(max_prompt_len, max_new_tokens, context_len):
    """The longest prompt the model's context leaves room for next to --max-new-tokens; ValueError when none."""
    if max_new_tokens >= context_len:
        raise ValueError(f"--max-new-tokens {max_new_tokens} leaves no room for a prompt in the model's context "
                         f"of {context_len} tokens: lower it")
    return min(max_prompt_len, context_len - max_new_tokens)


def load_rows(dataset, *, digits, eval_size, seed, config, split, eval_split, prompt_column, solution_column):
    """-> (train rows, held-out rows): the built-in task when dataset is None, else the dataset's two splits."""
    if dataset is None:
        return make_sort_dataset(digits, num_test=eval_size, seed=seed)
    load = lambda s: load_prompt_dataset(dataset, config=config, split=s, prompt_column=prompt_column,  # noqa: E731
                                         solution_column=solution_column)
    return load(split), load(eval_split)[:eval_size]


def prepare_prompts(tokenizer, rows, system_prompt, max_len, what, raw=False, log=print, min_rows=1):
    """Rows -> (kept rows, their token ids, conversational): render (chat template + system prompt, or plain
    text; raw: the question as it is, as the built-in task wants), encode, drop prompts over max_len tokens.
    ValueError when fewer than min_rows are left (train.py: each rank evaluates a share of the held-out ones)."""
    system_prompt = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt  # '' = none
    questions = [r["prompt"] for r in rows]
    texts, conversational = (questions, False) if raw else render_prompts(tokenizer, questions, system_prompt)
    ids = encode_prompts(tokenizer, texts, conversational)  # (a chat template writes its own BOS)
    keep = [i for i, x in enumerate(ids) if len(x) <= max_len]
    if not keep:
        raise ValueError(f"all {len(rows)} {what} prompts are longer than --max-prompt-len {max_len} tokens: raise "
                         f"it (the model's context must also hold --max-new-tokens)")
    if len(keep) < min_rows:
        raise ValueError(f"{len(keep)} of {len(rows)} {what} prompts fit in --max-prompt-len {max_len} tokens, fewer "
                         f"than the {min_rows} ranks that each need one: raise --max-prompt-len or add prompts")
    if len(keep) < len(rows):
        log(f"warning: dropped {len(rows) - len(keep)} of {len(rows)} {what} prompts longer than --max-prompt-len")
    return [rows[i] for i in keep], [ids[i] for i in keep], conversational

if __name__ == "__main__":
    tokenizer = build_tokenizer()
    train, test = make_sort_dataset()
    print(train[:5], len(train), len(test))
    ids = tokenizer(train[0]["prompt"] + train[0]["solution"])["input_ids"]
    print(ids, repr(tokenizer.decode(ids)))
    model = build_tiny_model(tokenizer)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
