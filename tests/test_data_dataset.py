"""TokenDataset / DatasetWriter: round trip, completeness, refusal of foreign or partial data."""

import copy
import json
import os

import numpy as np
import pytest

from dflash_ipc.data.dataset import (
    FORMAT_VERSION,
    DatasetWriter,
    TokenDataset,
    dataset_is_complete,
    length_histogram,
    tokenizer_fingerprint,
)
from dflash_ipc.builtin.tiny import build_tiny_tokenizer
from dflash_ipc.errors import DataError


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def random_samples(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(1, 300))
        out.append((rng.integers(0, 1000, length).astype(np.int32), rng.random(length) < 0.5))
    return out


def write(path, samples, fp="sha256:test", **kw):
    w = DatasetWriter(str(path), tokenizer_fingerprint=fp, **kw)
    for ids, mask in samples:
        w.add(ids, mask)
    return w.close()


def test_round_trip(tmp_path):
    samples = random_samples(50)
    meta = write(tmp_path / "ds", samples, max_length=300, source={"input": "x.jsonl"})
    ds = TokenDataset(str(tmp_path / "ds"))
    assert len(ds) == 50 and ds.lengths.dtype == np.int32
    assert ds.lengths.tolist() == [len(ids) for ids, _ in samples]
    for i, (ids, mask) in enumerate(samples):
        got_ids, got_mask = ds.sample(i)
        assert got_ids.dtype == np.int32 and got_mask.dtype == np.bool_
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_mask, mask)
    assert meta == ds.meta
    assert meta["format_version"] == FORMAT_VERSION and meta["complete"] is True
    assert meta["num_tokens"] == sum(len(i) for i, _ in samples)
    assert meta["num_loss_tokens"] == sum(int(m.sum()) for _, m in samples)
    assert meta["max_length"] == 300 and meta["max_sample_length"] == max(len(i) for i, _ in samples)
    assert sum(meta["length_histogram"]["counts"]) == 50
    assert sorted(os.listdir(tmp_path)) == ["ds"]  # no partial left behind
    with pytest.raises(IndexError):
        ds.sample(50)


def test_samples_are_writable_copies(tmp_path):
    write(tmp_path / "ds", random_samples(3))
    ids, mask = TokenDataset(str(tmp_path / "ds")).sample(0)
    ids[0] = -1  # must not raise (read-only memmap) and must not change the file
    assert TokenDataset(str(tmp_path / "ds")).sample(0)[0][0] != -1


def test_pickles_as_its_path(tmp_path):
    import pickle

    write(tmp_path / "ds", random_samples(20))
    ds = TokenDataset(str(tmp_path / "ds"))
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # the path, not the tokens
    again = pickle.loads(blob)
    np.testing.assert_array_equal(again.sample(7)[0], ds.sample(7)[0])


def test_length_histogram():
    h = length_histogram(np.array([1, 2, 3, 4, 7, 8, 100]))
    assert h["edges"][:5] == [1, 2, 4, 8, 16]
    assert h["counts"][:4] == [1, 2, 2, 1]  # [1,2): 1  [2,4): 2,3  [4,8): 4,7  [8,16): 8
    assert sum(h["counts"]) == 7


def test_abort_and_exception_leave_nothing(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(RuntimeError):
        with DatasetWriter(str(out), tokenizer_fingerprint="x") as w:
            w.add([1, 2], [1, 1])
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_partial_directory_is_refused(tmp_path):
    w = DatasetWriter(str(tmp_path / "ds"), tokenizer_fingerprint="x")
    w.add([1, 2, 3], [0, 1, 1])
    # The process "dies" here: only "<out>.partial-<pid>" exists.
    assert not (tmp_path / "ds").exists()
    with pytest.raises(DataError, match="meta.json: missing"):
        TokenDataset(w.partial_dir)
    assert not dataset_is_complete(w.partial_dir)
    w.abort()


def test_existing_output_needs_overwrite(tmp_path):
    out = tmp_path / "ds"
    write(out, random_samples(2, seed=1))
    with pytest.raises(DataError, match="already exists; --overwrite"):
        DatasetWriter(str(out), tokenizer_fingerprint="x")
    write(out, random_samples(3, seed=2), overwrite=True)
    assert len(TokenDataset(str(out))) == 3
    assert sorted(os.listdir(tmp_path)) == ["ds"]


def test_never_replaces_a_foreign_directory(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "important.txt").write_text("keep me")
    with pytest.raises(DataError, match="holds no meta.json; refusing"):
        DatasetWriter(str(tmp_path / "notes"), tokenizer_fingerprint="x", overwrite=True)
    assert (tmp_path / "notes" / "important.txt").read_text() == "keep me"
    (tmp_path / "empty").mkdir()  # an empty directory made beforehand is fine
    write(tmp_path / "empty", random_samples(1))
    assert dataset_is_complete(str(tmp_path / "empty"))


@pytest.mark.parametrize(
    "damage, match",
    [
        (lambda d: os.remove(d / "meta.json"), "meta.json: missing"),
        (lambda d: (d / "meta.json").write_text("{oops"), "is not valid JSON \\(line 1"),
        (lambda d: _edit_meta(d, format_version=FORMAT_VERSION + 1), "format_version=2, this code reads 1"),
        (lambda d: _edit_meta(d, complete=False), "complete is not true"),
        (lambda d: _truncate(d / "tokens.bin"), "tokens.bin: .* bytes, meta.json implies"),
        (lambda d: os.remove(d / "loss_mask.bin"), "loss_mask.bin: missing"),
    ],
)
def test_damaged_dataset_is_refused_with_the_file_named(tmp_path, damage, match):
    write(tmp_path / "ds", random_samples(4))
    damage(tmp_path / "ds")
    with pytest.raises(DataError, match=match):
        TokenDataset(str(tmp_path / "ds"))


def test_a_crafted_held_out_list_is_a_clear_error():
    from dflash_ipc.data.held_out import held_out_prompts_of
    assert held_out_prompts_of({"extra": {"held_out": [{"sample_id": 3, "prompt_ids": [1, 2]}]}})[0][0] == 3
    for held in ([{"sample_id": 1}], [7], "xy", [{"sample_id": "1", "prompt_ids": [1]}],
                 [{"sample_id": 1, "prompt_ids": [[1]]}], [{"sample_id": 1, "prompt_ids": ["a"]}]):
        with pytest.raises(DataError, match="ds/meta.json: extra.held_out must be a list"):
            held_out_prompts_of({"extra": {"held_out": held}}, "ds/meta.json")


def _index(d, array, **kw):
    np.save(d / "index.npy", array, **kw)


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "meta.json").write_text("[1, 2]"), "meta.json: dataset metadata is not a JSON object"),
    (lambda d: (d / "meta.json").write_text("[" * 100_000), "nested deeper than the parser's recursion limit"),
    (lambda d: (d / "meta.json").write_bytes(b'{"a": "\xff"}'), "meta.json: dataset metadata is not UTF-8"),
    (lambda d: (d / "meta.json").write_text('{"n": ' + "9" * 5000 + "}"), "meta.json: dataset metadata unreadable"),
    (lambda d: (d / "meta.json").write_text('{"n": NaN}'), "NaN is not a JSON number"),
    (lambda d: _edit_meta(d, num_samples="4"), "field num_samples must be an integer >= 0, got '4'"),
    (lambda d: _edit_meta(d, num_samples=None), "field num_samples must be an integer"),
    (lambda d: _edit_meta(d, num_tokens=-4), "field num_tokens must be an integer >= 0"),
    (lambda d: _edit_meta(d, tokenizer_fingerprint=7), "field tokenizer_fingerprint must be a string"),
    (lambda d: _edit_meta(d, source=[]), "field source must be an object"),
    (lambda d: _index(d, np.array([[-10, 5]] * 4)), r"sample 0 spans tokens \[-10, \+5\), outside"),
    (lambda d: _index(d, np.array([[0, 5], [10**9, 5], [0, 5], [0, 5]])), "sample 1 spans tokens"),
    (lambda d: _index(d, np.array([[0, 5], [5, 0], [0, 5], [0, 5]])), r"sample 1 spans tokens \[5, \+0\)"),
    (lambda d: _index(d, np.array([[0, 5]] * 3)), r"int64 \(3, 2\), meta.json says int64 \(4, 2\)"),
    (lambda d: _index(d, np.array([[0.0, 5.5]] * 4)), "index.npy: float64"),
    (lambda d: _index(d, np.array([[{}, 1]] * 4, dtype=object), allow_pickle=True), "Python objects or a pickle, never loaded"),
    (lambda d: (d / "index.npy").write_text("state,target\n"), "index.npy: cannot read index"),
    (lambda d: os.remove(d / "index.npy"), "index.npy: missing"),
])
def test_hostile_dataset_files_are_one_line_errors_never_misread(tmp_path, damage, match):
    """Every file of a dataset directory may be damaged or crafted: each way is one line naming
    the file and field, never a traceback, a pickle load, or samples read from the wrong place."""
    write(tmp_path / "ds", random_samples(4))
    damage(tmp_path / "ds")
    with pytest.raises(DataError, match=match) as info:
        TokenDataset(str(tmp_path / "ds"))
    message = str(info.value)
    assert "\n" not in message and "allow_pickle" not in message and len(message) < 400


def _edit_meta(d, **kw):
    meta = json.loads((d / "meta.json").read_text())
    meta.update(kw)
    (d / "meta.json").write_text(json.dumps(meta))


def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 4)


def test_missing_dataset(tmp_path):
    with pytest.raises(DataError, match="no such dataset directory"):
        TokenDataset(str(tmp_path / "nope"))


def test_empty_dataset_opens(tmp_path):
    write(tmp_path / "ds", [])
    ds = TokenDataset(str(tmp_path / "ds"))
    assert len(ds) == 0 and ds.lengths.shape == (0,)


def test_fingerprint_is_stable_and_sensitive(tok, tmp_path):
    fp = tokenizer_fingerprint(tok)
    assert fp == tokenizer_fingerprint(build_tiny_tokenizer())
    tok.save_pretrained(str(tmp_path / "tok"))
    from transformers import AutoTokenizer

    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(str(tmp_path / "tok"))) == fp
    other = copy.deepcopy(tok)
    other.chat_template = tok.chat_template + " "
    assert tokenizer_fingerprint(other) != fp
    assert tokenizer_fingerprint(build_tiny_tokenizer(with_generation_markers=True)) != fp
    more = copy.deepcopy(tok)
    more.add_tokens(["zzzz"])
    assert tokenizer_fingerprint(more) != fp


def test_check_tokenizer(tok, tmp_path):
    tok.save_pretrained(str(tmp_path / "target"))
    write(tmp_path / "ds", random_samples(2), fp=tokenizer_fingerprint(tok), source={"model_dir": "m"})
    ds = TokenDataset(str(tmp_path / "ds"))
    ds.check_tokenizer(str(tmp_path / "target"))  # same tokenizer: accepted
    ds.check_tokenizer(tok)
    other = build_tiny_tokenizer(with_generation_markers=True)
    other.save_pretrained(str(tmp_path / "other"))
    with pytest.raises(DataError) as e:
        ds.check_tokenizer(str(tmp_path / "other"))
    msg = str(e.value)
    assert ds.tokenizer_fingerprint in msg and tokenizer_fingerprint(other) in msg
    assert str(tmp_path / "other") in msg and "re-run `dflash-ipc prepare" in msg


def test_add_rejects_mismatched_shapes(tmp_path):
    with DatasetWriter(str(tmp_path / "ds"), tokenizer_fingerprint="x") as w:
        with pytest.raises(DataError, match="must be equal"):
            w.add([1, 2, 3], [1, 1])
        with pytest.raises(DataError, match="non-empty"):
            w.add([], [])
        w.close()


def test_token_ids_outside_the_vocabulary_are_found_in_one_pass(tmp_path, monkeypatch):
    from dflash_ipc.data import dataset as dataset_module
    monkeypatch.setattr(dataset_module, "_CHECK_CHUNK", 100)  # several chunks over the ~1,500 tokens
    samples = random_samples(10)
    write(tmp_path / "ok", samples)
    TokenDataset(str(tmp_path / "ok")).check_token_ids(1000)
    for bad in (2 ** 30, -5, 1000):
        damaged = copy.deepcopy(samples)
        damaged[7][0][3] = bad
        write(tmp_path / f"bad{bad}", damaged)
        ds = TokenDataset(str(tmp_path / f"bad{bad}"))
        at = int(ds.offsets[7]) + 3
        with pytest.raises(DataError, match=rf"tokens.bin: token {at} \(of sample 7\) is id {bad}, outside the "
                                            r"vocabulary of the target \[0, 1000\); .* re-run prepare"):
            ds.check_token_ids(1000)


@pytest.mark.timeout(10)
def test_a_dataset_file_that_is_a_fifo_or_a_device_is_refused_unread(tmp_path):
    from dflash_ipc.data.dataset import INDEX_FILE, TOKENS_FILE
    write(tmp_path / "d", random_samples(3))
    os.unlink(tmp_path / "d" / INDEX_FILE)
    os.mkfifo(tmp_path / "d" / INDEX_FILE)
    with pytest.raises(DataError, match="index.npy: the dataset index is a FIFO"):
        TokenDataset(str(tmp_path / "d"))
    write(tmp_path / "e", random_samples(3))
    os.unlink(tmp_path / "e" / TOKENS_FILE)
    os.symlink("/dev/zero", tmp_path / "e" / TOKENS_FILE)
    with pytest.raises(DataError, match="tokens.bin: a dataset file is a character device"):
        TokenDataset(str(tmp_path / "e"))
