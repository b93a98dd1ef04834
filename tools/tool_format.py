"""
How tool calls look in the policy's tokens: found in what it wrote, and how the
results are written back. tools.py's loop takes either.

    FenceFormat     ToRL (train.py --tools python): a closed ```python block is
                    a call of the python tool; its output comes back as an
                    ```output block, and generation goes on in the same turn.
    TemplateFormat  the chat template's own tool calls (--environment, --tools
                    module.fn): the turn ends with <tool_call>{json}</tool_call>
                    (Qwen2.5, Hermes); the results come back as the template's
                    tool turn, then a new assistant turn.

A call is {"name", "arguments", "error"}: error is the text the policy reads
instead of a result when the call could not be read.

Simplifications:
1. Without transformers' response parser on the tokenizer (a response_template,
   which few tokenizers carry yet), calls are read as <tool_call> JSON, or as
   one bare JSON object {"name", "arguments" (or "parameters")}, Llama 3.1's form.
2. A result longer than output_tokens keeps its last tokens: a traceback's
   error, the last prints.
"""
import json
import re

# a closed ```python block; group 1 is its code
FENCE = re.compile(r"```(?:python|py)3?[ \t]*\n(.*?)```", re.DOTALL)
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class FenceFormat:
    """ToRL's fenced code: the python tool (environments/python_tool.py)."""

    def __init__(self, tokenizer, output_tokens):
        self.tokenizer = tokenizer
        self.output_tokens = output_tokens

    def find_calls(self, ids):
        """-> (tokens kept, calls, the kept text). Kept: up to the token that
        closes the first block, the shortest prefix that holds it."""
        text = decode(self.tokenizer, ids)
        if FENCE.search(text) is None:
            return len(ids), [], text

        # bisect: once a prefix holds a closed block, every longer one does
        lo = 1
        hi = len(ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if FENCE.search(decode(self.tokenizer, ids[:mid])):
                hi = mid
            else:
                lo = mid + 1

        text = decode(self.tokenizer, ids[:lo])
        code = FENCE.search(text)[1]
        return lo, [dict(name="python", arguments=dict(code=code), error=None)], text

    def result_ids(self, text, calls, results):
        """The output as "```output\\n{output}\\n```\\n" tokens, at most
        output_tokens: the end of the output kept (tools/tool_format.py, simplification 2)."""
        lead = "" if text.endswith("\n") else "\n"
        head = encode(self.tokenizer, lead + "```output\n")
        tail = encode(self.tokenizer, "\n```\n")
        body = encode(self.tokenizer, results[0].rstrip("\n"))

        room = max(0, self.output_tokens - len(head) - len(tail))
        return head + body[max(0, len(body) - room):] + tail


class TemplateFormat:
    """The chat template's tool calls and tool turns."""

    def __init__(self, tokenizer, output_tokens):
        self.tokenizer = tokenizer
        self.output_tokens = output_tokens

    def find_calls(self, ids):
        """A turn ends at EOS; its calls run after it. -> (len(ids), calls, text)."""
        text = decode(self.tokenizer, ids)

        if getattr(self.tokenizer, "response_template", None) is not None:
            # transformers' own parser, where the tokenizer has one
            message = self.tokenizer.parse_response(ids)
            raw = [c["function"] for c in message.get("tool_calls") or []]
            calls = [dict(name=c["name"], arguments=c["arguments"], error=None)
                     for c in raw]
            return len(ids), calls, text

        blocks = TOOL_CALL.findall(text)
        if not blocks and text.strip().startswith("{"):
            # Llama 3.1's bare JSON call
            blocks = [text.strip()]
        return len(ids), [read_call(block) for block in blocks], text

    def result_ids(self, text, calls, results):
        """The tool turn that follows an assistant turn, as the template writes
        it, ending with the next assistant turn's header (TRL's
        _get_tool_suffix_ids: render with and without it, keep the difference)."""
        messages = [dict(role="tool", name=call["name"], content=self.cut(result))
                    for call, result in zip(calls, results)]
        name = calls[0]["name"]
        dummy = [
            dict(role="user", content="dummy"),
            dict(role="assistant", content="", tool_calls=[
                dict(type="function", function=dict(name=name, arguments={}))]),
        ]

        before = self.render(dummy, add_generation_prompt=False)
        after = self.render(dummy + messages, add_generation_prompt=True)
        # templates that write "<|im_end|>\n": the policy's turn ended at EOS
        eos = self.tokenizer.eos_token_id
        ends = [i for i, x in enumerate(before) if x == eos]
        if ends:
            before = before[:ends[-1] + 1]

        if after[:len(before)] != before:
            raise ValueError("the chat template renders a tool turn that changes the "
                             "turns before it: it cannot be spliced in")
        return after[len(before):]

    def cut(self, result):
        """A result at most output_tokens long: its end kept."""
        ids = encode(self.tokenizer, result)
        if len(ids) <= self.output_tokens:
            return result
        return decode(self.tokenizer, ids[-self.output_tokens:])

    def render(self, messages, add_generation_prompt):
        return self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=False,
            add_generation_prompt=add_generation_prompt)


def read_call(block):
    """One call's JSON -> {"name", "arguments", "error"}."""
    try:
        call = json.loads(block)
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            # some models write the arguments as a JSON string
            arguments = json.loads(arguments)
        return dict(name=str(call["name"]), arguments=arguments, error=None)
    except (ValueError, KeyError, AttributeError, TypeError) as e:
        error = str({"error": f"the tool call is not valid JSON with a name and "
                              f"arguments ({type(e).__name__}: {e})"})
        return dict(name="unknown", arguments=None, error=error)


def supports_tools(tokenizer):
    """The template renders a whole tool exchange, its parts visible (TRL's
    supports_tool_calling: some templates drop tool_calls or tool turns)."""
    if not getattr(tokenizer, "chat_template", None):
        return False

    call = dict(type="function", function=dict(name="probe_name_7f3a",
                                                arguments={"probe_key_2c9e": 1}))
    messages = [
        dict(role="user", content="hi"),
        dict(role="assistant", content="", tool_calls=[call]),
        dict(role="tool", name="probe_name_7f3a", content="probe_content_8d1b"),
    ]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:
        return False
    return all(s in text for s in ("probe_name_7f3a", "probe_key_2c9e", "probe_content_8d1b"))


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]
