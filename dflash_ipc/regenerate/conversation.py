"""One conversation being regenerated: which turns are kept and which the target replaces.

The user, system and tool turns are kept as they are; each assistant turn is replaced by the
target's own reply, generated on the history as regenerated so far (turn k sees the target's
replies 1..k-1, never the dataset's). A conversation that ends with a user or tool turn gets
a reply to it too, so prompt-only data works. `max_turns` stops after that many replies and
drops the rest of the conversation (later user turns answer replies that were not written).

Tool results are kept from the source: they answer the source's tool calls, whatever the
target's reply calls. A reply's tool-call markup stays in its text as the target wrote it (the
chat template renders text content verbatim), unless a server returns parsed `tool_calls`.

Reasoning: a reply `<think>R</think>A` becomes content A with `reasoning_content` R ("keep",
the template renders it back as the target wrote it) or content A alone ("drop"). A reply
without the closing tag (cut by the token limit) is kept as it was written.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ipc.data.messages import Conversation, RowRejected

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(slots=True)
class Reply:
    """What a backend returns for one request."""

    key: tuple[int, int, int]  # (row index, turn, sample)
    text: str = ""
    reasoning: str | None = None  # a server's parsed reasoning (vLLM's reasoning parsers)
    tool_calls: list | None = None  # a server's parsed tool calls
    num_tokens: int = 0  # generated tokens, the stop token included
    truncated: bool = False  # cut at max_new_tokens
    error: str | None = None  # the backend gave up on this request: the row is rejected


@dataclass(slots=True)
class Request:
    """One reply to generate: the history before it, and (hf) its rendered token ids."""

    key: tuple[int, int, int]  # (row index, turn, sample)
    messages: list[dict]
    tools: list | None
    max_new_tokens: int
    prompt_ids: list[int] | None = None


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of `[<think>]R</think>A`; (None, text) without a closing tag."""
    head, sep, answer = text.partition(THINK_END)
    if not sep:
        return None, text
    reasoning = head.split(THINK_START, 1)[1] if THINK_START in head else head
    return reasoning.strip("\n"), answer.lstrip("\n")


def assistant_message(reply: Reply, reasoning_mode: str) -> dict:
    """The assistant turn a reply becomes; RowRejected("empty_reply") when nothing is left."""
    if reply.reasoning is not None:
        reasoning, content = reply.reasoning, reply.text
    else:
        reasoning, content = split_reasoning(reply.text)
    message = {"role": "assistant", "content": content}
    if reasoning is not None and reasoning_mode == "keep":
        message["reasoning_content"] = reasoning
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    if not content.strip() and not reply.tool_calls and not message.get("reasoning_content", "").strip():
        raise RowRejected("empty_reply", f"turn {reply.key[1]}: the target's reply is empty"
                                         + (" once its reasoning is dropped" if reasoning else ""))
    return message


class RowState:
    """The turns of one row: `history` is what the next reply is generated on."""

    def __init__(self, index: int, conv: Conversation, *, max_turns: int | None = None, sample: int | None = None):
        self.index = index
        self.sample = sample  # None: the one reply of a run without --samples-per-prompt
        self.tools = conv.tools
        self._source = conv.messages
        self._max_turns = max_turns
        self.history: list[dict] = []
        self.turn = 0  # replies written so far
        self._pos = 0  # next source message
        self.done = False
        self._advance()
        if self.done:
            raise RowRejected("no_assistant_turn", "nothing to reply to: no assistant turn and no final user/tool turn "
                                                   f"(roles: {[m['role'] for m in self._source]})")

    def _advance(self) -> None:
        """Copy kept turns up to the next reply to generate; done when there is none."""
        while self._pos < len(self._source) and self._source[self._pos]["role"] != "assistant":
            self.history.append(self._source[self._pos])
            self._pos += 1
        at_assistant = self._pos < len(self._source)
        ends_asking = not at_assistant and bool(self.history) and self.history[-1]["role"] in ("user", "tool")
        self.done = not (at_assistant or ends_asking)

    def add_reply(self, message: dict) -> None:
        """The target's reply to the current history; moves on to the next turn to replace."""
        assert not self.done, "add_reply on a finished row"
        self.history.append(message)
        self.turn += 1
        if self._pos < len(self._source):
            self._pos += 1  # the source's assistant turn this reply replaces
        if self._max_turns is not None and self.turn >= self._max_turns:
            self.done = True
            return
        if self._pos >= len(self._source):
            self.done = True
            return
        self._advance()

    def request(self, max_new_tokens: int) -> Request:
        """The request for the next reply."""
        return Request((self.index, self.turn, self.sample or 0), list(self.history), self.tools, max_new_tokens)

    def result(self) -> dict:
        """The regenerated row: its source index first (resume reads it from the line's head)."""
        row = {"index": self.index} | ({"sample": self.sample} if self.sample is not None else {})
        row["messages"] = self.history
        if self.tools:
            row["tools"] = self.tools
        return row
