"""The hybrid lane's channel: each end proves the run's token before a frame passes, and a peer
that cannot, or that stalls, is dropped without holding up the hybrid replica that can."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from libra.training import grad_channel
from libra.training.grad_channel import MAX_PENDING_HANDSHAKES, Channel, LaneRefused, Listener
from tests.control.helpers import wait_for

TOKEN = "lane-test-token-0123456789"


@pytest.fixture
def listener():
    lane = Listener(TOKEN)
    yield lane
    lane.close()


def _accepted(listener: Listener) -> Channel:
    return wait_for(listener.poll, timeout_s=10, what="the listener to accept the lane")


def test_ends_that_share_the_token_exchange_frames(listener):
    replica = Channel.connect(listener.address, TOKEN)
    core = _accepted(listener)
    replica.send("hello", {"replica": 1}, b"\x00\x01")
    frame = core.recv(timeout_s=10)
    assert (frame.kind, frame.meta, frame.body) == ("hello", {"replica": 1}, b"\x00\x01")
    core.send("state", {"step": 3})
    assert replica.recv(timeout_s=10).meta == {"step": 3}
    assert listener.refused == 0
    replica.close()
    core.close()


def test_a_peer_without_the_token_is_refused_and_never_accepted(listener):
    with pytest.raises(LaneRefused, match="refused this end's proof"):
        Channel.connect(listener.address, "some-other-token")
    wait_for(lambda: listener.refused == 1, timeout_s=10, what="the refusal")
    assert listener.poll() is None


def test_a_replica_does_not_follow_a_core_without_the_token():
    """A replica unpickles what its core sends: it must not follow a listener posing as one, one
    that refuses its proof (another run's) or one that answers without the token."""
    other_run = Listener("another-runs-token")
    try:
        with pytest.raises(LaneRefused, match="refused this end's proof"):
            Channel.connect(other_run.address, TOKEN)
    finally:
        other_run.close()
    with socket.create_server(("127.0.0.1", 0)) as impostor:
        address = f"127.0.0.1:{impostor.getsockname()[1]}"

        def pose_as_core():
            sock, _ = impostor.accept()
            with sock:
                sock.sendall(grad_channel._GREETING + bytes(32))
                sock.recv(64)
                sock.sendall(bytes(32))  # a proof made without the token
                sock.recv(1)

        threading.Thread(target=pose_as_core, daemon=True).start()
        with pytest.raises(LaneRefused, match="did not prove the run's token"):
            Channel.connect(address, TOKEN)


def test_a_raw_peer_gets_no_frame_in(listener):
    """Bytes that skip the handshake (a frame sent at once) are a failed proof, not a frame."""
    with socket.create_connection(_host_port(listener.address)) as raw:
        raw.sendall(b"\x00" * 200)
        wait_for(lambda: listener.refused == 1, timeout_s=10, what="the refusal")
    assert listener.poll() is None


def test_a_stalled_peer_does_not_hold_up_the_replica(listener, monkeypatch):
    monkeypatch.setattr(grad_channel, "HANDSHAKE_TIMEOUT_S", 5.0)
    stalled = socket.create_connection(_host_port(listener.address))  # connects, says nothing
    try:
        replica = Channel.connect(listener.address, TOKEN)
        core = _accepted(listener)
        assert listener.refused == 0  # the replica was proven while the stalled peer still waited
        wait_for(lambda: listener.refused == 1, timeout_s=10, what="the stalled peer's refusal")
        replica.close()
        core.close()
    finally:
        stalled.close()


def test_a_peer_that_drips_bytes_is_dropped_at_the_handshake_deadline(listener, monkeypatch):
    """The deadline is the handshake's, not each read's: the 64 bytes of a proof at one per
    0.3 s would take 19 s."""
    monkeypatch.setattr(grad_channel, "HANDSHAKE_TIMEOUT_S", 1.5)
    with socket.create_connection(_host_port(listener.address)) as dripping:
        started = time.monotonic()
        try:
            while listener.refused == 0 and time.monotonic() - started < 12:
                dripping.sendall(b"x")
                time.sleep(0.3)
        except OSError:
            pass  # the listener closed the connection
        wait_for(lambda: listener.refused == 1, timeout_s=5, what="the dripping peer's refusal")
        assert time.monotonic() - started < 12
    assert listener.poll() is None


def test_a_flood_of_stalled_peers_delays_the_replica_but_never_refuses_it(listener, monkeypatch):
    monkeypatch.setattr(grad_channel, "HANDSHAKE_TIMEOUT_S", 1.0)
    flood = [
        socket.create_connection(_host_port(listener.address)) for _ in range(2 * MAX_PENDING_HANDSHAKES)
    ]
    try:
        replica = Channel.connect(listener.address, TOKEN)  # waits in the backlog for a free slot
        core = _accepted(listener)
        core.send("state", {"step": 1})
        assert replica.recv(timeout_s=10).meta == {"step": 1}
        replica.close()
        core.close()
    finally:
        for sock in flood:
            sock.close()


def test_a_lane_needs_a_token():
    with pytest.raises(ValueError, match="token"):
        Listener("")
    with pytest.raises(ValueError, match="token"):
        Channel.connect("127.0.0.1:1", "")


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def test_a_closed_listener_stops_listening():
    lane = Listener(TOKEN)
    address = lane.address
    lane.close()
    with pytest.raises(OSError):  # refused outright, not proven and then dropped
        Channel.connect(address, TOKEN, timeout_s=5)
