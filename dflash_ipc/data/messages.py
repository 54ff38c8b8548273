"""Conversational rows -> validated, normalized messages: what a chat template is given.

Two row forms (read by `data/reader.py` from JSONL, JSON, Parquet or a `datasets` directory):
  OpenAI:   {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ...}, ...],
             "tools": [...]?}
  ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt"|..., "value": str}, ...]}
OpenAI content is a string or a list of parts: text parts are joined with "\\n" (as vLLM
joins them, so training sees what the server renders); any other part (image, audio) rejects
the row. Assistant turns may carry `tool_calls` (content may then be empty; `arguments`
given as a JSON string become an object, the form HF chat templates expect) and
`reasoning_content`; `role: tool` turns carry the tool's answer (`tool_call_id`, `name`).
A row's `tools` (JSON schemas, or a JSON string of them) go to the template. Keys a
Parquet struct fills with null are absent.

Bad rows raise `RowRejected` with a reason from `REJECT_REASONS`; callers count them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from dflash_ipc.errors import ConfigError, DataError

REJECT_REASONS = (
    "malformed_json",  # the row is not valid JSON / UTF-8 (or nested too deep, numbers too long)
    "line_too_long",  # the row is over the byte limit (--max-line-bytes); not parsed
    "not_an_object",  # valid JSON but not an object
    "unknown_format",  # none of messages / conversations / input_ids+loss_mask
    "bad_messages",  # messages/conversations is not a non-empty list of objects
    "missing_role",  # a turn without role (OpenAI) / from (ShareGPT)
    "unknown_role",  # a role outside the allowed set
    "missing_content",  # a turn without content / value
    "non_string_content",  # content is neither a string nor a list of parts (numbers, null)
    "non_text_content",  # a content part that is not text (image, audio, ...)
    "empty_content",  # content is empty or whitespace only
    "bad_tool_calls",  # tool_calls / tools malformed
    "special_token_in_content",  # content spells a special token (would corrupt the turn layout)
    "no_assistant_turn",  # nothing to learn from
    "bad_tokens",  # pre-tokenized: input_ids/loss_mask malformed or out of vocabulary
    "no_loss_tokens",  # pre-tokenized: the mask has no two consecutive trained tokens
    "template_error",  # the chat template failed or rendered turns inconsistently
    "tools_not_rendered",  # the chat template dropped the row's tool schemas or tool calls (no tool support)
    "too_long",  # longer than max_length (on_long=reject), or truncation left nothing to learn
    "duplicate",  # the same tokens as an earlier row (dropped with --dedup, or a held-out copy)
    "generation_error",  # regenerate: the backend failed on the row (after its retries)
    "empty_reply",  # regenerate: the target's reply is empty once reasoning is handled
    "unreadable_row",  # Parquet/Arrow: its values cannot be read (a damaged row group, a value out of range)
    "row_error",  # anything else that went wrong on this row (type and message in the detail)
)

OPENAI_ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "tool": "tool",
    "observation": "tool",
}
PART_SEPARATOR = "\n"
# apply_chat_template's own arguments: not template variables.
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
))


class RowRejected(DataError):
    """One input row is unusable. `reason` is one of REJECT_REASONS; `detail` says which
    turn/field and what was allowed. Recovery: the row is skipped (or, with --strict,
    the prepare stops); fix the row in the input file."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def parse_json(raw: bytes | str):
    """json.loads with every failure as RowRejected("malformed_json")."""
    try:
        return json.loads(raw)
    except UnicodeDecodeError as e:
        raise RowRejected("malformed_json", f"invalid UTF-8 at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise RowRejected("malformed_json", f"column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise RowRejected("malformed_json", "nested deeper than the parser's recursion limit") from None
    except ValueError as e:  # e.g. an integer of more than 4,300 digits
        raise RowRejected("malformed_json", f"{str(e)[:200]}") from None


@dataclass(slots=True)
class Conversation:
    """A validated conversation: OpenAI-style messages and the tools offered to the model."""

    messages: list[dict]
    tools: list[dict] | None = None


def parse_conversation(row: dict, *, need_assistant: bool = True) -> Conversation:
    """Validate a conversational row and return its normalized Conversation.

    Raises RowRejected naming the turn index and the field. need_assistant=False accepts a
    conversation without an assistant turn (a prompt to regenerate a reply for).
    """
    if row.get("messages") is not None:  # a Parquet column of other rows is null here
        turns, role_key, content_key, kind = row["messages"], "role", "content", "messages"
    elif row.get("conversations") is not None:
        turns, role_key, content_key, kind = row["conversations"], "from", "value", "conversations"
    else:
        raise RowRejected("unknown_format", f"no 'messages', 'conversations' or 'input_ids' key (keys: {sorted(row)[:8]})")
    if not isinstance(turns, list) or not turns:
        raise RowRejected("bad_messages", f"'{kind}' must be a non-empty list, got {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowRejected("bad_messages", f"{kind}[{i}] is {type(turn).__name__}, not an object")
        messages.append(_message(turn, i, kind, role_key, content_key))
    if need_assistant and not any(m["role"] == "assistant" for m in messages):
        raise RowRejected("no_assistant_turn", f"{kind} has no assistant turn (roles: {[m['role'] for m in messages]})")
    return Conversation(messages, _tools(row.get("tools")))


def _message(turn: dict, i: int, kind: str, role_key: str, content_key: str) -> dict:
    role = _role(turn, i, kind, role_key)
    where = f"{kind}[{i}]"
    message = {"role": role}
    if role == "assistant" and turn.get("tool_calls") is not None:
        message["tool_calls"] = _tool_calls(turn["tool_calls"], where)
    reasoning = turn.get("reasoning_content") if role == "assistant" else None
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RowRejected("non_string_content", f"{where}.reasoning_content is {type(reasoning).__name__}; must be a string")
        message["reasoning_content"] = reasoning
    may_be_empty = "tool_calls" in message or bool(reasoning and reasoning.strip())
    message["content"] = _content(turn, where, content_key, may_be_empty)
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str):
                message[key] = turn[key]
    return message


def _role(turn: dict, i: int, kind: str, key: str) -> str:
    if turn.get(key) is None:
        raise RowRejected("missing_role", f"{kind}[{i}] has no '{key}'")
    raw = turn[key]
    if kind == "messages":
        if raw not in OPENAI_ROLES:
            raise RowRejected("unknown_role", f"{kind}[{i}].{key}={raw!r}; allowed: {list(OPENAI_ROLES)}")
        return raw
    if not isinstance(raw, str) or raw not in SHAREGPT_ROLES:
        raise RowRejected("unknown_role", f"{kind}[{i}].{key}={raw!r}; allowed: {sorted(SHAREGPT_ROLES)}")
    return SHAREGPT_ROLES[raw]


def _content(turn: dict, where: str, key: str, may_be_empty: bool) -> str:
    if key not in turn:
        if may_be_empty:
            return ""
        raise RowRejected("missing_content", f"{where} has no '{key}'")
    content = turn[key]
    if content is None and may_be_empty:
        return ""
    if isinstance(content, list) and key == "content":
        content = _join_parts(content, where)
    if not isinstance(content, str):
        raise RowRejected("non_string_content", f"{where}.{key} is {type(content).__name__}; must be a string "
                                                "or a list of text parts")
    if not content.strip() and not may_be_empty:
        raise RowRejected("empty_content", f"{where}.{key} is empty or whitespace")
    return content


def _join_parts(parts: list, where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowRejected("non_text_content", f"{where}.content[{j}] is a {kind!r} part; only text parts "
                                                  "({'type': 'text', 'text': str}) can be trained on")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise RowRejected("bad_tool_calls", f"{where}.tool_calls is {type(calls).__name__}; must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RowRejected("bad_tool_calls", f"{where}.tool_calls[{j}] needs function.name (a string)")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = parse_json(args) if args.strip() else {}
            except RowRejected as e:
                raise RowRejected("bad_tool_calls", f"{where}.tool_calls[{j}].function.arguments: {e.detail}") from None
        if not isinstance(args, dict):
            raise RowRejected("bad_tool_calls", f"{where}.tool_calls[{j}].function.arguments must be an object "
                                                "or a JSON string of one")
        norm = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call.get("id"), str):
            norm["id"] = call["id"]
        out.append(norm)
    return out


def _tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = parse_json(tools)
        except RowRejected as e:
            raise RowRejected("bad_tool_calls", f"tools: {e.detail}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RowRejected("bad_tool_calls", f"tools must be a list of objects (JSON schemas), got {type(tools).__name__}")
    return tools or None


def parse_template_kwargs(values) -> dict:
    """Chat-template variables from the command line: each value a JSON object
    ('{"enable_thinking": false}') or KEY=VALUE (VALUE read as JSON when it parses:
    true, 3, "x"; else taken as a string). ConfigError for apply_chat_template's own
    arguments and malformed values."""
    out: dict = {}
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--chat-template-kwargs {value!r}: not a JSON object ({e.msg})") from None
            if not isinstance(parsed, dict):
                raise ConfigError(f"--chat-template-kwargs {value!r}: not a JSON object")
            out.update(parsed)
            continue
        key, sep, raw = value.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--chat-template-kwargs {value!r}: give KEY=VALUE or a JSON object")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    bad = sorted(set(out) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise ConfigError(f"--chat-template-kwargs: {bad} are apply_chat_template's own arguments, not template "
                          "variables")
    return out


def message_texts(message: dict) -> list[str]:
    """Every string of a message that reaches the rendered text (content, reasoning, tool calls)."""
    texts = [message.get("content") or "", message.get("reasoning_content") or ""]
    for call in message.get("tool_calls") or ():
        texts.append(json.dumps(call["function"], ensure_ascii=False))
    return texts


def check_special_tokens(messages: list[dict], specials: list[str]) -> None:
    """RowRejected when a message spells one of the tokenizer's special tokens."""
    for i, m in enumerate(messages):
        for text in message_texts(m):
            for special in specials:
                if special in text:
                    raise RowRejected("special_token_in_content", f"turn {i} ({m['role']}) contains {special!r}")


def tool_names(tools: list[dict] | None) -> list[str]:
    """The function names of a row's tool schemas (OpenAI {"type": "function", "function":
    {"name": ...}} or a bare {"name": ...}); schemas without a name are left out."""
    names = []
    for tool in tools or ():
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            names.append(fn["name"])
    return names


def check_tools_rendered(conv: Conversation, text: str) -> None:
    """RowRejected("tools_not_rendered") when a rendering lacks the row's tools: a template
    without tool support renders a tool-call turn as an empty turn and drops the schemas, and
    training on that text would teach the drafter replies the target never gives. Each name
    must occur at least once per schema and per call that names it (a lower bound: a tool's
    answer may name it too, so a rendering that drops calls can still pass, never the reverse)."""
    wanted: dict[str, int] = {}
    for name in tool_names(conv.tools):
        wanted[name] = wanted.get(name, 0) + 1
    for m in conv.messages:
        for call in m.get("tool_calls") or ():
            name = call["function"]["name"]
            wanted[name] = wanted.get(name, 0) + 1
    for name, count in wanted.items():
        found = text.count(name)
        if found < count:
            raise RowRejected("tools_not_rendered",
                              f"tool {name!r} is named {count} times in the row's tools and tool calls but {found} "
                              "times in the chat template's rendering: the template drops tools (use a target "
                              "whose template supports tools, or drop the tool turns)")

