"""Who may connect: CURVE on non-loopback tcp:// by default, and the ipc:// socket folder that
this code picks in the shared temp directory closed to other users."""

import os

import numpy as np
import pytest

from dflash_ipc.config.load import load_config
from dflash_ipc.errors import ConfigError
from dflash_ipc.run.files import MAX_SOCKET_PATH, shared_socket_dir
from dflash_ipc.wire.security import curve_required, private_socket_dir


def test_curve_is_on_by_default_for_every_address_but_loopback():
    for address in ("tcp://10.0.0.5:29600", "tcp://node0:29600", "tcp://*:29600", "tcp://[fe80::1]:5"):
        assert curve_required("auto", address), address
    for address in ("tcp://127.0.0.1:29600", "tcp://localhost:1", "tcp://[::1]:1", "ipc:///tmp/x.sock"):
        assert not curve_required("auto", address), address
    assert curve_required("curve", "tcp://127.0.0.1:1") and not curve_required("none", "tcp://10.0.0.5:1")
    assert load_config(None, []).dispatch.auth == "auto"


@pytest.fixture
def temp_dir(tmp_path, monkeypatch):
    """The temp directory as this test's own folder (the real one is shared with other runs)."""
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_a_long_run_directory_gets_a_short_socket_that_binds(temp_dir):
    """A run directory path past ~100 characters would make the socket path longer than a
    Unix socket allows (ZMQError 'File name too long' once children had started)."""
    import zmq

    from dflash_ipc.dispatch.buckets import BucketSpec, plan_epoch
    from dflash_ipc.dispatch.dispatcher import Dispatcher
    from dflash_ipc.dispatch.proc import DispatcherProc
    run_dir = temp_dir / ("r" * 60) / ("u" * 60)
    cfg = load_config(None, [f"run.run_dir={run_dir}", "target.num_workers=1", "drafter.num_workers=1"])
    assert len(cfg.files.socket.encode()) <= MAX_SOCKET_PATH < len(str(run_dir / "dispatcher.sock"))
    assert os.path.dirname(cfg.files.socket) == shared_socket_dir()
    epochs = [plan_epoch(np.full(4, 32), BucketSpec(boundaries=(64,), token_budget=64), seed=0, epoch=0)]
    proc = DispatcherProc(cfg, Dispatcher(epochs, policy="pull", num_targets=1, num_drafters=1),
                          address=cfg.dispatcher_address)
    try:
        assert os.path.exists(cfg.files.socket)
        assert oct(os.stat(shared_socket_dir()).st_mode & 0o777) == "0o700"
        assert proc.socket.getsockopt(zmq.TYPE) == zmq.ROUTER
    finally:
        proc.close()
    assert not os.path.exists(cfg.files.socket)


def test_a_shared_socket_folder_open_to_others_or_of_another_user_is_refused(temp_dir):
    folder = shared_socket_dir()
    private_socket_dir(folder)  # made 0700: fine
    private_socket_dir(folder)  # and again
    os.chmod(folder, 0o777)
    with pytest.raises(ConfigError, match=r"not a folder of this user closed to others .*mode 777"):
        private_socket_dir(folder)
    os.chmod(folder, 0o700)
    if os.geteuid() == 0:  # root can hand it to another user, as a stranger could have made it
        os.chown(folder, 65534, 65534)
        with pytest.raises(ConfigError, match="uid 65534"):
            private_socket_dir(folder)
    private_socket_dir(str(temp_dir / "run"))  # a run directory is the user's own choice
    assert os.path.isdir(temp_dir / "run")


def test_the_job_secret_is_made_once_private_and_read_back(tmp_path):
    from dflash_ipc.wire.security import SECRET_BYTES, ensure_job_secret, read_job_secret, secret_matches
    path = str(tmp_path / "run" / "keys" / "job_secret")
    secret = ensure_job_secret(path)
    assert len(secret) == SECRET_BYTES and ensure_job_secret(path) == secret == read_job_secret(path)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600" and oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
    assert secret_matches(secret, read_job_secret(path)) and not secret_matches(secret, secret[:-1])
    assert ensure_job_secret(str(tmp_path / "other" / "job_secret")) != secret  # another job's


@pytest.mark.parametrize("damage, needle", [
    (lambda path: os.remove(path), "missing"),
    (lambda path: os.chmod(path, 0o644), "closed to others"),
    (lambda path: open(path, "w").write("garbage\n"), "not a job secret"),
    (lambda path: (os.remove(path), os.mkfifo(path, 0o600)), "not a file of this user"),
    (lambda path: (os.remove(path), os.symlink("/dev/zero", path)), "cannot open"),
])
def test_a_damaged_job_secret_is_one_clear_error(tmp_path, damage, needle):
    from dflash_ipc.wire.security import ensure_job_secret, read_job_secret
    path = str(tmp_path / "keys" / "job_secret")
    ensure_job_secret(path)
    damage(path)
    with pytest.raises(ConfigError, match=needle):
        read_job_secret(path)


def test_a_reader_concurrent_with_the_making_never_sees_an_empty_secret(tmp_path, monkeypatch):
    from dflash_ipc.wire import security
    path = str(tmp_path / "keys" / "job_secret")
    seen = []
    real = security.secrets.token_hex

    def token_hex(n):
        if n == security.SECRET_BYTES:  # the secret is being made: what does a reader find now?
            with pytest.raises(ConfigError) as err:
                security.read_job_secret(path)
            seen.append(str(err.value))
        return real(n)
    monkeypatch.setattr(security.secrets, "token_hex", token_hex)
    secret = security.ensure_job_secret(path)
    assert len(seen) == 1 and "missing" in seen[0]  # not "not a job secret ... remove it"
    assert security.read_job_secret(path) == secret and os.listdir(os.path.dirname(path)) == ["job_secret"]


def test_of_two_makers_at_once_the_first_secret_stays(tmp_path, monkeypatch):
    from dflash_ipc.wire import security
    path = str(tmp_path / "keys" / "job_secret")
    real_link = os.link
    first = []

    def link(src, dst):  # another maker links its secret in just before this one
        monkeypatch.setattr(security.os, "link", real_link)
        first.append(security.ensure_job_secret(path))
        return real_link(src, dst)
    monkeypatch.setattr(security.os, "link", link)
    assert security.ensure_job_secret(path) == first[0] == security.read_job_secret(path)
    assert os.listdir(os.path.dirname(path)) == ["job_secret"]  # no temp file left behind
