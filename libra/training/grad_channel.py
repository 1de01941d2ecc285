"""The elastic hybrid pool's side channel: length-prefixed frames over one TCP connection between
a core train rank and its paired hybrid rank.

It is deliberately not a torch.distributed group: the core's Megatron process groups are never
rebuilt when a hybrid replica joins or dies, and a dead peer must show up as an error on one
socket, never as a hung collective. A frame is a JSON header (kind + metadata) and an optional
binary body (a flat tensor, or torch.save bytes):

    u32 header length | header JSON | u64 body length | body

A reader thread turns incoming frames into a queue, so the receiver waits with a timeout and a
half-written frame (the peer died mid-send) is detected as `PeerLost`. A sender thread drains an
outgoing queue, so a core rank never blocks on a slow follower.

Before any frame, each end proves to the other that it holds the run's token (`LIBRA_TOKEN`):
a challenge-response with HMAC-SHA256 over both ends' fresh nonces, so the token never crosses
the wire and a recorded exchange cannot be replayed. The listener's port is open on a host's
routable address for the whole run; without the proof, anyone who reached it could feed the
core rank gradients, or pose as a core rank to a hybrid replica, which unpickles what its core
sends. A peer that fails the proof, or has not finished it within `HANDSHAKE_TIMEOUT_S`, is
dropped (`Listener.refused` counts them); a few such peers at once delay a replica by a
timeout. Frames are not encrypted, as the collectives of the rest of the data plane (NCCL, Gloo)
are not: keep the training network private.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import queue
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_BODY = struct.Struct("!Q")
_GREETING = b"libra-lane/1"
_NONCE_BYTES = 32
_PROOF_BYTES = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT_S = 10.0
"""How long the listener gives a connection to prove itself, all of it (not per read: a peer
that drips a byte at a time is dropped as surely as one that says nothing)."""
MAX_PENDING_HANDSHAKES = 8
"""Connections a listener proves at once; further ones wait in the kernel's backlog: N stalling
peers ahead of a replica delay it by about ceil(N / 8) handshake timeouts (it waits up to its
connect timeout for the greeting). A sustained flood is the private network's to prevent."""


class PeerLost(ConnectionError):
    """The peer closed the connection or died, possibly in the middle of a frame."""


class LaneRefused(PermissionError):
    """The other end did not prove that it holds the run's token."""


def _proof(token: str, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(token.encode(), role + first + second, hashlib.sha256).digest()


def _receive(sock: socket.socket, n: int, deadline: float) -> bytes:
    """`n` bytes, all of them by `deadline` (monotonic; TimeoutError after it)."""
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the handshake's {n} bytes did not arrive in time ({len(data)} did)")
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise LaneRefused(
                f"the peer closed the connection during the handshake ({len(data)} of {n} bytes)"
            )
        data += chunk
    return data


def _prove_as_listener(sock: socket.socket, token: str) -> None:
    """The listener's half: challenge, check the connecting end's proof, answer with its own."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
    challenge = secrets.token_bytes(_NONCE_BYTES)
    sock.settimeout(HANDSHAKE_TIMEOUT_S)
    sock.sendall(_GREETING + challenge)
    reply = _receive(sock, _NONCE_BYTES + _PROOF_BYTES, deadline)
    nonce, proof = reply[:_NONCE_BYTES], reply[_NONCE_BYTES:]
    if not hmac.compare_digest(proof, _proof(token, b"connect", challenge, nonce)):
        raise LaneRefused("the connecting end did not prove the run's token")
    sock.sendall(_proof(token, b"listen", nonce, challenge))


def _prove_as_connector(sock: socket.socket, token: str, address: str, timeout_s: float) -> None:
    """The connecting end's half: answer the challenge (it may wait `timeout_s` for it, behind
    other connections in the listener's backlog), then check the listener's proof."""
    try:
        greeting = _receive(sock, len(_GREETING) + _NONCE_BYTES, time.monotonic() + timeout_s)
    except TimeoutError:
        raise LaneRefused(f"{address} sent no lane greeting within {timeout_s:.0f} s") from None
    if not greeting.startswith(_GREETING):
        raise LaneRefused(f"{address} is not a Libra lane (it greeted with {greeting[:16]!r})")
    challenge, nonce = greeting[len(_GREETING) :], secrets.token_bytes(_NONCE_BYTES)
    sock.sendall(nonce + _proof(token, b"connect", challenge, nonce))
    try:
        proof = _receive(sock, _PROOF_BYTES, time.monotonic() + HANDSHAKE_TIMEOUT_S)
    except (LaneRefused, TimeoutError):
        raise LaneRefused(
            f"the lane at {address} refused this end's proof: is it the same run's token?"
        ) from None
    if not hmac.compare_digest(proof, _proof(token, b"listen", nonce, challenge)):
        raise LaneRefused(f"the lane at {address} did not prove the run's token")


@dataclass
class Frame:
    kind: str
    meta: dict = field(default_factory=dict)
    body: bytes = b""


def tensor_to_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().view(-1).float().numpy().tobytes()


def tensor_from_bytes(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


def object_to_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def object_from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


class Channel:
    """One connected socket with a reader and a sender thread."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # the receiver's timeouts are the inbox's
        self._sock = sock
        self._inbox: queue.Queue[Frame | PeerLost] = queue.Queue()
        self._outbox: queue.Queue[Frame | None] = queue.Queue()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="grad-channel-read")
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="grad-channel-send")
        self._reader.start()
        self._sender.start()

    @classmethod
    def connect(cls, address: str, token: str, timeout_s: float = 60.0) -> Channel:
        """A channel to the listener at `address`, once each end proved it holds `token`
        (`LaneRefused` otherwise)."""
        if not token:
            raise ValueError("a lane needs the run's token")
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        try:
            _prove_as_connector(sock, token, address, timeout_s)
            return cls(sock)
        except BaseException:
            sock.close()
            raise

    # -- sending ---------------------------------------------------------------------------------

    def send(self, kind: str, meta: dict | None = None, body: bytes = b"") -> None:
        """Queues a frame; returns at once (frames go out in order)."""
        self._outbox.put(Frame(kind, meta or {}, body))

    def _send_loop(self) -> None:
        while (frame := self._outbox.get()) is not None:
            try:
                self.write_frame(frame)
            except OSError:
                self._closed.set()
                return

    def write_frame(self, frame: Frame) -> None:
        """Writes one frame now, from the calling thread (header first, then the body)."""
        header = json.dumps({"kind": frame.kind, "meta": frame.meta}).encode()
        self._sock.sendall(_HEADER.pack(len(header)) + header + _BODY.pack(len(frame.body)))
        self._sock.sendall(frame.body)

    # -- receiving -------------------------------------------------------------------------------

    def recv(self, timeout_s: float | None = None) -> Frame:
        """The next frame; `PeerLost` when the peer is gone, `TimeoutError` after `timeout_s`."""
        try:
            item = self._inbox.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"no frame from the peer within {timeout_s} s") from None
        if isinstance(item, PeerLost):
            self._inbox.put(item)  # every later recv fails the same way
            raise item
        return item

    def poll(self) -> Frame | None:
        """The next frame if one has arrived, else None (`PeerLost` when the peer is gone)."""
        try:
            return self.recv(timeout_s=0)
        except TimeoutError:
            return None

    def _read_loop(self) -> None:
        try:
            while True:
                (length,) = _HEADER.unpack(self._read_exactly(_HEADER.size))
                header = json.loads(self._read_exactly(length))
                (body_length,) = _BODY.unpack(self._read_exactly(_BODY.size))
                body = self._read_exactly(body_length)
                self._inbox.put(Frame(header["kind"], header["meta"], body))
        except (OSError, PeerLost, ValueError) as e:
            self._inbox.put(e if isinstance(e, PeerLost) else PeerLost(str(e)))

    def _read_exactly(self, n: int) -> bytes:
        chunks, remaining = [], n
        while remaining:
            chunk = self._sock.recv(min(remaining, 1 << 20))
            if not chunk:
                raise PeerLost(f"connection closed with {remaining} of {n} bytes unread")
            chunks.append(chunk)
            remaining -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self._outbox.put(None)
        self._sender.join(timeout=5)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


class Listener:
    """The core side: accepts hybrid connections in the background, each once it proved that it
    holds `token`."""

    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0):
        if not token:
            raise ValueError("a lane needs the run's token")
        self._token = token
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._accepted: queue.Queue[Channel] = queue.Queue()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.refused = 0
        """Connections closed unproven: a wrong or missing token, a stall."""
        threading.Thread(target=self._accept_loop, daemon=True, name="grad-channel-accept").start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            if not self._pending.acquire(timeout=1.0):
                continue  # every slot is proving a connection; new ones wait in the backlog
            try:
                sock, peer = self._sock.accept()
            except OSError:  # the listener was closed
                self._pending.release()
                return
            try:
                threading.Thread(
                    target=self._prove, args=(sock, peer), daemon=True, name="grad-channel-handshake"
                ).start()
            except RuntimeError:  # no thread to be had: the peer sees the connection close
                self._pending.release()
                sock.close()

    def _prove(self, sock: socket.socket, peer) -> None:
        try:
            _prove_as_listener(sock, self._token)
            channel = Channel(sock)
        except OSError as e:  # LaneRefused and TimeoutError among them
            with self._lock:
                self.refused += 1
            logger.warning("lane %s refused a connection from %s: %s", self.address, peer, e)
            sock.close()
            return
        finally:
            self._pending.release()
        with self._lock:
            if self._closed.is_set():
                channel.close()
            else:
                self._accepted.put(channel)

    def poll(self) -> Channel | None:
        try:
            return self._accepted.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        """Stops listening; closes the connections proven but never taken."""
        with self._lock:
            self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes an accept() blocked in the loop's thread
        except OSError:
            pass
        self._sock.close()
        while (channel := self.poll()) is not None:
            channel.close()
