"""Conversations -> token ids + assistant loss mask, rendered by the target's chat template.

Input rows come in two conversational forms (the pre-tokenized form is handled by
`prepare`):
  OpenAI:   {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
  ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt"|..., "value": str}, ...]}

The loss mask marks the tokens the assistant produces: its content and the end-of-turn
token that closes it, not the role header, and not whitespace the template adds after the
end-of-turn token (generation stops at that token, so there is nothing to learn after it).
Two ways to find those tokens, which give the same mask on the same rendered text:
  markers: the template has HF `{% generation %}` markers; transformers reports the tokens
           rendered inside them (`return_assistant_tokens_mask`).
  prefix:  for assistant turn i, render messages[:i] with the generation prompt (where the
           turn starts) and messages[:i+1] (where it ends) and map that character span of
           the full rendering onto tokens through the tokenizer's offsets. Templates that
           render an earlier turn differently once later turns exist (Qwen3 drops the
           empty think block of older turns) are handled by ending the span at the first
           end-of-turn token that follows its start in the full rendering.

Bad rows raise `RowRejected` with a reason from `REJECT_REASONS`; `prepare` counts them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np

from dflash_ipc.errors import DataError

log = logging.getLogger(__name__)

REJECT_REASONS = (
    "malformed_json",  # the line is not valid JSON / UTF-8
    "not_an_object",  # valid JSON but not an object
    "unknown_format",  # none of messages / conversations / input_ids+loss_mask
    "bad_messages",  # messages/conversations is not a non-empty list of objects
    "missing_role",  # a turn without role (OpenAI) / from (ShareGPT)
    "unknown_role",  # a role outside the allowed set
    "missing_content",  # a turn without content / value
    "non_string_content",  # content is not a string (lists of parts, numbers, null)
    "empty_content",  # content is empty or whitespace only
    "special_token_in_content",  # content spells a special token (would corrupt the turn layout)
    "no_assistant_turn",  # nothing to learn from
    "bad_tokens",  # pre-tokenized: input_ids/loss_mask malformed or out of vocabulary
    "no_loss_tokens",  # pre-tokenized: the mask has no two consecutive trained tokens
    "template_error",  # the chat template failed or rendered turns inconsistently
    "too_long",  # longer than max_length (on_long=reject), or truncation left nothing to learn
)

OPENAI_ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
MASK_METHODS = ("auto", "markers", "prefix")


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


def normalize_conversation(row: dict) -> list[dict]:
    """Validate a conversational row and return OpenAI-style [{"role", "content"}, ...].

    Raises RowRejected naming the turn index and the field.
    """
    if "messages" in row:
        turns, role_key, content_key, kind = row["messages"], "role", "content", "messages"
    elif "conversations" in row:
        turns, role_key, content_key, kind = row["conversations"], "from", "value", "conversations"
    else:
        raise RowRejected("unknown_format", f"no 'messages', 'conversations' or 'input_ids' key (keys: {sorted(row)[:8]})")
    if not isinstance(turns, list) or not turns:
        raise RowRejected("bad_messages", f"'{kind}' must be a non-empty list, got {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowRejected("bad_messages", f"{kind}[{i}] is {type(turn).__name__}, not an object")
        messages.append({"role": _role(turn, i, kind, role_key), "content": _content(turn, i, kind, content_key)})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowRejected("no_assistant_turn", f"{kind} has no assistant turn (roles: {[m['role'] for m in messages]})")
    return messages


def _role(turn: dict, i: int, kind: str, key: str) -> str:
    if key not in turn:
        raise RowRejected("missing_role", f"{kind}[{i}] has no '{key}'")
    raw = turn[key]
    if kind == "messages":
        if raw not in OPENAI_ROLES:
            raise RowRejected("unknown_role", f"{kind}[{i}].{key}={raw!r}; allowed: {list(OPENAI_ROLES)}")
        return raw
    if not isinstance(raw, str) or raw not in SHAREGPT_ROLES:
        raise RowRejected("unknown_role", f"{kind}[{i}].{key}={raw!r}; allowed: {sorted(SHAREGPT_ROLES)}")
    return SHAREGPT_ROLES[raw]


def _content(turn: dict, i: int, kind: str, key: str) -> str:
    if key not in turn:
        raise RowRejected("missing_content", f"{kind}[{i}] has no '{key}'")
    content = turn[key]
    if not isinstance(content, str):
        raise RowRejected("non_string_content", f"{kind}[{i}].{key} is {type(content).__name__}; must be a string")
    if not content.strip():
        raise RowRejected("empty_content", f"{kind}[{i}].{key} is empty or whitespace")
    return content


def has_generation_markers(tokenizer) -> bool:
    """True when the tokenizer's chat template marks assistant output with {% generation %}."""
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(_GENERATION_RE.search(template))


class ChatEncoder:
    """Renders conversations with one tokenizer's chat template and builds loss masks.

    method: "auto" (markers when the template has them, else prefix), "markers", "prefix".
    """

    def __init__(self, tokenizer, *, method: str = "auto"):
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
        self._specials = sorted(set(tokenizer.all_special_tokens), key=len, reverse=True)

    def encode(self, messages: list[dict], *, last_turn_only: bool = False) -> Encoded:
        """Tokenize a normalized conversation; mask all assistant turns (or the last one)."""
        for i, m in enumerate(messages):
            for special in self._specials:
                if special in m["content"]:
                    raise RowRejected("special_token_in_content", f"turn {i} ({m['role']}) contains {special!r}")
        try:
            if self.method == "markers":
                return self._encode_markers(messages, last_turn_only)
            return self._encode_prefix(messages, last_turn_only)
        except RowRejected:
            raise
        except Exception as e:  # jinja errors, template raise_exception(), tokenizer errors
            raise RowRejected("template_error", f"{type(e).__name__}: {e}") from e

    def _render(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode_markers(self, messages: list[dict], last_turn_only: bool) -> Encoded:
        enc = self.tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids = list(enc["input_ids"])
        mask = [int(bool(x)) for x in enc["assistant_masks"]]
        if last_turn_only:
            mask = keep_last_run(mask)
        return Encoded(ids, mask)

    def _encode_prefix(self, messages: list[dict], last_turn_only: bool) -> Encoded:
        full = self._render(messages, add_generation_prompt=False)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if last_turn_only:
            turns = turns[-1:]
        spans = [self._turn_span(messages, i, full) for i in turns]
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)  # [T, 2] char [s, e)
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), dtype=bool)  # [T]
        for a, b in spans:
            # a token is trained when its characters overlap the span (zero-width ones never)
            mask |= (starts < b) & (ends > a) & (ends > starts)
        return Encoded(ids, mask.astype(np.int64).tolist())

    def _turn_span(self, messages: list[dict], i: int, full: str) -> tuple[int, int]:
        """Character span [start, end) of assistant turn i in the full rendering."""
        prompt = self._render(messages[:i], add_generation_prompt=True)
        if not full.startswith(prompt):
            raise RowRejected(
                "template_error",
                f"turn {i}: the rendering of the turns before it (with generation prompt) is not a prefix "
                "of the full rendering; add {% generation %} markers to the template",
            )
        start = len(prompt)
        upto = self._render(messages[: i + 1], add_generation_prompt=False)
        if full.startswith(upto) and len(upto) > start:
            end = len(upto)
        else:
            end = self._end_by_marker(prompt, upto, full, i)
        # Whitespace after the end-of-turn token is the template's, not the assistant's.
        end = start + len(full[start:end].rstrip())
        return start, end

    def _end_by_marker(self, prompt: str, upto: str, full: str, i: int) -> int:
        """End of turn i when the template renders it differently in the full conversation:
        the first occurrence, after its start, of the special token that closes the turn
        when it is rendered last."""
        if not upto.startswith(prompt):
            raise RowRejected(
                "template_error",
                f"turn {i}: rendering the turn changes the text before it; add {{% generation %}} markers",
            )
        start = len(prompt)
        added = upto[start:]
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
