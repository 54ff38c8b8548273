"""decode/rows_configs.py: the few-row kernel's configs from a table file, a built-in table or the rule.

On CPU: the order of the sources, ``rule``, the built-in table chosen by the device's name, a
table written by the sweep's writer read back, a changed file read again, and each kind of bad
table refused with an error that names the file, the entry and the field. On CUDA (marked gpu):
the kernel at configs of the wide sweep's corners against fp32, and a table's config taken by
the kernel as if it were passed."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from dflash_ipc.decode import matvec, rows_configs
from dflash_ipc.decode.rows_configs import ROWS_CONFIGS_ENV, parse_table, rows_config, rule_config, table_document
from dflash_ipc.errors import ConfigError

cuda = pytest.mark.skipif(not (torch.cuda.is_available() and matvec.available()), reason="needs CUDA and Triton")

DEEP = dict(BLOCK_N=16, BLOCK_K=512, SPLIT=2, num_warps=4, num_stages=6)
WIDE = dict(BLOCK_N=128, BLOCK_K=128, SPLIT=8, num_warps=8, num_stages=3)
GATE_UP = dict(BLOCK_N=64, BLOCK_K=128, SPLIT=1, num_warps=4, num_stages=3)


def write_table(path, winners, device="NVIDIA H100 80GB HBM3"):
    path.write_text(json.dumps(table_document(device, 16, winners)))
    return str(path)


@pytest.fixture(autouse=True)
def no_setting(monkeypatch):
    monkeypatch.delenv(ROWS_CONFIGS_ENV, raising=False)


def test_a_table_file_comes_first_for_its_weights_and_the_rule_serves_the_rest(tmp_path, monkeypatch):
    path = write_table(tmp_path / "t.json", {(2048, 6144, False): (DEEP, 7.5), (12288, 2048, True): (GATE_UP, 15.0)})
    monkeypatch.setenv(ROWS_CONFIGS_ENV, path)
    assert rows_config(2048, 6144) == DEEP
    assert rows_config(12288, 2048, glu=True) == GATE_UP
    assert rows_config(2048, 4096, glu=True)["SPLIT"] == 1  # the rule would split 2,048 rows; silu * up does not
    assert rows_config(12288, 2048) == rule_config(12288, 2048)  # the same weight without silu * up: not in it
    assert rows_config(4096, 2048) == rule_config(4096, 2048)
    rows_config(2048, 6144)["SPLIT"] = 99  # a copy: the cached table is not changed through it
    assert rows_config(2048, 6144) == DEEP
    monkeypatch.setenv(ROWS_CONFIGS_ENV, "rule")
    assert rows_config(2048, 6144) == rule_config(2048, 6144)


def test_the_built_in_table_is_chosen_by_the_device_name_and_a_file_overrides_it(tmp_path, monkeypatch):
    monkeypatch.setattr(rows_configs, "TUNED", {"H100": {(2048, 2048, False): DEEP}})
    assert rows_config(2048, 2048, device_name="NVIDIA H100 80GB HBM3") == DEEP
    assert rows_config(2048, 2048, device_name="NVIDIA H200") == rule_config(2048, 2048)
    assert rows_config(2048, 2048) == rule_config(2048, 2048)
    monkeypatch.setenv(ROWS_CONFIGS_ENV, "rule")
    assert rows_config(2048, 2048, device_name="NVIDIA H100 80GB HBM3") == rule_config(2048, 2048)
    monkeypatch.setenv(ROWS_CONFIGS_ENV, write_table(tmp_path / "t.json", {(2048, 2048, False): (WIDE, 3.0)}))
    assert rows_config(2048, 2048, device_name="NVIDIA H100 80GB HBM3") == WIDE
    monkeypatch.setenv(ROWS_CONFIGS_ENV, "auto")
    assert rows_config(2048, 2048, device_name="NVIDIA H100 80GB HBM3") == DEEP


def test_the_rule_splits_k_only_for_weights_of_few_row_blocks():
    assert rule_config(2048, 6144) == dict(BLOCK_N=64, BLOCK_K=128, SPLIT=4, num_warps=4, num_stages=4)
    assert rule_config(4096, 2048)["SPLIT"] == 1 and rule_config(4096, 2048)["BLOCK_K"] == 256
    with pytest.raises(ValueError, match="a weight of 0 rows"):
        rule_config(0, 2048)


def test_a_changed_file_is_read_again(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    monkeypatch.setenv(ROWS_CONFIGS_ENV, write_table(path, {(2048, 2048, False): (DEEP, 3.0)}))
    assert rows_config(2048, 2048) == DEEP
    doc = table_document("NVIDIA H100", 16, {(2048, 2048, False): (WIDE, 2.0)})
    path.write_text(json.dumps(doc, indent=2))  # longer text: another size, and a later time where it has one
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert rows_config(2048, 2048) == WIDE


def test_the_writers_document_reads_back_with_the_sweeps_times_kept():
    doc = table_document("NVIDIA H100", 16, {(2048, 6144, False): (DEEP, 7.5123), (12288, 2048, True): (GATE_UP, 15.0)})
    assert doc["configs"][0] == {"n": 2048, "k": 6144, "glu": False, "config": DEEP, "us": 7.512}
    assert parse_table(json.loads(json.dumps(doc))) == {(2048, 6144, False): DEEP, (12288, 2048, True): GATE_UP}


def entry(**fields):
    base = {"n": 2048, "k": 2048, "glu": False, "config": dict(DEEP)}
    base.update(fields)
    return base


def document(*entries, **fields):
    doc = {"format": rows_configs.TABLE_FORMAT, "version": 1, "device": "x", "rows": 16, "configs": list(entries)}
    doc.update(fields)
    return doc


@pytest.mark.parametrize("doc,message", [
    ([], "not a rows configs table"),
    (document(format="other"), "not a rows configs table"),
    (document(extra=1), r"unknown field\(s\) \['extra'\]"),
    (document(version=2), "version 2; allowed: 1"),
    (document(configs={}), "configs must be a list"),
    (document(5), r"configs\[0\]: an entry must be an object"),
    (document(entry(), entry(us=1.0, speed=3)), r"configs\[1\]: unknown field\(s\) \['speed'\]"),
    (document({"n": 2048, "k": 2048, "config": DEEP}), r"configs\[0\]: .*missing \['glu'\]"),
    (document(entry(n=0)), r"configs\[0\]\.n = 0; allowed: an integer >= 1"),
    (document(entry(k="2048")), r"configs\[0\]\.k = '2048'"),
    (document(entry(glu=1)), r"configs\[0\]\.glu = 1; allowed: true or false"),
    (document(entry(n=2049, glu=True)), "even count"),
    (document(entry(), entry()), r"configs\[1\]: a second entry for n=2048, k=2048, glu=False"),
    (document(entry(config={**DEEP, "BLOCK_N": 48})), r"configs\[0\]\.config\.BLOCK_N = 48; allowed: \[16, 32"),
    (document(entry(config={**DEEP, "SPLIT": 0})), r"config\.SPLIT = 0; allowed: 1\.\.64"),
    (document(entry(config={**DEEP, "num_stages": True})), r"config\.num_stages = True; allowed: 1\.\.10"),
    (document(entry(config={"BLOCK_N": 16})), r"config: fields \['BLOCK_N'\]; want exactly"),
    (document(version=True), "version True; allowed: 1"),
    (document(device=7), "device 7; allowed: the GPU's name"),
    (document(rows=17), "rows 17; allowed: the rows swept, 1..16"),
    (document(entry(us="fast")), r"configs\[0\]\.us = 'fast'; allowed: the microseconds swept"),
    (document(entry(n=12288, glu=True)), r"config\.SPLIT = 2: silu \* up runs unsplit; allowed: 1"),
    (document(entry(config=dict(BLOCK_N=256, BLOCK_K=1024, SPLIT=1, num_warps=8, num_stages=10))),
     r"config: 5570560 bytes of shared memory a program .* allowed: at most 232448"),
])
def test_a_bad_table_is_refused_with_the_file_entry_and_field_named(tmp_path, monkeypatch, doc, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    monkeypatch.setenv(ROWS_CONFIGS_ENV, str(path))
    with pytest.raises(ConfigError, match=message) as err:
        rows_config(2048, 2048)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text,message", [
    ('{"format": "dflash-ipc rows configs", "version": 1, "version": 1, "configs": []}',
     r"the key\(s\) \['version'\] twice in one object"),
    ('{"format": "dflash-ipc rows configs", "version": 1, "configs": [{"n": ' + "9" * 5000 + "}]}",
     "cannot be read as a rows configs table"),
    ("[" * 100000 + "]" * 100000, "cannot be read as a rows configs table"),
])
def test_a_file_json_cannot_hold_as_a_table_is_refused_by_name(tmp_path, monkeypatch, text, message):
    path = tmp_path / "odd.json"
    path.write_text(text)
    monkeypatch.setenv(ROWS_CONFIGS_ENV, str(path))
    with pytest.raises(ConfigError, match=message):
        rows_configs.check_setting()


def test_an_unchanged_file_is_read_once_and_the_setting_is_checked_where_a_decoder_is_built(tmp_path, monkeypatch):
    path = write_table(tmp_path / "t.json", {(2048, 2048, False): (DEEP, 3.0)})
    monkeypatch.setenv(ROWS_CONFIGS_ENV, path)
    rows_configs._read_table.cache_clear()
    for _ in range(5):
        assert rows_config(2048, 2048) == DEEP
    assert rows_configs._read_table.cache_info().misses == 1
    rows_configs.check_setting()  # a good table passes; route_matvec calls this before the target decodes
    monkeypatch.setenv(ROWS_CONFIGS_ENV, str(tmp_path / "gone.json"))
    with pytest.raises(ConfigError, match="gone.json"):
        matvec.route_matvec(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    monkeypatch.setenv(ROWS_CONFIGS_ENV, "rule")
    rows_configs.check_setting()


def test_a_mig_slice_keeps_the_rule(monkeypatch):
    monkeypatch.setattr(rows_configs, "TUNED", {"NVIDIA H100 80GB HBM3": {(2048, 2048, False): DEEP}})
    assert rows_config(2048, 2048, device_name="NVIDIA H100 80GB HBM3 MIG 1g.10gb") == rule_config(2048, 2048)


def test_a_missing_or_unparsable_file_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv(ROWS_CONFIGS_ENV, str(tmp_path / "none.json"))
    with pytest.raises(ConfigError, match=r"DFLASH_DECODE_ROWS_CONFIGS=.*none\.json.*allowed: 'auto', 'rule'"):
        rows_config(2048, 2048)
    path = tmp_path / "broken.json"
    path.write_text('{"format": "dflash-ipc rows configs",\n "configs": [}')
    monkeypatch.setenv(ROWS_CONFIGS_ENV, str(path))
    with pytest.raises(ConfigError, match=r"broken\.json: line 2, column \d+: not JSON"):
        rows_config(2048, 2048)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("config,glu", [(DEEP, False), (WIDE, False),
                                        (dict(BLOCK_N=16, BLOCK_K=256, SPLIT=1, num_warps=4, num_stages=4), True),
                                        (dict(BLOCK_N=32, BLOCK_K=256, SPLIT=1, num_warps=4, num_stages=8), False)])
def test_the_kernel_at_the_wide_sweeps_corners_matches_fp32_and_takes_a_tables_config(tmp_path, monkeypatch,
                                                                                        config, glu):
    torch.manual_seed(0)
    dev = "cuda:0"
    n, k = (12288, 2048) if glu else (2048, 6144)
    x = torch.randn(16, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    got = matvec.triton_rows(x, w, config=config, glu=glu)
    full = F.linear(x.float(), w.float())
    if glu:
        gate, up = full[:, :n // 2].bfloat16().float(), full[:, n // 2:].bfloat16().float()
        want = F.silu(gate).bfloat16().float() * up
    else:
        want = full
    assert torch.allclose(got.float(), want, rtol=2 ** -6, atol=2 ** -6 * float(want.abs().max()))
    monkeypatch.setenv(ROWS_CONFIGS_ENV, write_table(tmp_path / "t.json", {(n, k, glu): (config, 1.0)}))
    assert torch.equal(matvec.triton_rows(x, w, glu=glu), got)  # the table's config, the same sums


def test_every_built_in_table_is_valid_and_keyed_by_a_whole_device_name():
    for name, table in rows_configs.TUNED.items():
        assert name.startswith("NVIDIA ") and table
        doc = table_document(name, 16, {key: (cfg, 1.0) for key, cfg in table.items()})
        assert parse_table(json.loads(json.dumps(doc))) == table  # what a table file would hold, checked
        assert rows_config(*next(iter(table))[:2], glu=next(iter(table))[2], device_name=name) == next(
            iter(table.values()))


def test_the_sweep_reads_a_models_config_and_keeps_splits_and_tiles_where_they_can_pay(tmp_path):
    from benchmarks import matvec as bench
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {
        "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
        "num_hidden_layers": 30, "vocab_size": 49152}}))
    shapes = bench.layer_shapes(str(tmp_path))
    assert shapes["qkv"] == (576 + 2 * 192, 576) and shapes["gate_up"] == (3072, 576) and shapes["head"] == (49152, 576)
    assert bench.layer_shapes("qwen3-1.7b")["fc"] == (2048, 5 * 2048)  # bench eval's drafter reads 5 layers
    (tmp_path / "bad.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit, match="bad.json: no integer intermediate_size"):
        bench.layer_shapes(str(tmp_path / "bad.json"))
    split = dict(DEEP, SPLIT=2)
    assert bench.useful(split, 2048) and not bench.useful(split, 151936)  # the head's blocks fill the GPU
    assert not bench.useful(split, 12288, glu=True)  # silu * up runs unsplit
    assert not bench.useful(dict(DEEP, SPLIT=1), 12288, glu=True)  # gate and up tiles overflow shared memory
    assert all(bench.useful(c, 2048) for c in bench.GRID)  # the one-row kernel's grid has no splits
    assert bench.products({"o": (8, 8), "down": (8, 16)}, "only") == [("o", 8, 8, False), ("down", 8, 16, True)]
