"""The attacks of issue 28 on the dispatcher, each against the job's own dispatcher process
(`run_dispatcher`, as `dflash-ipc dispatcher` runs it) on loopback tcp://, where no CURVE key
is required: any local user can reach it. Each test holds the dispatcher to three things:
it keeps serving (a real worker's request is answered at once), its RSS stays within
RSS_BOUND_MIB of what it was before the attack (the peak, sampled through the attack), and
no seat changes hands. The floods are scaled down from the issue's; the properties hold."""

import logging
import multiprocessing as mp
import os
import random
import socket
import threading
import time

import msgpack
import psutil
import pytest
import zmq

from dflash_ipc.config.load import load_config
from dflash_ipc.data.dataset import DatasetWriter
from dflash_ipc.wire import protocol as p
from dflash_ipc.wire.security import read_job_secret

RSS_BOUND_MIB = 64
POOL = {"backend": "shm", "segment": "s"}


def _serve_job(overrides: list[str], log_path: str) -> None:
    """Child: the job's dispatcher, as the supervisor starts it (minus the fork/exec)."""
    from dflash_ipc.dispatch.proc import run_dispatcher
    logging.basicConfig(filename=log_path, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    run_dispatcher(load_config(None, overrides))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A dispatcher process over 64 samples (32 batches) for 2 targets and 1 drafter."""

    def __init__(self, tmp_path) -> None:
        data = tmp_path / "data"
        with DatasetWriter(str(data), tokenizer_fingerprint="sha256:test") as writer:
            for _ in range(64):
                writer.add(list(range(1, 33)), [1] * 32)
            writer.close()
        overrides = [f"run.run_dir={tmp_path / 'run'}", f"data.path={data}", "target.num_workers=2",
                     "drafter.num_workers=1", "data.bucket_boundaries=[64]", "data.token_budget=64",
                     f"dispatch.address=tcp://127.0.0.1:{_free_port()}", "dispatch.heartbeat_interval_s=0.5",
                     "dispatch.heartbeat_timeout_s=60"]
        self.cfg = load_config(None, overrides)
        os.makedirs(self.cfg.run.run_dir, mode=0o700)
        self.log_path = tmp_path / "dispatcher.log"
        self.child = mp.get_context("spawn").Process(target=_serve_job, args=(overrides, str(self.log_path)),
                                                     daemon=True)
        self.child.start()
        self.address = self.cfg.dispatcher_address
        deadline = time.monotonic() + 60
        while self.status(timeout_ms=500) is None:
            assert time.monotonic() < deadline and self.child.is_alive(), "the dispatcher did not start"
        # What the supervisor's child reads to register (the dispatcher made it at its start).
        self.secret = read_job_secret(self.cfg.files.job_secret)

    def socket(self, identity: bytes | None = None) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, identity or os.urandom(8))
        sock.connect(self.address)
        return sock

    def status(self, timeout_ms: int = 3000) -> dict | None:
        """The status as a fresh peer gets it (None: no answer in time)."""
        sock = self.socket()
        try:
            reply = ask(sock, p.StatusRequest(), timeout_ms)
            return reply.status.to_json() if isinstance(reply, p.StatusReply) else None  # as on disk
        finally:
            sock.close(linger=0)

    def worker(self, role: str, rank: int, **fields):
        """A worker of this job, registered with the secret: (its socket, its pid)."""
        sock = self.socket(f"{role}/{rank}/{os.urandom(4).hex()}".encode())
        pid = fields.pop("pid", os.getpid())
        extra = {"pool": POOL, "num_slots": 2} if role == "target" else {}
        reply = ask(sock, p.Register(role=role, rank=rank, pid=pid, secret=self.secret, **extra, **fields))
        assert isinstance(reply, p.Registered), reply
        return sock, pid

    def rss_mib(self) -> float:
        return psutil.Process(self.child.pid).memory_info().rss / 2**20

    def assert_serving(self, target: zmq.Socket, within_s: float = 2.0) -> None:
        """A registered target's pull is answered with a batch, and a new peer's status, fast."""
        started = time.monotonic()
        assert isinstance(ask(target, p.Ready(credits=1), timeout_ms=int(within_s * 1000)), p.Batch)
        assert self.status(timeout_ms=int(within_s * 1000)) is not None
        assert time.monotonic() - started < within_s
        assert self.child.is_alive()

    def log_text(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.child.pid is not None and self.child.is_alive():
            os.kill(self.child.pid, 9)
        self.child.join(timeout=5)


@pytest.fixture
def job(tmp_path):
    job = Job(tmp_path)
    try:
        yield job
    finally:
        job.stop()


def ask(sock, msg, timeout_ms=3000):
    """Sends `msg` (a message or raw frames) and returns the next reply that is not a heartbeat
    (None when none comes in time, or when the send cannot even be queued: a DEALER whose
    connection never completes its handshake would block on it for ever)."""
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    try:
        sock.send_multipart(msg if isinstance(msg, list) else p.encode(msg))
    except zmq.Again:
        return None
    deadline = time.monotonic() + timeout_ms / 1000
    while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        reply = p.decode(sock.recv_multipart())
        if not isinstance(reply, p.Heartbeat):
            return reply
    return None


class PeakRss(threading.Thread):
    """The highest RSS of a process while the `with` block runs, sampled every 10 ms."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.process = psutil.Process(pid)
        self.base = self.peak = self.process.memory_info().rss / 2**20
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss / 2**20)

    def __enter__(self) -> "PeakRss":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)  # what is still queued in the dispatcher is read and counted
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, self.process.memory_info().rss / 2**20)

    def assert_within(self, bound_mib: float = RSS_BOUND_MIB) -> None:
        assert self.peak - self.base < bound_mib, f"RSS {self.base:.0f} -> {self.peak:.0f} MiB"


def _nested_pool(depth: int) -> dict:
    pool: dict = {"backend": "shm"}
    for _ in range(depth):
        pool = {"p": pool}
    return pool


@pytest.mark.timeout(60)
def test_a_register_nested_600_deep_is_refused_and_the_job_serves_on(job):
    """Was: RecursionError in the dispatcher on every start, until the job failed."""
    target, _ = job.worker("target", 0)
    evil = job.socket()
    body = msgpack.packb({"role": "target", "rank": 1, "pid": 4, "num_slots": 1, "pool": _nested_pool(600)},
                         use_bin_type=True)
    assert len(body) < 4096  # ~1.8 KB, as in the issue
    for _ in range(3):
        reply = ask(evil, [bytes((p.Kind.REGISTER,)), body])
        assert isinstance(reply, p.Refused) and "nested deeper" in reply.reason, reply
    deep = msgpack.packb({"role": "target", "rank": 1, "pid": 4})[:-1]  # 100k-deep list as a last value
    reply = ask(evil, [bytes((p.Kind.REGISTER,)), deep[:1] + b"\x84" + deep[1:] + b"\xa4pool" + b"\x91" * 100_000 + b"\x01"])
    assert isinstance(reply, p.Refused), reply
    job.assert_serving(target)
    assert "RecursionError" not in job.log_text() and "Traceback" not in job.log_text()
    assert set(job.status()["targets"]) == {"0"}


@pytest.mark.timeout(60)
def test_committed_bodies_of_millions_of_empty_lists_cost_nothing(job):
    """Was (from a peer that never registered): RSS 260 -> 581 MiB, the job 4x slower."""
    target, _ = job.worker("target", 0)
    drafter, _ = job.worker("drafter", 0)
    n = 4_194_032 - 64
    head = msgpack.packb({"step": 1, "batch_ids": [], "ranks": [], "attempts": [], "samples": []})[:-1]
    body = head + b"\xdd" + n.to_bytes(4, "big") + b"\x90" * n  # samples: ~4.2M empty lists
    frames = [bytes((p.Kind.COMMITTED,)), body]
    evil = job.socket()
    with PeakRss(job.child.pid) as rss:
        for _ in range(8):
            evil.send_multipart(frames, copy=False)
        started = time.monotonic()
        # A seated drafter's copy is refused at the outer list's header, not built.
        reply = ask(drafter, frames, timeout_ms=5000)
        assert isinstance(reply, p.Rejected) and "max_array_len" in reply.reason, reply
        assert time.monotonic() - started < 2.0
        job.assert_serving(target)
    rss.assert_within()
    # The stranger's frames are past its byte budget: dropped unread and counted, logged once.
    assert not evil.poll(200)
    status = job.status()
    assert status["refusals"] >= 8 + 1 and status["last_committed_step"] in (None, -1)
    assert job.log_text().count("over its budget") == 1


@pytest.mark.timeout(60)
def test_a_register_without_the_secret_cannot_take_a_live_seat(job):
    """Was: a Register as drafter/0 naming the live drafter's pid (read from any status) in
    replaces_pids was accepted, and the job failed. Also on a free seat: nothing without it."""
    assert oct(os.stat(job.cfg.files.job_secret).st_mode & 0o777) == "0o600"
    target, _ = job.worker("target", 0)
    drafter, drafter_pid = job.worker("drafter", 0, pid=os.getpid())
    live = job.status()
    assert live["drafters"]["0"]["pid"] == drafter_pid  # what any peer can read
    evil = job.socket(b"drafter/0/evil")
    for secret in (b"", os.urandom(32), job.secret[:-1] + bytes([job.secret[-1] ^ 1])):
        for role, rank, pid, extra in (("drafter", 0, drafter_pid, {}),
                                       ("target", 0, live["targets"]["0"]["pid"], {"pool": POOL, "num_slots": 1}),
                                       ("target", 1, 99, {"pool": POOL, "num_slots": 1})):
            reply = ask(evil, p.Register(role=role, rank=rank, pid=pid + 1, replaces_pids=[pid], secret=secret,
                                         **extra))
            assert isinstance(reply, p.Refused) and "without the job's secret" in reply.reason, reply
    # The seats are untouched: the same holders, and they are served.
    after = job.status()
    assert after["drafters"]["0"]["pid"] == drafter_pid and set(after["targets"]) == {"0"}
    drafter.send_multipart(p.encode(p.Heartbeat(metrics={"x": 1.0})))
    assert drafter.poll(2000) and isinstance(p.decode(drafter.recv_multipart()), p.Heartbeat)  # its seat answers
    assert isinstance(ask(evil, p.WantHidden(credits=1)), p.Unregistered)
    job.assert_serving(target)
    # The supervisor's child, restarted, proves itself with the secret and takes over.
    successor = job.socket(b"drafter/0/successor")
    reply = ask(successor, p.Register(role="drafter", rank=0, pid=drafter_pid + 1, replaces_pids=[drafter_pid],
                                      secret=job.secret))
    assert isinstance(reply, p.Registered)


@pytest.mark.timeout(90)
def test_a_mix_of_random_messages_huge_frames_and_many_registrations(job):
    """Was: RSS 260 -> 366 MiB; registrations from strangers over thousands of connections.
    Here: 2,000 random messages, absurd slot counts, two 100 MB frames, 100k-deep nesting,
    and 300 registrations over 300 connections; no stranger gets a seat."""
    target, _ = job.worker("target", 0)
    rng = random.Random(0)
    evil = job.socket()
    with PeakRss(job.child.pid) as rss:
        for _ in range(2000):
            kind = bytes((rng.randrange(256),))
            body = (rng.randbytes(rng.randrange(64)) if rng.random() < 0.5 else
                    msgpack.packb({rng.choice(["role", "rank", "pool", "x"]): rng.choice([1, "s", [1] * 50, {}])}))
            evil.send_multipart([kind, body])
        for num_slots in (5_000_000, 2**62):
            reply = ask(job.socket(), p.Register(role="target", rank=1, pid=5, pool=POOL, num_slots=num_slots), 5000)
            assert isinstance(reply, p.Refused), reply
        for _ in range(2):
            job.socket().send_multipart([bytes((p.Kind.REGISTER,)), b"\x00" * (100 << 20)], copy=False)
        evil.send_multipart([bytes((p.Kind.HEARTBEAT,)), b"\x81\xa7metrics" + b"\x91" * 100_000 + b"\x01"])
        strangers = [job.socket() for _ in range(300)]
        for i, sock in enumerate(strangers):
            # The free seats: target/1 and drafter/0.
            sock.send_multipart(p.encode(p.Register(role=("target", "drafter")[i % 2], rank=1 - i % 2, pid=1000 + i,
                                                    pool=POOL, num_slots=1)))
        answers = [p.decode(s.recv_multipart()) for s in strangers if s.poll(5000)]
        job.assert_serving(target)
    rss.assert_within()
    assert len(answers) == 300 and all(isinstance(a, p.Refused) for a in answers)
    status = job.status()
    assert set(status["targets"]) == {"0"} and not status["drafters"]
    assert "Traceback" not in job.log_text()
    for sock in strangers:
        sock.close(linger=0)


@pytest.mark.timeout(90)
def test_status_floods_that_never_read_queue_little_and_status_stays_answered(job):
    """Was: 400 connections x 1,000 StatusRequests, never read: +907 MiB of queued replies and
    status unanswered; a seat's ~1 MiB of metrics copied into every reply: +981 MiB. Here 100
    connections x 200 requests, and a seated target that tries to push 1 MiB of metrics."""
    target, _ = job.worker("target", 0)
    fat = {f"m{i:02d}" + "x" * (p.MAX_STR - 8): 1.0 for i in range(p.MAX_METRICS)}  # ~1 MiB of names
    reply = ask(target, p.Heartbeat(metrics=fat))
    assert isinstance(reply, p.Rejected) and "HEARTBEAT body" in reply.reason, reply  # refused before decode
    ask(target, p.Heartbeat(metrics={f"m{i:02d}" + "x" * 50: 1.0 for i in range(p.MAX_METRICS)}))  # the most allowed
    assert len(msgpack.packb(job.status())) < 16 * 1024
    floods = [job.socket() for _ in range(100)]
    request = p.encode(p.StatusRequest())
    with PeakRss(job.child.pid) as rss:
        for _ in range(200):
            for sock in floods:
                sock.send_multipart(request)
        started = time.monotonic()
        assert job.status(timeout_ms=2000) is not None  # answered during the flood
        assert time.monotonic() - started < 2.0
        job.assert_serving(target)
    rss.assert_within()
    # Each flooding peer had at most one request outstanding: a few replies each, not 200.
    time.sleep(0.5)
    replies = 0
    for sock in floods[:10]:
        while sock.poll(0):
            sock.recv_multipart()
            replies += 1
    assert 10 <= replies <= 10 * 30, replies
    for sock in floods:
        sock.close(linger=0)
