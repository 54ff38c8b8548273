"""The openai backend against a real HTTP server process on loopback answering from the tiny model."""

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.regenerate.hf import HFBackend
from dflash_ipc.regenerate.openai import OpenAIBackend
from dflash_ipc.regenerate.options import GenerationOptions

from regen_helpers import run_backend, write_rows

W = TINY_VOCAB_WORDS
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def target(tiny_cache):
    return os.path.join(tiny_cache, "tiny-target")


@pytest.fixture(scope="module")
def server(target):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "openai_server.py"), "--model", target],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PORT "), f"server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)  # by pid
        proc.wait(10)
        proc.stdout.close()


def stats(url):
    with urllib.request.urlopen(url + "/stats", timeout=5) as r:
        return json.loads(r.read())


def user(text):
    return {"role": "user", "content": text}


ROWS = [{"messages": [user(" ".join(W[i:i + 1 + i % 7])), {"role": "assistant", "content": "x"}, user(W[i + 50])]}
        for i in range(8)] + [{"messages": [user(W[99])]}]


@pytest.mark.timeout(120)
def test_openai_backend_gives_the_hf_backends_greedy_replies(target, server, tmp_path):
    options = GenerationOptions(max_new_tokens=10, template_kwargs={"enable_thinking": False})
    inp = write_rows(tmp_path / "in.jsonl", ROWS)
    before = stats(server)["max_in_flight"]
    served = run_backend(OpenAIBackend(server + "/v1", options, concurrency=3), inp, tmp_path / "served.jsonl", options)
    local = run_backend(HFBackend(target, options, devices="cpu"), inp, tmp_path / "local.jsonl", options)
    assert served.complete and served.num_written == 9 and served.num_replies == 17
    assert (tmp_path / "served.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    s = stats(server)
    assert before <= 3 and s["max_in_flight"] == 3  # overlapping, and never more than --concurrency
    body = s["last_body"]
    assert body["model"] == "tiny" and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["temperature"] == 0.0 and body["max_tokens"] == 10 and isinstance(body["seed"], int)


@pytest.mark.timeout(120)
def test_errors_and_timeouts_are_retried_refusals_rejected(server, tmp_path):
    options = GenerationOptions(max_new_tokens=6)
    rows = [{"messages": [user("FLAKY2 " + W[1])]}, {"messages": [user("SLOW " + W[2])]},
            {"messages": [user("REFUSE " + W[3])]}, {"messages": [user("BROKEN " + W[4])]}, {"messages": [user(W[5])]}]
    inp = write_rows(tmp_path / "in.jsonl", rows)
    backend = OpenAIBackend(server + "/v1", options, concurrency=2, timeout_s=1.0, retries=3, backoff_s=0.05)
    report = run_backend(backend, inp, tmp_path / "o.jsonl", options)
    assert report.complete and report.num_written == 3 and report.rejects_by_reason == {"generation_error": 2}
    assert backend.num_retries >= 2 + 1 + 3  # two 503s, one timeout, three 500s
    rejects = {r["index"]: r["detail"] for r in map(json.loads, (tmp_path / "o.rejects.jsonl").read_text().splitlines())}
    assert "HTTP 400" in rejects[2] and "this prompt is refused" in rejects[2]  # not retried
    assert "gave up after 4 attempts: HTTP 500" in rejects[3]
    assert [json.loads(line)["index"] for line in (tmp_path / "o.jsonl").read_text().splitlines()] == [0, 1, 4]


def test_unreachable_server_is_a_clear_error():
    from dflash_ipc.errors import ConfigError, DataError
    with pytest.raises(DataError, match="cannot list the served models .* is the server up"):
        OpenAIBackend("http://127.0.0.1:9/v1", GenerationOptions(), timeout_s=2)
    with pytest.raises(ConfigError, match="give the server's base URL"):
        OpenAIBackend("127.0.0.1:8000", GenerationOptions())


@pytest.mark.timeout(120)
def test_cli_openai_backend_and_what_each_backend_needs(server, tmp_path):
    from click.testing import CliRunner

    from dflash_ipc.cli import main
    from dflash_ipc.errors import ConfigError
    inp = write_rows(tmp_path / "in.jsonl", ROWS[:3])
    args = ["regenerate", "--input", inp, "--out", str(tmp_path / "o.jsonl"), "--max-new-tokens", "6"]
    result = CliRunner().invoke(main, args + ["--backend", "openai", "--url", server + "/v1", "--concurrency", "2",
                                              "--served-model", "tiny", "--retries", "1", "--timeout-s", "30"],
                                catch_exceptions=False)
    assert result.exit_code == 0 and "complete (sorted by index); 3 rows read" in result.output, result.output
    state = json.loads((tmp_path / "o.state.json").read_text())["settings"]
    assert state["backend"] == "openai" and state["model"] == "tiny" and state["url"].endswith("/v1/chat/completions")
    with pytest.raises(ConfigError, match="--backend openai needs --url"):
        CliRunner().invoke(main, args + ["--backend", "openai"], catch_exceptions=False)
    with pytest.raises(ConfigError, match="--backend hf needs --model DIR"):
        CliRunner().invoke(main, args, catch_exceptions=False)


def test_an_answer_is_read_up_to_a_bound(monkeypatch):
    """A broken or hostile server cannot make the client hold more than MAX_ANSWER_BYTES."""
    import io

    from dflash_ipc.regenerate import openai
    monkeypatch.setattr(openai, "MAX_ANSWER_BYTES", 100)
    assert openai._read_json(io.BytesIO(b'{"choices": []}')) == {"choices": []}
    for body, needle in ((b'{"x": "' + b"y" * 10**6 + b'"}', "an answer over 100 bytes"),
                         (b"[" * 90, "Expecting value")):
        with pytest.raises(ValueError, match=needle):
            openai._read_json(io.BytesIO(body))
    monkeypatch.setattr(openai, "MAX_ANSWER_BYTES", 10**6)
    with pytest.raises(ValueError, match="nested deeper"):
        openai._read_json(io.BytesIO(b"[" * 100_000))
