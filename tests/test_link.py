"""The worker's link: registration replies, and what an `Unregistered` answer means."""

import pytest
import zmq

from dflash_ipc.wire import protocol as p
from dflash_ipc.errors import DispatcherRestarted, WorkerDeadError
from dflash_ipc.wire.link import DispatcherLink


@pytest.fixture
def router(tmp_path):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    address = f"ipc://{tmp_path}/d.sock"
    sock.bind(address)
    yield sock, address
    sock.close(linger=0)


def _next(sock):
    assert sock.poll(5000), "the link sent nothing"
    identity, *frames = sock.recv_multipart()
    return identity, p.decode(frames)


def _send(sock, identity, msg):
    sock.send_multipart([identity, *p.encode(msg)])


def test_unregistered_means_restart_from_a_new_instance_and_drop_from_the_same(router):
    sock, address = router
    link = DispatcherLink(address, identity="target/0", heartbeat_interval_s=10, timeout_s=30)
    try:
        register = p.Register(role="target", rank=0, pid=1, pool={}, num_slots=1)
        link.send(p.Ready(credits=1))  # sent before registering: answered Unregistered
        identity, _ = _next(sock)
        _send(sock, identity, p.Unregistered(instance="", reason="unregistered sender"))
        link.send(register)
        _, msg = _next(sock)
        assert isinstance(msg, p.Register)
        _send(sock, identity, p.Registered(role="target", rank=0, num_batches=1, instance="a"))
        assert link.recv(5.0) == p.Registered(role="target", rank=0, num_batches=1, instance="a")
        # A new dispatcher process answers with its own instance: register again.
        _send(sock, identity, p.Unregistered(instance="b", reason="unregistered sender"))
        with pytest.raises(DispatcherRestarted):
            link.recv(5.0)
        # Answers to what was sent before the new Register are skipped while registering.
        _send(sock, identity, p.Unregistered(instance="b", reason="unregistered sender"))
        _send(sock, identity, p.Registered(role="target", rank=0, num_batches=1, instance="b"))
        assert link.request(register, timeout_s=5.0).instance == "b"
        # The same instance saying it does not know us: we were dropped.
        _send(sock, identity, p.Unregistered(instance="b", reason="dropped: silent"))
        with pytest.raises(WorkerDeadError) as info:
            link.recv(5.0)
        assert not isinstance(info.value, DispatcherRestarted)
    finally:
        link.close()
