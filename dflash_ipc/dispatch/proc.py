"""The dispatcher process: a ZMQ ROUTER socket around `Dispatcher`.

Busy loop, one pass:
  1) poll the socket (up to one heartbeat interval),
  2) decode and hand each message to the logic; refuse what it rejects, keep serving;
     answer the status requests that are due, all from one status,
  3) tick: liveness of workers, rates, periodic ledger save,
  4) drain: once every batch is committed, save the ledger, tell everyone to shut down, exit.

Every frame is hostile until its sender holds a seat: a peer without one spends a budget
(`PeerBudget`: past it, frames are dropped unread), and only its `Register` and
`StatusRequest` are decoded (with the small bounds `protocol.LIMITS` gives those kinds);
anything else it sends is answered `Unregistered` unread. Status replies are bounded per
peer (`StatusAnswers`) and share one body, so connections that ask and never read queue
little.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time

import zmq

from dflash_ipc.wire import protocol as p
from dflash_ipc.config.schema import JobConfig
from dflash_ipc.data.dataset import TokenDataset
from dflash_ipc.dispatch.buckets import BucketSpec, plan_epochs, plan_stats
from dflash_ipc.dispatch.dispatcher import Dispatcher
from dflash_ipc.dispatch.generation_file import read_generation, write_generation
from dflash_ipc.dispatch.ledger import BatchState, Ledger
from dflash_ipc.dispatch.ledger_file import load_ledger, save_ledger
from dflash_ipc.dispatch.peer_budget import PeerBudget, StatusAnswers, Verdict
from dflash_ipc.errors import DataError, ProtocolError, UnregisteredSender
from dflash_ipc.run.json_files import write_json_atomic
from dflash_ipc.wire.security import ensure_job_secret, private_socket_dir, server_security

log = logging.getLogger(__name__)

LEDGER_SAVE_INTERVAL_S = 2.0
MAX_MESSAGES_PER_PASS = 256  # then the loop ticks (liveness, saves, signals) before reading more,
                             # or sooner: after a quarter heartbeat interval of handling (any slow
                             # request, 256 at a time, must not hold liveness checks and signals)
STOP_DRAIN_S = 1.0           # on SIGTERM, what already arrived is answered for at most this long
SEND_HWM = 1000              # queued replies per peer; past it ZMQ drops them (a peer not reading)
# A peer without a seat, per second: enough for a worker's messages sent before it learns
# that its dispatcher restarted, and its Register (at most protocol.MAX_REGISTER_BYTES).
UNREGISTERED_FRAMES = 200
UNREGISTERED_BYTES = 1 << 20
STATUS_INTERVAL_S = 0.2      # a peer hears the status at most this often (the supervisor: every ~1 s)


def next_generation(cfg: JobConfig) -> int:
    """The drafter generation a (re)started dispatcher begins with: one past the last one
    used in this run directory, as its drafters are new processes forming a new group."""
    last = read_generation(cfg.files.drafter_generation)
    return 0 if last is None else last + 1


def save_generation(cfg: JobConfig, generation: int) -> None:
    write_generation(cfg.files.drafter_generation, generation)


def plan_job(cfg: JobConfig, lengths) -> list:
    """The batches of every epoch, ids unique across epochs."""
    spec = BucketSpec(boundaries=tuple(cfg.data.bucket_boundaries), token_budget=cfg.data.token_budget,
                      pad_multiple=cfg.data.pad_multiple, max_batch_size=cfg.data.max_batch_size)
    return plan_epochs(lengths, spec, seed=cfg.run.seed, num_epochs=cfg.data.num_epochs)


def check_same_plan(ledger: Ledger, epochs: list, path: str) -> None:
    """A ledger restored from a run directory must be of this job's plan: the same data,
    budget, buckets, seed and epochs give the same batches. Anything else is refused."""
    planned = [b for batches in epochs for b in batches]
    if len(planned) != len(ledger):
        raise DataError(f"{path}: holds {len(ledger)} batches, this job plans {len(planned)}; the data, "
                        f"data.* or run.seed changed since that run: use a new run.run_dir")
    for batch in planned:
        if batch.batch_id not in ledger or ledger.entry(batch.batch_id).batch != batch:
            raise DataError(f"{path}: batch {batch.batch_id} differs from this job's plan (data, data.* "
                            f"or run.seed changed since that run): use a new run.run_dir")


def _bindable(address: str) -> str:
    """tcp://HOST:PORT with HOST resolved to its IP (ZMQ binds interfaces, not host names):
    `dflash-up --dispatcher tcp://node0:29600` binds node 0's interface for that name."""
    if not address.startswith("tcp://"):
        return address
    host, _, port = address[len("tcp://"):].rpartition(":")
    if host in ("*", "") or host.replace(".", "").isdigit() or host.startswith("["):
        return address
    ip = socket.gethostbyname(host)
    if ip.startswith("127.") and host != "localhost":
        # Debian's /etc/hosts maps the own host name to 127.0.1.1: the other nodes could not
        # connect there. Listen on every interface instead.
        log.warning("%s resolves to %s here; listening on tcp://*:%s", host, ip, port)
        return f"tcp://*:{port}"
    return f"tcp://{ip}:{port}"


class RefusalLog:
    """Refusals logged at most `limit` per `window_s` (a flood of garbage must not fill the
    disk); the rest are counted and summed up in one line when the window ends."""

    def __init__(self, limit: int = 20, window_s: float = 10.0, clock=time.monotonic) -> None:
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._window_start, self._logged, self._suppressed = clock(), 0, 0

    def log(self, level: int, fmt: str, *args) -> None:
        now = self.clock()
        if now - self._window_start >= self.window_s:
            if self._suppressed:
                log.warning("%d more refusals in the last %.0fs not logged", self._suppressed, self.window_s)
            self._window_start, self._logged, self._suppressed = now, 0, 0
        if self._logged < self.limit:
            self._logged += 1
            log.log(level, fmt, *args)
        else:
            self._suppressed += 1


class DispatcherProc:
    def __init__(self, cfg: JobConfig, dispatcher: Dispatcher, *, address: str) -> None:
        self.cfg = cfg
        self.dispatcher = dispatcher
        self.context = zmq.Context.instance()
        self.socket = self.context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A frame larger than any message is refused by ZMQ before it is buffered, and replies
        # to a peer that does not read are dropped past the high-water mark instead of queueing.
        self.socket.setsockopt(zmq.MAXMSGSIZE, p.MAX_BODY_BYTES + 1024)
        self.socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        if address.startswith("ipc://"):
            private_socket_dir(os.path.dirname(address[len("ipc://"):]))
        self.security = server_security(cfg, self.socket, address)
        self.socket.bind(_bindable(address))
        self.address = address
        self._last_tick = 0.0
        self._last_save = 0.0
        self.stop_requested = False  # set from another thread (tests, benches) to end run()
        self._saved_generation = dispatcher.drafter_generation
        self.refusals = RefusalLog()
        self.budget = PeerBudget(frames=UNREGISTERED_FRAMES, nbytes=UNREGISTERED_BYTES, window_s=1.0)
        self.status_answers = StatusAnswers(interval_s=STATUS_INTERVAL_S)

    def _send_all(self, outgoing) -> None:
        for identity, msg in outgoing:
            self.socket.send_multipart([identity, *p.encode(msg)])

    def _answer_status(self) -> None:
        """One status for every peer whose request is due; the replies share its frames."""
        due = self.status_answers.due()
        if not due:
            return
        kind, body = (zmq.Frame(f) for f in p.encode(p.StatusReply(status=self.dispatcher.status())))
        for identity in due:
            self.socket.send_multipart([identity, kind, body], copy=False)

    def _admitted(self, identity: bytes, body: list[bytes]) -> bool:
        """For a sender without a seat: whether its frames are within its budget."""
        verdict = self.budget.admit(identity, sum(len(f) for f in body))
        if verdict is not Verdict.ADMIT:
            self.dispatcher.refusals += 1  # counted in the status, as every refusal
        if verdict is Verdict.DROP_FIRST:
            self.refusals.log(logging.WARNING, "%r without a seat is over its budget of %d frames and %d bytes "
                              "a second: its frames are dropped unread", identity[:40], UNREGISTERED_FRAMES,
                              UNREGISTERED_BYTES)
        return verdict is Verdict.ADMIT

    def _on_frames(self, frames: list[bytes]) -> None:
        identity, body = frames[0], frames[1:]
        msg = None
        try:
            trusted = self.dispatcher.trusted(identity)  # a seat, or an observer with the secret
            if not self.dispatcher.holds_seat(identity):
                if not trusted and not self._admitted(identity, body):
                    return
                kind = p.peek_kind(body)
                if kind is not None and kind not in (p.Kind.REGISTER, p.Kind.STATUS_REQUEST):
                    raise UnregisteredSender(f"{kind.name} from a sender without a seat (not read)")
            msg = p.decode(body)
            if isinstance(msg, p.StatusRequest):
                self.status_answers.ask(identity, trusted=trusted)  # answered after this pass (_answer_status)
                return
            outgoing = self.dispatcher.handle(identity, msg)
            if isinstance(msg, (p.Committed, p.Resumed)):
                self.save_ledger()  # durable before its confirmation, or anything it causes, goes out
            if self.dispatcher.drafter_generation != self._saved_generation:
                self._saved_generation = self.dispatcher.drafter_generation
                save_generation(self.cfg, self._saved_generation)
            self._send_all(outgoing)
        except UnregisteredSender as exc:
            # A worker that outlived a dispatcher restart registers again on this answer;
            # one this dispatcher dropped (hung, replaced) sees its instance and exits.
            self.dispatcher.refusals += 1
            self.refusals.log(logging.INFO, "%r: %s", identity[:40], exc)
            self._send_all([(identity, p.Unregistered(instance=self.dispatcher.instance, reason=str(exc)))])
        except ProtocolError as exc:
            self.dispatcher.refusals += 1
            kind = body[0][0] if body and len(body[0]) == 1 else 0
            self.refusals.log(logging.WARNING, "refused a message from %r: %s", identity[:40], exc)
            # A refused registration gets its own answer, so the worker fails at once with
            # the reason instead of waiting out its start-up timeout.
            reply = (p.Refused(reason=str(exc)[:p.MAX_STR]) if isinstance(msg, p.Register) or kind == p.Kind.REGISTER
                     else p.Rejected(kind=kind, reason=str(exc)[:p.MAX_STR]))
            self._send_all([(identity, reply)])

    def save_ledger(self) -> None:
        save_ledger(self.dispatcher.ledger, self.cfg.files.ledger)
        self._last_save = time.monotonic()

    def write_final_status(self) -> None:
        """The status at the end of the job, for the supervisor's last line and for reports."""
        write_json_atomic(self.cfg.files.final_status, self.dispatcher.final_status().to_json(), sort_keys=True)

    def run(self) -> None:
        interval = self.cfg.dispatch.heartbeat_interval_s
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            # 1) poll
            events = dict(poller.poll(int(interval * 1000 / 4)))
            if self.stop_requested:
                # SIGTERM: answer what already arrived (a drafter's last Committed), then go.
                self._handle_waiting(STOP_DRAIN_S)
                self._answer_status()
                return
            # 2) handle what is waiting, a bounded number for a bounded time: liveness checks
            #    and signals below run on time whatever arrives
            if events:
                self._handle_waiting(interval / 4)
            self._answer_status()
            # 3) tick
            now = time.monotonic()
            if now - self._last_tick >= interval / 2:
                self._last_tick = now
                self._send_all(self.dispatcher.tick())
            if now - self._last_save >= LEDGER_SAVE_INTERVAL_S:
                self.save_ledger()
            # 4) drain
            if self.dispatcher.finished:
                self.save_ledger()
                self.write_final_status()
                seats = list(self.dispatcher.targets.values()) + list(self.dispatcher.drafters.values())
                self._send_all([(s.identity, p.Shutdown(reason="job finished")) for s in seats])
                log.info("all %d batches committed; dispatcher exits", self.dispatcher.num_batches)
                return

    def _handle_waiting(self, budget_s: float) -> None:
        """Messages already queued, up to MAX_MESSAGES_PER_PASS and `budget_s` of handling."""
        end = time.monotonic() + budget_s
        for _ in range(MAX_MESSAGES_PER_PASS):
            if time.monotonic() >= end or not self.socket.poll(0):
                return
            self._on_frames(self.socket.recv_multipart())

    def close(self) -> None:
        self.socket.close(linger=0)
        if self.security is not None:
            self.security.stop()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://"):])
            except FileNotFoundError:
                pass


def run_dispatcher(cfg: JobConfig) -> None:
    """Entry point of `dflash-ipc dispatcher`: plan, restore the ledger if any, serve."""
    dataset = TokenDataset(cfg.data.path)
    epochs = plan_job(cfg, dataset.lengths)
    for epoch, batches in enumerate(epochs):
        log.info("epoch %d plan: %s", epoch, plan_stats(batches))
    ledger = None
    if os.path.exists(cfg.files.ledger):
        # load() applies the restart rule: every batch not committed goes back to pending.
        ledger = load_ledger(cfg.files.ledger)
        check_same_plan(ledger, epochs, cfg.files.ledger)
        counts = ledger.counts()
        log.info("restored the ledger from %s: %d of %d batches committed, the rest pending",
                 cfg.files.ledger, counts[BatchState.COMMITTED], len(ledger))
    generation = next_generation(cfg)
    save_generation(cfg, generation)
    dispatcher = Dispatcher(epochs, num_targets=cfg.total_targets,
                            num_drafters=cfg.total_drafters, num_nodes=cfg.run.num_nodes,
                            drafter_generation=generation, heartbeat_timeout_s=cfg.dispatch.heartbeat_timeout_s,
                            drafter_timeout_s=cfg.supervise.drafter_step_timeout_s, ledger=ledger,
                            secret=ensure_job_secret(cfg.files.job_secret),
                            max_batch_losses=cfg.dispatch.max_batch_losses)
    # Until it serves, a SIGTERM exits as in any stage (cli: SystemExit); from then on it ends
    # the loop between two messages, never inside one (the ledger stays whole).
    proc = DispatcherProc(cfg, dispatcher, address=cfg.dispatcher_address)
    try:
        signal.signal(signal.SIGTERM, lambda signum, frame: setattr(proc, "stop_requested", True))
        try:
            proc.run()
        finally:
            # On SIGTERM too: the next dispatcher in this run directory resumes from it.
            proc.save_ledger()
    finally:
        proc.close()  # the socket (and its file) and the CURVE thread, even when the save fails
    if not dispatcher.finished:
        # Exit 0 means "every batch committed" to the supervisor; a stop is not that.
        raise SystemExit(128 + signal.SIGTERM)


def finished_before(cfg) -> bool:
    """True when the run directory's ledger says this job already committed every batch;
    DataError when that ledger is of another plan (other data, budget, seed or epochs), or
    when its last committed checkpoint is not on disk (a ledger restored from another run's
    backup: "finished" would be a lie, and export would ship an older model)."""
    from dflash_ipc.data.dataset import TokenDataset
    from dflash_ipc.dispatch.ledger_file import load_ledger
    from dflash_ipc.run.checkpoints import MANIFEST, CheckpointStore
    path = cfg.files.ledger
    if not os.path.exists(path):
        return False
    ledger = load_ledger(path, recover=False)  # only read: nothing restarts here
    check_same_plan(ledger, plan_job(cfg, TokenDataset(cfg.data.path).lengths), path)
    if not ledger.all_committed():
        return False
    step = ledger.last_committed_step()
    step_dir = CheckpointStore(cfg.files.checkpoints).path(step) if step is not None else None
    if step_dir is not None and not os.path.isfile(os.path.join(step_dir, MANIFEST)):
        raise DataError(f"{path}: says every batch is committed, the last at checkpoint step {step}, but "
                        f"{step_dir} is not on disk: this ledger is not of the checkpoints beside it (a "
                        "backup of another run restored?). Restore that checkpoint with the ledger, or start "
                        "over with a new run.run_dir")
    return True
