"""Tiny checkpoints that keep what makes a real one different from the default toy.

The default is character-level (see shared/notes/real-checkpoints.md). These
keep the architecture class and weight names, the vocabulary size (V in every
softmax, far larger than the tokenizer), a tied or untied head, RoPE scaling,
bf16 on disk, and the tokenizer's special-token semantics. Only hidden size and
depth shrink (head_dim stays 32: vLLM's CPU attention floor).

    qwen_like(path)    Qwen2.5-Instruct-like: Qwen2ForCausalLM, V = 151,936, tied,
                       QKV bias, ChatML, EOS <|im_end|>, pad <eos>, no BOS
    llama_like(path)   Llama-3-Instruct-like: LlamaForCausalLM, V = 128,256, untied
                       lm_head, llama3 RoPE scaling, a BOS the tokenizer adds and the
                       chat template writes, two EOS ids, NO pad token
"""
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM)

import task

QWEN_VOCAB = 151_936
LLAMA_VOCAB = 128_256
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1)
BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
END = "<|end_of_text|>"
HEADER = ("<|start_header_id|>", "<|end_header_id|>")
# Llama 3's format: the template writes BOS itself (encode with add_special_tokens=False)
LLAMA_TEMPLATE = (
    BOS + "{% for m in messages %}" + HEADER[0] + "{{ m['role'] }}" + HEADER[1]
    + "\n\n{{ m['content'] }}" + EOT + "{% endfor %}{% if add_generation_prompt %}"
    + HEADER[0] + "assistant" + HEADER[1] + "\n\n{% endif %}")


def _byte_char(c):
    """GPT-2's byte alphabet: " " -> "Ġ"."""
    if c > " ":
        return c
    return chr(256 + ord(c))


def llama_tokenizer():
    """One token per printable ASCII character plus Llama 3's special tokens.

    Byte-level, like task.build_tokenizer. The tokenizer adds BOS to plain text,
    <|eot_id|> is EOS, and there is no pad token.
    """
    specials = [BOS, END, *HEADER, EOT, "<unk>"]
    tokens = specials + [_byte_char(c) for c in task.TEXT_CHARS]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.add_special_tokens(specials)

    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A",
                                                       special_tokens=[(BOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOT,
                                   unk_token="<unk>", chat_template=LLAMA_TEMPLATE)


def _save(model, tokenizer, path, eos_ids, dtype):
    model.generation_config.eos_token_id = eos_ids
    model.generation_config.pad_token_id = tokenizer.pad_token_id

    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)


def qwen_like(path, seed=0, dtype=torch.bfloat16):
    """-> the fp32 model in memory.

    Saved to path in dtype with its ChatML tokenizer (vocab ~100 << 151,936).
    """
    tokenizer = task.build_tokenizer(task.TEXT_CHARS, task.CHAT_TEMPLATE)
    config = Qwen2Config(vocab_size=QWEN_VOCAB, **SHAPE, max_position_embeddings=2048,
                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)

    # <|im_end|>, <eos>
    eos_ids = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    _save(model, tokenizer, path, eos_ids, dtype)
    return model.float()


def llama_like(path, seed=0, dtype=torch.bfloat16):
    """-> the fp32 model in memory.

    Saved to path in dtype with a tokenizer that has no pad token.
    """
    tokenizer = llama_tokenizer()
    ids = tokenizer.convert_tokens_to_ids
    rope_scaling = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                        high_freq_factor=4.0, original_max_position_embeddings=8192)
    config = LlamaConfig(vocab_size=LLAMA_VOCAB, **SHAPE, max_position_embeddings=131_072,
                         rope_theta=5e5, rope_scaling=rope_scaling, tie_word_embeddings=False,
                         bos_token_id=ids(BOS), eos_token_id=ids(END), pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight is not model.model.embed_tokens.weight

    # the Instruct generation config's EOS list
    _save(model, tokenizer, path, [ids(END), ids(EOT)], dtype)
    return model.float()


def token_id_reward(completion_ids, **kw):
    """A dense, meaningless reward: the completion's token-id sum mod 7, / 6.

    So that groups have advantages to learn from: a random model never answers,
    and with all rewards equal only the KL term would move the weights.
    """
    return [sum(ids) % 7 / 6 for ids in completion_ids]
