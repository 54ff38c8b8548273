"""The resumable output file: torn tails cut, done rows skipped, settings pinned, sorted at the end."""

import json
import os

import pytest

from dflash_ipc.errors import DataError
from dflash_ipc.regenerate.output import RegenOutput, line_index, sort_by_index

SETTINGS = {"model_dir": "/m", "max_new_tokens": 8}


def row(i):
    return {"index": i, "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "é"}]}


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_append_out_of_order_and_are_sorted_when_complete(tmp_path):
    out = RegenOutput(str(tmp_path / "o.jsonl"), SETTINGS)
    for i in (2, 0, 3):
        out.write(row(i))
    out.reject(1, "in.jsonl:2", "template_error", "boom")
    assert [r["index"] for r in lines(tmp_path / "o.jsonl")] == [2, 0, 3]  # as they finished
    assert out.finish(num_rows=4) is True
    assert lines(tmp_path / "o.jsonl") == [row(0), row(2), row(3)]
    state = json.loads((tmp_path / "o.state.json").read_text())
    assert state["complete"] is True and state["num_done"] == 3 and state["num_rejected"] == 1
    assert json.loads((tmp_path / "o.rejects.jsonl").read_text())["index"] == 1


def test_a_torn_last_line_is_cut_and_done_rows_are_skipped(tmp_path):
    path = tmp_path / "o.jsonl"
    out = RegenOutput(str(path), SETTINGS)
    out.write(row(5))
    out.write(row(1))
    assert out.finish(num_rows=None) is False  # interrupted: partial, not sorted
    with open(path, "ab") as f:
        f.write(json.dumps(row(3)).encode()[:17])  # killed mid-write
    out = RegenOutput(str(path), SETTINGS)
    assert out.num_torn == 1 and out.done == {1, 5}
    assert path.read_text().endswith("\n") and [r["index"] for r in lines(path)] == [5, 1]
    out.write(row(3))
    out.write(row(0))
    assert out.finish(num_rows=4) is False  # 4 rows of input, index 2 neither written nor rejected
    out = RegenOutput(str(path), SETTINGS)
    out.write(row(2))
    assert out.finish(num_rows=4) is True
    assert lines(path) == [row(i) for i in (0, 1, 2, 3, 5)]


def test_other_settings_or_a_foreign_file_are_refused(tmp_path):
    path = tmp_path / "o.jsonl"
    out = RegenOutput(str(path), SETTINGS)
    out.write(row(0))
    out.finish(num_rows=None)
    with pytest.raises(DataError, match=r"made with other settings .*'max_new_tokens': \(8, 9\)"):
        RegenOutput(str(path), SETTINGS | {"max_new_tokens": 9})
    again = RegenOutput(str(path), SETTINGS | {"max_new_tokens": 9}, overwrite=True)
    assert again.done == set()
    again.finish(num_rows=None)
    other = tmp_path / "other.jsonl"
    other.write_text('{"messages": []}\n')
    with pytest.raises(DataError, match="exists without its other.state.json"):
        RegenOutput(str(other), SETTINGS)
    (tmp_path / "other.state.json").write_text(json.dumps({"settings": SETTINGS}))
    with pytest.raises(DataError, match=r"other.jsonl:1: not a regenerated row"):
        RegenOutput(str(other), SETTINGS)


@pytest.mark.parametrize("line", [b'{"index": ' + b"9" * 5000 + b"}", b"[" * 100_000, b'{"index": -3}', b'{"a": "\xff"}'])
def test_a_hostile_line_in_the_output_is_named_not_a_traceback(tmp_path, line):
    path = tmp_path / "o.jsonl"
    out = RegenOutput(str(path), SETTINGS)
    out.write(row(0))
    out.finish(num_rows=None)
    with open(path, "ab") as f:
        f.write(line + b"\n")
    with pytest.raises(DataError, match=r"o.jsonl:2: not a regenerated row"):
        RegenOutput(str(path), SETTINGS)


@pytest.mark.parametrize("state, needle", [
    ("[" * 100_000, "nested deeper"), ("[]", "is not a JSON object"), ('{"settings": [1]}', "field settings must be"),
    ("\x00\xff", "o.state.json: regenerate state"),
])
def test_a_hostile_state_file_is_one_line(tmp_path, state, needle):
    path = tmp_path / "o.jsonl"
    RegenOutput(str(path), SETTINGS).finish(num_rows=None)
    (tmp_path / "o.state.json").write_bytes(state.encode("latin-1"))
    with pytest.raises(DataError, match=needle) as info:
        RegenOutput(str(path), SETTINGS)
    assert "\n" not in str(info.value)


def test_unwritable_output_is_a_clear_error(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(DataError, match="cannot create the output directory"):
        RegenOutput(str(tmp_path / "afile" / "o.jsonl"), SETTINGS)
    with pytest.raises(DataError, match="is a directory"):
        RegenOutput(str(tmp_path), SETTINGS)


def test_sort_drops_a_later_copy_and_reads_indices_fast(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (row(2), row(1), row(2) | {"x": 1})))
    assert sort_by_index(str(path)) == 2
    assert lines(path) == [row(1), row(2)]
    assert line_index(b'{"index": 12, "messages": []}\n') == 12
    assert line_index(b'{"messages": [], "index": 4}\n') == 4 and line_index(b"[1]\n") is None


@pytest.mark.parametrize("text", ["", "\n\n", "[]"])
def test_an_empty_input_is_refused_before_any_output_exists(tmp_path, text):
    from dflash_ipc.errors import DataError
    from dflash_ipc.regenerate.options import GenerationOptions
    from dflash_ipc.regenerate.run import regenerate
    name = "in.json" if text == "[]" else "in.jsonl"
    (tmp_path / name).write_text(text)
    with pytest.raises(DataError, match=f"{name}: the input is empty"):
        regenerate(str(tmp_path / name), str(tmp_path / "out.jsonl"), None, GenerationOptions(max_new_tokens=4))
    assert sorted(os.listdir(tmp_path)) == [name]
