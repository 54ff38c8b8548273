"""Assistant loss masks, token by token, with the tiny Qwen-style tokenizer."""

import re

import pytest

from dflash_ipc.data.chat import ChatEncoder, has_generation_markers, keep_last_run
from dflash_ipc.data.messages import RowRejected, parse_conversation
from dflash_ipc.builtin.tiny import IM_END, IM_START, TINY_VOCAB_WORDS, build_tiny_tokenizer
from dflash_ipc.errors import DataError

W = TINY_VOCAB_WORDS


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def tok_markers():
    return build_tiny_tokenizer(with_generation_markers=True)


def expected(tok, messages, *, last_turn_only=False):
    """ChatML written out by hand: <|im_start|> role \\n words <|im_end|> \\n per turn;
    trained = the assistant's words and its <|im_end|> (not the header, not the final \\n)."""
    last_assistant = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids, mask = [], []
    for i, m in enumerate(messages):
        trained = m["role"] == "assistant" and (not last_turn_only or i == last_assistant)
        head = [IM_START, m["role"], "\n"]
        body = re.findall(r"\n|[^\s]+", m["content"]) + [IM_END]
        ids += head + body + ["\n"]
        mask += [0] * len(head) + [int(trained)] * len(body) + [0]
    return tok.convert_tokens_to_ids(ids), mask


def conv(*turns):
    return [{"role": r, "content": c} for r, c in turns]


SINGLE = conv(("user", f"{W[1]} {W[2]} {W[3]}"), ("assistant", f"{W[4]} {W[5]}"))
MULTI = conv(
    ("system", f"{W[10]} {W[11]}"),
    ("user", f"{W[1]} {W[2]}"),
    ("assistant", f"{W[3]} {W[4]} {W[5]}"),
    ("user", f"{W[6]}"),
    ("assistant", f"{W[7]}\n{W[8]}"),
)


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
@pytest.mark.parametrize("method", ["prefix", "markers"])
def test_mask_token_by_token(tok, tok_markers, messages, method):
    encoder = ChatEncoder(tok_markers if method == "markers" else tok, method=method)
    assert encoder.method == method
    enc = encoder.encode(messages)
    want_ids, want_mask = expected(tok, messages)
    assert enc.input_ids == want_ids
    assert enc.loss_mask == want_mask


@pytest.mark.parametrize("messages", [SINGLE, MULTI], ids=["single", "multi"])
def test_both_methods_agree_on_the_marker_template(tok_markers, messages):
    # The marker template renders the same text, so the prefix method must find the same mask.
    for last in (False, True):
        a = ChatEncoder(tok_markers, method="markers").encode(messages, last_turn_only=last)
        b = ChatEncoder(tok_markers, method="prefix").encode(messages, last_turn_only=last)
        assert (a.input_ids, a.loss_mask) == (b.input_ids, b.loss_mask)


@pytest.mark.parametrize("method", ["prefix", "markers"])
def test_last_turn_only(tok, tok_markers, method):
    encoder = ChatEncoder(tok_markers if method == "markers" else tok, method=method)
    enc = encoder.encode(MULTI, last_turn_only=True)
    want_ids, want_mask = expected(tok, MULTI, last_turn_only=True)
    assert enc.input_ids == want_ids and enc.loss_mask == want_mask
    assert sum(enc.loss_mask) == 4  # W7, \n, W8, <|im_end|>


def test_auto_method_follows_the_template(tok, tok_markers):
    assert not has_generation_markers(tok) and has_generation_markers(tok_markers)
    assert ChatEncoder(tok).method == "prefix"
    assert ChatEncoder(tok_markers).method == "markers"
    with pytest.raises(DataError, match="no \\{% generation %\\} markers"):
        ChatEncoder(tok, method="markers")
    with pytest.raises(DataError, match="allowed"):
        ChatEncoder(tok, method="regex")


def test_template_that_rewrites_older_turns(tok):
    """Like Qwen3: the last assistant turn gets an (empty) think block, older ones do not,
    so messages[:i+1] is not a prefix of the full rendering. The turn must still end at
    its own <|im_end|>."""
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = (
        "{%- for message in messages %}"
        "{%- if message['role'] == 'assistant' and loop.last %}"
        "{{- '<|im_start|>assistant\\n' + W0 + ' ' + message['content'] + '<|im_end|>\\n' }}"
        "{%- else %}"
        "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    ).replace("W0", repr(W[0]))
    messages = conv(("user", W[1]), ("assistant", f"{W[2]} {W[3]}"), ("user", W[4]), ("assistant", W[5]))
    enc = ChatEncoder(t, method="prefix").encode(messages)
    names = t.convert_ids_to_tokens(enc.input_ids)
    trained = [n for n, m in zip(names, enc.loss_mask) if m]
    # Older turn: its words and <|im_end|>; last turn: the template's prefix word too.
    assert trained == [W[2], W[3], IM_END, W[0], W[5], IM_END]


def test_template_errors_are_rejections(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = "{{ raise_exception('no system messages') if messages[0]['role'] == 'system' else '' }}"
    with pytest.raises(RowRejected) as e:
        ChatEncoder(t).encode(MULTI)
    assert e.value.reason == "template_error" and "no system messages" in e.value.detail


def test_special_token_in_content_rejected(tok):
    messages = conv(("user", f"{W[1]} {IM_END} {W[2]}"), ("assistant", W[3]))
    with pytest.raises(RowRejected) as e:
        ChatEncoder(tok).encode(messages)
    assert e.value.reason == "special_token_in_content" and "turn 0" in e.value.detail


def test_no_chat_template_is_an_error(tok):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(DataError, match="no chat_template"):
        ChatEncoder(t)


def test_normalize_openai_and_sharegpt():
    openai = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                           {"role": "assistant", "content": "a"}]}
    sharegpt = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "u"},
                                  {"from": "gpt", "value": "a"}]}
    want = conv(("system", "s"), ("user", "u"), ("assistant", "a"))
    assert parse_conversation(openai).messages == want
    assert parse_conversation(sharegpt).messages == want


@pytest.mark.parametrize(
    "row, reason, where",
    [
        ({"messages": [{"content": "x"}, {"role": "assistant", "content": "y"}]}, "missing_role", "messages[0]"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "unknown_role", "'bot'"),
        ({"conversations": [{"from": "robot", "value": "x"}]}, "unknown_role", "conversations[0].from"),
        ({"conversations": [{"value": "x"}]}, "missing_role", "conversations[0]"),
        ({"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "y"}]}, "empty_content", "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}, "empty_content", "messages[1]"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "non_text_content", "content[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "non_text_content",
         "'image_url' part"),
        ({"messages": [{"role": "user", "content": {"text": "x"}}]}, "non_string_content", "dict"),
        ({"messages": [{"role": "user", "content": None}]}, "non_string_content", "NoneType"),
        ({"messages": [{"role": "user"}]}, "missing_content", "messages[0]"),
        ({"messages": [{"role": "user", "content": "x"}]}, "no_assistant_turn", "['user']"),
        ({"messages": []}, "bad_messages", "non-empty"),
        ({"messages": ["hi"]}, "bad_messages", "messages[0]"),
        ({"text": "hi"}, "unknown_format", "'text'"),
    ],
)
def test_bad_conversations(row, reason, where):
    with pytest.raises(RowRejected) as e:
        parse_conversation(row)
    assert e.value.reason == reason
    assert where in e.value.detail


def test_keep_last_run():
    assert keep_last_run([0, 1, 1, 0, 1, 1, 0]) == [0, 0, 0, 0, 1, 1, 0]
    assert keep_last_run([0, 0]) == [0, 0]


def test_marker_spans_match_transformers_assistant_mask(tok_markers):
    """The sentinel rendering finds the same tokens as transformers' own
    return_assistant_tokens_mask on a template with {% generation %} markers."""
    for messages in (SINGLE, MULTI):
        enc = ChatEncoder(tok_markers, method="markers").encode(messages)
        ref = tok_markers.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
        assert enc.input_ids == list(ref["input_ids"])
        assert enc.loss_mask == [int(bool(x)) for x in ref["assistant_masks"]]


@pytest.mark.parametrize("method", ["prefix", "markers"])
def test_head_tokenization_is_the_full_tokenizations_head(tok, tok_markers, method):
    encoder = ChatEncoder(tok_markers if method == "markers" else tok, method=method)
    long = conv(("user", " ".join(W[i % 1000] for i in range(3000))), ("assistant", W[1]),
                ("user", W[2]), ("assistant", " ".join(W[i % 997] for i in range(3000))))
    full = encoder.encode(long)
    for n in (5, 100, 3500):
        head = encoder.encode(long, max_tokens=n)
        assert (head.input_ids, head.loss_mask) == (full.input_ids[:n], full.loss_mask[:n])
    assert encoder.encode(long, max_tokens=10**6).input_ids == full.input_ids


def test_tool_calls_reasoning_tools_and_null_fields_normalize():
    from dflash_ipc.data.messages import parse_conversation

    row = {"tools": '[{"type": "function", "function": {"name": "f"}}]', "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "tool_calls": None},
        {"role": "assistant", "content": None, "reasoning_content": None,
         "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1]}'}},
                        {"name": "g", "arguments": {"y": 2}}]},
        {"role": "tool", "content": "r", "tool_call_id": "1", "name": None},
        {"role": "assistant", "content": "", "reasoning_content": "thought"},
    ]}
    c = parse_conversation(row)
    assert c.tools == [{"type": "function", "function": {"name": "f"}}]
    assert c.messages == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": {"x": [1]}}, "id": "1"},
            {"type": "function", "function": {"name": "g", "arguments": {"y": 2}}}]},
        {"role": "tool", "content": "r", "tool_call_id": "1"},
        {"role": "assistant", "content": "", "reasoning_content": "thought"},
    ]
    for bad, where in (([{"function": {"arguments": "{}"}}], "tool_calls[0] needs function.name"),
                       ([{"function": {"name": "f", "arguments": "{oops"}}], "arguments: column 2"),
                       ("call", "must be a list")):
        with pytest.raises(RowRejected) as e:
            parse_conversation({"messages": [{"role": "user", "content": "a"},
                                             {"role": "assistant", "content": "", "tool_calls": bad}]})
        assert e.value.reason == "bad_tool_calls" and where in e.value.detail


def test_template_kwargs_from_the_command_line():
    from dflash_ipc.data.messages import parse_template_kwargs
    from dflash_ipc.errors import ConfigError

    assert parse_template_kwargs(['{"enable_thinking": false}', "depth=3", "name=qwen", 'x="1"']) == {
        "enable_thinking": False, "depth": 3, "name": "qwen", "x": "1"}
    for bad, match in (("[1]", "give KEY=VALUE"), ("{nope", "not a JSON object"), ("tools=[]", "own arguments")):
        with pytest.raises(ConfigError, match=match):
            parse_template_kwargs([bad])


TOOL_ROW = {"tools": [{"type": "function", "function": {"name": W[20], "parameters": {"type": "object"}}}],
            "messages": [{"role": "user", "content": f"{W[1]} {W[2]}"},
                         {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": W[20],
                                                                                           "arguments": {}}}]},
                         {"role": "tool", "content": f"{W[3]}", "tool_call_id": "1", "name": W[20]},
                         {"role": "assistant", "content": f"{W[4]} {W[5]}"}]}


@pytest.mark.parametrize("method", ["prefix", "markers"])
def test_a_template_without_tool_support_rejects_the_row_instead_of_an_empty_turn(tok, tok_markers, method):
    """The tiny ChatML template renders content only: the tool call became an empty assistant
    turn and the schema vanished, silently; now the row is rejected, naming the tool."""
    encoder = ChatEncoder(tok_markers if method == "markers" else tok, method=method)
    with pytest.raises(RowRejected) as e:
        encoder.encode(parse_conversation(TOOL_ROW))
    assert e.value.reason == "tools_not_rendered" and f"tool {W[20]!r} is named 2 times" in e.value.detail
    calls_only = {"messages": TOOL_ROW["messages"]}  # no schema: the dropped call alone is caught
    with pytest.raises(RowRejected, match="tools_not_rendered"):
        encoder.encode(parse_conversation(calls_only))
    encoder.encode(parse_conversation({"messages": SINGLE}))  # rows without tools are untouched


def test_a_template_with_tool_support_renders_the_tool_row():
    from chat_templates import qwen_like_tokenizer
    encoded = ChatEncoder(qwen_like_tokenizer()).encode(parse_conversation(TOOL_ROW))
    assert sum(encoded.loss_mask) > 0
