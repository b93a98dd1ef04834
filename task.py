"""
The built-in task and tiny model: what `train.py` trains when no --model or
--dataset is given.

Task "sort the digits": the prompt is K random digits and '>' (e.g. `739>`), the
answer is the same digits sorted largest first (`973`) followed by EOS. The
reward is checkable by a rule, and a random policy scores 1/1000. A
0.3M-parameter model learns it from scratch with GRPO on a 2-core CPU in a few
minutes: the first answer digit (the max) comes first, then the rest, helped by
a per-position shaping reward.

Real datasets (GSM8K and the like) load through data.py instead; the recipe for
each is config.py's.

    python -m pytest -q tests/test_data.py

Simplifications:
1. Prompts are drawn with their largest digit even over 0-9. Drawing digits
   uniformly skews the max towards 9 (P(max=9) = 27%), and a policy stuck on
   "9..." never learns prompts of small digits.
2. Train and held-out prompts are disjoint strings, except for max digit 0 and
   1, which have only 1 and 7 possible prompts (for K=3): those strings appear
   in both splits.
3. A character-level tokenizer: one token per character, EOS doubles as padding.
   It is built in memory with `tokenizers`, as a byte-level BPE with no merges,
   and saved like any HF tokenizer, so vLLM and `AutoTokenizer` load it from the
   model folder and tokenize exactly as the built one does.
   `build_tokenizer(TEXT_CHARS, CHAT_TEMPLATE)` is its chat variant for tests of
   real-data runs: printable ASCII, ChatML (Qwen2.5's format) with
   <|im_start|>/<|im_end|> as single tokens, <|im_end|> as EOS.
"""
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

# Everything the built-in task can print; extend for a new task.
CHARS = list("0123456789>+-=*/ ")
# Printable ASCII and newline: word problems.
TEXT_CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
EOS = "<eos>"
UNK = "<unk>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# ChatML, the format of Qwen2.5-Instruct, without tool calls.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n"
    + "{% endfor %}"
    + "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)


def build_tokenizer(chars=CHARS, chat_template=None):
    """One token per character; id 0 is EOS (also used as pad), id 1 UNK.

    With a chat template, <|im_start|> and <|im_end|> are single tokens (ids 2,
    3) and <|im_end|> is EOS: the end of the assistant's turn ends a completion,
    as in Qwen2.5-Instruct. Id 0 stays the pad.

    Stored as a byte-level BPE with no merges, i.e. Qwen2's format. transformers
    5 reloads a folder whose config says qwen2 as a Qwen2Tokenizer
    (tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), which imposes
    byte-level pre-tokenization: any other vocabulary loses spaces and newlines
    on reload.
    """
    if any(not " " <= c <= "~" and c != "\n" for c in chars):
        raise ValueError("build_tokenizer takes printable ASCII characters and newline "
                         "only")

    def byte_char(c):
        """c in GPT-2's byte alphabet: " " -> "Ġ"."""
        return c if c > " " else chr(256 + ord(c))

    specials = [EOS, UNK]
    if chat_template:
        specials += [IM_START, IM_END]
    vocab = {tok: i for i, tok in enumerate(specials + [byte_char(c) for c in chars])}

    # no merges: one token per byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    # specials are matched whole, never split into characters
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()

    eos = IM_END if chat_template else EOS
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=EOS,
                                   unk_token=UNK, chat_template=chat_template)


def build_tiny_model(tokenizer, seed=0, hidden_size=128, num_layers=2, num_heads=4,
                     max_len=64):
    """A randomly initialised Qwen2 from a config (hidden 128, 2 layers: ~0.3M
    parameters). head_dim = hidden_size / num_heads must be >= 32: vLLM's CPU
    attention rejects 16."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)

    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny_model(path, seed=0):
    """The default run's starting point, as a save_pretrained folder: vLLM and
    every rank load it from disk."""
    tokenizer = build_tokenizer()
    build_tiny_model(tokenizer, seed=seed).save_pretrained(path)
    tokenizer.save_pretrained(path)


def make_sort_dataset(num_digits=3, num_train=20000, num_test=500, test_frac=0.2, seed=0):
    """Returns (train, test): lists of {"prompt": "739>", "solution": "973"}, the
    max digit even over 0-9."""
    rng = random.Random(seed)

    # every possible prompt string, bucketed by its answer
    by_answer = {a: [] for a in range(10)}
    for n in range(10 ** num_digits):
        s = str(n).zfill(num_digits)
        by_answer[int(max(s))].append(s)

    train_strings = {}
    test_strings = {}
    for a, strings in by_answer.items():
        rng.shuffle(strings)
        k = int(len(strings) * test_frac)
        if k >= 1:
            train_strings[a] = strings[k:]
            test_strings[a] = strings[:k]
        else:
            # too few strings to split (answers 0 and 1): share them, see
            # task.py, simplification 2

            train_strings[a] = strings
            test_strings[a] = strings

    def draw(pool, n):
        rows = []
        for _ in range(n):
            a = rng.randrange(10)
            digits = rng.choice(pool[a])
            answer = "".join(sorted(digits, reverse=True))
            rows.append({"prompt": digits + ">", "solution": answer})
        return rows

    return draw(train_strings, num_train), draw(test_strings, num_test)


def position_reward(completions, solution, **kw):
    """The default task's shaping reward (weight 0.5 beside exact match 1.0).

    The fraction of answer positions that are right, over the longer of answer
    and completion: "973" vs "97" scores 2/3, vs "9731" 3/4. Exact match alone is
    too sparse to start from (1 in 1000 at random); this rewards getting the max
    first, then more.
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    pairs = zip(texts, solution, strict=True)
    return [sum(a == b for a, b in zip(t, s)) / max(len(t), len(s)) for t, s in pairs]

