"""
Tool calls inside the rollout, ToRL style (arXiv 2503.23383; train.py --tools
python). When a completion closes a ```python block, the code runs in the
sandbox (sandbox.run_code), its output is appended as tokens, and generation goes
on after it:

    completion = policy ... ```python\\nCODE```
                 | ```output\\nOUTPUT\\n```\\n
                 | policy ... EOS
    completion_mask: 1 on the policy's tokens (the loss trains on these)
    tool_mask:       1 on the outputs

    # any rollout engine inside
    engine = ToolEngine(engine, tokenizer, max_calls=4, output_tokens=256)
    # -> ToolRollout
    rollout = engine.generate(prompt_ids, G, max_new_tokens, temperature=1.0)

The rewards see the whole transcript, outputs included, and a tool_calls column
(reward.score).

Tests: python -m pytest -q tests/test_tools.py
A learning run: python -m bench tools_run

Simplifications:
1. Rounds: the inner engine generates every row to its end. Then a row that
   closed a block is cut right after the token that closed it, and what it
   sampled later is thrown away. Sampling is autoregressive, so the kept prefix
   is exactly what a stop at that token would have produced.
2. A round's calls run together (sandbox.WORKERS at a time). Then the rows with
   budget left go on as new prompts (prompt + transcript, one completion each),
   in one inner generate call per round. A row without calls never waits; a
   slow call delays its round, at most the timeout.
3. Each continuation reads its prompt and transcript again: vLLM's prefix cache
   (on by default) serves it from cache; HFEngine prefills it again.
4. --max-new-tokens bounds the whole completion, outputs included. An output is
   cut to the budget left, a continuation to its row's own budget (the inner
   call asks for the largest one).
5. After max_calls calls a row generates on, and its further blocks do not run.
   An output longer than output_tokens (fences included) keeps its last tokens:
   a traceback's error, the last prints.
6. An output's tokens are its text encoded alone, not necessarily how the whole
   transcript would tokenize. The trainer never re-tokenizes, so the policy is
   trained on exactly what it saw.
"""
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import sandbox
from model import pad_id
from rollout import Rollout, build_rollout


# a closed ```python block; group 1 is its code
FENCE = re.compile(r"```(?:python|py)3?[ \t]*\n(.*?)```", re.DOTALL)


@dataclass
class ToolRollout(Rollout):
    # (N, T) float, 1 at tool-output tokens (completion_mask: 0)
    tool_mask: torch.Tensor
    # (N,) per completion: code, output, status, error, seconds
    tool_calls: list[list[dict]]


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
    """Wraps a rollout engine (HFEngine, VLLMEngine): its generate with tool calls
    spliced in. state_dict, load_state_dict, sync_weights and close are the inner
    engine's."""

    def __init__(self, engine, tokenizer, max_calls=4, output_tokens=256, timeout_s=None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.output_tokens = output_tokens
        # None: sandbox.TIMEOUT_S
        self.timeout_s = timeout_s

    def generate(self, prompt_ids, G, max_new_tokens, temperature=1.0, **sampling):
        """G completions per prompt, as the inner engine samples them, each call's
        output spliced in (simplifications 1-5) -> ToolRollout."""
        rollout = self.engine.generate(prompt_ids, G, max_new_tokens,
                                       temperature=temperature, **sampling)
        prompts = rollout.prompt_ids  # (N,)
        N = len(prompts)

        # the transcripts: policy and tool tokens, in order
        ids = [[] for _ in range(N)]
        # the sampler's log-probs, 0.0 at tool tokens
        logps = [[] for _ in range(N)]
        # 1 at tool tokens
        tool = [[] for _ in range(N)]
        calls = [[] for _ in range(N)]
        finished = [False] * N
        # the rows the last inner call generated
        rows = list(range(N))

        while rows:
            # 1. keep each row's segment up to its first closed block
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

            # 2. run the round's calls and splice their outputs in
            rows = []
            results = self.run(pending)
            for (i, code, text), (output, status, seconds) in zip(pending, results):

                lead = "" if text.endswith("\n") else "\n"
                block = self.output_ids(output, lead)[:max_new_tokens - len(ids[i])]
                ids[i] += block
                logps[i] += [0.0] * len(block)
                tool[i] += [1] * len(block)
                calls[i].append(dict(code=code, output=output, status=status,
                                     error=status != "ok", seconds=seconds))
                if len(ids[i]) < max_new_tokens:
                    rows.append(i)

            # 3. the rows with budget left go on, each from its whole transcript
            if rows:
                budget = max(max_new_tokens - len(ids[i]) for i in rows)
                continuations = [prompts[i] + ids[i] for i in rows]
                rollout = self.engine.generate(continuations, 1, budget,
                                               temperature=temperature, **sampling)

        return self.build(prompt_ids, G, ids, logps, tool, calls, finished)

    def build(self, prompt_ids, G, ids, logps, tool, calls, finished):
        """The transcripts -> a ToolRollout: the layout of rollout.build_rollout,
        whichever engine sampled, then tool_mask out of completion_mask."""
        base = build_rollout(prompt_ids, G, ids, logps, finished, pad_id(self.tokenizer),
                             self.tokenizer)

        every = base.completion_mask.bool()  # (N, T) the transcript's tokens
        flat = torch.tensor([t for row in tool for t in row], dtype=torch.float32)
        tool_mask = torch.zeros(every.shape).masked_scatter_(every, flat)  # (N, T)

        fields = dict(vars(base), completion_mask=base.completion_mask - tool_mask)
        return ToolRollout(**fields, tool_mask=tool_mask, tool_calls=calls)

    def find_call(self, ids):
        """-> (tokens kept, the code of the first closed ```python block or None,
        the kept text). Kept: up to the token that closes the block, the shortest
        prefix that holds it."""
        text = self.decode(ids)
        if FENCE.search(text) is None:
            return len(ids), None, text

        # bisect: once a prefix holds a closed block, every longer one does
        lo = 1
        hi = len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if FENCE.search(self.decode(ids[:mid])):
                hi = mid
            else:
                lo = mid + 1

        text = self.decode(ids[:lo])
        return lo, FENCE.search(text)[1], text

    def output_ids(self, output, lead=""):
        """The tool's output as "```output\\n{output}\\n```\\n" tokens, at most
        output_tokens: the end of the output kept (simplification 5)."""
        head = self.encode(lead + "```output\n")
        tail = self.encode("\n```\n")
        body = self.encode(output.rstrip("\n"))

        room = max(0, self.output_tokens - len(head) - len(tail))
        return head + body[max(0, len(body) - room):] + tail

    def run(self, pending):
        """A round's calls [(row, code, text)], all at once -> [(output, status,
        seconds)]."""
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


def with_tools(engine, tokenizer, tools, max_calls, output_tokens):
    """train.py: the engine in a ToolEngine when tools is "python" (--tools), else
    the engine itself (tools None)."""
    if tools is None:
        return engine
    return ToolEngine(engine, tokenizer, max_calls, output_tokens)


def tool_metrics(rollout):
    """A step's tool metrics, {} for a plain Rollout: calls per completion, the
    fraction of calls that failed, and the sandbox seconds summed over the calls
    (they overlap: the wall time is less)."""
    if not isinstance(rollout, ToolRollout):
        return {}

    made = [call for row in rollout.tool_calls for call in row]
    errors = sum(call["error"] for call in made)
    seconds = sum(call["seconds"] for call in made)

    return dict(tool_calls_mean=len(made) / len(rollout.tool_calls),
                tool_error_rate=errors / max(1, len(made)),
                tool_seconds=seconds)
