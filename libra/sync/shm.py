"""Shared-memory transport for rollout instances on the trainer's host.

The publisher creates one file under /dev/shm per buffer and version and the resharding executor
writes the buckets straight into its mapping: no intermediate full tensors. A rollout worker maps
the file copy-on-write (`MAP_PRIVATE`): reading costs no copy, and nothing it does can change the
publisher's file. New versions always get new files, so a worker's mapping of version v stays
intact while v+1 is written; `release` unlinks the files of a superseded version, and the memory
goes back when the last worker unmaps it (the loader keeps its committed version mapped as the
source to restore from if a later load fails midway).

Raw files + mmap rather than multiprocessing.shared_memory: in Python 3.11 attaching to a segment
registers it with the attaching process's resource tracker, which unlinks it when that process
exits, under the publisher's feet.

A publisher killed by SIGKILL cannot unlink its files. Names carry the publisher's PID namespace,
pid and a random part, so a later publisher that got the same pid never collides with them, and
each new publisher removes the files of publishers whose process is gone: only its own user's, and
only from its own PID namespace (a container sharing /dev/shm but not pids cannot tell whether
another's publisher lives).
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from libra.sync.transport import BufferManifest, TransferError, WeightReceiver, WeightSender

SHM_DIR = Path("/dev/shm")
_SAFE_KEY = re.compile(r"[^A-Za-z0-9_.-]")
_PUBLISHER_FILE = re.compile(r"libra-w(\d+)\.(\d+)-")
"""libra-w{PID namespace}.{pid}-{random}-v{version}-{key}"""
logger = logging.getLogger(__name__)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def pid_namespace() -> int:
    """This process's PID namespace (its inode; 0 where /proc does not say)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def remove_orphaned_segments(directory: Path = SHM_DIR) -> int:
    """Unlink this user's buffers of publishers in this PID namespace whose process no longer
    exists; returns how many."""
    removed, namespace, uid = 0, pid_namespace(), os.getuid()
    for path in directory.glob("libra-w*"):
        match = _PUBLISHER_FILE.match(path.name)
        if match is None or int(match.group(1)) != namespace or _process_exists(int(match.group(2))):
            continue
        try:
            if path.stat().st_uid != uid:
                continue
            path.unlink()
            removed += 1
        except OSError:
            pass  # swept by another publisher first, or not ours to remove
    if removed:
        logger.info("removed %d shared-memory buffers left by exited publishers in %s", removed, directory)
    return removed


class ShmSender(WeightSender):
    kind = "shm"

    def __init__(self, prefix: str | None = None, directory: Path = SHM_DIR) -> None:
        self.directory = Path(directory)
        if prefix is None:
            remove_orphaned_segments(self.directory)
        self.prefix = prefix or f"libra-w{pid_namespace()}.{os.getpid()}-{secrets.token_hex(4)}"
        self._buffers: dict[tuple[int, str], tuple[Path, mmap.mmap]] = {}

    def path(self, version: int, key: str) -> Path:
        return self.directory / f"{self.prefix}-v{version}-{_SAFE_KEY.sub('_', key)}"

    def allocate(self, version: int, key: str, num_bytes: int) -> torch.Tensor:
        if num_bytes <= 0:
            raise ValueError(f"buffer {key}: num_bytes must be positive, got {num_bytes}")
        if (version, key) in self._buffers:
            raise ValueError(f"buffer {key} of version {version} is already allocated")
        path = self.path(version, key)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_bytes)
            mapping = mmap.mmap(fd, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._buffers[(version, key)] = (path, mapping)
        return torch.frombuffer(mapping, dtype=torch.uint8)

    def seal(self, manifest: BufferManifest) -> dict[str, Any]:
        if (manifest.version, manifest.key) not in self._buffers:
            raise ValueError(f"buffer {manifest.key} of version {manifest.version} was never allocated")
        path, _ = self._buffers[(manifest.version, manifest.key)]
        return {"kind": self.kind, "path": str(path)}

    def release(self, version: int) -> None:
        for version_key in [k for k in self._buffers if k[0] == version]:
            path, mapping = self._buffers.pop(version_key)
            path.unlink(missing_ok=True)
            try:
                mapping.close()
            except BufferError:
                pass  # a tensor still views it; the memory goes when that tensor does

    def close(self) -> None:
        for version in {v for v, _ in self._buffers}:
            self.release(version)


class ShmReceiver(WeightReceiver):
    kind = "shm"

    def fetch(self, manifest: BufferManifest, handle: Mapping[str, Any]) -> torch.Tensor:
        path = Path(str(handle.get("path", "")))
        if not path.is_absolute():
            raise TransferError(
                f"shm handle for {manifest.key}: path must be absolute, got {handle.get('path')!r}"
            )
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise TransferError(f"{manifest.key} v{manifest.version}: {path} is gone (released?)") from None
        try:
            size = os.fstat(fd).st_size
            if size != manifest.num_bytes:
                raise TransferError(
                    f"{manifest.key} v{manifest.version}: {path} has {size} B, expected {manifest.num_bytes}"
                )
            # Copy-on-write: torch gets a writable buffer, the publisher's file stays untouched.
            mapping = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(mapping, dtype=torch.uint8)
