"""A chat-completions answer checked field by field before anything of it becomes a row.

The server is not trusted: what it returns is parsed JSON of any shape. Only these fields
are read, each of the type shown, and an answer with any of them wrong is refused whole
(BadAnswer: the row is rejected; the others are unaffected):

    choices: a non-empty list; choices[0] an object with
      message: an object with
        content: a string or null
        reasoning_content / reasoning: a string or null (the first present is read)
        tool_calls: null or a list of objects, each {"function": {"name": a non-empty string,
                    "arguments": a string holding JSON}} (plus "id"/"type" strings if present)
      finish_reason: a string or null
    usage: absent, null, or an object whose completion_tokens is absent, null or an int >= 0
"""

from __future__ import annotations

import json
from dataclasses import dataclass


class BadAnswer(ValueError):
    """The answer is JSON but not a chat completion of the shape above; the message says where."""


@dataclass(frozen=True)
class AnswerFields:
    content: str | None
    reasoning: str | None
    tool_calls: list | None
    finish_reason: str | None
    num_tokens: int


def check_answer(answer) -> AnswerFields:
    """The fields of a chat-completions answer, each checked; BadAnswer when one is wrong."""
    choices = _field(answer, "choices", "the answer", list)
    if not choices:
        raise BadAnswer("not a chat completion: choices is empty")
    choice = _of_type(choices[0], "choices[0]", dict)
    message = _field(choice, "message", "choices[0]", dict)
    content = _optional(message, "content", "choices[0].message", str)
    key = "reasoning_content" if "reasoning_content" in message else "reasoning"
    reasoning = _optional(message, key, "choices[0].message", str)
    calls = _optional(message, "tool_calls", "choices[0].message", list)
    for i, call in enumerate(calls or ()):
        _check_tool_call(call, f"choices[0].message.tool_calls[{i}]")
    finish = _optional(choice, "finish_reason", "choices[0]", str)
    usage = _optional(answer, "usage", "the answer", dict) or {}
    tokens = _optional(usage, "completion_tokens", "usage", int)
    if isinstance(tokens, bool) or (tokens is not None and tokens < 0):
        raise BadAnswer(f"usage.completion_tokens is {tokens!r}; allowed: an int >= 0 or null")
    return AnswerFields(content, reasoning, calls or None, finish, tokens or 0)


def _check_tool_call(call, where: str) -> None:
    _of_type(call, where, dict)
    for key in ("id", "type"):
        _optional(call, key, where, str)
    function = _field(call, "function", where, dict)
    name = _field(function, "name", f"{where}.function", str)
    if not name:
        raise BadAnswer(f"{where}.function.name is empty")
    arguments = _field(function, "arguments", f"{where}.function", str)
    try:
        json.loads(arguments)
    except (ValueError, RecursionError):
        raise BadAnswer(f"{where}.function.arguments is not a string of JSON: {arguments[:100]!r}") from None


_NAMES = {str: "a string", list: "a list", dict: "an object", int: "an int"}


def _of_type(value, where: str, kind: type):
    if not isinstance(value, kind):
        raise BadAnswer(f"{where} is {type(value).__name__} {str(value)[:80]!r}; allowed: {_NAMES[kind]}")
    return value


def _field(obj, key: str, where: str, kind: type):
    _of_type(obj, where, dict)
    if key not in obj:
        raise BadAnswer(f"not a chat completion: {where} has no {key!r}")
    return _of_type(obj[key], f"{where}.{key}", kind)


def _optional(obj, key: str, where: str, kind: type):
    """obj[key] when present and not null (then of type kind), else None."""
    _of_type(obj, where, dict)
    value = obj.get(key)
    return None if value is None else _of_type(value, f"{where}.{key}", kind)
