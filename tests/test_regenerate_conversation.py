"""Which turns regeneration keeps and which the target replaces, and what a reply becomes."""

import pytest

from dflash_ipc.data.messages import Conversation, RowRejected, parse_conversation
from dflash_ipc.regenerate.conversation import Reply, RowState, assistant_message, split_reasoning


def turns(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def run(messages, *, max_turns=None, tools=None):
    """Drive a RowState with fake replies naming the history they saw; returns (result, histories)."""
    state = RowState(7, Conversation(messages, tools), max_turns=max_turns)
    seen = []
    while not state.done:
        request = state.request(16)
        assert request.key == (7, len(seen), 0)  # (index, turn, sample)
        seen.append([m["content"] for m in request.messages])
        state.add_reply({"role": "assistant", "content": f"reply{len(seen)}"})
    return state.result(), seen


def test_every_assistant_turn_is_replaced_and_only_those():
    source = turns(("system", "s"), ("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"),
                   ("user", "u3"), ("assistant", "a3"))
    result, seen = run(source)
    assert result == {"index": 7, "messages": turns(("system", "s"), ("user", "u1"), ("assistant", "reply1"),
                                                    ("user", "u2"), ("assistant", "reply2"), ("user", "u3"),
                                                    ("assistant", "reply3"))}
    # each reply is generated on the regenerated history, never on the dataset's replies
    assert seen == [["s", "u1"], ["s", "u1", "reply1", "u2"], ["s", "u1", "reply1", "u2", "reply2", "u3"]]


def test_tool_turns_are_kept_and_a_final_user_turn_gets_a_reply():
    source = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [1]},
              {"role": "tool", "content": "t", "tool_call_id": "1"}, {"role": "assistant", "content": "a"},
              {"role": "user", "content": "u2"}]
    result, seen = run(source, tools=[{"name": "f"}])
    assert [m["role"] for m in result["messages"]] == ["user", "assistant", "tool", "assistant", "user", "assistant"]
    assert result["messages"][2] == source[2] and result["tools"] == [{"name": "f"}]
    assert seen[1] == ["u", "reply1", "t"] and len(seen) == 3


def test_prompt_only_rows_and_max_turns():
    result, seen = run(turns(("user", "q")))
    assert result["messages"] == turns(("user", "q"), ("assistant", "reply1"))
    source = turns(("user", "u1"), ("assistant", "a1"), ("user", "u2"), ("assistant", "a2"))
    result, seen = run(source, max_turns=1)
    assert result["messages"] == turns(("user", "u1"), ("assistant", "reply1"))  # later turns dropped
    with pytest.raises(RowRejected) as e:
        RowState(0, Conversation(turns(("system", "s"))))
    assert e.value.reason == "no_assistant_turn"


def test_reasoning_kept_or_dropped():
    assert split_reasoning("<think>\nwhy\n</think>\n\nanswer") == ("why", "answer")
    assert split_reasoning("why</think>answer") == ("why", "answer")  # the prompt opened the block
    assert split_reasoning("<think>\nunfinished") == (None, "<think>\nunfinished")
    reply = Reply((0, 0), text="<think>\nwhy\n</think>\n\nanswer")
    assert assistant_message(reply, "keep") == {"role": "assistant", "content": "answer", "reasoning_content": "why"}
    assert assistant_message(reply, "drop") == {"role": "assistant", "content": "answer"}
    served = Reply((0, 0), text="answer", reasoning="why")  # a server's reasoning parser split it already
    assert assistant_message(served, "keep") == {"role": "assistant", "content": "answer", "reasoning_content": "why"}
    for text, mode in (("  ", "keep"), ("<think>why</think>", "drop")):
        with pytest.raises(RowRejected) as e:
            assistant_message(Reply((0, 2), text=text), mode)
        assert e.value.reason == "empty_reply" and "turn 2" in e.value.detail
    # the regenerated message goes back through prepare's normalization
    msg = assistant_message(reply, "keep")
    assert parse_conversation({"messages": [{"role": "user", "content": "q"}, msg]}).messages[1] == msg
