"""Benchmark prompt sets: JSONL files through the target's chat template, a dataset's held-out prompts.

A prompt file holds one JSON object per line (blank lines skipped); the first of these keys
that a row has decides its form:

    {"turns": ["...", "..."]}                          MT-Bench: user turns, in order
    {"messages": [{"role": ..., "content": ...}]}      chat: system and user turns kept; its
    {"conversations": [{"from": ..., "value": ...}]}   assistant turns are dropped (the model
                                                       writes its own replies); read as
                                                       prepare reads them (content may be
                                                       a list of text parts)
    {"question": "..."}                                GSM8K
    {"problem": "..."}                                 MATH
    {"prompt": "..."}                                  any single prompt

A directory (a Hub dataset id resolved to its snapshot: hf/hub.py) is read as `prepare` reads
one (data/reader.py: its Parquet/JSON(L) shards, the train split), its rows in these forms.

Rows of the last four forms may add ``"system": "..."``. Turn k of a row is the chat
template (with the generation prompt and the caller's template kwargs, e.g.
``enable_thinking``) applied to the system message, the user turns 1..k and the model's
own replies to turns 1..k-1 (decoded, special tokens skipped), so each turn is
conditioned on what this run generated. :class:`Conversations` hands the turns to a
decoder as they become ready.

A dataset's held-out prompts (``held_out_prompts``) are token ids already rendered by
``prepare``: single-turn, no template applied here.
"""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.messages import RowRejected, check_special_tokens, parse_conversation
from dflash_ipc.data.reader import InputSource, decode_row
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.decode.requests import Generation, Request
from dflash_ipc.run.json_lines import MAX_LINE_BYTES, capped_lines

logger = logging.getLogger(__name__)

PROMPT_KEYS = ("turns", "messages", "conversations", "question", "problem", "prompt")
MESSAGE_ROLES = ("system", "user", "assistant")


@dataclass(slots=True)
class PromptCase:
    """One benchmark prompt: one or more user turns, or ready token ids."""

    sample_id: int
    """Row index in its file (0-based, blank lines not counted), or the dataset sample id."""
    turns: list[str]
    system: str | None = None
    prompt_ids: np.ndarray | None = None
    """Pre-rendered single-turn prompt (a dataset's held-out prompt); no template applied."""
    where: str = ""
    """Where it came from, for errors: ``FILE:LINE``, or the dataset and its sample id."""


@dataclass(slots=True)
class PromptSet:
    name: str
    cases: list[PromptCase]
    source: str
    """The file or dataset it came from."""

    @property
    def num_turns(self) -> int:
        return sum(len(c.turns) for c in self.cases)


def prompt_set_arg(arg: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``PATH`` (named by its file stem) -> (name, path)."""
    name, sep, path = arg.partition("=")
    if sep and name and os.sep not in name and not os.path.exists(arg):
        return name, path
    return os.path.splitext(os.path.basename(arg))[0], arg


def read_prompt_file(path: str, *, name: str | None = None, limit: int | None = None) -> PromptSet:
    """The first ``limit`` (None: all) prompts of a JSONL file, or of a dataset directory (a Hub
    dataset's snapshot: its Parquet/JSON(L) shards, data/reader.py); DataError naming file:line
    on a bad row."""
    if os.path.isdir(path):
        return _read_prompt_dir(path, name=name, limit=limit)
    if not os.path.isfile(path):
        raise DataError(f"prompt file {path}: not found")
    cases: list[PromptCase] = []
    with open(path, "rb") as f:
        for line_no, line, size in capped_lines(f, MAX_LINE_BYTES):
            if limit is not None and len(cases) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            if size > MAX_LINE_BYTES:
                raise DataError(f"{where}: a line of {size} bytes, over {MAX_LINE_BYTES}: not a prompt")
            try:
                row = json.loads(line)
            except RecursionError:
                raise DataError(f"{where}: not valid JSON (nested deeper than the parser's recursion limit)") from None
            except ValueError as exc:  # bad JSON or UTF-8, an integer past 4,300 digits
                raise DataError(f"{where}: not valid JSON ({str(exc)[:200]})") from None
            turns, system = parse_row(row, where)
            cases.append(PromptCase(sample_id=len(cases), turns=turns, system=system, where=where))
    if not cases:
        raise DataError(f"prompt file {path}: no prompts")
    return PromptSet(name=name or os.path.splitext(os.path.basename(path))[0], cases=cases, source=path)


def _read_prompt_dir(path: str, *, name: str | None, limit: int | None) -> PromptSet:
    """`read_prompt_file` of a directory of shards: its rows (the train split, or the only one)."""
    cases: list[PromptCase] = []
    for raw in InputSource(path, max_row_bytes=MAX_LINE_BYTES).rows():
        if limit is not None and len(cases) >= limit:
            break
        try:
            row = decode_row(raw, MAX_LINE_BYTES)
        except RowRejected as exc:
            raise DataError(f"{raw.where}: {exc}") from None
        turns, system = parse_row(row, raw.where)
        cases.append(PromptCase(sample_id=len(cases), turns=turns, system=system, where=raw.where))
    if not cases:
        raise DataError(f"prompt set {path}: no prompts")
    return PromptSet(name=name or os.path.basename(os.path.normpath(path)), cases=cases, source=path)


def parse_row(row, where: str) -> tuple[list[str], str | None]:
    """(user turns, system message) of one prompt row."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    keys = [k for k in PROMPT_KEYS if k in row]
    if not keys:
        raise DataError(f"{where}: no prompt field; allowed: {list(PROMPT_KEYS)} (keys: {sorted(row)[:8]})")
    key = keys[0]
    if key in ("messages", "conversations"):
        turns, system = _parse_messages(row, where)
        _check_redundant(row, keys[1:], turns, where)
        return turns, system
    if len(keys) > 1:  # which one is the prompt would be a guess: the set would silently change
        raise DataError(f"{where}: the row has {' and '.join(repr(k) for k in keys)}; a prompt row holds one of them")
    value = row[key]
    if key == "turns":
        if not isinstance(value, list) or not value or not all(_text(t) for t in value):
            raise DataError(f"{where}: 'turns' must be a non-empty list of non-empty strings")
        turns = list(value)
    elif isinstance(value, str) and not value.strip():
        raise DataError(f"{where}: '{key}' is empty (or whitespace only); it must hold the prompt")
    elif not _text(value):
        raise DataError(f"{where}: '{key}' must be a non-empty string, got {type(value).__name__}")
    else:
        turns = [value]
    system = row.get("system")
    if system is not None and not _text(system):
        raise DataError(f"{where}: 'system' must be a non-empty string")
    return turns, system


def _check_redundant(row: dict, keys: Sequence[str], turns: list[str], where: str) -> None:
    """A chat row may also carry its first user turn as "prompt"/"question"/... (UltraChat's
    "prompt"), or all its user turns as "turns": the chat is the prompt then. Any other value
    in those fields is a second, different prompt, and the row is refused."""
    for key in keys:
        value = row[key]
        if key in ("messages", "conversations"):
            raise DataError(f"{where}: the row has both 'messages' and 'conversations'; a prompt row holds one of them")
        if value != (turns if key == "turns" else turns[0]):
            raise DataError(f"{where}: the row's '{key}' is not its chat's first user turn; a prompt row holds one "
                            f"prompt (drop '{key}' or the chat)")


def _parse_messages(row: dict, where: str) -> tuple[list[str], str | None]:
    """A chat row read as prepare and regenerate read it (`data/messages.py`: OpenAI or
    ShareGPT shape, content as a string or text parts): its system message, if first, and its
    user turns; assistant turns are dropped, tool turns refused (nothing would answer them)."""
    try:
        conversation = parse_conversation(row, need_assistant=False)
    except RowRejected as exc:
        raise DataError(f"{where}: {exc.detail}") from None
    kind = "messages" if row.get("messages") is not None else "conversations"
    system, turns = None, []
    for i, m in enumerate(conversation.messages):
        role = m["role"]
        if role == "system" and i == 0:
            system = m["content"]
        elif role == "user":
            turns.append(m["content"])
        elif role == "system":
            raise DataError(f"{where}: {kind}[{i}]: a system message is allowed first only")
        elif role not in MESSAGE_ROLES:
            raise DataError(f"{where}: {kind}[{i}] is a {role!r} turn; a prompt holds {list(MESSAGE_ROLES)} turns")
    if not turns:
        raise DataError(f"{where}: '{kind}' has no user turn")
    return turns, system


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


class ChatRenderer:
    """A tokenizer's chat template with fixed template kwargs; and replies back to text."""

    def __init__(self, tokenizer, template_kwargs: dict | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat_template; prompt "
                            "files cannot be rendered")
        self.tokenizer, self.template_kwargs = tokenizer, dict(template_kwargs or {})
        # Longest first, as regenerate and prepare check them (data/messages.py).
        self._specials = sorted(set(getattr(tokenizer, "all_special_tokens", ())), key=len, reverse=True)

    def check_case(self, case: PromptCase) -> None:
        """DataError when a turn or the system message spells one of the tokenizer's special tokens
        ("<|im_end|>" in a question would end the turn early: regenerate and prepare reject such
        rows as special_token_in_content). The model's own replies are decoded without them."""
        messages = [{"role": "system", "content": case.system}] if case.system else []
        messages += [{"role": "user", "content": turn} for turn in case.turns]
        try:
            check_special_tokens(messages, self._specials)
        except RowRejected as exc:
            raise DataError(f"{case.where or f'prompt {case.sample_id}'}: special_token_in_content: "
                            f"{exc.detail}") from None

    def render(self, messages: list[dict], where: str) -> np.ndarray:
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                      **self.template_kwargs)
        except Exception as exc:  # jinja errors, raise_exception() in the template
            raise DataError(f"{where}: the chat template failed ({type(exc).__name__}: {exc})") from exc
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)

    def reply_text(self, tokens: Sequence[int], stop_token_ids) -> str:
        if tokens and tokens[-1] in stop_token_ids:
            tokens = tokens[:-1]
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True).strip()


class Conversations:
    """A request source over a prompt set: turn k+1 of a case is ready once turn k came back.

    Request keys are ``(sample_id, turn)``.

    ``max_positions`` (the target's): a turn's budget is cut to what fits in them after its prompt
    and ``reserve`` positions (a speculative step writes a draft block past its last token), as
    regenerate does; a turn whose prompt leaves no room is a DataError naming it. Prompts are
    never cut: a cut prompt would be another prompt. ``capped`` lists the turns whose budget was cut.
    """

    def __init__(self, prompt_set: PromptSet, *, max_new_tokens: int, renderer: ChatRenderer | None,
                 stop_token_ids=frozenset(), max_positions: int | None = None, reserve: int = 0) -> None:
        if renderer is None and any(c.prompt_ids is None for c in prompt_set.cases):
            raise ConfigError(f"prompt set {prompt_set.name}: rendering its turns needs the target's tokenizer")
        for case in prompt_set.cases:
            if case.prompt_ids is None:
                renderer.check_case(case)  # every turn, before the first is decoded
        self.prompt_set, self.max_new_tokens = prompt_set, max_new_tokens
        self.max_positions, self.reserve, self.capped = max_positions, reserve, []
        self.renderer, self.stop_token_ids = renderer, stop_token_ids
        self.num_expected = prompt_set.num_turns
        self._cases = {c.sample_id: c for c in prompt_set.cases}
        self._history = {c.sample_id: ([{"role": "system", "content": c.system}] if c.system else [])
                         for c in prompt_set.cases}
        self._ready = collections.deque(self._request(c, 0) for c in prompt_set.cases)

    def _request(self, case: PromptCase, turn: int) -> Request:
        if case.prompt_ids is not None:
            return Request(key=(case.sample_id, 0), prompt_ids=case.prompt_ids,
                           max_new_tokens=self._budget(case, 0, len(case.prompt_ids)))
        history = self._history[case.sample_id]
        history.append({"role": "user", "content": case.turns[turn]})
        ids = self.renderer.render(history, f"{self.prompt_set.source}: prompt {case.sample_id}, turn {turn}")
        return Request(key=(case.sample_id, turn), prompt_ids=ids, max_new_tokens=self._budget(case, turn, len(ids)))

    def _budget(self, case: PromptCase, turn: int, prompt_len: int) -> int:
        if not self.max_positions:
            return self.max_new_tokens
        room = self.max_positions - prompt_len - self.reserve
        if room < 1:
            where = case.where or f"{self.prompt_set.source}: prompt {case.sample_id}"
            raise DataError(f"{where}: turn {turn}: {prompt_len} prompt tokens leave no room in the target's "
                            f"{self.max_positions} positions (a speculative step needs {self.reserve} more past the "
                            f"last token); shorten or drop the prompt")
        if room < self.max_new_tokens:
            self.capped.append(f"{case.where or f'prompt {case.sample_id}'} turn {turn} "
                               f"({prompt_len} prompt tokens: {room} new)")
        return min(self.max_new_tokens, room)

    def next_request(self) -> Request | None:
        return self._ready.popleft() if self._ready else None

    def finished(self, generation: Generation) -> None:
        sample_id, turn = generation.request.key
        case = self._cases[sample_id]
        if turn + 1 < len(case.turns):
            reply = self.renderer.reply_text(generation.tokens, self.stop_token_ids)
            self._history[sample_id].append({"role": "assistant", "content": reply})
            self._ready.append(self._request(case, turn + 1))


def held_out_set(dataset: TokenDataset, *, num_prompts: int, sample_ids: Sequence[int] | None = None) -> PromptSet:
    """The dataset's held-out prompts (:func:`held_out_prompts`) as a single-turn prompt set."""
    cases = [PromptCase(sample_id=i, turns=[""], prompt_ids=ids, where=f"{dataset.path}: sample {i}")
             for i, ids in held_out_prompts(dataset, num_prompts=num_prompts, sample_ids=sample_ids)]
    return PromptSet(name="held-out", cases=cases, source=dataset.path)


def check_token_ids(prompt_set: PromptSet, vocab_size: int) -> None:
    """DataError unless every pre-rendered prompt's token ids are in [0, vocab_size): an id past
    the target's embedding is an IndexError on CPU and a device-side assert on a GPU (a dataset
    prepared with another tokenizer, or damaged)."""
    for case in prompt_set.cases:
        if case.prompt_ids is None or not len(case.prompt_ids):
            continue
        low, high = int(case.prompt_ids.min()), int(case.prompt_ids.max())
        if high >= vocab_size:
            raise DataError(f"{case.where}: token id {high} >= the target's vocab {vocab_size} (prepared with "
                            "another tokenizer?)")
        if low < 0:
            raise DataError(f"{case.where}: token id {low} is negative")


def held_out_prompts(dataset: TokenDataset, *, num_prompts: int,
                     sample_ids: Sequence[int] | None = None) -> list[tuple[int, np.ndarray]]:
    """(sample id, prompt ids ``[P]``) pairs: ``sample_ids`` of the dataset when given; else the
    first ``num_prompts`` prompts the dataset declares held out (never trained on); else the
    last ``num_prompts`` usable samples.

    A sample is usable when it has a loss-mask token after at least one prompt token.
    """
    from dflash_ipc.data.held_out import held_out_prompts_of

    if num_prompts < 1:
        raise ConfigError(f"num_prompts={num_prompts} must be >= 1")
    declared = held_out_prompts_of(dataset.meta, os.path.join(dataset.path, "meta.json"))
    if sample_ids is None and declared:
        if len(declared) < num_prompts:
            logger.warning("%s: only %d held-out prompts, %d asked (--num-prompts)", dataset.path, len(declared), num_prompts)
        return declared[:num_prompts]

    def prompt_of(i: int) -> np.ndarray | None:
        ids, mask = dataset.sample(i)
        first = int(np.argmax(mask)) if mask.any() else 0
        return ids[:first] if first > 0 else None

    if sample_ids is not None:
        picked = []
        for i in sample_ids:
            prompt = prompt_of(int(i))
            if prompt is None:
                raise DataError(f"{dataset.path}: sample {i} has no prompt before its first loss-mask token")
            picked.append((int(i), prompt))
        return picked
    picked = []
    for i in range(len(dataset) - 1, -1, -1):
        prompt = prompt_of(i)
        if prompt is not None:
            picked.append((i, prompt))
        if len(picked) == num_prompts:
            break
    if not picked:
        raise DataError(f"{dataset.path}: no sample has a prompt followed by loss-mask tokens")
    if len(picked) < num_prompts:
        logger.warning("%s: only %d usable prompts, %d asked (--num-prompts)", dataset.path, len(picked), num_prompts)
    return picked[::-1]
