"""The openai backend: an OpenAI-compatible chat-completions server the user runs
(`vllm serve`, SGLang), asked by N threads, so never more than N requests are in flight.

Each request is `POST {url}/chat/completions` with the regenerated history, `max_tokens`,
the sampling options, a per-row seed (so sampled rows do not depend on the order requests
are served in) and `chat_template_kwargs` (vLLM and SGLang pass them to the template). The
server applies the target's chat template and stop tokens.

Failures: a connection error, a timeout, HTTP 429 or 5xx, or an unreadable answer is retried
after an exponential backoff with jitter (`backoff_s` x 2^attempt, at most 60 s) up to
`retries` times; then, or at once on another HTTP 4xx (the server refused the request, e.g.
a prompt over its context), the row is rejected with the server's message. A rerun retries
rejected rows. Only the standard library is used.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import queue
import random
import socket
import threading
import time
import urllib.error
import urllib.request

from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.regenerate.conversation import Reply, Request
from dflash_ipc.regenerate.options import GenerationOptions

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
MAX_ANSWER_BYTES = 64 << 20  # a chat completion is kilobytes; more is a broken or hostile server
_RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)


class _Retry(Exception):
    """A failure worth another attempt."""


class OpenAIBackend:
    """Requests go to a queue; `concurrency` threads send them; replies come back on another."""

    name = "openai"

    def __init__(self, url: str, options: GenerationOptions, *, model: str | None = None, concurrency: int = 16,
                 timeout_s: float = 600.0, retries: int = 5, backoff_s: float = 1.0, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000/v1")
        if concurrency < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0:
            raise ConfigError(f"openai backend: concurrency={concurrency} (>= 1), retries={retries} (>= 0), "
                              f"timeout_s={timeout_s} (> 0), backoff_s={backoff_s} (>= 0)")
        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.options = options
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self.model = model or self._served_model(base)
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._outstanding = 0
        self.num_retries = 0
        self._threads = [threading.Thread(target=self._work, name=f"openai-{i}", daemon=True)
                         for i in range(concurrency)]
        for t in self._threads:
            t.start()

    def describe(self) -> dict:
        """Settings the replies depend on, for the output's state file."""
        return {"backend": "openai", "url": self.endpoint, "model": self.model}

    def _served_model(self, base: str) -> str:
        """The first model the server lists (GET /models), when none is named."""
        url = base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/models", headers=self._headers),
                                        timeout=min(self.timeout_s, 30.0)) as r:
                models = _read_json(r)["data"]
            return str(models[0]["id"])
        except (OSError, ValueError, KeyError, IndexError, TypeError, http.client.HTTPException) as e:
            raise DataError(f"{url}/models: cannot list the served models ({type(e).__name__}: {e}); "
                            "is the server up? Or name the model with --served-model") from None

    def prepare(self, request: Request) -> None:
        """Nothing to render here: the server applies the chat template."""

    def submit(self, request: Request) -> None:
        self._outstanding += 1
        self._todo.put(request)

    def pending(self) -> int:
        """Requests submitted and not yet answered."""
        return self._outstanding

    def poll(self, *, flush: bool, timeout_s: float = 1.0) -> list[Reply]:
        """Replies that came back (waits up to timeout_s for the first)."""
        out = []
        try:
            out.append(self._done.get(timeout=timeout_s) if self._outstanding else None)
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        out = [r for r in out if r is not None]
        self._outstanding -= len(out)
        return out

    def close(self) -> None:
        """Stop the threads after the request each is sending (they are daemons: never waited for long)."""
        for _ in self._threads:
            self._todo.put(None)
        for t in self._threads:
            t.join(0.1)

    def _work(self) -> None:
        while True:
            request = self._todo.get()
            if request is None:
                return
            try:
                reply = self._ask(request)
            except Exception as e:  # a bug must not kill the thread silently: the row is rejected
                reply = Reply(request.key, error=f"{type(e).__name__}: {e}"[:500])
            self._done.put(reply)

    def body(self, request: Request) -> dict:
        """The JSON body of one chat-completions request."""
        o = self.options
        body = {"model": self.model, "messages": request.messages, "max_tokens": request.max_new_tokens,
                "temperature": o.temperature, "top_p": o.top_p if not o.greedy else 1.0, "n": 1, "stream": False,
                "seed": _row_seed(o.seed, request.key)}
        if o.top_k and not o.greedy:
            body["top_k"] = o.top_k
        if o.template_kwargs:
            body["chat_template_kwargs"] = o.template_kwargs
        if request.tools:
            body["tools"] = request.tools
        return body

    def _ask(self, request: Request) -> Reply:
        data = json.dumps(self.body(request)).encode()
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                self.num_retries += 1
                delay = min(MAX_BACKOFF_S, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
                time.sleep(delay)
            try:
                return _reply(request, self._post(data))
            except _Retry as e:
                last = str(e)
                log.debug("openai: %s attempt %d: %s", request.key, attempt + 1, last)
            except urllib.error.HTTPError as e:
                return Reply(request.key, error=f"HTTP {e.code} from {self.endpoint}: {_body_of(e)}")
        return Reply(request.key, error=f"gave up after {self.retries + 1} attempts: {last}")

    def _post(self, data: bytes) -> dict:
        req = urllib.request.Request(self.endpoint, data=data, headers=self._headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return _read_json(r)
        except urllib.error.HTTPError as e:
            if e.code in _RETRY_STATUS:
                raise _Retry(f"HTTP {e.code}: {_body_of(e)}") from None
            raise
        except (urllib.error.URLError, OSError, socket.timeout, http.client.HTTPException, ValueError) as e:
            raise _Retry(f"{type(e).__name__}: {e}") from None


def _read_json(response):
    """The JSON of a server's answer, read up to MAX_ANSWER_BYTES: a server that streams
    without end, or answers with gigabytes, costs a bounded amount of memory."""
    data = response.read(MAX_ANSWER_BYTES + 1)
    if len(data) > MAX_ANSWER_BYTES:
        raise ValueError(f"an answer over {MAX_ANSWER_BYTES} bytes")
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("an answer nested deeper than the parser's recursion limit") from None


def _body_of(e: urllib.error.HTTPError) -> str:
    try:
        return e.read(2000).decode("utf-8", errors="replace").strip()[:500]
    except OSError:
        return ""


def _reply(request: Request, answer: dict) -> Reply:
    """A Reply from a chat-completions answer; _Retry when it is not one."""
    try:
        choice = answer["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise _Retry(f"not a chat completion: {str(answer)[:200]}") from None
    text = message.get("content") or ""
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    tokens = (answer.get("usage") or {}).get("completion_tokens", 0)
    return Reply(request.key, text=text, reasoning=reasoning if isinstance(reasoning, str) else None,
                 tool_calls=message.get("tool_calls") or None, num_tokens=int(tokens or 0),
                 truncated=choice.get("finish_reason") == "length")


def _row_seed(seed: int, key: tuple[int, int]) -> int:
    """A seed per (row, turn): sampled replies do not depend on the order requests are served in."""
    # Sample 0 keeps the seed of the (index, turn) keys before --samples-per-prompt existed.
    sample = f"/{key[2]}" if len(key) > 2 and key[2] else ""
    h = hashlib.blake2b(f"{seed}/{key[0]}/{key[1]}{sample}".encode(), digest_size=4)
    return int.from_bytes(h.digest(), "little") >> 1
