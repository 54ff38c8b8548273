"""The input reader: every format people have, row indices and places, rows isolated."""

import json
import os
import random
import shutil
import threading

import pytest

from dflash_ipc.data.messages import RowRejected, parse_conversation
from dflash_ipc.data.reader import InputSource, decode_row, split_of
from dflash_ipc.errors import DataError

ROWS = [
    {"messages": [{"role": "user", "content": 'a "quoted" \\ [x] {y}, z'}, {"role": "assistant", "content": "b"}]},
    {"conversations": [{"from": "human", "value": "c ] }"}, {"from": "gpt", "value": "d"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "e"}]}, {"role": "assistant", "content": "f"}]},
]


def read(path, **kw):
    """[(index, line, decoded row or 'reason')]."""
    src = InputSource(str(path), **kw)
    out = []
    for row in src.rows():
        try:
            out.append((row.index, row.line, decode_row(row, src.max_row_bytes)))
        except RowRejected as e:
            out.append((row.index, row.line, e.reason))
    return out


def conversations(path, **kw):
    return [parse_conversation(r).messages for _, _, r in read(path, **kw)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("indent", [None, 2])
def test_json_array_compact_and_pretty_printed(tmp_path, indent):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(ROWS, indent=indent))
    got = read(path)
    assert [(i, r) for i, _, r in got] == list(enumerate(ROWS))
    if indent:  # each element's line is where it starts
        lines = path.read_text().split("\n")
        assert all(lines[line - 1].strip() == "{" for _, line, _ in got)


def test_pretty_printed_objects_one_after_another(tmp_path):
    path = tmp_path / "a.json"
    path.write_text("\n".join(json.dumps(r, indent=1) for r in ROWS) + "\n")
    assert [r for _, _, r in read(path)] == ROWS


def test_jsonl_indices_skip_blank_lines_and_name_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n   \n" + json.dumps(ROWS[1]) + "\n{broken\n" + json.dumps(ROWS[2]))
    assert read(path) == [(0, 1, ROWS[0]), (1, 4, ROWS[1]), (2, 5, "malformed_json"), (3, 6, ROWS[2])]


def test_hostile_rows_are_rejects_not_crashes(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text("\n".join(["[" * 100_000, '{"n": ' + "9" * 5000 + "}", '{"s": "\\ud800"}', "\xff".encode("latin-1").decode("latin-1"),
                               "[1, 2]", json.dumps(ROWS[0])]) + "\n", encoding="latin-1")
    got = read(path)
    assert [r if isinstance(r, str) else "ok" for _, _, r in got] == [
        "malformed_json", "malformed_json", "ok", "malformed_json", "not_an_object", "ok"]
    src = InputSource(str(path))
    rows = list(src.rows())
    with pytest.raises(RowRejected, match="recursion limit"):
        decode_row(rows[0])
    with pytest.raises(RowRejected, match="digits"):
        decode_row(rows[1])


def test_rows_over_the_cap_are_never_held_whole(tmp_path):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 50_000}]})
    (tmp_path / "a.jsonl").write_text(json.dumps(ROWS[0]) + "\n" + big + "\n" + json.dumps(ROWS[1]) + "\n")
    (tmp_path / "a.json").write_text(json.dumps([ROWS[0], json.loads(big), ROWS[1]], indent=1))
    for name in ("a.jsonl", "a.json"):
        src = InputSource(str(tmp_path / name), max_row_bytes=10_000)
        rows = list(src.rows())
        assert [r.oversize > 0 for r in rows] == [False, True, False], name
        assert rows[1].oversize >= 50_000 and len(rows[1].raw) <= 2000
        with pytest.raises(RowRejected) as e:
            decode_row(rows[1], 10_000)
        assert e.value.reason == "line_too_long" and "10000-byte" in e.value.detail
        assert [decode_row(r) for r in (rows[0], rows[2])] == ROWS[:2]


@pytest.mark.parametrize("long_value", ['"' + "x" * (8 << 20) + '"', "1" * (8 << 20), '"' + "\\n" * (4 << 20) + '"'])
def test_one_long_value_in_a_json_array_is_never_held_whole(tmp_path, monkeypatch, long_value):
    """An 8 MiB string (or number) in one element: the scanner's buffer stays within the cap
    plus one read chunk, the element is rejected as too long, the rows after it are read."""
    from dflash_ipc.data import reader
    sizes = []
    more = reader._JsonScanner._more

    def watched_more(self):
        got = more(self)
        sizes.append(len(self.buf))
        return got

    monkeypatch.setattr(reader._JsonScanner, "_more", watched_more)
    path = tmp_path / "a.json"
    path.write_text("[" + json.dumps(ROWS[0]) + ', {"messages": [{"content": ' + long_value + "}]}, "
                    + json.dumps(ROWS[1]) + "]")
    got = read(path, max_row_bytes=10_000)
    assert [r if isinstance(r, str) else "ok" for _, _, r in got] == ["ok", "line_too_long", "ok"]
    assert [r for _, _, r in got][::2] == ROWS[:2]
    assert len(sizes) > 8 and max(sizes) <= 10_000 + reader._READ_CHUNK, max(sizes)


def test_truncated_json_array_rejects_only_the_torn_element(tmp_path):
    text = json.dumps(ROWS, indent=2)
    path = tmp_path / "a.json"
    path.write_text(text[: text.rindex("{") + 10])  # the last element cut short
    got = read(path)
    assert [r for _, _, r in got][:2] == ROWS[:2] and got[2][2] == "malformed_json"


def test_parquet_file_and_null_fields(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    path = tmp_path / "a.parquet"
    rows = [ROWS[0], ROWS[1], {"messages": [{"role": "user", "content": "g"},
                                            {"role": "assistant", "content": None, "tool_calls": [
                                                {"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}]}]
    # (from_pylist takes its columns from the first row: every row names both)
    pq.write_table(pa.Table.from_pylist([{"messages": None, "conversations": None} | r for r in rows]), str(path))
    got = read(path)
    assert [r["messages"] is None for _, _, r in got] == [False, True, False]  # columns other rows fill are null
    convs = conversations(path)
    assert convs[0] == parse_conversation(ROWS[0]).messages and convs[1] == parse_conversation(ROWS[1]).messages
    assert convs[2][1] == {"role": "assistant", "content": "",
                           "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}
    assert InputSource(str(path)).estimated_rows() == 3



def _parquet_of(path, num_rows, *, timestamps=None, row_group_size=100):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    rows = [{"messages": [{"role": "user", "content": f"question {i} " + "q" * 80},
                          {"role": "assistant", "content": f"answer {i}"}]} for i in range(num_rows)]
    table = pa.Table.from_pylist(rows)
    if timestamps is not None:
        table = table.append_column("ts", pa.array(timestamps, type=pa.timestamp("s")))
    pq.write_table(table, str(path), row_group_size=row_group_size, use_dictionary=False, compression="none")
    return pq.ParquetFile(str(path)).metadata


def test_a_value_python_cannot_hold_rejects_its_row_only(tmp_path):
    """A timestamp column with one value past year 9999 (OverflowError in pyarrow's to_pylist)."""
    path = tmp_path / "ts.parquet"
    _parquet_of(path, 150, timestamps=[0] * 70 + [10 ** 14] + [0] * 79)
    got = read(path)
    assert [i for i, _, r in got if isinstance(r, str)] == [70] and len(got) == 150
    assert got[71][2]["messages"][0]["content"].startswith("question 71 ")
    src = InputSource(str(path))
    row = list(src.rows())[70]
    with pytest.raises(RowRejected, match="a value cannot be read \\(OverflowError") as info:
        decode_row(row)
    assert info.value.reason == "unreadable_row" and row.where.endswith("ts.parquet row 70")


def test_a_damaged_row_group_rejects_its_rows_and_the_others_are_read(tmp_path):
    """4 KB of random bytes over the data page of row group 1 of 3."""
    path = tmp_path / "damaged.parquet"
    meta = _parquet_of(path, 300, row_group_size=100)
    start = meta.row_group(1).column(0).data_page_offset
    assert start + 4096 <= meta.row_group(2).column(0).data_page_offset  # inside row group 1
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(random.Random(0).randbytes(4096))
    got = read(path)
    assert len(got) == 300 and [i for i, _, r in got if isinstance(r, str)] == list(range(100, 200))
    assert {r for _, _, r in got[100:200]} == {"unreadable_row"}
    assert got[200][2]["messages"][0]["content"].startswith("question 200 ")
    row = list(InputSource(str(path)).rows())[150]
    with pytest.raises(RowRejected, match=f"row group 1 of {path} unreadable"):
        decode_row(row)


def test_a_save_to_disk_value_python_cannot_hold_rejects_its_row_only(tmp_path):
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
            for i in range(100)]
    table = pa.Table.from_pylist(rows).append_column(
        "ts", pa.array([0] * 66 + [10 ** 14] + [0] * 33, type=pa.timestamp("s")))
    datasets.Dataset(table).save_to_disk(str(tmp_path / "ds"))
    got = read(tmp_path / "ds")
    assert len(got) == 100 and [i for i, _, r in got if isinstance(r, str)] == [66]
    assert got[66][2] == "unreadable_row" and got[67][2]["messages"][0]["content"] == "q67"

def test_save_to_disk_dataset_and_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    flat = [ROWS[0], {"messages": [{"role": "user", "content": "e"}, {"role": "assistant", "content": "f"}]}]
    datasets.Dataset.from_list(flat).save_to_disk(str(tmp_path / "one"))
    assert conversations(tmp_path / "one") == [parse_conversation(r).messages for r in flat]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(flat[:1]),
                          "test": datasets.Dataset.from_list(flat[1:])}).save_to_disk(str(tmp_path / "two"))
    assert conversations(tmp_path / "two") == [parse_conversation(flat[0]).messages]
    assert conversations(tmp_path / "two", split="test") == [parse_conversation(flat[1]).messages]
    with pytest.raises(DataError, match=r"split 'dev' not found; splits: \['train', 'test'\]"):
        InputSource(str(tmp_path / "two"), split="dev").rows().__next__()
    assert InputSource(str(tmp_path / "two"), split="test").estimated_rows() == 1


def test_save_to_disk_dataset_dict_hash_covers_its_rows(tmp_path):
    """input_sha256 of a DatasetDict directory: the rows live in split subdirectories."""
    datasets = pytest.importorskip("datasets")

    def digest(name):
        src = InputSource(str(tmp_path / name))
        list(src.rows())
        return src.sha256.hexdigest()

    for name, rows in (("a", ROWS[:1]), ("b", ROWS[1:2])):
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / name))
    assert digest("a") != digest("b")
    shutil.copytree(tmp_path / "a", tmp_path / "a-copy")  # the same dataset elsewhere: the same hash
    assert digest("a") == digest("a") == digest("a-copy")
    # Only the split read is hashed: another split (here a large test split) is not read at all.
    with_test = {"train": datasets.Dataset.from_list(ROWS[:1]), "test": datasets.Dataset.from_list(ROWS[:1] * 50)}
    datasets.DatasetDict(with_test).save_to_disk(str(tmp_path / "c"))
    with_other_test = {"train": datasets.Dataset.from_list(ROWS[:1]), "test": datasets.Dataset.from_list(ROWS[:1] * 2)}
    datasets.DatasetDict(with_other_test).save_to_disk(str(tmp_path / "d"))
    c = InputSource(str(tmp_path / "c"))
    list(c.rows())
    assert c.sha256.hexdigest() == digest("d") != digest("a")  # dataset_dict.json names both splits


def test_shard_directory_by_split(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    data = tmp_path / "ds" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([ROWS[0]]), str(data / "train-00000-of-00002.parquet"))
    write_jsonl(data / "train-00001-of-00002.jsonl", [ROWS[1]])
    (data / "test-00000-of-00001.json").write_text(json.dumps([ROWS[2]], indent=1))
    (tmp_path / "ds" / ".git").mkdir()
    write_jsonl(tmp_path / "ds" / ".git" / "x.jsonl", [ROWS[2]])  # hidden: never read
    assert conversations(tmp_path / "ds") == [parse_conversation(r).messages for r in ROWS[:2]]
    assert conversations(tmp_path / "ds", split="test") == [parse_conversation(ROWS[2]).messages]
    src = InputSource(str(tmp_path / "ds"))
    assert [r.index for r in src.rows()] == [0, 1] and src.estimated_rows() == 2
    with pytest.raises(DataError, match="no shard of split 'dev'"):
        InputSource(str(tmp_path / "ds"), split="dev")
    assert [split_of(p) for p in ("train-00000-of-00003.parquet", "test/part.jsonl", "validation.json", "x.jsonl",
                                  "train_sft-00000-of-00003-abc.parquet")] == ["train", "test", "validation", None,
                                                                              "train_sft"]


def test_several_splits_without_train_need_a_choice(tmp_path):
    write_jsonl(tmp_path / "train_sft-00000-of-00001.jsonl", [ROWS[0]])
    write_jsonl(tmp_path / "test_sft-00000-of-00001.jsonl", [ROWS[1]])
    with pytest.raises(DataError, match=r"several splits \['test_sft', 'train_sft'\]; choose one with --split"):
        InputSource(str(tmp_path))
    assert len(read(tmp_path, split="train_sft")) == 1


def test_empty_missing_and_stream_inputs(tmp_path):
    assert read("/dev/null") == []
    with pytest.raises(DataError, match="no such input file or directory"):
        InputSource(str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataError, match="no \\*.parquet, \\*.jsonl or \\*.json files"):
        InputSource(str(tmp_path))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text(json.dumps(ROWS, indent=1)))
    writer.start()
    assert [r for _, _, r in read(fifo)] == ROWS  # a JSON array through a pipe: sniffed without seeking
    writer.join(5)
