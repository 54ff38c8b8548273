"""Conversations -> token ids + assistant loss mask, rendered by the target's chat template.

Rows are validated into a `Conversation` by `messages.py` (OpenAI `messages`, ShareGPT
`conversations`, content parts, tool calls, reasoning); this module renders them.

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

A row the template cannot render raises `RowRejected` (messages.py); `prepare` counts them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import numpy as np

from dflash_ipc.data.messages import Conversation, RowRejected, check_special_tokens, check_tools_rendered, message_texts
from dflash_ipc.errors import DataError

log = logging.getLogger(__name__)

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_GENERATION_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use sentinels put where the generation tags were
MASK_METHODS = ("auto", "markers", "prefix")
_HEAD_CHARS_PER_TOKEN = 8  # first guess of characters per token for a head tokenization
_HEAD_MARGIN = 64  # tokens kept clear of the cut: the cut can change only the last ones


@dataclass(slots=True)
class Encoded:
    """One tokenized conversation: ids and a 0/1 assistant mask of the same length."""

    input_ids: list[int]
    loss_mask: list[int]


def render(tokenizer, conv: Conversation, *, add_generation_prompt: bool, template_kwargs: dict | None = None,
           upto: int | None = None, chat_template: str | None = None) -> str:
    """The chat template's text for conv.messages[:upto] (all when None)."""
    messages = conv.messages if upto is None else conv.messages[:upto]
    return tokenizer.apply_chat_template(messages, tools=conv.tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                         **(template_kwargs or {}))


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
            check_tools_rendered(conv, full)
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
