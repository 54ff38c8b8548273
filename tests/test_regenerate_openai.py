"""The openai backend against a real HTTP server process on loopback answering from the tiny model."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from dflash_ipc.builtin.tiny import TINY_VOCAB_WORDS
from dflash_ipc.regenerate.hf import HFBackend
from dflash_ipc.regenerate.openai import OpenAIBackend
from dflash_ipc.regenerate.options import GenerationOptions

from openai_server import HostileServer
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


def hostile_rows(texts):
    return [{"messages": [user(t)]} for t in texts]


def written_and_rejects(out):
    written = [json.loads(line)["index"] for line in out.read_text().splitlines()]
    rejects_path = out.with_name(out.name.replace(".jsonl", ".rejects.jsonl"))
    rejects = {r["index"]: r["detail"] for r in map(json.loads, rejects_path.read_text().splitlines())} \
        if rejects_path.exists() else {}
    return written, rejects


@pytest.mark.timeout(30)
def test_a_redirect_to_another_origin_is_not_followed_and_the_key_stays_home(tmp_path):
    options = GenerationOptions(max_new_tokens=6)
    with HostileServer() as other, HostileServer(redirect_to=other.url) as server:
        inp = write_rows(tmp_path / "in.jsonl", hostile_rows(["REDIRECT a", "fine", "REDIRECT b"]))
        backend = OpenAIBackend(server.url + "/v1", options, api_key="s3cret", retries=2, backoff_s=0.01)
        report = run_backend(backend, inp, tmp_path / "o.jsonl", options)
        assert other.authorizations == []  # nothing reached the other origin, the key least of all
        assert server.authorizations and set(server.authorizations) == {"Bearer s3cret"}
    written, rejects = written_and_rejects(tmp_path / "o.jsonl")
    assert report.complete and written == [1] and sorted(rejects) == [0, 2]
    assert f"HTTP 302 from {server.url}/v1/chat/completions: a redirect to '{other.url}/v1/chat/completions', " \
           "not followed" in rejects[0]
    assert backend.num_retries == 0  # a redirect is refused at once


@pytest.mark.timeout(30)
def test_a_trickling_server_is_given_up_after_timeout_s(tmp_path):
    """Headers at once then 1 byte per 0.2 s (or the headers themselves trickled): each recv
    is quick, yet the whole request is bounded by timeout_s."""
    options = GenerationOptions(max_new_tokens=6)
    with HostileServer() as server:
        inp = write_rows(tmp_path / "in.jsonl", hostile_rows(["TRICKLE a", "SLOWHEAD b", "fine"]))
        backend = OpenAIBackend(server.url + "/v1", options, timeout_s=1.0, retries=1, backoff_s=0.01)
        start = time.monotonic()
        report = run_backend(backend, inp, tmp_path / "o.jsonl", options)
        elapsed = time.monotonic() - start
    written, rejects = written_and_rejects(tmp_path / "o.jsonl")
    assert report.complete and written == [2] and sorted(rejects) == [0, 1]
    assert all("no complete answer within 1 s (--timeout-s)" in r for r in rejects.values()), rejects
    assert elapsed < 6  # two attempts of 1 s each (in parallel), not the body's ~40 s


@pytest.mark.timeout(30)
def test_an_answer_over_the_bound_is_refused_unread(tmp_path):
    options = GenerationOptions(max_new_tokens=6)
    with HostileServer() as server:
        inp = write_rows(tmp_path / "in.jsonl", hostile_rows(["HUGE a", "STREAM b", "fine"]))
        backend = OpenAIBackend(server.url + "/v1", options, retries=2, backoff_s=0.01, max_answer_mib=1)
        report = run_backend(backend, inp, tmp_path / "o.jsonl", options)
    written, rejects = written_and_rejects(tmp_path / "o.jsonl")
    assert report.complete and written == [2] and sorted(rejects) == [0, 1]
    assert f"an answer of {1 << 30} bytes (Content-Length), over the bound of {1 << 20} bytes" in rejects[0]
    assert f"over the bound of {1 << 20} bytes; refused after reading" in rejects[1]
    assert backend.num_retries == 0


BAD_ANSWERS = [
    ({"choices": [{"message": {"content": 7}}]}, "choices[0].message.content is int"),
    ({"choices": [{"message": {"content": {"a": 1}}}]}, "choices[0].message.content is dict"),
    ({"choices": [{"message": {"content": ["x"]}}]}, "choices[0].message.content is list"),
    ({"choices": [{"message": {"content": True}}]}, "choices[0].message.content is bool"),
    ({"choices": [{"message": {"content": None, "tool_calls": "call f"}}]}, "tool_calls is str"),
    ({"choices": [{"message": {"content": None, "tool_calls": [5]}}]}, "tool_calls[0] is int"),
    ({"choices": [{"message": {"tool_calls": [{"function": {"name": 3, "arguments": "{}"}}]}}]},
     "tool_calls[0].function.name is int"),
    ({"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}}]},
     "tool_calls[0].function.arguments is dict"),
    ({"choices": [{"message": {"tool_calls": [{"function": {"name": "f", "arguments": "{nope"}}]}}]},
     "arguments is not a string of JSON"),
    ({"object": "chat.completion"}, "the answer has no 'choices'"),
    ({"choices": []}, "choices is empty"),
    ([1, 2], "the answer is list"),
    ({"choices": [{"message": {"content": "x"}}], "usage": {"completion_tokens": "9"}}, "completion_tokens is str"),
    ({"choices": [{"message": {"content": "x", "reasoning_content": 1}}]}, "reasoning_content is int"),
]


@pytest.mark.timeout(30)
def test_an_answer_of_the_wrong_schema_rejects_only_its_row(tmp_path):
    options = GenerationOptions(max_new_tokens=6)
    good = {"choices": [{"message": {"content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        "finish_reason": "tool_calls"}], "usage": {"completion_tokens": 4}}
    texts = ["ANSWER " + json.dumps(a) for a, _ in BAD_ANSWERS] + ["ANSWER " + json.dumps(good), "fine"]
    with HostileServer() as server:
        inp = write_rows(tmp_path / "in.jsonl", hostile_rows(texts))
        backend = OpenAIBackend(server.url + "/v1", options, retries=2, backoff_s=0.01)
        report = run_backend(backend, inp, tmp_path / "o.jsonl", options)
    written, rejects = written_and_rejects(tmp_path / "o.jsonl")
    n = len(BAD_ANSWERS)
    assert report.complete and written == [n, n + 1] and sorted(rejects) == list(range(n))
    for i, (_, needle) in enumerate(BAD_ANSWERS):
        assert needle in rejects[i], (i, rejects[i])
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert rows[0]["messages"][-1]["tool_calls"] == good["choices"][0]["message"]["tool_calls"]
    assert rows[1]["messages"][-1]["content"] == "ok"
    assert backend.num_retries == 0


def test_an_unreadable_answer_is_parsed_with_bounded_recursion():
    from dflash_ipc.regenerate import openai
    assert openai._parse_json(b'{"choices": []}') == {"choices": []}
    with pytest.raises(ValueError, match="Expecting value"):
        openai._parse_json(b"[" * 90)
    with pytest.raises(ValueError, match="nested deeper"):
        openai._parse_json(b"[" * 100_000)


@pytest.mark.timeout(30)
def test_a_deadline_passed_while_connecting_still_bounds_the_request(tmp_path, monkeypatch):
    """The name lookup or connect took the whole --timeout-s (no socket yet for the deadline to
    cut): the request is given up at once instead of sending to a server that then trickles."""
    import http.client

    from dflash_ipc.regenerate import http_request
    real_connect = http.client.HTTPConnection.connect

    def slow_connect(self):
        time.sleep(1.5)
        real_connect(self)
    monkeypatch.setattr(http.client.HTTPConnection, "connect", slow_connect)
    with HostileServer() as server:
        start = time.monotonic()
        body = json.dumps({"messages": [{"role": "user", "content": "TRICKLE a"}]}).encode()
        with pytest.raises(http_request.RequestFailed, match=r"no complete answer within 1 s"):
            http_request.request("POST", server.url + "/v1/chat/completions", data=body, deadline_s=1.0,
                                 headers={"Content-Type": "application/json"}, max_bytes=1 << 20)
        assert time.monotonic() - start < 4  # the trickled body would take ~40 s
