"""Conversations -> token ids + assistant loss mask, rendered by the target's chat template.

Input rows come in two conversational forms (the pre-tokenized form is handled by
`prepare`), read by `data/reader.py` from JSONL, JSON, Parquet or a `datasets` directory:
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

The loss mask marks the tokens the assistant produces: its content and the end-of-turn
token that closes it, not the role header, and not whitespace the template adds after the
end-of-turn token (generation stops at that token, so there is nothing to learn after it).
Two ways to find those characters, which give the same mask on the same rendered text:
  markers: the template has HF `{% generation %}` markers; the blocks they enclose are
           found by rendering the template with a sentinel character in place of each tag.
  prefix:  for assistant turn i, render messages[:i] with the generation prompt (where the
           turn starts) and messages[:i+1] (where it ends). Templates that render an earlier
           turn differently once later turns exist (Qwen3 drops the think block of older
           turns) are handled by ending the span at the first end-of-turn token that follows
           its start in the full rendering, and, where the generation prompt itself is not
           in the full rendering (Qwen3 with enable_thinking=False), by starting it where
           the two renderings part.
The character spans become a token mask through the tokenizer's offsets. With `max_tokens`
only the head of a long rendering is tokenized (memory stays proportional to the text, not
~100x it as a full token list with offsets would be), and the head is checked against a
longer one so it is exactly the full tokenization's head.

Bad rows raise `RowRejected` with a reason from `REJECT_REASONS`; `prepare` counts them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import numpy as np

from dflash_ipc.errors import ConfigError, DataError

log = logging.getLogger(__name__)

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
    "too_long",  # longer than max_length (on_long=reject), or truncation left nothing to learn
    "duplicate",  # the same tokens as an earlier row (dropped with --dedup, or a held-out copy)
    "generation_error",  # regenerate: the backend failed on the row (after its retries)
    "empty_reply",  # regenerate: the target's reply is empty once reasoning is handled
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

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_GENERATION_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use sentinels put where the generation tags were
MASK_METHODS = ("auto", "markers", "prefix")
_HEAD_CHARS_PER_TOKEN = 8  # first guess of characters per token for a head tokenization
_HEAD_MARGIN = 64  # tokens kept clear of the cut: the cut can change only the last ones


class RowRejected(DataError):
    """One input row is unusable. `reason` is one of REJECT_REASONS; `detail` says which
    turn/field and what was allowed. Recovery: the row is skipped (or, with --strict,
    the prepare stops); fix the row in the input file."""

    def __init__(self, reason: str, detail: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class Encoded:
    """One tokenized conversation: ids and a 0/1 assistant mask of the same length."""

    input_ids: list[int]
    loss_mask: list[int]


@dataclass(slots=True)
class Conversation:
    """A validated conversation: OpenAI-style messages and the tools offered to the model."""

    messages: list[dict]
    tools: list[dict] | None = None


def normalize_conversation(row: dict) -> list[dict]:
    """The messages of a conversational row with an assistant turn (see parse_conversation)."""
    return parse_conversation(row).messages


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
            from dflash_ipc.data.reader import parse_json
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
        from dflash_ipc.data.reader import parse_json
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


def render(tokenizer, conv: Conversation, *, add_generation_prompt: bool, template_kwargs: dict | None = None,
           upto: int | None = None, chat_template: str | None = None) -> str:
    """The chat template's text for conv.messages[:upto] (all when None)."""
    messages = conv.messages if upto is None else conv.messages[:upto]
    return tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                         **(template_kwargs or {}))


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


def has_generation_markers(tokenizer) -> bool:
    """True when the tokenizer's chat template marks assistant output with {% generation %}."""
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_RE.search(template))


class ChatEncoder:
    """Renders conversations with one tokenizer's chat template and builds loss masks.

    method: "auto" (markers when the template has them, else prefix), "markers", "prefix".
    template_kwargs: chat-template variables (e.g. {"enable_thinking": False}), the same the
    replies were generated with.
    """

    def __init__(self, tokenizer, *, method: str = "auto", template_kwargs: dict | None = None):
        if method not in MASK_METHODS:
            raise DataError(f"mask method {method!r}; allowed: {list(MASK_METHODS)}")
        if not tokenizer.chat_template:
            raise DataError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat_template; "
                "conversations cannot be rendered (pre-tokenized rows need none)"
            )
        markers = has_generation_markers(tokenizer)
        if method == "markers" and not markers:
            raise DataError("mask method 'markers' asked for, but the chat template has no {% generation %} markers")
        self.tokenizer = tokenizer
        self.method = "markers" if method == "markers" or (method == "auto" and markers) else "prefix"
        self.template_kwargs = dict(template_kwargs or {})
        self._specials = sorted(set(tokenizer.all_special_tokens), key=len, reverse=True)
        self._sentinel_template = _GENERATION_TAG.sub(_sentinel_tag, tokenizer.chat_template) if markers else None

    def encode(self, conv: Conversation | list[dict], *, last_turn_only: bool = False,
               max_tokens: int | None = None) -> Encoded:
        """Tokenize a normalized conversation; mask all assistant turns (or the last one).

        max_tokens: only the first max_tokens tokens are wanted (the rest would be cut):
        a longer rendering is tokenized only that far."""
        if isinstance(conv, list):
            conv = Conversation(conv)
        check_special_tokens(conv.messages, self._specials)
        try:
            if self.method == "markers":
                full, spans = self._marker_spans(conv)
            else:
                full = self._render(conv, add_generation_prompt=False)
                turns = [i for i, m in enumerate(conv.messages) if m["role"] == "assistant"]
                spans = [self._turn_span(conv, i, full) for i in (turns[-1:] if last_turn_only else turns)]
            ids, mask = self._mask(full, spans, max_tokens)
        except RowRejected:
            raise
        except Exception as e:  # jinja errors, template raise_exception(), tokenizer errors
            raise RowRejected("template_error", f"{type(e).__name__}: {e}") from e
        if last_turn_only and self.method == "markers":
            mask = keep_last_run(mask)
        return Encoded(ids, mask)

    def _render(self, conv: Conversation, *, add_generation_prompt: bool, upto: int | None = None) -> str:
        return render(self.tokenizer, conv, add_generation_prompt=add_generation_prompt,
                      template_kwargs=self.template_kwargs, upto=upto)

    def _marker_spans(self, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, spans of its generation blocks): rendered with a sentinel in place
        of each tag, the sentinels then removed."""
        for i, m in enumerate(conv.messages):
            if any(_OPEN in t or _CLOSE in t for t in message_texts(m)):
                raise RowRejected("template_error", f"turn {i} holds U+E000/U+E001, the characters that mark "
                                                    "generation blocks here")
        marked = render(self.tokenizer, conv, add_generation_prompt=False, template_kwargs=self.template_kwargs,
                        chat_template=self._sentinel_template)
        pieces = re.split(f"([{_OPEN}{_CLOSE}])", marked)
        text, spans, start = [], [], None
        length = 0
        for piece in pieces:
            if piece == _OPEN:
                start = length
            elif piece == _CLOSE:
                if start is not None:
                    spans.append((start, length))
                start = None
            else:
                text.append(piece)
                length += len(piece)
        return "".join(text), spans

    def _mask(self, full: str, spans: list[tuple[int, int]], max_tokens: int | None) -> tuple[list[int], list[int]]:
        ids, offsets = self._tokenize(full, max_tokens)
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=bool)  # [T]
        for a, b in spans:
            # a token is trained when its characters overlap the span (zero-width ones never)
            mask |= (starts < b) & (ends > a) & (ends > starts)
        return ids, mask.astype(np.int64).tolist()

    def _tokenize(self, text: str, max_tokens: int | None) -> tuple[list[int], np.ndarray]:
        """(ids, char offsets [T, 2]) of text, or of its first max_tokens tokens. A head is
        tokenized from a prefix of the text and accepted only when a prefix twice as long
        gives the same first tokens (then the rest cannot change them)."""
        cut = (max_tokens or 0) * _HEAD_CHARS_PER_TOKEN
        while max_tokens is not None and cut < len(text):
            ids, offsets = self._encode_text(text[:cut])
            if len(ids) > max_tokens + _HEAD_MARGIN:
                ids2, offsets2 = self._encode_text(text[: 2 * cut])
                if ids2[:max_tokens] == ids[:max_tokens] and np.array_equal(offsets2[:max_tokens], offsets[:max_tokens]):
                    return ids[:max_tokens], offsets[:max_tokens]
                break  # the cut reached back: tokenize all of it
            cut *= 4
        return self._encode_text(text)

    def _encode_text(self, text: str) -> tuple[list[int], np.ndarray]:
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)

    def _turn_span(self, conv: Conversation, i: int, full: str) -> tuple[int, int]:
        """Character span [start, end) of assistant turn i in the full rendering."""
        prompt = self._render(conv, add_generation_prompt=True, upto=i)
        start = len(prompt) if full.startswith(prompt) else self._parting_start(conv, i, prompt, full)
        upto = self._render(conv, add_generation_prompt=False, upto=i + 1)
        if full.startswith(upto) and len(upto) > start:
            end = len(upto)
        else:
            end = self._end_by_marker(prompt, upto, full, start, i)
        # Whitespace after the end-of-turn token is the template's, not the assistant's.
        end = start + len(full[start:end].rstrip())
        return start, end

    def _parting_start(self, conv: Conversation, i: int, prompt: str, full: str) -> int:
        """Start of turn i when the generation prompt is not in the full rendering (Qwen3 with
        enable_thinking=False: its prompt ends in an empty think block that older turns lose):
        where the two texts part, provided the turns before it are rendered intact there."""
        before = self._render(conv, add_generation_prompt=False, upto=i)
        parted = _common_prefix_len(prompt, full)
        if not full.startswith(before) or parted < len(before):
            raise RowRejected(
                "template_error",
                f"turn {i}: the rendering of the turns before it is not a prefix of the full rendering; "
                "add {% generation %} markers to the template",
            )
        return parted

    def _end_by_marker(self, prompt: str, upto: str, full: str, start: int, i: int) -> int:
        """End of turn i when the template renders it differently in the full conversation:
        the first occurrence, after its start, of the special token that closes the turn
        when it is rendered last."""
        if not upto.startswith(prompt):
            raise RowRejected(
                "template_error",
                f"turn {i}: rendering the turn changes the text before it; add {{% generation %}} markers",
            )
        added = upto[len(prompt):]
        closing = None
        best = -1
        for special in self._specials:
            pos = added.rfind(special)
            if pos >= 0 and pos + len(special) > best:
                closing, best = special, pos + len(special)
        if closing is None:
            raise RowRejected("template_error", f"turn {i}: no end-of-turn special token found in its rendering")
        end = full.find(closing, start)
        if end < 0:
            raise RowRejected("template_error", f"turn {i}: end-of-turn {closing!r} not found in the full rendering")
        return end + len(closing)


def _common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (bisection over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _sentinel_tag(m: re.Match) -> str:
    """`{%- generation %}` -> `{{- '\ue000' }}`: the same whitespace control, a sentinel out."""
    left, end, right = m.group(1), m.group(2), m.group(3)
    return "{{" + left + " '" + (_CLOSE if end else _OPEN) + "' " + right + "}}"


def keep_last_run(mask: list[int]) -> list[int]:
    """Keep only the last run of 1s in a 0/1 mask: assistant turns are separated by
    unmasked user turns, so each run is one turn and the last run is the last turn."""
    out = [0] * len(mask)
    t = len(mask) - 1
    while t >= 0 and not mask[t]:
        t -= 1
    while t >= 0 and mask[t]:
        out[t] = 1
        t -= 1
    return out
