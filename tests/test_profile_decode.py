"""benchmarks/profile_decode.py on the CPU at the tiny shape: per case, the run's figures and the
synchronised stage times it measured (the kernel profile needs CUDA)."""

import re
import sys

from benchmarks import profile_decode


def test_profile_decode_prints_each_case(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DEV", "cpu")
    monkeypatch.setenv("WORK", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["profile_decode", "tiny", "1:2:4:4:1", "4:8:2:6:0"])
    profile_decode.main()
    out = capsys.readouterr().out
    heads = re.findall(r"== tiny: rows (\d+), (\d+) prompts, replies of (\d+)\.\.(\d+) tokens, continuous (\w+): "
                       r"([\d,]+) tokens in .* (\d+) steps, (\d+) prefills", out)
    assert [h[:5] for h in heads] == [("1", "2", "4", "4", "True"), ("4", "8", "2", "6", "False")]
    assert heads[0][5] == "8" and heads[0][6] == "6"  # 2 replies of 4: the first tokens come from the prefills
    assert out.count("synchronised stages (s): _harvest") == 2
    assert (tmp_path / "profile-decode-tiny" / "config.json").exists()
