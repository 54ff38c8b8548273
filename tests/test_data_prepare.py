"""prepare_dataset end to end on JSONL files, with the tiny tokenizer saved locally."""

import json
import os
import re

import numpy as np
import pytest

from dflash_ipc.data import prepare as prepare_mod
from dflash_ipc.data.dataset import TokenDataset, tokenizer_fingerprint
from dflash_ipc.data.prepare import prepare_dataset
from dflash_ipc.builtin.tiny import IM_END, IM_START, TINY_VOCAB_WORDS, build_tiny_tokenizer
from dflash_ipc.errors import ConfigError, DataError

W = TINY_VOCAB_WORDS


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def model_dir(tok, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-tok")
    tok.save_pretrained(str(path))  # prepare needs only the tokenizer of the target
    return str(path)


def chatml(tok, turns, trained_turns=None):
    """Expected (ids, mask) written out by hand for [(role, text), ...]."""
    ids, mask = [], []
    for i, (role, text) in enumerate(turns):
        on = role == "assistant" and (trained_turns is None or i in trained_turns)
        body = re.findall(r"\n|[^\s]+", text) + [IM_END]
        ids += [IM_START, role, "\n"] + body + ["\n"]
        mask += [0, 0, 0] + [int(on)] * len(body) + [0]
    return tok.convert_tokens_to_ids(ids), mask


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(row if isinstance(row, str) else json.dumps(row))
            f.write("\n")
    return str(path)


def msgs(*turns):
    return {"messages": [{"role": r, "content": c} for r, c in turns]}


def samples(out):
    ds = TokenDataset(str(out))
    return [(ids.tolist(), mask.astype(int).tolist()) for ids, mask in (ds.sample(i) for i in range(len(ds)))]


GOOD = [("system", f"{W[9]}"), ("user", f"{W[1]} {W[2]}"), ("assistant", f"{W[3]} {W[4]}"),
        ("user", W[5]), ("assistant", f"{W[6]}\n{W[7]}")]


def test_each_input_form(tok, model_dir, tmp_path):
    ids, mask = chatml(tok, GOOD)
    sharegpt_roles = {"system": "system", "user": "human", "assistant": "gpt"}
    rows = [
        msgs(*GOOD),
        {"conversations": [{"from": sharegpt_roles[r], "value": c} for r, c in GOOD]},
        {"input_ids": ids, "loss_mask": mask},
        {"input_ids": ids[:6], "loss_mask": [False, False, False, True, True, True]},
    ]
    report = prepare_dataset(model_dir, write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out"),
                             progress=False)
    assert (report.num_rows, report.num_samples, report.num_rejected) == (4, 4, 0)
    got = samples(tmp_path / "out")
    assert got[0] == (ids, mask) and got[1] == (ids, mask) and got[2] == (ids, mask)
    assert got[3] == (ids[:6], [0, 0, 0, 1, 1, 1])
    meta = TokenDataset(str(tmp_path / "out")).meta
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    assert meta["source"]["num_rows"] == 4 and meta["source"]["input"].endswith("in.jsonl")


BAD_ROWS = [
    ('{"messages": [', "malformed_json"),
    ('[1, 2]', "not_an_object"),
    (msgs(("user", W[1]), ("assistant", W[2])) | {"messages": [{"content": W[1]}, {"role": "assistant", "content": W[2]}]}, "missing_role"),
    (msgs(("user", W[1]), ("robot", W[2])), "unknown_role"),
    (msgs(("user", ""), ("assistant", W[2])), "empty_content"),
    ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": W[2]}]}, "non_string_content"),
    (msgs(("system", W[1]), ("user", W[2])), "no_assistant_turn"),
    (msgs(("user", " ".join(W[:40])), ("assistant", W[2])), "too_long"),  # cut inside the prompt
    ({"input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "bad_tokens"),
    ({"input_ids": [1, 2, 99999], "loss_mask": [0, 1, 1]}, "bad_tokens"),
    ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 0]}, "no_loss_tokens"),
    ({"text": "plain"}, "unknown_format"),
]


def bad_file(tmp_path):
    """Good rows around each bad row, and a blank line; returns (path, {line: reason})."""
    rows, want = [msgs(*GOOD)], {}
    for raw, reason in BAD_ROWS:
        rows.append(raw)
        want[len(rows)] = reason
        rows.append(msgs(("user", W[1]), ("assistant", W[2])))
    rows.append("   ")
    rows.append(msgs(*GOOD))
    return write_jsonl(tmp_path / "in.jsonl", rows), want


def test_bad_rows_counted_and_written_with_line_numbers(model_dir, tmp_path):
    path, want = bad_file(tmp_path)
    report = prepare_dataset(model_dir, path, str(tmp_path / "out"), max_length=20, progress=False)
    assert report.num_rejected == len(BAD_ROWS) and report.num_samples == len(BAD_ROWS) + 2
    assert report.num_rows == 2 * len(BAD_ROWS) + 2  # the blank line is not a row
    assert sum(report.rejects_by_reason.values()) == len(BAD_ROWS)
    with open(report.rejects_path) as f:
        rejects = [json.loads(line) for line in f]
    assert {r["line"]: r["reason"] for r in rejects} == want
    by_line = {r["line"]: r for r in rejects}
    assert by_line[1 + 1]["raw"] == '{"messages": ['
    assert "line 1" not in by_line[4]["detail"] and "messages[1].role='robot'" in by_line[8]["detail"]
    assert os.path.dirname(report.rejects_path) == str(tmp_path / "out")


def test_strict_stops_at_the_first_bad_row(model_dir, tmp_path):
    path, want = bad_file(tmp_path)
    first = min(want)
    with pytest.raises(DataError, match=rf"in\.jsonl:{first}: {want[first]}: .*strict"):
        prepare_dataset(model_dir, path, str(tmp_path / "out"), strict=True, progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]  # no output, no partial


def test_truncation_keeps_the_head(tok, model_dir, tmp_path):
    ids, mask = chatml(tok, GOOD)
    report = prepare_dataset(model_dir, write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)]), str(tmp_path / "out"),
                             max_length=18, progress=False)
    assert report.num_truncated == 1 and report.num_samples == 1
    # system (6 tokens) + user (7) + assistant header (3) + the first two assistant words
    assert samples(tmp_path / "out") == [(ids[:18], mask[:18])]
    assert mask[16:18] == [1, 1] and sum(mask[:18]) == 2
    assert TokenDataset(str(tmp_path / "out")).meta["max_length"] == 18


def test_on_long_reject(model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD), msgs(("user", W[1]), ("assistant", W[2]))])
    report = prepare_dataset(model_dir, path, str(tmp_path / "out"), max_length=16, on_long="reject",
                             progress=False)
    assert report.rejects_by_reason == {"too_long": 1} and report.num_samples == 1
    with open(report.rejects_path) as f:
        assert "max_length 16 (on_long=reject)" in json.loads(f.readline())["detail"]


def test_last_turn_only(tok, model_dir, tmp_path):
    ids, mask = chatml(tok, GOOD, trained_turns={4})
    pre_ids, pre_mask = chatml(tok, GOOD)
    rows = [msgs(*GOOD), {"input_ids": pre_ids, "loss_mask": pre_mask}]
    prepare_dataset(model_dir, write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out"),
                    last_turn_only=True, progress=False)
    assert samples(tmp_path / "out") == [(ids, mask), (ids, mask)]


def test_interrupted_prepare_leaves_the_previous_dataset(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    prepare_dataset(model_dir, write_jsonl(tmp_path / "old.jsonl", [msgs(*GOOD)]), str(out), progress=False)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}
    real = prepare_mod.RowEncoder.encode_row

    def dies_at_line_5(self, row):
        if row.line == 5:
            raise KeyboardInterrupt  # Ctrl-C mid-way
        return real(self, row)

    monkeypatch.setattr(prepare_mod.RowEncoder, "encode_row", dies_at_line_5)
    path = write_jsonl(tmp_path / "new.jsonl", [msgs(*GOOD)] * 200)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(model_dir, path, str(out), overwrite=True, progress=False)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert sorted(os.listdir(tmp_path)) == ["new.jsonl", "old.jsonl", "out"]
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(model_dir, path, str(tmp_path / "fresh"), progress=False)
    assert not (tmp_path / "fresh").exists()
    assert not [n for n in os.listdir(tmp_path) if "partial" in n]


def test_workers_give_byte_identical_output(model_dir, tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(300):  # several chunks of CHUNK_LINES, some bad rows among them
        if i % 37 == 5:
            rows.append('{"broken')
            continue
        n_turns = int(rng.integers(1, 4))
        turns = []
        for _ in range(n_turns):
            turns.append(("user", " ".join(W[k] for k in rng.integers(0, 1000, rng.integers(1, 30)))))
            turns.append(("assistant", " ".join(W[k] for k in rng.integers(0, 1000, rng.integers(1, 30)))))
        rows.append(msgs(*turns))
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    r1 = prepare_dataset(model_dir, path, str(tmp_path / "w1"), max_length=64, progress=False)
    r2 = prepare_dataset(model_dir, path, str(tmp_path / "w2"), max_length=64, num_workers=2, progress=False)
    assert r1.num_rows == 300 and r1.num_truncated > 0 and r1.num_rejected == r2.num_rejected > 0
    for name in ("tokens.bin", "loss_mask.bin", "index.npy", "rejects.jsonl"):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    m1, m2 = (json.loads((tmp_path / d / "meta.json").read_text()) for d in ("w1", "w2"))
    m1.pop("created_at"), m2.pop("created_at")
    assert m1 == m2
    # strict with workers still names the first bad line in file order (i=5 -> line 6)
    with pytest.raises(DataError, match=r"in\.jsonl:6: malformed_json"):
        prepare_dataset(model_dir, path, str(tmp_path / "w3"), num_workers=2, strict=True, progress=False)
    assert not (tmp_path / "w3").exists()


def test_no_usable_rows(model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ['{"x', msgs(("user", W[1]))])
    with pytest.raises(DataError, match=r"no usable rows .*line 1: malformed_json"):
        prepare_dataset(model_dir, path, str(tmp_path / "out"), progress=False)
    assert os.listdir(tmp_path) == ["in.jsonl"]


def test_existing_output_and_bad_options(model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)])
    prepare_dataset(model_dir, path, str(tmp_path / "out"), progress=False)
    with pytest.raises(DataError, match="already exists"):
        prepare_dataset(model_dir, path, str(tmp_path / "out"), progress=False)
    with pytest.raises(ConfigError, match=r"on_long='cut'; allowed: \['truncate', 'reject'\]"):
        prepare_dataset(model_dir, path, str(tmp_path / "o2"), on_long="cut")
    with pytest.raises(DataError, match="no such input file"):
        prepare_dataset(model_dir, str(tmp_path / "missing.jsonl"), str(tmp_path / "o3"))


def test_progress_reports_rate(model_dir, tmp_path, capsys):
    path = write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)] * 3)
    report = prepare_dataset(model_dir, path, str(tmp_path / "out"), progress=True)
    err = capsys.readouterr().err
    assert "100.0% 3 rows, 3 samples, 0 rejected" in err and "samples/s" in err
    assert report.samples_per_s > 0 and report.seconds > 0


# --- hostile and broken input: every row isolated, clear messages ---------------------
def test_hostile_rows_are_rejects_with_their_line(model_dir, tmp_path):
    rows = ["[" * 100_000, '{"messages": [{"role": "user", "content": ' + "9" * 5000 + "}]}",
            msgs(("user", W[1]), ("assistant", W[2]))]
    report = prepare_dataset(model_dir, write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out"), progress=False)
    assert report.num_samples == 1 and report.rejects_by_reason == {"malformed_json": 2}
    with open(report.rejects_path) as f:
        rejects = [json.loads(line) for line in f]
    assert [(r["index"], r["line"]) for r in rejects] == [(0, 1), (1, 2)]
    assert "recursion limit" in rejects[0]["detail"] and "digits" in rejects[1]["detail"]


def test_an_unexpected_error_on_a_row_is_that_rows_reject(model_dir, tmp_path, monkeypatch):
    from dflash_ipc.data import chat

    real = chat.ChatEncoder.encode

    def breaks_on_w7(self, conv, **kw):
        if any(m["content"] == W[7] for m in conv.messages):
            raise ZeroDivisionError("a bug triggered by one row")
        return real(self, conv, **kw)

    monkeypatch.setattr(chat.ChatEncoder, "encode", breaks_on_w7)
    rows = [msgs(("user", W[1]), ("assistant", W[2])), msgs(("user", W[7]), ("assistant", W[2])), msgs(*GOOD)]
    report = prepare_dataset(model_dir, write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "out"), progress=False)
    assert report.num_samples == 2 and report.rejects_by_reason == {"row_error": 1}
    with open(report.rejects_path) as f:
        record = json.loads(f.readline())
    assert record["line"] == 2 and record["detail"] == "ZeroDivisionError: a bug triggered by one row"


def test_unwritable_output_folder_is_a_clear_error(model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)])
    (tmp_path / "afile").write_text("")
    with pytest.raises(DataError, match=r"afile/out: cannot write the dataset there \(Not a directory"):
        prepare_dataset(model_dir, path, str(tmp_path / "afile" / "out"), progress=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_output_folder_is_a_clear_error(model_dir, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)])
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(DataError, match=r"cannot write the dataset there \(Permission denied"):
        prepare_dataset(model_dir, path, str(ro / "out"), progress=False)


def test_empty_input_and_missing_model_folder(model_dir, tmp_path):
    with pytest.raises(DataError, match=r"^/dev/null: the input is empty \(no rows\)$"):
        prepare_dataset(model_dir, "/dev/null", str(tmp_path / "out"), progress=False)
    path = write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)])
    with pytest.raises(DataError, match=r"no-such-model: no such model directory") as e:
        prepare_dataset(str(tmp_path / "no-such-model"), path, str(tmp_path / "out"), progress=False)
    assert "Repo id" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_truncations_and_duplicates_are_in_the_summary(model_dir, tmp_path):
    rows = [msgs(*GOOD), msgs(("user", W[1]), ("assistant", " ".join(W[:40]))), msgs(*GOOD)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    report = prepare_dataset(model_dir, path, str(tmp_path / "out"), max_length=40, progress=False)
    assert (report.num_samples, report.num_truncated, report.num_duplicates) == (3, 1, 1)
    assert "1 truncated, 1 duplicates" in report.summary()
    source = TokenDataset(str(tmp_path / "out")).meta["source"]
    assert (source["num_truncated"], source["num_duplicates"]) == (1, 1)
    report = prepare_dataset(model_dir, path, str(tmp_path / "dedup"), max_length=40, dedup=True, progress=False)
    assert report.num_samples == 2 and report.rejects_by_reason == {"duplicate": 1}
    with open(report.rejects_path) as f:
        assert json.loads(f.readline())["detail"] == "the same tokens as row 0 (--dedup)"


def test_a_ten_megabyte_line_takes_memory_in_proportion(tok, model_dir, tmp_path):
    """The head of a long sample is tokenized, not all of it (a full token list with offsets
    took ~135x the line)."""
    import tracemalloc

    reply = " ".join(W[i % 1000] for i in range(2_000_000))  # ~10 MB
    path = write_jsonl(tmp_path / "big.jsonl", [msgs(("user", W[1]), ("assistant", reply))])
    size = os.path.getsize(path)
    tracemalloc.start()
    try:
        report = prepare_dataset(model_dir, path, str(tmp_path / "out"), max_length=4096, progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert report.num_samples == 1 and report.num_truncated == 1
    assert peak < 12 * size, f"peak {peak / 1e6:.0f} MB for a {size / 1e6:.0f} MB line"
    ids, mask = samples(tmp_path / "out")[0]
    want_ids, want_mask = chatml(tok, [("user", W[1]), ("assistant", " ".join(W[i % 1000] for i in range(5000)))])
    assert (ids, mask) == (want_ids[:4096], want_mask[:4096])


def test_pretty_printed_json_array_is_read_like_jsonl(model_dir, tmp_path):
    rows = [msgs(*GOOD), msgs(("user", W[1]), ("assistant", W[2]))]
    prepare_dataset(model_dir, write_jsonl(tmp_path / "in.jsonl", rows), str(tmp_path / "a"), progress=False)
    (tmp_path / "in.json").write_text(json.dumps(rows, indent=2))
    report = prepare_dataset(model_dir, str(tmp_path / "in.json"), str(tmp_path / "b"), progress=False)
    assert report.num_rejected == 0 and samples(tmp_path / "a") == samples(tmp_path / "b")


# --- what used to be lost silently: said with a count ---------------------------------
def test_a_directory_input_skips_regenerates_side_files_and_says_so_once(model_dir, tmp_path, capsys):
    """A directory holding regenerate's output also holds its `.rejects.jsonl` and `.state.json`:
    they were read as data (86 rows instead of 77, 9 bogus rejects); now skipped and counted."""
    from click.testing import CliRunner
    from dflash_ipc.cli import main
    data = tmp_path / "regen"
    data.mkdir()
    write_jsonl(data / "chats.jsonl", [msgs(*GOOD)] * 4)
    write_jsonl(data / "chats.rejects.jsonl", [{"index": 9, "where": "x:10", "reason": "generation_error"}] * 2)
    (data / "chats.state.json").write_text(json.dumps({"format": 1, "complete": True, "num_rows": 6}))
    report = prepare_dataset(model_dir, str(data), str(tmp_path / "out"), progress=False)
    assert (report.num_rows, report.num_rejected) == (4, 0)
    assert report.warnings == [f"{data}: skipped 2 side files of regenerate (*.rejects.jsonl, *.state.json), "
                               "not read as data: chats.rejects.jsonl, chats.state.json"]
    result = CliRunner().invoke(main, ["prepare", "--model", model_dir, "--input", str(data),
                                       "--out", str(tmp_path / "out2")])
    assert result.exit_code == 0, result.output
    assert result.output.count("skipped 2 side files of regenerate") == 1


def test_a_tokenizer_that_maps_much_of_the_text_to_unk_is_warned_about_with_the_share(tok, model_dir, tmp_path):
    known = msgs(("user", f"{W[1]} {W[2]}"), ("assistant", f"{W[3]} {W[4]}"))
    turns = [("user", "bonjour tout le monde"), ("assistant", "merci beaucoup mes amis")]
    foreign = msgs(*turns)
    fine = prepare_dataset(model_dir, write_jsonl(tmp_path / "a.jsonl", [known] * 3), str(tmp_path / "a"),
                           progress=False)
    assert fine.unk_share == 0.0 and fine.warnings == []
    bad = prepare_dataset(model_dir, write_jsonl(tmp_path / "b.jsonl", [foreign] * 3), str(tmp_path / "b"),
                          progress=False)
    ids, _ = chatml(tok, turns)  # the ChatML written out by hand: every French word is <|unk|>
    assert ids.count(tok.unk_token_id) == 8 and bad.unk_share == pytest.approx(8 / len(ids))
    assert len(bad.warnings) == 1 and bad.warnings[0].startswith(
        f"{800 / len(ids):.1f}% of the {3 * len(ids)} tokens are the tokenizer's unknown token '<|unk|>' (above 5%)")


def test_prepare_progress_shows_an_eta(model_dir, tmp_path):
    from dflash_ipc.data.prepare import _progress_line
    from dflash_ipc.data.reader import InputSource

    class Bar:
        elapsed_s = 10.0

    class Sink:
        num_samples, num_rejected = 30, 0

    source = InputSource(write_jsonl(tmp_path / "in.jsonl", [msgs(*GOOD)] * 4))
    source.bytes_read, source.num_rows = source.total_bytes // 4, 1  # a quarter in 10 s: 30 s to go
    assert _progress_line(source, Sink(), Bar()).endswith("3 samples/s, ETA 30s")
    source.total_bytes = 0  # a datasets directory: by rows
    source.num_rows = 20
    assert _progress_line(source, Sink(), Bar(), total_rows=80).endswith(", ETA 30s")
    assert "ETA" not in _progress_line(source, Sink(), Bar())  # a pipe: nothing to estimate
