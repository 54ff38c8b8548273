"""prepare on every input form people have, tool and reasoning turns, template variables,
and held-out prompts declared at prepare time."""

import json

import numpy as np
import pytest

from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.builtin.tiny import IM_END, TINY_VOCAB_WORDS, build_tiny_tokenizer
from dflash_ipc.errors import DataError

from chat_templates import qwen_like_tokenizer

W = TINY_VOCAB_WORDS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tok")
    build_tiny_tokenizer().save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen-like-tok")
    qwen_like_tokenizer().save_pretrained(str(path))
    return str(path)


def msgs(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def dataset_bytes(out):
    return {name: (out / name).read_bytes() for name in ("tokens.bin", "loss_mask.bin", "index.npy")}


ROWS = [msgs(("user", f"{W[1]} {W[2]}"), ("assistant", f"{W[3]} {W[4]}")),
        {"conversations": [{"from": "human", "value": W[5]}, {"from": "gpt", "value": f"{W[6]} {W[7]}"}]},
        msgs(("system", W[8]), ("user", W[9]), ("assistant", W[10]), ("user", W[11]), ("assistant", W[12]))]


def test_each_input_format_round_trips_into_prepare(model_dir, tmp_path):
    """The same conversations as JSONL, a pretty-printed JSON array, Parquet, a save_to_disk
    directory and a directory of shards give byte-identical datasets."""
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    flat = [{"messages": r["messages"]} if "messages" in r else
            {"messages": [{"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]}
                          for t in r["conversations"]]} for r in ROWS]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "in.json").write_text(json.dumps(ROWS, indent=2))
    pq.write_table(pa.Table.from_pylist(flat), str(tmp_path / "in.parquet"))
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "saved"))
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(flat[:2]), str(shards / "train-00000-of-00002.parquet"))
    (shards / "train-00001-of-00002.jsonl").write_text(json.dumps(ROWS[2]) + "\n")
    (shards / "test-00000-of-00001.jsonl").write_text(json.dumps(ROWS[0]) + "\n")  # another split: left out
    got = {}
    for name in ("in.jsonl", "in.json", "in.parquet", "saved", "shards"):
        report = prepare_dataset(model_dir, str(tmp_path / name), str(tmp_path / f"out-{name}"), progress=False)
        assert (report.num_rows, report.num_samples, report.num_rejected) == (3, 3, 0), name
        got[name] = dataset_bytes(tmp_path / f"out-{name}")
    assert all(v == got["in.jsonl"] for v in got.values())
    report = prepare_dataset(model_dir, str(tmp_path / "shards"), str(tmp_path / "test"), split="test", progress=False)
    assert report.num_samples == 1


def test_rejects_name_the_shard_and_row(model_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    d = tmp_path / "shards"
    d.mkdir()
    pq.write_table(pa.Table.from_pylist([ROWS[0], msgs(("user", W[1]))]), str(d / "a.parquet"))
    (d / "b.jsonl").write_text(json.dumps(ROWS[2]) + "\n{oops\n")
    report = prepare_dataset(model_dir, str(d), str(tmp_path / "out"), progress=False)
    with open(report.rejects_path) as f:
        rejects = [json.loads(line) for line in f]
    assert [(r["index"], r["reason"]) for r in rejects] == [(1, "no_assistant_turn"), (3, "malformed_json")]
    assert rejects[0]["where"].endswith("a.parquet row 1") and rejects[1]["where"].endswith("b.jsonl:2")


def tokens_of(tok, text):
    return tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"])


def trained(out, tok, i=0):
    ids, mask = TokenDataset(str(out)).sample(i)
    names = tok.convert_ids_to_tokens(ids.tolist())
    return [n for n, m in zip(names, mask) if m]


def test_tool_calls_tool_turns_reasoning_and_content_parts(qwen_dir, tmp_path):
    tok = qwen_like_tokenizer()
    row = {"tools": json.dumps([{"type": "function", "function": {"name": W[20]}}]),
           "messages": [{"role": "user", "content": [{"type": "text", "text": W[1]}, {"type": "text", "text": W[2]}]},
                        {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "c1", "type": "function", "function": {"name": W[20], "arguments": '{"q": 1}'}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": W[3]},
                        {"role": "assistant", "content": W[4], "reasoning_content": W[5]}]}
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    report = prepare_dataset(qwen_dir, str(tmp_path / "in.jsonl"), str(tmp_path / "out"), progress=False)
    assert report.num_samples == 1, report.rejects_by_reason
    ids, _ = TokenDataset(str(tmp_path / "out")).sample(0)
    text = tok.decode(ids.tolist())
    assert f"{W[1]} \n {W[2]}" in text  # text parts joined with a newline
    call = tokens_of(tok, '\n<tool_call>\n{"name": "' + W[20] + '", "arguments": {"q": 1}}\n</tool_call>')
    assert trained(tmp_path / "out", tok) == call + [IM_END] + ["<think>", "\n", W[5], "\n", "</think>", "\n", "\n",
                                                                W[4], IM_END]


def test_template_variables_reach_the_template(qwen_dir, tmp_path):
    """enable_thinking=False: the generation prompt ends in an empty think block that older
    turns lose; every assistant turn is still masked exactly."""
    tok = qwen_like_tokenizer()
    rows = [msgs(("user", W[1]), ("assistant", W[2]), ("user", W[3]), ("assistant", f"{W[4]} {W[5]}"))]
    (tmp_path / "in.jsonl").write_text(json.dumps(rows[0]) + "\n")
    for kwargs, out in (({}, "on"), ({"enable_thinking": False}, "off")):
        report = prepare_dataset(qwen_dir, str(tmp_path / "in.jsonl"), str(tmp_path / out), template_kwargs=kwargs,
                                 progress=False)
        assert report.num_samples == 1, report.rejects_by_reason
        assert TokenDataset(str(tmp_path / out)).meta["source"]["template_kwargs"] == kwargs
    # the last turn carries the (empty) think block, the older one does not, in both
    want = [W[2], IM_END, "<think>", "\n", "\n", "</think>", "\n", "\n", W[4], W[5], IM_END]
    assert trained(tmp_path / "on", tok) == want
    # off: the empty think block is the generation prompt's (the target never wrote it)
    assert trained(tmp_path / "off", tok) == [W[2], IM_END, W[4], W[5], IM_END]


def test_held_out_conversations_stay_out_and_are_declared(model_dir, tmp_path):
    from dflash_ipc.eval.speculative import held_out_prompts

    tok = build_tiny_tokenizer()
    rows = [msgs(("user", W[i]), ("assistant", f"{W[i + 1]} {W[i + 2]}")) for i in range(10, 20)]
    rows[2] = msgs(("user", W[18]), ("assistant", f"{W[40]} {W[41]}"))  # the prompt of row 8, seen earlier
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = prepare_dataset(model_dir, str(tmp_path / "in.jsonl"), str(tmp_path / "out"), held_out=2, progress=False)
    ds = TokenDataset(str(tmp_path / "out"))
    assert report.num_held_out == 2 and len(ds) == 8
    held = ds.meta["extra"]["held_out"]
    assert [h["sample_id"] for h in held] == [7, 9]  # the last two whose prompt no other row has
    for h, i in zip(held, (7, 9)):
        want = tok(tok.apply_chat_template(rows[i]["messages"][:1], tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"]
        assert h["prompt_ids"] == want
    trained_prompts = {tuple(ds.sample(i)[0][: int(np.argmax(ds.sample(i)[1]))].tolist()) for i in range(len(ds))}
    assert not trained_prompts & {tuple(h["prompt_ids"]) for h in held}
    got = held_out_prompts(ds, num_prompts=2)  # what `dflash-ipc eval` takes by default
    assert [i for i, _ in got] == [7, 9] and [p.tolist() for _, p in got] == [h["prompt_ids"] for h in held]
    with pytest.raises(DataError, match="--held-out 20, but only 8 conversations qualify"):
        prepare_dataset(model_dir, str(tmp_path / "in.jsonl"), str(tmp_path / "o2"), held_out=20, progress=False)
