"""A learned reward model as a reward function: --rewards org/name (a hub id) or
a folder holding a one-label sequence-classification model.

    python train.py ... --rewards path/to/reward_model

Run the tests: python -m pytest -q tests/test_data.py -k reward_model

Simplifications:
1. A reward model sees the dataset's prompt (as in TRL), not the policy's
   rendered text, and nothing is truncated: prompt + completion must fit its
   context.
"""
import os

import torch

from reward import completion_text


def get_reward_model_func(path, *, batch_size=16, device=None):
    """A one-label sequence-classification model (hub id or folder) -> a reward
    function on prompt + completion: as user and assistant turns of its chat
    template, else concatenated. ValueError: it does not load, or has more labels."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForSequenceClassification.from_pretrained(path)
    except OSError as e:
        # not a local model folder, and not found on the hub
        raise ValueError(f"reward model {path!r}: cannot load it as a sequence-"
                         f"classification model from a local folder or the hub "
                         f"({e})") from e
    model = model.to(device).eval().requires_grad_(False)
    if model.config.num_labels != 1:
        raise ValueError(f"reward model {path!r} has {model.config.num_labels} labels; "
                         f"a reward model needs 1")

    # batching needs a pad token; HF pools the last non-pad token
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    # real tokens keep positions 0..L-1
    tokenizer.padding_side = "right"

    def render(prompt, completion):
        if not tokenizer.chat_template:
            return completion_text(prompt) + completion_text(completion)

        if isinstance(prompt, str):
            turns = [{"role": "user", "content": prompt}]
        else:
            turns = list(prompt)
        turns = turns + [{"role": "assistant", "content": completion_text(completion)}]
        return tokenizer.apply_chat_template(turns, tokenize=False)

    @torch.no_grad()
    def reward_model(completions, prompts, **kw):
        texts = [render(p, c) for p, c in zip(prompts, completions, strict=True)]

        scores = []
        for i in range(0, len(texts), batch_size):
            # a rendered template holds its own BOS: add no second one (see
            # data.encode_prompts)
            batch = tokenizer(texts[i:i + batch_size], padding=True, return_tensors="pt",
                              add_special_tokens=not tokenizer.chat_template).to(device)
            scores += model(**batch).logits[:, 0].float().tolist()  # (b,)
        return scores

    reward_model.__name__ = f"reward_model_{os.path.basename(os.path.normpath(path))}"
    return reward_model
