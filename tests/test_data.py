"""The real-data path on CPU, with no hub.

GSM8K-format fixtures written here -> load_prompt_dataset -> the R1 rewards. The
chat template renders through a tiny character tokenizer, and a tiny reward model
is built from a config.

    python -m pytest -q tests/test_data.py
"""
import json
import os
import re
import subprocess
import sys

import datasets
import pytest
import torch
from tokenizers import processors
from transformers import Qwen2Config, Qwen2ForSequenceClassification

import data
import model
import task
from helpers import ROOT, assert_close_rel, fp32_tol, summed_terms
from reward import compute_rewards, get_reward_funcs
from rewards.math_answers import accuracy_reward, reasoning_accuracy_reward
from rewards.reward_model import get_reward_model_func
from rewards.think_format import think_format_reward

# Made-up word problems in GSM8K's format: a worked answer with <<calculator>> notes,
# the gold after "####".
GSM8K_FIXTURES = [
    dict(question="Mia has 3 boxes with 4 pencils in each box. She gives away 5 pencils. "
                  "How many pencils does she have left?",
         answer="Mia has 3*4 = <<3*4=12>>12 pencils.\n"
                "After giving 5 away she has 12-5 = <<12-5=7>>7.\n#### 7",
         level=1),
    dict(question="A baker makes 24 muffins. He sells half of them in the morning and 4 "
                  "more in the afternoon. How many muffins are left?",
         answer="He sells 24/2 = <<24/2=12>>12 in the morning.\n"
                "12-4 = <<12-4=8>>8 are left.\n#### 8",
         level=2),
    dict(question="Tom reads 15 pages a day for 6 days. How many pages does he read?",
         answer="Tom reads 15*6 = <<15*6=90>>90 pages.\n#### 90",
         level=1),
    dict(question="A train ticket costs $12 and a bus ticket costs $3 less. How much do "
                  "2 train tickets and 1 bus ticket cost together?",
         answer="A bus ticket costs 12-3 = <<12-3=9>>9 dollars.\n"
                "2*12+9 = <<2*12+9=33>>33 dollars.\n#### 33",
         level=2),
    dict(question="A farm has 1,200 chickens and buys 34 more. How many chickens does "
                  "it have now?",
         answer="1200+34 = <<1200+34=1234>>1234 chickens.\n#### 1,234",
         level=1),
]
GOLDS = ["7", "8", "90", "33", "1234"]


def write_gsm8k_jsonl(path):
    """The fixtures as a GSM8K-style jsonl file -> its path.

    Its columns are question, answer and level.
    """
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in GSM8K_FIXTURES)
    return str(path)


def chat_tokenizer(bos=False):
    """The tiny chat tokenizer.

    bos=True adds a BOS that both the template and the tokenizer write (Llama 3).
    """
    if not bos:
        return task.build_tokenizer(task.TEXT_CHARS, task.CHAT_TEMPLATE)

    tok = task.build_tokenizer(task.TEXT_CHARS, "{{ bos_token }}" + task.CHAT_TEMPLATE)
    tok.add_special_tokens({"bos_token": "<s>"})
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def load_fixtures(path, **kw):
    return data.load_prompt_dataset(path, prompt_column="question",
                                    solution_column="answer", **kw)


# -----------------------------------------------------------------------------
# Loading and column mapping

def write_as(fmt, directory):
    ds = datasets.Dataset.from_list(GSM8K_FIXTURES)
    path = directory / f"gsm8k.{fmt}"

    if fmt == "jsonl":
        write_gsm8k_jsonl(path)
    elif fmt == "json":  # one JSON array, not lines
        path.write_text(json.dumps(GSM8K_FIXTURES))
    elif fmt == "csv":
        ds.to_csv(str(path), index=False)
    else:
        ds.to_parquet(str(path))

    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
def test_load_maps_columns_and_keeps_the_others(fmt, tmp_path):
    rows = load_fixtures(write_as(fmt, tmp_path))

    columns = {"prompt", "solution", "level"}
    assert [set(r) for r in rows] == [columns] * len(GSM8K_FIXTURES)
    assert [r["prompt"] for r in rows] == [f["question"] for f in GSM8K_FIXTURES]
    assert [r["solution"] for r in rows] == [f["answer"] for f in GSM8K_FIXTURES]
    assert [r["level"] for r in rows] == [1, 2, 1, 2, 1]


def test_load_several_files_by_glob_or_list_and_slices(tmp_path):
    (tmp_path / "a").mkdir()
    for i in range(2):
        (tmp_path / "a" / f"part{i}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in GSM8K_FIXTURES[i::2]))

    by_glob = load_fixtures(str(tmp_path / "a" / "*.jsonl"))
    parts = [tmp_path / "a" / "part0.jsonl", tmp_path / "a" / "part1.jsonl"]
    by_list = load_fixtures(parts)
    questions = sorted(f["question"] for f in GSM8K_FIXTURES)
    assert sorted(r["prompt"] for r in by_glob) == questions
    assert by_glob == by_list

    path = write_gsm8k_jsonl(tmp_path / "g.jsonl")
    assert len(load_fixtures(path, split="train[:2]")) == 2


def test_jsonl_is_read_without_datasets_and_gives_its_rows(tmp_path):
    """A .jsonl split, whole or an integer slice, is read with json
    (data._load_json_lines): the rows datasets gives (a percent still goes
    through datasets), and datasets, with its Arrow tables, is never imported."""
    path = tmp_path / "mixed.jsonl"
    lines = [
        {"prompt": "What is 2 + 3?", "solution": "5", "level": 1},
        {"prompt": "Say hi", "solution": "hi", "level": 2},
        {"prompt": "No level here", "solution": "7", "source": "made up"},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")

    ours = data.load_prompt_dataset(str(path))
    theirs = data.load_prompt_dataset(str(path), split="train[:100%]")  # datasets
    assert ours == theirs
    assert ours[2] == {"prompt": "No level here", "solution": "7", "level": None,
                       "source": "made up"}

    # integer slices as datasets takes them: Python's
    for split in ("train[:2]", "train[1:]", "train[-2:]", "train[:-1]", "train[-100:2]"):
        start, stop = re.fullmatch(r"train\[(-?\d*):(-?\d*)\]", split).groups()
        expected = ours[int(start) if start else None:int(stop) if stop else None]
        assert data.load_prompt_dataset(str(path), split=split) == expected, split
    with pytest.raises(ValueError, match="is empty"):
        data.load_prompt_dataset(str(path), split="train[3:]")

    script = ("import sys, data; data.load_prompt_dataset(sys.argv[1], split='train[1:]'); "
              "sys.exit('datasets' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script, str(path)], cwd=ROOT)
    assert done.returncode == 0

    (tmp_path / "list.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="row 0 is \\[1, 2\\], not a JSON object"):
        data.load_prompt_dataset(str(tmp_path / "list.jsonl"))


def test_load_without_golds(tmp_path):
    path = write_gsm8k_jsonl(tmp_path / "g.jsonl")
    rows = data.load_prompt_dataset(path, prompt_column="question", solution_column=None)
    assert set(rows[0]) == {"prompt", "answer", "level"}


def test_load_errors_say_what_to_change(tmp_path):
    path = write_gsm8k_jsonl(tmp_path / "g.jsonl")
    columns = r"\['question', 'answer', 'level'\]"
    message = r"no prompt column 'prompt'; its columns are " + columns
    with pytest.raises(ValueError, match=message):
        data.load_prompt_dataset(path)
    message = "no solution column 'solution'.*solution_column=None"
    with pytest.raises(ValueError, match=message):
        data.load_prompt_dataset(path, prompt_column="question")

    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        data.load_prompt_dataset(str(tmp_path / "missing.jsonl"))

    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no rows"):
        data.load_prompt_dataset(str(tmp_path / "empty.jsonl"))
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="empty files have no rows"):
        data.load_prompt_dataset(str(tmp_path / "empty.json"))

    with pytest.raises(ValueError, match="Unknown split.*one split, 'train'"):
        load_fixtures(path, split="test")

    (tmp_path / "g.txt").write_text("hello")
    with pytest.raises(ValueError, match="files ending in .json, .jsonl, .csv, .parquet"):
        data.load_prompt_dataset(str(tmp_path / "g.txt"))

    # a column that reward functions already get as a keyword
    clash = tmp_path / "clash.jsonl"
    row = {"question": "q", "answer": "#### 1", "completions": "x"}
    clash.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="column 'completions' would clash"):
        load_fixtures(str(clash))
    row = {"question": "q", "answer": "#### 1", "prompt": "p"}
    clash.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match="column 'prompt' would clash"):
        load_fixtures(str(clash))


@pytest.mark.parametrize("world", [1, 2])
def test_batch_indices_draw_each_prompt_once_per_epoch(world):
    """Every epoch holds each prompt exactly once, whatever the number of ranks.

    Global draw g is position g % n of epoch g // n's permutation. A batch that
    crosses an epoch boundary finishes the old epoch with its last prompts and
    starts the new one. Here 7 rows, 4 per batch: the boundary falls inside
    batches.
    """
    n = 7
    per_step = 4
    batches = 14  # 56 draws: 8 epochs

    draws = []
    for b in range(batches):
        for rank in range(world):
            draws += data.batch_indices(n, b * per_step, per_step, rank, world, seed=3)

    epochs = [sorted(draws[e * n:(e + 1) * n]) for e in range(len(draws) // n)]
    assert epochs == [list(range(n))] * 8
    # each epoch its own order
    assert draws[:n] != draws[n:2 * n]
    again = data.batch_indices(n, 20, per_step, 1, world, 3)
    assert data.batch_indices(n, 20, per_step, 1, world, 3) == again

    # The stream is indexed by prompts consumed, not by step (--dynamic-sampling
    # draws several batches a step). The ranks' shares of a batch are consecutive
    # in it, whatever the number of ranks.
    assert data.batch_indices(n, 13, per_step, 0, 1, 3) == draws[13:17]


BAD_PROMPTS = {
    "null": None,
    "number": 7,
    "list of strings": ["a", "b"],
    "empty": "",
    "blank": "   ",
    "empty list": [],
    "bad message": [{"content": "no role"}],
}


@pytest.mark.parametrize("prompt", list(BAD_PROMPTS.values()), ids=list(BAD_PROMPTS))
def test_load_refuses_a_prompt_that_is_not_text_or_a_conversation(prompt, tmp_path):
    path = tmp_path / "bad.jsonl"
    rows = [{"question": "fine?", "answer": "#### 1"},
            {"question": prompt, "answer": "#### 2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    message = (r"row 1 has prompt .* in column 'question': a prompt must be a non-empty "
               r"string or a conversation")
    with pytest.raises(ValueError, match=message):
        load_fixtures(str(path))


def test_load_names_the_line_of_a_malformed_jsonl(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n'
                    '{"question": "b", "answer": \n')
    message = r"broken.jsonl: line 2 is not valid JSON .*fix or remove it"
    with pytest.raises(ValueError, match=message):
        load_fixtures(str(path))

    # other formats: datasets' own reason, in one line
    path = tmp_path / "broken.csv"
    path.write_text('question,answer\n"a,#### 1\n')
    with pytest.raises(ValueError, match="broken.csv"):
        load_fixtures(str(path))


@pytest.mark.parametrize("content", ["nothing", "binary", "a model"])
def test_load_a_folder_that_is_not_a_dataset_names_it(content, tiny, tmp_path):
    folder = tmp_path / "not_a_dataset"
    folder.mkdir()
    if content == "binary":
        (folder / "weights.bin").write_bytes(b"\0" * 64)
    elif content == "a model":
        folder = tiny[0]

    name = re.escape(repr(str(folder)))
    with pytest.raises(ValueError, match=f"cannot load dataset {name}.*check the folder"):
        data.load_prompt_dataset(str(folder))


def test_load_a_hub_id_offline_is_one_line(monkeypatch):
    import huggingface_hub.constants

    # as HF_HUB_OFFLINE=1, which they read at import time
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    message = r"cannot load dataset 'no-org/no-data' \(ConnectionError.*offline\?"
    with pytest.raises(ValueError, match=message):
        data.load_prompt_dataset("no-org/no-data")


# -----------------------------------------------------------------------------
# Model folders: model.load_tokenizer refuses what would crash later
# (transformers, vLLM, the first forward)

def broken_model(kind, tiny, tmp_path):
    """A copy of the tiny model's folder with one thing wrong."""
    import shutil

    path = tmp_path / kind.replace(" ", "_")
    shutil.copytree(tiny[0], path)

    if kind == "config only":
        for f in os.listdir(path):
            if f != "config.json":
                os.remove(path / f)
    elif kind == "no tokenizer":
        os.remove(path / "tokenizer.json")
        os.remove(path / "tokenizer_config.json")
    elif kind == "weights cut short":
        weights = path / "model.safetensors"
        os.truncate(weights, os.path.getsize(weights) // 2)
    elif kind == "header cut short":
        os.truncate(path / "model.safetensors", 100)
    elif kind == "missing shard":
        json.dump({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}},
                  open(path / "model.safetensors.index.json", "w"))
    elif kind == "tokenizer larger than the embedding, no pad":
        tok = task.build_tokenizer(task.TEXT_CHARS)
        tok.pad_token = None
        tok.save_pretrained(path)

    return str(path)


@pytest.mark.parametrize("kind, message", [
    ("config only", "no weights"),
    ("no tokenizer", "has no tokenizer"),
    ("weights cut short", "model.safetensors is damaged or cut short"),
    ("header cut short", "model.safetensors is damaged or cut short"),
    ("missing shard",
     "shard model-00002-of-00002.safetensors named in model.safetensors.index.json "
     "is missing"),
    ("tokenizer larger than the embedding, no pad",
     r"its tokenizer has 98 tokens but the model's embedding has 19 rows"),
])
def test_load_tokenizer_refuses_a_model_folder_that_would_crash_later(kind, message, tiny, tmp_path):
    path = broken_model(kind, tiny, tmp_path)
    with pytest.raises(ValueError, match=f"--model {re.escape(repr(path))}: {message}"):
        model.load_tokenizer(path)


def test_load_tokenizer_accepts_the_tiny_model(tiny):
    tokenizer, context = model.load_tokenizer(tiny[0])
    assert len(tokenizer) == len(tiny[2])
    assert context == 64


def test_load_model_names_weights_that_do_not_load(tiny, tmp_path):
    from model import load_model

    path = broken_model("weights cut short", tiny, tmp_path)
    message = f"model {re.escape(repr(path))}: cannot load its weights"
    with pytest.raises(ValueError, match=message):
        load_model(path, torch.float32, torch.device("cpu"))


def test_prompt_limit_leaves_room_for_the_completion():
    assert data.prompt_limit(512, 16, 64) == 48
    assert data.prompt_limit(8, 16, 64) == 8

    message = ("--max-new-tokens 64 leaves no room for a prompt in the model's context "
               "of 64 tokens: lower it")
    with pytest.raises(ValueError, match=message):
        data.prompt_limit(512, 64, 64)


def test_gsm8k_golds_score_with_accuracy_reward(tmp_path):
    rows = load_fixtures(write_gsm8k_jsonl(tmp_path / "g.jsonl"))
    solutions = [r["solution"] for r in rows]

    # the reward parses the gold after "####": the bare gold scores 1, the
    # number before "####" 0
    assert accuracy_reward([f"\\boxed{{{g}}}" for g in GOLDS], solutions) == [1.0] * 5
    assert accuracy_reward(["12", "12", "90", "9", "1200"], solutions) == [0, 0, 1, 0, 0]


# -----------------------------------------------------------------------------
# The R1 reward pair on the fixtures: format 0.1 + correctness 1.0 in the seed's recipe

@pytest.mark.parametrize("conversational", [False, True])
def test_r1_rewards_on_good_badly_formatted_and_wrong_completions(conversational, tmp_path):
    # golds 7 and 8
    rows = load_fixtures(write_gsm8k_jsonl(tmp_path / "g.jsonl"))[:2]
    completions = [
        # good
        "<think>3*4 = 12 pencils, 12 - 5 = 7.</think>\nThe answer is 7.",
        # good, answer right after the tag
        "<think>Half of 24 is 12, 12 - 4 = 8.</think> 8",
        # right answer, no think block
        "3*4 = 12, 12 - 5 = 7. The answer is 7.",
        # reasoning never closes
        "<think>Half of 24 is 12, and 12 - 4 = 8",
        # well formatted, wrong
        "<think>3*4 = 12, 12 - 5 = 7.</think>\nThe answer is 12.",
        # two think blocks, wrong
        "<think>24 - 4 = 20</think>\n<think>again</think> 20",
    ]
    solutions = [rows[i % 2]["solution"] for i in range(len(completions))]
    if conversational:
        completions = [[{"role": "assistant", "content": c}] for c in completions]

    funcs = [think_format_reward, reasoning_accuracy_reward, accuracy_reward]
    prompts = [rows[i % 2]["prompt"] for i in range(6)]
    levels = [rows[i % 2]["level"] for i in range(6)]
    rewards = compute_rewards(funcs, prompts, completions, solution=solutions,
                              level=levels)  # (6, 3)
    assert rewards.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1], [0, 0, 1], [1, 0, 0],
                                [0, 0, 0]]

    weighted = rewards[:, :2] @ torch.tensor([0.1, 1.0])  # (6,) the seed's weights
    assert torch.allclose(weighted, torch.tensor([1.1, 1.1, 0, 0, 0.1, 0]))


# -----------------------------------------------------------------------------
# Prompt rendering

def test_render_through_the_chat_template():
    tok = chat_tokenizer()
    questions = [f["question"] for f in GSM8K_FIXTURES]

    texts, conversational = data.render_prompts(tok, questions)
    assert conversational
    assert texts[0] == (f"<|im_start|>system\n{data.DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
                        f"<|im_start|>user\n{questions[0]}<|im_end|>\n"
                        "<|im_start|>assistant\n")

    ids = data.encode_prompts(tok, texts, conversational)
    assert [tok.decode(x) for x in ids] == texts
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    # one token each, not 12 characters
    assert ids[0][0] == im_start
    assert ids[0].count(im_start) == 3
    assert tok.eos_token == "<|im_end|>"
    # every character known
    assert tok.unk_token_id not in sum(ids, [])

    brief = data.render_prompts(tok, ["Q?"], system_prompt="Be brief.")[0]
    assert brief == ["<|im_start|>system\nBe brief.<|im_end|>\n"
                     "<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"]
    no_system = data.render_prompts(tok, ["Q?"], system_prompt=None)[0]
    assert no_system == ["<|im_start|>user\nQ?<|im_end|>\n<|im_start|>assistant\n"]

    # kept, not doubled
    own_system = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    rendered = data.render_prompts(tok, [own_system])[0][0]
    assert rendered.count("<|im_start|>system\nS<|im_end|>") == 1


def test_render_plain_text_without_a_chat_template():
    tok = task.build_tokenizer(task.TEXT_CHARS)

    texts, conversational = data.render_prompts(tok, ["What is 2+3?"])
    assert not conversational
    assert texts == [f"{data.DEFAULT_SYSTEM_PROMPT}\n\nUser: What is 2+3?\nAssistant:"]
    bare = data.render_prompts(tok, ["What is 2+3?"], system_prompt="")[0]
    assert bare == ["What is 2+3?"]

    with pytest.raises(ValueError, match="no chat template"):
        data.render_prompts(tok, [[{"role": "user", "content": "Q?"}]])


def test_encode_prompts_writes_bos_once():
    # the template writes <s> and so does the tokenizer's post-processor
    tok = chat_tokenizer(bos=True)
    bos = tok.bos_token_id

    texts, conversational = data.render_prompts(tok, ["Q?"])
    # the trap: plain tokenization doubles it
    assert tok(texts[0])["input_ids"][:2] == [bos, bos]
    assert data.encode_prompts(tok, texts, conversational)[0].count(bos) == 1

    plain = tok("Q?", add_special_tokens=False)["input_ids"]
    assert data.encode_prompts(tok, ["Q?"], False)[0] == [bos] + plain


def test_tokenizer_survives_save_and_auto_reload(tmp_path):
    # transformers 5 reloads a folder with a qwen2 config as a Qwen2Tokenizer
    # (byte-level pre-tokenizer)
    from transformers import AutoTokenizer

    tok = chat_tokenizer()
    tok.save_pretrained(tmp_path)
    Qwen2Config(vocab_size=len(tok)).save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)

    prompt = data.render_prompts(tok, [GSM8K_FIXTURES[3]["question"]])[0][0]
    text = prompt + "<think>12 - 3 = 9\n</think> 33"
    assert reloaded(text)["input_ids"] == tok(text)["input_ids"]
    assert reloaded.decode(tok(text)["input_ids"]) == text
    assert (reloaded.eos_token_id, reloaded.pad_token_id) == (3, 0)
    assert (tok.eos_token_id, tok.pad_token_id) == (3, 0)


def test_default_task_tokenizer_unchanged():
    tok = task.build_tokenizer()
    assert len(tok) == 2 + len(task.CHARS)
    assert tok.eos_token_id == tok.pad_token_id == 0
    assert tok.chat_template is None
    assert tok.decode(tok("739>9")["input_ids"]) == "739>9"


# -----------------------------------------------------------------------------
# A learned reward model as a reward function

def save_reward_model(directory, tokenizer, num_labels=1, seed=0):
    # head_dim 32
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)

    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


PROMPTS = [GSM8K_FIXTURES[0]["question"]] * 3 + [
    [{"role": "user", "content": GSM8K_FIXTURES[2]["question"]}]]
COMPLETIONS = ["<think>12 - 5 = 7</think> 7", "<think>no idea</think> 12", "7",
               [{"role": "assistant", "content": "<think>15*6 = 90</think> 90"}]]


@pytest.mark.parametrize("with_template", [True, False])
@pytest.mark.same_math
def test_reward_model_scores(with_template, tmp_path):
    if with_template:
        tok = chat_tokenizer()
    else:
        tok = task.build_tokenizer(task.TEXT_CHARS)
    path = save_reward_model(tmp_path / "rm", tok)

    fn = get_reward_model_func(path, batch_size=3, device="cpu")
    assert fn.__name__ == "reward_model_rm"
    scores = fn(completions=COMPLETIONS, prompts=PROMPTS)
    assert len(scores) == 4
    assert all(isinstance(s, float) for s in scores)
    # deterministic: eval mode
    assert fn(completions=COMPLETIONS, prompts=PROMPTS) == scores
    # the completion matters
    assert len(set(scores)) == 4

    # padding in a batch of 3 (right padding) changes nothing against one sequence
    # at a time, but fp32 rounding (the matmuls' shapes differ): fp32_tol of the
    # model's sums over its longest sequence, of the scores' magnitude
    one_at_a_time = get_reward_model_func(path, batch_size=1, device="cpu")
    one_by_one = one_at_a_time(completions=COMPLETIONS, prompts=PROMPTS)
    model = Qwen2ForSequenceClassification.from_pretrained(path).eval()
    tol = fp32_tol(summed_terms(model.config, 128))
    assert_close_rel(torch.tensor(scores), torch.tensor(one_by_one), tol, msg="one by one")

    # by hand: render the pair, run the model, read the logit at the last token
    if with_template:
        text = (f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n"
                f"<|im_start|>assistant\n{COMPLETIONS[0]}<|im_end|>\n")
    else:
        text = PROMPTS[0] + COMPLETIONS[0]
    with torch.no_grad():
        expected = model(torch.tensor([tok(text)["input_ids"]])).logits[0, 0].item()
    assert_close_rel(scores[0], expected, tol, scale=max(map(abs, scores)), msg="by hand")


def test_reward_model_mixes_with_a_rule_reward(tmp_path):
    path = save_reward_model(tmp_path / "rm", chat_tokenizer())
    funcs = get_reward_funcs(["think_format_reward", path])
    assert [f.__name__ for f in funcs] == ["think_format_reward", "reward_model_rm"]

    solutions = ["#### 7"] * 3 + ["#### 90"]
    rewards = compute_rewards(funcs, PROMPTS, COMPLETIONS, solution=solutions)  # (4, 2)
    assert rewards.shape == (4, 2)
    assert torch.isfinite(rewards).all()
    assert rewards[:, 0].tolist() == [1, 1, 0, 1]
    assert rewards[:, 1].tolist() == get_reward_model_func(path)(COMPLETIONS, PROMPTS)


def test_reward_model_errors(tmp_path):
    path = save_reward_model(tmp_path / "two_labels", chat_tokenizer(), num_labels=2)
    with pytest.raises(ValueError, match="has 2 labels; a reward model needs 1"):
        get_reward_funcs([path])

    with pytest.raises(ValueError, match="reward model '/no/such/rm': cannot load"):
        get_reward_funcs(["/no/such/rm"])

    message = "unknown reward function 'no_such_reward'.*hub id"
    with pytest.raises(ValueError, match=message):
        get_reward_funcs(["no_such_reward"])
