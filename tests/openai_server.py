"""A tiny OpenAI-compatible chat-completions server for tests: a real HTTP server process
answering from a real (tiny) model with its chat template, greedy.

    python tests/openai_server.py --model DIR [--delay-s 0.1]      prints "PORT <n>" when ready

Faults, chosen by the last user message (so one server serves every test):
  "REFUSE ..."     HTTP 400 with an error body
  "FLAKY<k> ..."   the first k requests with this text get HTTP 503, then it answers
  "SLOW ..."       the first request with this text sleeps 3 s before answering (a timeout)
  "BROKEN ..."     always HTTP 500
GET /stats: {"max_in_flight", "requests", "last_body"}. Stop it with SIGTERM.
"""

import argparse
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class State:
    def __init__(self, model_dir: str, delay_s: float):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(1)
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.delay_s = delay_s
        self.lock = threading.Lock()  # one generation at a time; requests still overlap
        self.count_lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.requests = 0
        self.seen: dict[str, int] = {}
        self.last_body = None

    def answer(self, body: dict) -> tuple[int, dict]:
        import torch
        text = body["messages"][-1].get("content") or ""
        with self.count_lock:
            self.seen[text] = n = self.seen.get(text, 0) + 1
        flaky = re.match(r"FLAKY(\d+)", text)
        if text.startswith("REFUSE"):
            return 400, {"error": {"message": "this prompt is refused", "type": "invalid_request_error"}}
        if text.startswith("BROKEN") or (flaky and n <= int(flaky.group(1))):
            return (500 if text.startswith("BROKEN") else 503), {"error": {"message": "busy"}}
        if text.startswith("SLOW") and n == 1:
            time.sleep(3.0)
        time.sleep(self.delay_s)
        prompt = self.tok.apply_chat_template(body["messages"], tools=body.get("tools"), tokenize=False,
                                              add_generation_prompt=True, **(body.get("chat_template_kwargs") or {}))
        ids = torch.tensor([self.tok(prompt, add_special_tokens=False)["input_ids"]])
        with self.lock, torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=int(body["max_tokens"]), pad_token_id=self.tok.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        stopped = bool(new) and new[-1] == self.tok.eos_token_id
        content = self.tok.decode(new[:-1] if stopped else new)
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": "stop" if stopped else "length"}],
                     "usage": {"prompt_tokens": ids.shape[1], "completion_tokens": len(new)}}


def handler(state: State):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout test)

        def do_GET(self):
            if self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": "tiny", "object": "model"}]})
            elif self.path == "/stats":
                self._send(200, {"max_in_flight": state.max_in_flight, "requests": state.requests,
                                 "last_body": state.last_body})
            else:
                self._send(404, {"error": {"message": "not found"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.count_lock:
                state.requests += 1
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
                state.last_body = body
            try:
                answer = state.answer(body) if self.path == "/v1/chat/completions" else (404, {"error": {}})
            finally:
                # Out of flight before the answer is sent: a client that sends its next request
                # on receiving this one is never counted twice.
                with state.count_lock:
                    state.in_flight -= 1
            self._send(*answer)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--delay-s", type=float, default=0.1)
    args = parser.parse_args()
    state = State(args.model, args.delay_s)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler(state))
    server.daemon_threads = True
    print(f"PORT {server.server_address[1]}", flush=True)
    server.serve_forever()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # the client's 16 threads connect at once: none is reset by a full backlog


class HostileServer:
    """An in-process server (a thread, no model) that misbehaves on request, for the client's
    bounds. The last user message picks the answer:
      "REDIRECT ..."   302 to `redirect_to` (another origin), which records what reaches it
      "TRICKLE ..."    the status line and headers at once, then the body 1 byte per 0.2 s
      "SLOWHEAD ..."   the status line, then the headers 1 byte per 0.2 s
      "ANSWER <json>"  that JSON as a 200 answer, whatever it is
      "HUGE ..."       a Content-Length of 1 GiB, then bytes until the client hangs up
      "STREAM ..."     no Content-Length: 64 KiB chunks until the client hangs up
      anything else    a valid chat completion of content "ok"
    `authorizations` lists the Authorization header of every request (None when absent)."""

    def __init__(self, redirect_to: str | None = None):
        self.redirect_to = redirect_to
        self.authorizations: list = []
        self.server = _Server(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.authorizations.append(self.headers.get("Authorization"))
                self._json(200, {"object": "list", "data": [{"id": "hostile", "object": "model"}]})

            def do_POST(self):
                owner.authorizations.append(self.headers.get("Authorization"))
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][-1].get("content") or ""
                try:
                    self._answer(text)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up, as it should

            def _answer(self, text: str) -> None:
                if text.startswith("REDIRECT"):
                    self.send_response(302)
                    self.send_header("Location", owner.redirect_to + "/v1/chat/completions")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif text.startswith(("TRICKLE", "SLOWHEAD")):
                    data = json.dumps(_completion("ok")).encode()
                    self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                    head = f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
                    if text.startswith("TRICKLE"):
                        self.wfile.write(head)
                    for b in (head if text.startswith("SLOWHEAD") else b"") + data:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.2)
                elif text.startswith("ANSWER "):
                    self._raw(200, text[len("ANSWER "):].encode())
                elif text.startswith("HUGE"):
                    self.send_response(200)
                    self.send_header("Content-Length", str(1 << 30))
                    self.end_headers()
                    for _ in range(1 << 14):
                        self.wfile.write(b" " * (1 << 16))
                elif text.startswith("STREAM"):
                    self.send_response(200)
                    self.end_headers()  # no Content-Length: the body ends when the connection does
                    for _ in range(1 << 14):
                        self.wfile.write(b" " * (1 << 16))
                else:
                    self._json(200, _completion("ok"))

            def _json(self, code: int, payload) -> None:
                self._raw(code, json.dumps(payload).encode())

            def _raw(self, code: int, data: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler


def _completion(content) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "hostile",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {"completion_tokens": 1}}


if __name__ == "__main__":
    main()
