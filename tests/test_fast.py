"""--fast: the speed machinery of fast/, held against the plain path it replaces.

- One update from the same state: the same log-probs, loss and gradients with
  --fast on and off, through the logits and through the fused head: in fp64 to
  FP64_TOL (the same math), and in fp32 (the fused head and the norms' backward
  by hand run in fp32 only) to its rounding, fp32_tol (tests/helpers.py).
- The two decode loops draw the same completions from the same uniforms, and
  the same log-probs to fp32 rounding (both run in fp32).
- A default run imports none of the optional features' modules; --fast off none
  of fast/.
- A resume across a change of --fast is refused in one line.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import config
import fast
from batch import UpdateBatch
from helpers import (ENV, FP64_TOL, ROOT, assert_close_rel, fp32_tol, fp64_norms, run_train,
                     summed_terms)
from loss import LossSettings, minibatch_tokens, policy_loss
from model import Forward, load_model, pad_id, prompt_batch, sequence_logps
from rollout import HFEngine

# the engines' seed: both loops draw the same uniforms from it
SEED = 3
# the optional features' folders and modules: a default run imports none of them
FEATURE_FOLDERS = ("tools", "trl_compat", "variants", "scale", "rewards", "sampling", "resume",
                   "data_sources")
FEATURE_MODULES = ("engines.server", "engines.staleness", "engines.worker_extension",
                   "engines.vllm_sleep", "engines.background", "runlog.report", "runlog.completions",
                   "runlog.pass_at_k")


def features(loaded):
    """The feature modules among the module names loaded."""
    return sorted(name for name in loaded
                  if name.split(".")[0] in FEATURE_FOLDERS or name in FEATURE_MODULES)


def flags(*argv):
    """config.py's args for these flags, as train.py parses and fills them."""
    args = config.parse_args(list(argv))
    config.fill_defaults(args)
    return args


def installed(path, tokenizer, args, minibatch):
    """A fresh fp32 policy from path with --fast installed: (policy, engine, forward, micro)."""
    policy = load_model(path, torch.float32, "cpu")
    engine = HFEngine(policy, tokenizer, seed=SEED)
    optimizer = torch.optim.AdamW(policy.parameters())
    engine, forward, micro, _ = fast.install(
        "on", args=args, model=policy, reference=None, engine=engine, optimizer=optimizer,
        device=torch.device("cpu"), dtype=torch.float32, loss_impl="torch",
        minibatch=minibatch)
    return policy, engine, forward, micro


def a_rollout(tokenizer, prompt_ids, G=3, T=6):
    """(N,) prompts, each G times; completions (N, T) that end at different lengths."""
    g = torch.Generator().manual_seed(0)
    rows = [p for p in prompt_ids for _ in range(G)]
    completion_ids = torch.randint(3, len(tokenizer), (len(rows), T), generator=g)  # (N, T)
    lengths = torch.randint(1, T + 1, (len(rows),), generator=g)  # (N,)
    completion_mask = (torch.arange(T) < lengths[:, None]).float()  # (N, T)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, pad_id(tokenizer))
    return rows, completion_ids, completion_mask


def one_update(policy, forward, prompts, completion_ids, completion_mask, settings):
    """The update's forward, loss and backward on every row -> (log-probs, loss, grads)."""
    N = len(completion_ids)
    batch = UpdateBatch(completion_ids=completion_ids, completion_mask=completion_mask,
                        advantages=torch.linspace(-1, 1, N), sampling_logps=None)
    rows = torch.arange(N)
    policy.zero_grad(set_to_none=True)

    logits = None
    entropies = None
    if forward.head_logps:
        logps = forward.head_logps(policy, prompts, rows, completion_ids, completion_mask,
                                   settings.temperature)
    else:
        logits = forward.logits(policy, prompts, rows, completion_ids)
        if settings.entropy_coef:
            entropies = forward.entropies(logits, settings.temperature)
        logps = forward.logps(logits, completion_ids, settings.temperature)
    loss, _ = policy_loss(logits, batch, settings, minibatch_size=N,
                          minibatch_tokens=minibatch_tokens(completion_mask), logps=logps,
                          entropies=entropies)
    loss.backward()

    grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
    return logps.detach() * completion_mask, loss.detach(), grads


# entropy bonus on: through the logits; off: the fused head (fast.update.completion_logps)
@pytest.mark.parametrize("entropy_coef", [0.1, 0.0])
@pytest.mark.same_math
def test_one_update_is_the_same_with_fast_on_and_off(tiny, entropy_coef):
    path, _, tokenizer, prompt_ids = tiny
    args = flags("--entropy-coef", str(entropy_coef))
    rows, completion_ids, completion_mask = a_rollout(tokenizer, prompt_ids)
    prompts = prompt_batch(rows, pad_id(tokenizer))
    settings = LossSettings(entropy_coef=entropy_coef, temperature=0.7)

    plain = load_model(path, torch.float32, "cpu")
    want = one_update(plain, Forward(), prompts, completion_ids, completion_mask, settings)
    policy, _, forward, _ = installed(path, tokenizer, args, minibatch=len(rows))
    assert (forward.head_logps is not None) == (entropy_coef == 0)
    got = one_update(policy, forward, prompts, completion_ids, completion_mask, settings)

    n_summed = summed_terms(plain.config, prompts[0].shape[1] + completion_ids.shape[1])
    mask = completion_mask.bool()

    def the_same(got, want, tol):
        (logps, loss, grads), (ref_logps, ref_loss, ref_grads) = got, want
        assert_close_rel(logps, ref_logps, tol, msg="log-probs")
        assert_close_rel(loss, ref_loss, tol, msg="loss")
        for name, grad in ref_grads.items():
            assert_close_rel(grads[name], grad, tol, msg=name)

        # the old and reference log-probs, micro-batch by micro-batch
        plain_logps = sequence_logps(Forward(), plain, prompts, completion_ids, 0.7, micro=4)
        fast_logps = sequence_logps(forward, policy, prompts, completion_ids, 0.7, micro=4)
        assert_close_rel(fast_logps[mask], plain_logps[mask], tol, msg="old log-probs")

    the_same(got, want, fp32_tol(n_summed))

    # fp64 (in place): the same forward (fast.install's, above), the same math
    plain.double()
    policy.double()
    with fp64_norms():
        want = one_update(plain, Forward(), prompts, completion_ids, completion_mask, settings)
        got = one_update(policy, forward, prompts, completion_ids, completion_mask, settings)
        assert got[0].dtype == want[0].dtype == torch.float64
        the_same(got, want, FP64_TOL)


@pytest.mark.parametrize("temperature, filters", [
    (1.0, {}),
    (0.0, {}),
    (0.8, dict(top_k=5, repetition_penalty=1.3)),
])
@pytest.mark.same_math
def test_the_decode_loops_draw_the_same_completions(tiny, temperature, filters):
    """The same seed gives both loops the same uniforms: the same tokens, and
    log-probs to fp32 rounding (the plain loop prefills each completion's
    prompt)."""
    path, _, tokenizer, prompt_ids = tiny
    plain = HFEngine(load_model(path, torch.float32, "cpu"), tokenizer, seed=SEED)
    _, engine, _, _ = installed(path, tokenizer, flags(), minibatch=1)
    assert type(engine).__name__ == "FastHFEngine"

    want = plain.generate(prompt_ids, 4, 12, temperature=temperature, **filters)
    got = engine.generate(prompt_ids, 4, 12, temperature=temperature, **filters)

    assert got.completion_ids.tolist() == want.completion_ids.tolist()
    assert got.is_finished.tolist() == want.is_finished.tolist()
    # fp32 only (the fast loop's shared prompt and tiled head): to its rounding
    n_summed = summed_terms(plain.model.config, max(map(len, prompt_ids)) + 12)
    assert_close_rel(got.sampling_logps, want.sampling_logps, fp32_tol(n_summed),
                     msg="sampling log-probs")


def test_a_sliding_window_model_keeps_the_plain_decode_loop(tmp_path):
    """The fast loop's left-padded rows are off with a sliding-window layer
    (tests/test_decode.py): install leaves such a model the plain loop."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from task import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=32, use_sliding_window=True, sliding_window=4,
                         layer_types=["full_attention", "sliding_attention"])
    Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    _, engine, _, _ = installed(str(tmp_path), tokenizer, flags(), minibatch=1)
    assert type(engine) is HFEngine


def imported_by_a_run(tmp_path, *train_flags):
    """The module names a 1-step default run of train.py imports (a cold interpreter)."""
    names = tmp_path / "modules.json"
    code = (f"import json, runpy, sys; "
            f"sys.argv = ['train.py', '--steps', '1', '--eval-every', '0', '--eval-size', '40', "
            f"'--out-dir', {str(tmp_path / 'out')!r}, *{list(train_flags)!r}]; "
            f"runpy.run_path('train.py', run_name='__main__'); "
            f"json.dump(sorted(sys.modules), open({str(names)!r}, 'w'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env={**ENV, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return set(json.load(open(names)))


def test_a_default_run_imports_no_feature_module(tmp_path):
    loaded = imported_by_a_run(tmp_path)
    assert not features(loaded), features(loaded)
    assert "fast.decode" in loaded and "fast.update" in loaded


def test_fast_off_imports_nothing_of_fast(tmp_path):
    loaded = imported_by_a_run(tmp_path, "--fast", "off")
    assert not {name for name in loaded if name.split(".")[0] == "fast"}
    assert not features(loaded), features(loaded)


def test_a_resume_across_a_change_of_fast_is_refused(tmp_path):
    out = tmp_path / "out"
    run_train(["--steps", "2", "--save-every", "1", "--eval-every", "0", "--eval-size", "40",
               "--engine", "hf"], out)

    code, output, _ = run_train(["--steps", "3", "--eval-every", "0", "--eval-size", "40",
                                 "--engine", "hf", "--fast", "off"], out, check=False)
    assert code != 0
    error = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "fast" in error[0], output[-2000:]
    assert os.path.exists(out / "checkpoints")
