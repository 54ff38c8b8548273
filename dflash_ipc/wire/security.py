"""Who may talk to the dispatcher: ZMQ CURVE on tcp://, file permissions on ipc://.

Security model (docs/operations.md, "Security"): on `ipc://` the socket lives in the run
directory, made mode 0700, so only the job's own user can connect (a run directory whose path
is too long for a socket has it in a folder of this user in the temp directory, made 0700;
one there that another user owns, or that others may open, is refused: they could replace
the socket). On `tcp://` every
connection is encrypted and authenticated with CURVE when `dispatch.auth` is `curve`, or
`auto` (the default) and the host is not loopback: the supervisor of node 0 makes one key
pair for the dispatcher and one for the job's workers in `<run_dir>/keys/` (mode 0700,
secret files 0600) on the first start; the dispatcher accepts only the workers' public key,
so processes of other jobs and strangers are refused by the ZAP handshake before any
message is read. Other nodes need the same `keys/` folder (a shared run directory, or copied).

Seats: on every address (loopback and ipc:// too) a `Register` for a target or drafter seat
must carry the job's secret, 32 random bytes that node 0's supervisor (or a dispatcher
started by hand) writes once to `<run_dir>/keys/job_secret` (mode 0600, folder 0700). Every
stage reads it from there, so a process of the job's own user can take a seat (a restarted
child, a stage run by hand with `--config`) and a peer that only reached the socket cannot,
whatever it read from a status reply. The dispatcher compares in constant time.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dflash_ipc.errors import ConfigError
from dflash_ipc.run.files import shared_socket_dir

log = logging.getLogger(__name__)

SERVER, CLIENT = "dispatcher", "worker"
SECRET_BYTES = 32  # the job secret's length; written as 64 hex digits
LOOPBACK_HOSTS = ("127.", "localhost", "[::1]", "::1")


def private_socket_dir(directory: str) -> None:
    """Makes the folder of an ipc:// socket (mode 0700). The one this code picks in the temp
    directory, which every user may write, must then be a directory of this user closed to
    everyone else: one made by another user would let them replace the socket (ConfigError,
    before anything binds)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    if os.path.abspath(directory) != os.path.abspath(shared_socket_dir()):
        return  # the run directory, or a folder the user named in dispatch.address
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"dispatch.address: the socket folder {directory} (for a run directory whose path "
                          f"is too long for a socket) is not a folder of this user closed to others (uid "
                          f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): another user could replace the "
                          f"socket; remove it, or use a shorter run.run_dir")


def curve_required(auth: str, address: str) -> bool:
    """Whether the dispatcher at `address` uses CURVE under `dispatch.auth`."""
    if auth == "none" or not address.startswith("tcp://"):
        return False
    if auth == "curve":
        return True
    host = address[len("tcp://"):].rpartition(":")[0]
    return not host.startswith(LOOPBACK_HOSTS)


def ensure_keys(keys_dir: str) -> None:
    """Creates the job's key pairs once (node 0's supervisor); keeps existing ones."""
    if not zmq.has("curve"):
        raise ConfigError("dispatch.auth: this pyzmq/libzmq has no CURVE support; install a pyzmq wheel "
                          "built with libsodium, or set dispatch.auth=none on a trusted network")
    os.makedirs(keys_dir, mode=0o700, exist_ok=True)
    os.chmod(keys_dir, 0o700)
    allowed = os.path.join(keys_dir, "allowed")
    os.makedirs(allowed, mode=0o700, exist_ok=True)
    for name in (SERVER, CLIENT):
        if not os.path.exists(os.path.join(keys_dir, f"{name}.key_secret")):
            public, secret = zmq.auth.create_certificates(keys_dir, name)
            os.chmod(secret, 0o600)
            if name == CLIENT:
                os.replace(public, os.path.join(allowed, os.path.basename(public)))
            log.info("made the job's %s CURVE key pair in %s", name, keys_dir)


def _load(path: str, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"dispatch.auth: cannot read the job's CURVE key {path} ({exc}); on a node other "
                          f"than node 0 copy <run_dir>/keys from node 0 (or share the run directory)") from None
    if secret and secret_key is None:
        raise ConfigError(f"dispatch.auth: {path} holds no secret key")
    return public, secret_key


class ServerSecurity:
    """The dispatcher's side: its key pair on the socket, a ZAP authenticator allowing only
    the job's worker key."""

    def __init__(self, socket: zmq.Socket, keys_dir: str) -> None:
        public, secret = _load(os.path.join(keys_dir, f"{SERVER}.key_secret"), secret=True)
        self.authenticator = ThreadAuthenticator(socket.context)
        self.authenticator.start()
        self.authenticator.configure_curve(domain="*", location=os.path.join(keys_dir, "allowed"))
        socket.curve_secretkey, socket.curve_publickey = secret, public
        socket.curve_server = True

    def stop(self) -> None:
        self.authenticator.stop()


def server_security(cfg, socket: zmq.Socket, address: str) -> ServerSecurity | None:
    """CURVE on the dispatcher's socket when the job's address requires it (before bind)."""
    if not curve_required(cfg.dispatch.auth, address):
        return None
    return ServerSecurity(socket, cfg.files.curve_keys)


def client_security(cfg, socket: zmq.Socket, address: str) -> None:
    """CURVE on a worker's (or tool's) socket to the dispatcher, when required (before connect)."""
    if not curve_required(cfg.dispatch.auth, address):
        return
    keys = cfg.files.curve_keys
    public, secret = _load(os.path.join(keys, f"{CLIENT}.key_secret"), secret=True)
    server_public, _ = _load(os.path.join(keys, f"{SERVER}.key"), secret=False)
    socket.curve_secretkey, socket.curve_publickey, socket.curve_serverkey = secret, public, server_public


def ensure_job_secret(path: str) -> bytes:
    """The job's secret, made once (node 0's supervisor before its children start, or a
    dispatcher started by hand); an existing one is kept: a restarted supervisor, the other
    nodes and every stage run by hand read the same file."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    if os.path.lexists(path):
        return read_job_secret(path)
    # Written whole to a temp file, then linked into place: a concurrent reader (a stage started
    # by hand at the same time) finds no file or the whole secret, never an empty one.
    tmp = f"{path}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never replaces: of two makers at once, the first one's stays
        except FileExistsError:
            return read_job_secret(path)
    finally:
        os.unlink(tmp)
    log.info("made the job's secret %s", path)
    return read_job_secret(path)


def read_job_secret(path: str) -> bytes:
    """The secret in `path`; ConfigError when it is missing, not a regular file of this user
    closed to others (another user could read or replace it), or not 64 hex digits."""
    fix = "remove it: the next start of the job (or of its dispatcher) makes a new one"
    try:
        # O_NONBLOCK: a FIFO planted there must not block the reader; it is refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"{path}: the job's secret is missing; node 0's supervisor (or the dispatcher) makes it "
                          f"when it starts: start the dispatcher first, and on a node other than node 0 copy "
                          f"<run_dir>/keys from node 0 (or share the run directory)") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot open the job's secret ({exc}); {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ConfigError(f"{path}: the job's secret is not a file of this user closed to others (uid "
                              f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); {fix}")
        raw = os.read(fd, 4 * SECRET_BYTES)
    finally:
        os.close(fd)
    text = raw.decode("ascii", "replace").strip()
    if len(text) != 2 * SECRET_BYTES or any(c not in "0123456789abcdef" for c in text):
        raise ConfigError(f"{path}: not a job secret ({2 * SECRET_BYTES} hex digits); {fix}")
    return bytes.fromhex(text)


def secret_matches(expected: bytes, given: bytes) -> bool:
    """Constant-time: the time to refuse says nothing about how much of a guess was right."""
    return hmac.compare_digest(expected, given)
