"""
Tool calls inside the rollout, ToRL style (arXiv 2503.23383; train.py --tools python): when a
completion closes a ```python block, the code runs in the sandbox (sandbox.run_code), its output is
appended as tokens, and generation goes on after it:

    completion = policy ... ```python\\nCODE``` | ```output\\nOUTPUT\\n```\\n | policy ... EOS
    completion_mask 1 on the policy's tokens (the loss trains on these), tool_mask 1 on the outputs

    engine = ToolEngine(engine, tokenizer, max_calls=4, output_tokens=256)  # any rollout engine
    rollout = engine.generate(prompt_ids, G, max_new_tokens, temperature=1.0)  # -> ToolRollout

The rewards see the whole transcript (outputs included) and a tool_calls column (reward.score).
Tests: python -m pytest -q tests/test_tools.py; a learning run: python -m bench tools_run

Simplifications:
1. Rounds: the inner engine generates every row to its end, then a row that closed a block is cut
   right after the token that closed it, and what it sampled later is thrown away. Sampling is
   autoregressive, so the kept prefix is exactly what a stop at that token would have produced.
2. A round's calls run together (sandbox.WORKERS at a time); then the rows with budget left go on
   as new prompts (prompt + transcript, one completion each), in one inner generate call per
   round. A row without calls never waits; a slow call delays its round, at most the timeout.
3. Each continuation reads its prompt and transcript again: vLLM's prefix cache (on by default)
   serves it from cache; HFEngine prefills it again.
4. --max-new-tokens bounds the whole completion, outputs included: an output is cut to the budget
   left, a continuation to its row's own budget (the inner call asks for the largest one).
5. After max_calls calls a row generates on, and its further blocks do not run. An output longer
   than output_tokens (fences included) keeps its last tokens: a traceback's error, the last prints.
6. An output's tokens are its text encoded alone, not necessarily how the whole transcript would
   tokenize: the trainer never re-tokenizes, so the policy is trained on exactly what it saw.
"""
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import sandbox
from rollout import Rollout, build_rollout, pad_id

# a closed ```python block; group 1 is its code
FENCE = re.compile(r"```(?:python|py)3?[ \t]*\n(.*?)```", re.DOTALL)
# the default --system-prompt with --tools (data.render_prompts: the system turn, or a plain prefix)
SYSTEM_PROMPT = (
    "You can run Python: write a ```python block that prints what you need. When the block closes "
    "it runs, and what it printed appears in an ```output block. Then state the answer.\n\n"
    "Example:\nUser: Ann buys 23 bags of apples with 47 apples in each bag. How many apples does "
    "she have now?\nAssistant: ```python\nprint(23 * 47)\n```\n```output\n1081\n```\nShe has "
    "1081 apples.")


@dataclass
class ToolRollout(Rollout):
    tool_mask: torch.Tensor         # (N, T) float, 1 at tool-output tokens (completion_mask: 0)
    tool_calls: list[list[dict]]    # (N,) per completion: code, output, status, error, seconds


def unpad(rollout):
    """A Rollout -> per row (token ids, sampling logprobs, EOS reached), without its padding."""
    lengths = rollout.completion_mask.sum(1).int().tolist()  # (N,) a plain mask is a prefix
    ids = rollout.completion_ids.tolist()
    logps = rollout.sampling_logps.tolist()
    finished = rollout.is_finished.tolist()
    return [(x[:n], lp[:n], f) for x, lp, n, f in zip(ids, logps, lengths, finished)]


class ToolEngine:
    """Wraps a rollout engine (HFEngine, VLLMEngine): its generate with tool calls spliced in.
    state_dict, load_state_dict, sync_weights and close are the inner engine's."""

    def __init__(self, engine, tokenizer, max_calls=4, output_tokens=256, timeout_s=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.output_tokens = output_tokens
        self.timeout_s = timeout_s  # None: sandbox.TIMEOUT_S

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, **sampling):
        """G completions per prompt, as the inner engine samples them, each call's output spliced
        in (simplifications 1-5) -> ToolRollout."""
        rollout = self.engine.generate(prompt_ids, G, max_new_tokens, temperature=temperature,
                                       **sampling)
        prompts = rollout.prompt_ids  # (N,)
        N = len(prompts)
        ids = [[] for _ in range(N)]  # the transcripts: policy and tool tokens, in order
        logps = [[] for _ in range(N)]  # the sampler's, 0.0 at tool tokens
        tool = [[] for _ in range(N)]  # 1 at tool tokens
        calls = [[] for _ in range(N)]
        finished = [False] * N
        rows = list(range(N))  # the rows the last inner call generated
        while rows:
            pending = []  # (row, code, its text so far) of this round's calls
            for i, (segment, segment_logps, eos) in zip(rows, unpad(rollout)):
                # each row to its own budget
                segment = segment[:max_new_tokens - len(ids[i])]
                keep = len(segment)
                code = None
                if len(calls[i]) < self.max_calls:
                    keep, code, text = self.find_call(segment)
                finished[i] = eos and keep == len(segment_logps)
                ids[i] += segment[:keep]
                logps[i] += segment_logps[:keep]
                tool[i] += [0] * keep
                if code is not None and len(ids[i]) < max_new_tokens:
                    pending.append((i, code, text))
            rows = []
            for (i, code, text), (output, status, seconds) in zip(pending, self.run(pending)):
                lead = "" if text.endswith("\n") else "\n"
                block = self.output_ids(output, lead)[:max_new_tokens - len(ids[i])]
                ids[i] += block
                logps[i] += [0.0] * len(block)
                tool[i] += [1] * len(block)
                calls[i].append(dict(code=code, output=output, status=status,
                                     error=status != "ok", seconds=seconds))
                if len(ids[i]) < max_new_tokens:
                    rows.append(i)
            if rows:  # the rows with budget left go on, each from its whole transcript
                budget = max(max_new_tokens - len(ids[i]) for i in rows)
                rollout = self.engine.generate([prompts[i] + ids[i] for i in rows], 1, budget,
                                               temperature=temperature, **sampling)
        return self.build(prompt_ids, G, ids, logps, tool, calls, finished)

    def build(self, prompt_ids, G, ids, logps, tool, calls, finished):
        """The transcripts -> a ToolRollout: the layout of rollout.build_rollout, whichever engine
        sampled, then tool_mask out of completion_mask."""
        base = build_rollout(prompt_ids, G, ids, logps, finished, pad_id(self.tokenizer),
                             self.tokenizer)
        every = base.completion_mask.bool()  # (N, T) the transcript's tokens
        flat = torch.tensor([t for row in tool for t in row], dtype=torch.float32)
        tool_mask = torch.zeros(every.shape).masked_scatter_(every, flat)  # (N, T)
        fields = dict(vars(base), completion_mask=base.completion_mask - tool_mask)
        return ToolRollout(**fields, tool_mask=tool_mask, tool_calls=calls)

    def find_call(self, ids):
        """-> (tokens kept, the code of the first closed ```python block or None, the kept text).
        Kept: up to the token that closes the block (the shortest prefix that holds it)."""
        text = self.decode(ids)
        if FENCE.search(text) is None:
            return len(ids), None, text
        lo = 1
        hi = len(ids)
        while lo < hi:  # bisect: once a prefix holds a closed block, every longer one does
            mid = (lo + hi) // 2
            if FENCE.search(self.decode(ids[:mid])):
                hi = mid
            else:
                lo = mid + 1
        text = self.decode(ids[:lo])
        return lo, FENCE.search(text)[1], text

    def output_ids(self, output, lead=""):
        """The tool's output as "```output\\n{output}\\n```\\n" tokens, at most output_tokens: the
        end of the output kept (simplification 5)."""
        head = self.encode(lead + "```output\n")
        tail = self.encode("\n```\n")
        body = self.encode(output.rstrip("\n"))
        room = max(0, self.output_tokens - len(head) - len(tail))
        return head + body[max(0, len(body) - room):] + tail

    def run(self, pending):
        """A round's calls [(row, code, text)], all at once -> [(output, status, seconds)]."""
        def timed(call):
            start = time.perf_counter()
            output, status = sandbox.run_code(call[1], self.timeout_s)
            return output, status, time.perf_counter() - start

        # threads only wait on the sandbox's subprocesses
        with ThreadPoolExecutor(sandbox.WORKERS) as pool:
            return list(pool.map(timed, pending))

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def state_dict(self):
        return self.engine.state_dict()

    def load_state_dict(self, state):
        self.engine.load_state_dict(state)

    def sync_weights(self, model, **kwargs):
        return self.engine.sync_weights(model, **kwargs)

    def close(self):
        self.engine.close()


def with_tools(engine, tokenizer, args):
    """train.py: the engine in a ToolEngine when --tools is on, else the engine itself."""
    if args.tools is None:
        return engine
    return ToolEngine(engine, tokenizer, args.max_tool_calls, args.tool_output_tokens)


def tool_metrics(rollout):
    """A step's tool metrics ({} for a plain Rollout): calls per completion, the fraction of calls
    that failed, and sandbox seconds summed over the calls (they overlap: the wall time is less)."""
    if not isinstance(rollout, ToolRollout):
        return {}
    made = [call for row in rollout.tool_calls for call in row]
    return dict(tool_calls_mean=len(made) / len(rollout.tool_calls),
                tool_error_rate=sum(call["error"] for call in made) / max(1, len(made)),
                tool_seconds=sum(call["seconds"] for call in made))
