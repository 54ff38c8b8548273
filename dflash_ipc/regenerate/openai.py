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

The server is not trusted (http_request.py): `timeout_s` bounds each whole request, however
slowly the server sends; a redirect is never followed (the row is rejected, and --api-key
reaches only the URL given); an answer over `max_answer_mib` is refused unread; an answer
that is JSON but not a chat completion (openai_answer.py checks it field by field) rejects
its row at once, without retries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import random
import threading
import time

from dflash_ipc.errors import ConfigError, DataError
from dflash_ipc.regenerate.conversation import Reply, Request
from dflash_ipc.regenerate import http_request
from dflash_ipc.regenerate.http_request import Answer, AnswerTooLarge, RequestFailed
from dflash_ipc.regenerate.openai_answer import BadAnswer, check_answer
from dflash_ipc.regenerate.options import GenerationOptions

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 60.0
MAX_ANSWER_MIB = 16  # a chat completion is kilobytes; more is a broken or hostile server
_RETRY_STATUS = (408, 409, 425, 429, 500, 502, 503, 504)


class _Retry(Exception):
    """A failure worth another attempt."""


class _Refused(Exception):
    """The server refused the request (a 4xx) or redirected it: the row is rejected at once."""


class OpenAIBackend:
    """Requests go to a queue; `concurrency` threads send them; replies come back on another."""

    name = "openai"

    def __init__(self, url: str, options: GenerationOptions, *, model: str | None = None, concurrency: int = 16,
                 timeout_s: float = 600.0, retries: int = 5, backoff_s: float = 1.0, api_key: str | None = None,
                 max_answer_mib: float = MAX_ANSWER_MIB):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r}: give the server's base URL, e.g. http://127.0.0.1:8000/v1")
        if concurrency < 1 or retries < 0 or timeout_s <= 0 or backoff_s < 0 or max_answer_mib <= 0:
            raise ConfigError(f"openai backend: concurrency={concurrency} (>= 1), retries={retries} (>= 0), "
                              f"timeout_s={timeout_s} (> 0), backoff_s={backoff_s} (>= 0), "
                              f"max_answer_mib={max_answer_mib} (> 0)")
        base = url.rstrip("/")
        self.endpoint = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self.options = options
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_answer_bytes = int(max_answer_mib * (1 << 20))
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
        url = (base[: -len("/chat/completions")] if base.endswith("/chat/completions") else base) + "/models"
        try:
            answer = http_request.request("GET", url, headers=self._headers, data=None, deadline_s=min(self.timeout_s, 30.0),
                             max_bytes=self.max_answer_bytes)
            if answer.status != 200:
                raise ValueError(_status_error(answer, url))
            return str(_parse_json(answer.body)["data"][0]["id"])
        except (RequestFailed, ValueError, KeyError, IndexError, TypeError) as e:
            raise DataError(f"{url}: cannot list the served models ({type(e).__name__}: {e}); "
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
            except _Refused as e:  # its message names the URL
                return Reply(request.key, error=str(e)[:1000])
            except (BadAnswer, AnswerTooLarge) as e:
                return Reply(request.key, error=f"{self.endpoint}: {e}"[:1000])
        return Reply(request.key, error=f"gave up after {self.retries + 1} attempts: {last}")

    def _post(self, data: bytes) -> dict:
        """The JSON of a 2xx answer; _Retry on a transient failure, _Refused on a refusal."""
        try:
            answer = http_request.request("POST", self.endpoint, headers=self._headers, data=data, deadline_s=self.timeout_s,
                             max_bytes=self.max_answer_bytes)
        except AnswerTooLarge:
            raise
        except RequestFailed as e:
            raise _Retry(str(e)) from None
        if answer.status in _RETRY_STATUS or answer.status < 200:
            raise _Retry(_status_error(answer, self.endpoint))
        if answer.status >= 300:  # a redirect, a refusal
            raise _Refused(_status_error(answer, self.endpoint))
        try:
            return _parse_json(answer.body)
        except ValueError as e:
            raise _Retry(f"an unreadable answer: {e}"[:300]) from None


def _status_error(answer: Answer, url: str) -> str:
    """What an answer other than 2xx says, for a reject or an error message."""
    if 300 <= answer.status < 400:
        return (f"HTTP {answer.status} from {url}: a redirect to {answer.location!r}, not followed (the request "
                f"and its --api-key go only to the URL given); give the final URL as --url")
    return f"HTTP {answer.status} from {url}: " + answer.body[:2000].decode("utf-8", errors="replace").strip()[:500]


def _parse_json(data: bytes):
    """The JSON of an answer (its size is bounded by the request)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("an answer nested deeper than the parser's recursion limit") from None


def _reply(request: Request, answer) -> Reply:
    """A Reply from a chat-completions answer checked field by field; BadAnswer when it is not one."""
    fields = check_answer(answer)
    return Reply(request.key, text=fields.content or "", reasoning=fields.reasoning, tool_calls=fields.tool_calls,
                 num_tokens=fields.num_tokens, truncated=fields.finish_reason == "length")


def _row_seed(seed: int, key: tuple[int, int]) -> int:
    """A seed per (row, turn): sampled replies do not depend on the order requests are served in."""
    # Sample 0 keeps the seed of the (index, turn) keys before --samples-per-prompt existed.
    sample = f"/{key[2]}" if len(key) > 2 and key[2] else ""
    h = hashlib.blake2b(f"{seed}/{key[0]}/{key[1]}{sample}".encode(), digest_size=4)
    return int.from_bytes(h.digest(), "little") >> 1
