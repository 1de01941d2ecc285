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
"""

from __future__ import annotations

import io
import json
import queue
import socket
import struct
import threading
from dataclasses import dataclass, field

import torch

_HEADER = struct.Struct("!I")
_BODY = struct.Struct("!Q")


class PeerLost(ConnectionError):
    """The peer closed the connection or died, possibly in the middle of a frame."""


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
        self._sock = sock
        self._inbox: queue.Queue[Frame | PeerLost] = queue.Queue()
        self._outbox: queue.Queue[Frame | None] = queue.Queue()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, daemon=True, name="grad-channel-read")
        self._sender = threading.Thread(target=self._send_loop, daemon=True, name="grad-channel-send")
        self._reader.start()
        self._sender.start()

    @classmethod
    def connect(cls, address: str, timeout_s: float = 60.0) -> Channel:
        host, port = address.rsplit(":", 1)
        return cls(socket.create_connection((host, int(port)), timeout=timeout_s))

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
        self._sock.settimeout(None)
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
    """The core side: accepts hybrid connections in the background."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._accepted: queue.Queue[Channel] = queue.Queue()
        threading.Thread(target=self._accept_loop, daemon=True, name="grad-channel-accept").start()

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return
            self._accepted.put(Channel(sock))

    def poll(self) -> Channel | None:
        try:
            return self._accepted.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self._sock.close()
