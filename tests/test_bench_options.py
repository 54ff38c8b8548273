"""The bench commands refuse sizes, ranges, bounds and output paths that would crash or mislead
deep inside a run (or after it): one error line each, before any target is built."""

import os

import pytest
from click.testing import CliRunner

from dflash_ipc.cli import main

REGEN = ["bench", "regenerate", "--shape", "tiny", "--device", "cpu", "--prompts", "4", "--max-new-tokens", "8",
         "--min-prompt", "8", "--max-prompt", "16", "--one-at-a-time", "1"]
EVAL = ["bench", "eval", "--shape", "tiny", "--device", "cpu", "--batch-sizes", "1", "--max-new-tokens", "4"]


def _refused(args: list[str]) -> str:
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, (args, result.output, result.exception)
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize("extra, message", [
    (["--prompts", "0"], "'--prompts': 0 is not in the range x>=1"),
    (["--one-at-a-time", "0"], "'--one-at-a-time': 0 is not in the range x>=1"),
    (["--min-prompt", "0"], "'--min-prompt': 0 is not in the range x>=1"),
    (["--min-prompt", "20"], "--min-prompt 20 is above --max-prompt 16"),
    (["--min-new-tokens", "20"], "--min-new-tokens 20 is above --max-new-tokens 8"),
    (["--max-batch-size", "0"], "'--max-batch-size': 0 is not in the range x>=1"),
    (["--max-batch-size", "-5"], "'--max-batch-size': -5 is not in the range x>=1"),
    (["--token-budget", "0"], "'--token-budget': 0 is not in the range x>=1"),
    (["--hbm-tbps", "nan"], "'--hbm-tbps': 'nan' is not a finite number"),
    (["--hbm-tbps", "inf"], "'--hbm-tbps': 'inf' is not a finite number"),
])
def test_bench_regenerate_refuses_bad_sizes_and_ranges(extra, message):
    assert message in _refused(REGEN + extra)


def test_bench_eval_refuses_a_reversed_length_range_and_paths_it_could_not_write(tmp_path):
    assert "--prompt-len's MIN 16 is above MAX 8" in _refused(EVAL + ["--prompt-len", "16,8"])
    missing = tmp_path / "no" / "such"
    assert f"its directory {missing} does not exist" in _refused(EVAL + ["--json", str(missing / "x.json")])
    assert "is a directory" in _refused(EVAL + ["--json", str(tmp_path)])
    (tmp_path / "file").write_text("kept")  # a work dir under a file cannot be made
    assert "cannot be made" in _refused(EVAL + ["--work-dir", str(tmp_path / "file" / "w")])
    assert (tmp_path / "file").read_text() == "kept"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_a_read_only_directory_is_refused_for_the_json(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert "is not writable" in _refused(EVAL + ["--json", str(locked / "x.json")])
    finally:
        locked.chmod(0o700)
