"""model.completion_logits shares each prompt's forward among its completions (prefix sharing): the logits and the
gradients must be those of the plain forward over whole (prompt + completion) sequences, whatever the prompt lengths
(left padding, a 1-token prompt), the micro-batch cut (through a group) and the dtype."""
import pytest
import torch

from model import completion_logits, prompt_batch, sequence_batch, sequence_logps
from loss import selective_log_softmax


def whole_sequence_logits(model, prompt_ids, completion_ids):  # the plain way: one (P+T) sequence per completion
    ids, mask, positions = sequence_batch(prompt_ids, completion_ids, 0)
    T = completion_ids.shape[1]
    return model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=T + 1).logits[:, :-1]


def rollout_like(G=3, T=4, lengths=(3, 1, 5, 2)):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 15, (n,), generator=g).tolist() for n in lengths]
    prompt_ids = [p for p in prompts for _ in range(G)]  # (N,) each prompt G times, consecutively
    return prompt_ids, torch.randint(3, 15, (len(prompt_ids), T), generator=g)  # (N, T)


def test_prompt_batch_keeps_each_prompt_once():
    ids, mask, positions, row = prompt_batch([[5, 6], [5, 6], [7], [7], [5, 6]], pad_id=0)
    assert ids.tolist() == [[5, 6], [0, 7], [5, 6]] and row.tolist() == [0, 0, 1, 1, 2]  # groups, not a set
    assert mask.tolist() == [[1, 1], [0, 1], [1, 1]] and positions.tolist() == [[0, 1], [0, 0], [0, 1]]


@pytest.mark.parametrize("micro", [12, 5, 1])  # all, through groups, one completion
@pytest.mark.parametrize("lengths", [(3, 1, 5, 2), (1, 1, 1, 1)])  # a 1-token prompt; no prefix at all
def test_logits_and_gradients_match_whole_sequences(tiny, micro, lengths):
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like(lengths=lengths)
    N = len(prompt_ids)
    weights = torch.randn(N, completion_ids.shape[1], model.config.vocab_size)  # a loss that touches every logit
    model.zero_grad()
    (whole_sequence_logits(model, prompt_ids, completion_ids) * weights).sum().backward()
    want = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    prompts, got = prompt_batch(prompt_ids, 0), []
    for i in range(0, N, micro):
        logits = completion_logits(model, prompts, slice(i, i + micro), completion_ids[i:i + micro])  # (n, T, V)
        (logits * weights[i:i + micro]).sum().backward()
        got.append(logits.detach())
    torch.testing.assert_close(torch.cat(got), whole_sequence_logits(model, prompt_ids, completion_ids).detach(),
                               atol=1e-5, rtol=1e-5)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[k], atol=1e-4, rtol=1e-4, msg=k)


def test_sequence_logps_bf16_matches_whole_sequences(tiny):
    _, model, _, _ = tiny
    prompt_ids, completion_ids = rollout_like()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = selective_log_softmax(whole_sequence_logits(model, prompt_ids, completion_ids), completion_ids, 1.0)
    got = sequence_logps(model, prompt_batch(prompt_ids, 0), completion_ids, 1.0, micro=5, dtype=torch.bfloat16)
    assert got.shape == completion_ids.shape
    torch.testing.assert_close(got, want.float(), atol=0.05, rtol=0.0)  # bf16 rounding differs with the batch shape
