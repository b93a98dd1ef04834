"""
The built-in task and tiny model: what `train.py` trains when no --model / --dataset is given.

Task "max of digits": the prompt is K random digits and '>' (e.g. `739>`), the answer is the largest
digit (`9`) followed by EOS. The reward is checkable by a rule, the prompt space is small enough for a
0.3M-parameter model to learn from scratch on a CPU in about a minute, and a random policy scores ~1/10.

    python task.py          # prints a few prompts, the tokenizer round trip and the model size

Simplifications:
1. Answers are drawn evenly from 0-9 and digits are then drawn below the answer. Drawing digits uniformly
   skews answers towards 9 (P(max=9) = 27%), and a policy stuck on "9" never learns small answers.
2. Train and held-out prompts are disjoint strings, except for answers 0 and 1, which have only 1 and
   7 possible prompts (for K=3): those strings appear in both splits.
3. A character-level tokenizer (one token per character, EOS doubles as padding) built in memory with
   `tokenizers`, saved like any HF tokenizer so vLLM and `AutoTokenizer` load it from the model folder.
"""
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

CHARS = list("0123456789>+-=*/ ")  # everything the built-in task can print; extend for a new task
EOS, UNK = "<eos>", "<unk>"


def build_tokenizer():
    """One token per character; id 0 is EOS (also used as pad), id 1 UNK."""
    vocab = {tok: i for i, tok in enumerate([EOS, UNK] + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # every char its own token
    tok.decoder = decoders.Fuse()  # join tokens back without spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS, unk_token=UNK)


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


def make_max_digit_dataset(num_digits=3, num_train=20000, num_test=500, test_frac=0.2, seed=0):
    """Returns (train, test): lists of {"prompt": "739>", "solution": "9"}, answers even over 0-9."""
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
            rows.append({"prompt": rng.choice(pool[a]) + ">", "solution": str(a)})
        return rows

    return draw(train_strings, num_train), draw(test_strings, num_test)


def digit_format_reward(completions, **kw):
    """0.1-weighted shaping reward of the default task: 1.0 iff the completion is one digit then EOS.
    (Texts are decoded up to EOS, and max_new_tokens is 2, so a 1-character digit text means EOS came.)"""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if len(t) == 1 and t.isdigit() else 0.0 for t in texts]


if __name__ == "__main__":
    tokenizer = build_tokenizer()
    train, test = make_max_digit_dataset()
    print(train[:5], len(train), len(test))
    ids = tokenizer(train[0]["prompt"] + train[0]["solution"])["input_ids"]
    print(ids, repr(tokenizer.decode(ids)))
    model = build_tiny_model(tokenizer)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
