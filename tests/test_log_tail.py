"""The tail of a child's log, read from its end (a crashed long job's log may be gigabytes)."""

import pytest

from dflash_ipc.run.logs import tail_lines


def test_the_tail_is_the_last_lines_and_only_the_end_of_the_file_is_read(tmp_path, monkeypatch):
    path = tmp_path / "drafter-0.log"
    path.write_text("".join(f"line {i}\n" for i in range(200_000)))  # ~2.3 MB
    reads = []
    real_open = open

    def spying_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        real_read = f.read
        f.read = lambda n=-1: reads.append(n) or real_read(n)
        return f

    monkeypatch.setattr("builtins.open", spying_open)
    assert tail_lines(str(path), 3) == ["line 199997", "line 199998", "line 199999"]
    assert reads == [8000]
    monkeypatch.undo()
    (tmp_path / "short.log").write_text("only\n")
    assert tail_lines(str(tmp_path / "short.log"), 25) == ["only"]
    with pytest.raises(OSError):
        tail_lines(str(tmp_path / "missing.log"), 3)
