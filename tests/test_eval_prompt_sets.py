"""Prompt sets from JSONL files: every row form, clear errors, chat templates with kwargs, multi-turn
conversations conditioned on the model's own replies, and `dflash-ipc eval` over such files."""

import json

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from dflash_ipc.cli import main
from dflash_ipc.builtin.tiny import TINY_CHAT_TEMPLATE
from dflash_ipc.drafter.inference_format import save_inference_checkpoint
from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.eval.decoding import PlainDecoder, SpeculativeDecoder
from dflash_ipc.eval.drafter_context import DrafterContext
from dflash_ipc.eval.prompt_sets import ChatRenderer, Conversations, prompt_set_arg, read_prompt_file
from dflash_ipc.decode.target import BatchedTarget
from eval_helpers import LAYER_IDS, random_drafter

torch.set_num_threads(1)

ROWS = [
    {"question_id": 81, "turns": ["baba badu", "bagu balu"]},  # MT-Bench
    {"messages": [{"role": "system", "content": "banu"}, {"role": "user", "content": "baba"},
                  {"role": "assistant", "content": "baru"}, {"role": "user", "content": "badu"}]},
    {"question": "balu bagu", "answer": "#### 4"},  # GSM8K
    {"problem": "badu baba", "solution": "x"},  # MATH
    {"prompt": "bagu", "system": "banu"},
    # as prepare and regenerate read chats: ShareGPT, and content as text parts
    {"conversations": [{"from": "system", "value": "banu"}, {"from": "human", "value": "balu"},
                       {"from": "gpt", "value": "baru"}, {"from": "human", "value": "bagu"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "baba"}]}]},
]


def write_jsonl(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def test_every_row_form(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", ROWS[:2] + ["", "  "] + ROWS[2:])
    prompt_set = read_prompt_file(path)
    assert prompt_set.name == "mixed" and prompt_set.num_turns == 10
    assert [(c.sample_id, c.turns, c.system) for c in prompt_set.cases] == [
        (0, ["baba badu", "bagu balu"], None), (1, ["baba", "badu"], "banu"), (2, ["balu bagu"], None),
        (3, ["badu baba"], None), (4, ["bagu"], "banu"), (5, ["balu", "bagu"], "banu"), (6, ["baba"], None)]
    assert [c.sample_id for c in read_prompt_file(path, limit=2).cases] == [0, 1]


@pytest.mark.parametrize("line, match", [
    ("{not json", "bad.jsonl:2: not valid JSON"),
    ('["a"]', "bad.jsonl:2: a row must be a JSON object"),
    ('{"text": "a"}', r"bad.jsonl:2: no prompt field; allowed: \['turns', 'messages', 'conversations', 'question'"),
    ('{"messages": [{"role": "tool", "content": "a"}]}', r"bad.jsonl:2: messages\[0\] is a 'tool' turn"),
    ('{"conversations": [{"from": "gpt", "value": "a"}]}', "bad.jsonl:2: 'conversations' has no user turn"),
    ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', r"messages\[0\].content\[0\] is a 'image_url'"),
    ('{"turns": []}', "bad.jsonl:2: 'turns' must be a non-empty list"),
    ('{"question": 3}', "bad.jsonl:2: 'question' must be a non-empty string, got int"),
    ('{"messages": [{"role": "bot", "content": "a"}]}', r"bad.jsonl:2: messages\[0\].role='bot'; allowed"),
    ('{"messages": [{"role": "assistant", "content": "a"}]}', "bad.jsonl:2: 'messages' has no user turn"),
    ('{"prompt": "a", "system": ""}', "bad.jsonl:2: 'system' must be a non-empty string"),
    ("[" * 100_000, r"bad.jsonl:2: not valid JSON \(nested deeper than the parser's recursion limit\)"),
    ('{"prompt": ' + "9" * 5000 + "}", r"bad.jsonl:2: not valid JSON \(Exceeds the limit"),
    ('{"prompt": "' + "x" * (17 << 20) + '"}', r"bad.jsonl:2: a line of 17825806 bytes, over 16777216: not a prompt"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, match):
    path = write_jsonl(tmp_path / "bad.jsonl", [ROWS[2], line])
    with pytest.raises(DataError, match=match):
        read_prompt_file(path)


def test_bad_utf8_names_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not valid JSON"):
        read_prompt_file(str(tmp_path / "bad.jsonl"))


def test_missing_or_empty_files_and_set_names(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_prompt_file(str(tmp_path / "none.jsonl"))
    with pytest.raises(DataError, match="no prompts"):
        read_prompt_file(write_jsonl(tmp_path / "empty.jsonl", [""]))
    assert prompt_set_arg("gsm8k=/data/test.jsonl") == ("gsm8k", "/data/test.jsonl")
    assert prompt_set_arg("/data/mt_bench.jsonl") == ("mt_bench", "/data/mt_bench.jsonl")


def test_template_kwargs_reach_the_template(target_dir):
    tok = AutoTokenizer.from_pretrained(target_dir)
    tok.chat_template = TINY_CHAT_TEMPLATE + "{%- if enable_thinking is defined and not enable_thinking %}" \
                                            "{{- 'system' }}{%- endif %}"
    messages = [{"role": "user", "content": "baba"}]
    plain = ChatRenderer(tok).render(messages, "test")
    no_think = ChatRenderer(tok, {"enable_thinking": False}).render(messages, "test")
    assert no_think.tolist() == plain.tolist() + [tok.convert_tokens_to_ids("system")]
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat_template"):
        ChatRenderer(tok)


def test_turns_are_conditioned_on_the_models_own_replies(target_dir, tmp_path):
    """Turn 2's prompt is turn 1's prompt, the model's reply and the next user turn; speculative
    and plain decoding see the same turns (float32: identical replies)."""
    target = BatchedTarget(target_dir, layer_ids=LAYER_IDS, dtype="float32")
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompt_set = read_prompt_file(write_jsonl(tmp_path / "mt.jsonl", ROWS[:5]))

    def run(decoder):
        source = Conversations(prompt_set, max_new_tokens=10, renderer=ChatRenderer(tok),
                               stop_token_ids=target.stop_token_ids)
        return {g.request.key: g for g in decoder.run(source).generations}

    plain = run(PlainDecoder(target, batch_size=3))
    spec = run(SpeculativeDecoder(target, DrafterContext(random_drafter(target_dir, num_layers=1), target.head),
                                  batch_size=2))
    assert sorted(plain) == sorted(spec) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (3, 0), (4, 0)]
    for key, gen in plain.items():
        assert spec[key].tokens == gen.tokens and spec[key].request.prompt_ids.tolist() == gen.request.prompt_ids.tolist()
    for case, next_turn in ((0, "bagu balu"), (1, "badu")):
        first, second = plain[(case, 0)], plain[(case, 1)]
        reply = [t for t in first.tokens if t not in target.stop_token_ids]
        head = first.request.prompt_ids.tolist() + reply
        assert second.request.prompt_ids.tolist()[: len(head)] == head
        assert next_turn in tok.decode(second.request.prompt_ids[len(head):])
    system_first = plain[(1, 0)].request.prompt_ids.tolist()
    assert tok.convert_ids_to_tokens(system_first[:2]) == ["<|im_start|>", "system"]
    own_reply = ChatRenderer(tok).reply_text(plain[(1, 0)].tokens, target.stop_token_ids)
    want = ChatRenderer(tok).render([{"role": "system", "content": "banu"}, {"role": "user", "content": "baba"},
                                     {"role": "assistant", "content": own_reply},
                                     {"role": "user", "content": "badu"}], "test")
    assert plain[(1, 1)].request.prompt_ids.tolist() == want.tolist()  # the file's assistant turn is not used


def test_eval_command_on_prompt_files(target_dir, tmp_path):
    mt = write_jsonl(tmp_path / "mt.jsonl", ROWS[:2])
    gsm = write_jsonl(tmp_path / "gsm.jsonl", ROWS[2:4])
    drafter = str(tmp_path / "drafter")
    save_inference_checkpoint(random_drafter(target_dir, num_layers=1, block_size=8), drafter, dtype=torch.float32)
    args = ["eval", "--target", target_dir, "--drafter", drafter, "--prompts", f"mt={mt}", "--prompts", gsm,
            "--max-new-tokens", "8", "--batch-size", "2", "--json"]
    result = CliRunner().invoke(main, args + ["--check-lossless"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    reports = json.loads(result.stdout)
    assert [(r["prompt_set"], r["num_prompts"], r["num_turns"]) for r in reports] == [("mt", 2, 4), ("gsm", 2, 2)]
    for r in reports:
        assert r["num_lossless_checked"] == r["num_turns"] and r["lossless_mismatches"] == []
        assert r["plain"]["tokens_per_s"] > 0 and r["speedup"] > 0 and len(r["acceptance_per_position"]) == 7
    assert "[mt] plain: 4/4 turns" in result.stderr and "[gsm] plain: 2/2 prompts" in result.stderr and "ETA" in result.stderr
    sampled = CliRunner().invoke(main, args + ["--temperature", "0.8", "--top-p", "0.9"], catch_exceptions=False)
    assert sampled.exit_code == 0 and json.loads(sampled.stdout)[0]["sampling"]["temperature"] == 0.8
    with pytest.raises(ConfigError, match="lossless check compares greedy outputs"):
        CliRunner().invoke(main, args + ["--temperature", "0.8", "--check-lossless"], catch_exceptions=False)
    with pytest.raises(ConfigError, match="no prompts; give --data"):
        CliRunner().invoke(main, ["eval", "--target", target_dir, "--drafter", drafter], catch_exceptions=False)


@pytest.mark.parametrize("args", [["--chat-template-kwargs", "enable_thinking=false", "--chat-template-kwargs", "x=2"],
                                  ["--template-kwargs", '{"enable_thinking": false, "x": 2}']])
def test_eval_takes_template_variables_as_prepare_does(monkeypatch, target_dir, tmp_path, args):
    """`eval` parses --chat-template-kwargs (alias --template-kwargs) with prepare's parser."""
    import dflash_ipc.eval.speculative as speculative
    seen = {}
    monkeypatch.setattr(speculative, "evaluate_sets", lambda *a, **k: seen.update(k) or [])
    cmd = ["eval", "--target", target_dir, "--drafter", str(tmp_path), "--prompts", "x.jsonl", *args]
    result = CliRunner().invoke(main, cmd, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert seen["template_kwargs"] == {"enable_thinking": False, "x": 2}
    with pytest.raises(ConfigError, match="give KEY=VALUE or a JSON object"):
        CliRunner().invoke(main, cmd[:-2] + ["--chat-template-kwargs", "oops"], catch_exceptions=False)
