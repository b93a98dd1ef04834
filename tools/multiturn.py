"""
Multi-turn rollouts: the policy calls tools, reads their results, and goes on
(train.py --tools python, --tools module.fn, --environment module.Class).

    completion = policy ... <call> | <result> | policy ... <call> | <result> | policy ... EOS
    completion_mask: 1 on the policy's tokens (the loss trains on these)
    tool_mask:       1 on the results

    engine = ToolEngine(engine, tokenizer, TemplateFormat(tokenizer, 256), specs,
                        max_calls=4, timeout_s=10.0, render=render)
    rollout = engine.generate(prompt_ids, G, max_new_tokens, rows=rows)  # -> ToolRollout

Each completion gets its own environment instance (environment.py), reset with
its row. tool_format.py says what a call and a result look like: ToRL's fenced
code, or the chat template's tool calls. The rewards see the whole transcript,
results included, as a conversation of assistant and tool turns when the prompts
are chat, and the columns tool_calls and, where an environment scores,
environment_reward (reward.py).

Tests: python -m pytest -q tests/test_tools.py tests/test_environment.py
A learning run: python -m bench tools_run

Simplifications:
1. Rounds: the inner engine generates every row to its end (EOS, for the
   template's calls). A row whose text holds a call is cut right after it
   (FenceFormat: after the closing fence), and what it sampled later is thrown
   away. Sampling is autoregressive, so the kept prefix is exactly what a stop
   there would have produced.
2. A round's calls run together, each instance in its own process (MAX_LIVE at
   most: a larger call samples in chunks of whole groups). Then the rows
   with budget left go on as new prompts (prompt + transcript, one completion
   each), in one inner generate call per round. A slow call delays its round, at
   most --tool-timeout.
3. Each continuation reads its prompt and transcript again: vLLM's prefix cache
   (on by default) serves it from cache; HFEngine prefills it again.
4. --max-new-tokens bounds the whole completion, results included. A result is
   cut to the budget left, a continuation to its row's own budget (the inner
   call asks for the largest one).
5. --max-tool-calls bounds the rounds of a completion, as TRL's
   max_tool_calling_iterations; after them a row's calls do not run.
6. A result's tokens are its text encoded alone, not necessarily how the whole
   transcript would tokenize. The trainer never re-tokenizes, so the policy is
   trained on exactly what it saw.
"""
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import data
from tools import environment
from model import pad_id
from reward import final_number_reward
from rollout import Rollout, build_rollout, call_seed
from tools.tool_format import FenceFormat, TemplateFormat, supports_tools

# environment processes alive at once (~10-20 MB each): a larger call goes in
# chunks
MAX_LIVE = 64


@dataclass
class ToolRollout(Rollout):
    # (N, T) float, 1 at tool-result tokens (completion_mask: 0)
    tool_mask: torch.Tensor
    # (N,) per completion: name, arguments, output, error, seconds
    tool_calls: list[list[dict]]
    # (N,) per completion: its assistant and tool turns
    messages: list[list[dict]]
    # (N,) per completion: (environment class, get_reward's value), or None
    environment_rewards: list

    def reward_columns(self):
        """Each completion's calls, and its environment's score (reward.score)."""
        return dict(tool_calls=self.tool_calls, environment_rewards=self.environment_rewards)

    def conversations(self):
        """The assistant and tool turns, as TRL gives them."""
        return self.messages


def unpad(rollout):
    """A Rollout -> per row (token ids, sampling logprobs, EOS reached), without
    its padding."""
    # (N,) a plain mask is a prefix
    lengths = rollout.completion_mask.sum(1).int().tolist()
    ids = rollout.completion_ids.tolist()
    logps = rollout.sampling_logps.tolist()
    finished = rollout.is_finished.tolist()

    return [(x[:n], lp[:n], f) for x, lp, n, f in zip(ids, logps, lengths, finished)]


class ToolEngine:
    """Wraps a rollout engine (HFEngine, VLLMEngine): its generate, with the tool
    calls run and their results spliced in. state_dict, load_state_dict,
    sync_weights and close are the inner engine's."""

    def __init__(self, engine, tokenizer, call_format, specs, *, max_calls=4,
                 timeout_s=10.0, render=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.format = call_format
        # {environment name: environment.EnvironmentSpec}
        self.specs = specs
        self.max_calls = max_calls
        self.timeout_s = timeout_s
        # render(row, observation) -> the prompt's ids with reset's text appended
        self.render = render

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, rows=None,
                 **sampling):
        """G completions per prompt (rows: the prompts' dataset rows, for reset),
        each with its calls run (simplifications 1-5) -> ToolRollout. At most
        MAX_LIVE instances live at once: the prompts go in chunks of whole
        groups."""
        if rows is None:
            rows = [{} for _ in prompt_ids]
        per_chunk = max(1, MAX_LIVE // G)  # prompts

        prompts = []
        transcripts = []
        rewards = []
        failures = []  # per row: why its environment failed to start or reset, or None
        for start in range(0, len(prompt_ids), per_chunk):
            chunk = slice(start, start + per_chunk)
            # the last chunk judges the whole call: every reset failed -> stop
            last = start + per_chunk >= len(prompt_ids)
            played = self.play(prompt_ids[chunk], rows[chunk], G, max_new_tokens,
                               temperature, sampling, failures if last else None)
            prompts += played[0]
            transcripts += played[1]
            rewards += played[2]
            failures += played[3]

        return self.build(prompts, transcripts, rewards)

    def play(self, prompt_ids, rows, G, max_new_tokens, temperature, sampling, earlier):
        """One chunk: an instance per completion, reset, the rounds, the rewards
        -> (prompts, transcripts, rewards, reset failures), a list each of N.
        earlier: the call's failures so far, when this chunk is its last (it
        stops the run if every row failed: environment.reset_failures)."""
        rows = [row for row in rows for _ in range(G)]  # (N,)
        N = len(rows)

        # seeded by the engine's position, which a resume restores
        seed = call_seed(self.engine.seed, self.engine.calls) * 1000
        instances, observations = environment.start(self.specs, rows, seed,
                                                    self.timeout_s)
        try:
            failures = environment.reset_failures(self.specs, rows, instances, earlier)
            prompts = [prompt_ids[i // G] for i in range(N)]  # (N,)
            for i, observation in enumerate(observations):
                if observation is not None:
                    prompts[i] = self.render(rows[i], observation)

            if all(prompts[i] == prompts[i - i % G] for i in range(N)):
                rollout = self.engine.generate(prompt_ids, G, max_new_tokens,
                                               temperature=temperature, **sampling)
            else:
                # reset gave the G rollouts of a prompt different prompts
                rollout = self.engine.generate(prompts, 1, max_new_tokens,
                                               temperature=temperature, **sampling)

            transcripts = self.converse(rollout, prompts, instances, max_new_tokens,
                                        temperature, sampling)
            rewards = [self.reward(instance, row) for instance, row in zip(instances, rows)]
        finally:
            for instance in instances:
                instance.close()

        return prompts, transcripts, rewards, failures

    def converse(self, rollout, prompts, instances, max_new_tokens, temperature,
                 sampling):
        """The rounds: keep each row's turn, run its calls, splice the results in,
        generate on. -> per row dict(ids, logps, tool, calls, messages,
        finished)."""
        N = len(prompts)
        rows = [dict(ids=[], logps=[], tool=[], calls=[], messages=[], rounds=0,
                     finished=False) for _ in range(N)]
        # the rows the last inner call generated
        active = list(range(N))

        while active:
            # 1. keep each row's segment up to its calls
            pending = []
            for i, (segment, segment_logps, eos) in zip(active, unpad(rollout)):
                row = rows[i]
                # each row to its own budget
                segment = segment[:max_new_tokens - len(row["ids"])]
                keep = len(segment)
                calls = []
                text = None
                if row["rounds"] < self.max_calls:
                    keep, calls, text = self.format.find_calls(segment)

                row["finished"] = eos and keep == len(segment_logps) and not calls
                row["ids"] += segment[:keep]
                row["logps"] += segment_logps[:keep]
                row["tool"] += [0] * keep
                if text is None:
                    text = self.tokenizer.decode(segment[:keep], skip_special_tokens=True)
                row["messages"].append(self.assistant_turn(text, calls))
                if calls and len(row["ids"]) < max_new_tokens:
                    pending.append((i, calls, text))

            # 2. run the round's calls, splice their results in
            active = []
            for (i, calls, text), results in zip(pending, self.run(pending, instances)):
                row = rows[i]
                row["rounds"] += 1
                outputs = [output for output, _, _ in results]
                block = self.format.result_ids(text, calls, outputs)
                block = block[:max_new_tokens - len(row["ids"])]

                row["ids"] += block
                row["logps"] += [0.0] * len(block)
                row["tool"] += [1] * len(block)
                for call, (output, error, seconds) in zip(calls, results):
                    record = dict(name=call["name"], arguments=call["arguments"],
                                  output=output, error=error, seconds=seconds)
                    row["calls"].append(record)
                    row["messages"].append(dict(role="tool", name=call["name"],
                                                content=output))
                if len(row["ids"]) < max_new_tokens:
                    active.append(i)

            # 3. the rows with budget left go on, each from its whole transcript
            if active:
                budget = max(max_new_tokens - len(rows[i]["ids"]) for i in active)
                continuations = [prompts[i] + rows[i]["ids"] for i in active]
                rollout = self.engine.generate(continuations, 1, budget,
                                               temperature=temperature, **sampling)

        return rows

    def run(self, pending, instances):
        """A round's calls [(row, calls, text)], all rows at once -> per row
        [(output, error, seconds)]."""
        def row_calls(item):
            i, calls, _ = item
            results = []
            for call in calls:
                start = time.perf_counter()
                if call["error"] is not None:
                    # unreadable: its error is the result
                    output = call["error"]
                    error = True
                else:
                    output, error = instances[i].call(call["name"], call["arguments"])
                results.append((output, error, time.perf_counter() - start))
            return results

        # threads only wait on the environments' processes
        with ThreadPoolExecutor(max(1, min(32, len(pending)))) as pool:
            return list(pool.map(row_calls, pending))

    def assistant_turn(self, text, calls):
        """The policy's turn as a message, its calls as TRL writes them."""
        message = dict(role="assistant", content=text)
        readable = [c for c in calls if c["error"] is None]
        if readable:
            message["tool_calls"] = [
                dict(type="function", function=dict(name=c["name"], arguments=c["arguments"]))
                for c in readable]
        return message

    def reward(self, instance, row):
        """get_reward's value, as (class name, value), or None: no such method."""
        spec = environment.spec_of(self.specs, row)
        if not spec.has_reward:
            return None
        return spec.name, instance.reward()

    def build(self, prompts, rows, rewards):
        """The transcripts -> a ToolRollout: the layout of rollout.build_rollout,
        whichever engine sampled, then tool_mask out of completion_mask."""
        base = build_rollout(prompts, 1, [r["ids"] for r in rows], [r["logps"] for r in rows],
                             [r["finished"] for r in rows], pad_id(self.tokenizer),
                             self.tokenizer)

        every = base.completion_mask.bool()  # (N, T) the transcript's tokens
        flat = torch.tensor([t for r in rows for t in r["tool"]], dtype=torch.float32)
        tool_mask = torch.zeros(every.shape).masked_scatter_(every, flat)  # (N, T)

        fields = dict(vars(base), completion_mask=base.completion_mask - tool_mask)
        return ToolRollout(**fields, tool_mask=tool_mask,
                           tool_calls=[r["calls"] for r in rows],
                           messages=[r["messages"] for r in rows],
                           environment_rewards=rewards)

    def state_dict(self):
        return self.engine.state_dict()

    def load_state_dict(self, state):
        self.engine.load_state_dict(state)

    def sync_weights(self, model, **kwargs):
        return self.engine.sync_weights(model, **kwargs)

    def close(self):
        self.engine.close()


@dataclass
class Environments:
    """What train.py's --tools and --environment load (load_environments)."""

    specs: dict  # environment.load_specs's
    fence: bool  # --tools python: ToRL's fenced code, no schemas shown
    tools_of: object  # a row -> its tools' schemas for the prompt, or None (fence)
    rewards: list  # a reward function per environment class that scores


def load_environments(args, tokenizer):
    """--tools and --environment (config.py's args) -> Environments: each
    environment's tools, probed in a process of its own (environment.py), and
    its reward (get_reward), of weight 1, named after its class, as in TRL.
    ValueError where the chat template renders no tool calls."""
    fence = args.tools == ["python"]
    tools_of = None
    if fence:
        specs = environment.load_specs(["environments.python_tool.PythonTool"], [])
    else:
        if not supports_tools(tokenizer):
            raise ValueError(f"the chat template of {args.model} renders no tool calls: "
                             f"pass --chat-template assets/chatml_tools.jinja (ChatML, "
                             f"<tool_call> JSON), or use --tools python (ToRL's fenced "
                             f"code, no template needed)")
        specs = environment.load_specs(args.environment, args.tools or [])

        def tools_of(row):
            return list(environment.spec_of(specs, row).schemas.values())

    scoring = dict.fromkeys(s.name for s in specs.values() if s.has_reward)
    rewards = [environment_reward_func(name) for name in scoring]
    return Environments(specs=specs, fence=fence, tools_of=tools_of, rewards=rewards)


def with_observation(question, observation):
    """The question with an environment's reset text appended to its last
    message, as TRL does."""
    if isinstance(question, str):
        return question + observation

    last = dict(question[-1], content=question[-1]["content"] + observation)
    return list(question[:-1]) + [last]


def environment_reward_func(name):
    """An environment's get_reward as a reward function, named after its class
    (TRL's column): the rollout's environment_rewards, None for the rows of
    another class."""
    def reward(completions, environment_rewards, **kw):
        return [pair[1] if pair is not None and pair[0] == name else None
                for pair in environment_rewards]

    reward.__name__ = name
    return reward


def with_environment_rewards(environments, args, reward_funcs, eval_func):
    """train.py: each environment's reward after reward_funcs, of weight 1 (added
    to args.reward_weights); where no --eval-reward named one (eval_func None),
    the evaluation's is the first, else final_number_reward. -> (reward
    functions, eval_func)."""
    args.reward_weights = args.reward_weights + [1.0] * len(environments.rewards)
    if eval_func is None and environments.rewards:
        eval_func = environments.rewards[0]
    elif eval_func is None:
        eval_func = final_number_reward
    return reward_funcs + environments.rewards, eval_func


def with_tools(engine, tokenizer, environments, args):
    """train.py: the engine in a ToolEngine (environments: load_environments's;
    args: config.py's, for --max-tool-calls, --tool-output-tokens,
    --tool-timeout and the system prompt)."""
    def render(row, observation):
        """The row's prompt ids with its environment's reset text (data.py)."""
        question = with_observation(row["prompt"], observation)
        system_prompt = args.system_prompt
        if system_prompt is None:
            system_prompt = data.DEFAULT_SYSTEM_PROMPT
        tools = None
        if environments.tools_of:
            tools = [environments.tools_of(row)]

        texts, chat = data.render_prompts(tokenizer, [question], system_prompt, tools)
        return data.encode_prompts(tokenizer, texts, chat)[0]

    if environments.fence:
        call_format = FenceFormat(tokenizer, args.tool_output_tokens)
    else:
        call_format = TemplateFormat(tokenizer, args.tool_output_tokens)
    return ToolEngine(engine, tokenizer, call_format, environments.specs,
                      max_calls=args.max_tool_calls, timeout_s=args.tool_timeout,
                      render=render)


def tool_metrics(rollout):
    """A step's tool metrics, {} for a plain Rollout: calls per completion, the
    fraction of calls that failed, and the tools' seconds summed over the calls
    (they overlap: the wall time is less)."""
    if not isinstance(rollout, ToolRollout):
        return {}

    made = [call for row in rollout.tool_calls for call in row]
    errors = sum(call["error"] for call in made)
    seconds = sum(call["seconds"] for call in made)

    return dict(tool_calls_mean=len(made) / len(rollout.tool_calls),
                tool_error_rate=errors / max(1, len(made)),
                tool_seconds=seconds)
