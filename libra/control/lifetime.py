"""Tying a process's life to its parent's (Linux): a process that would be left alone when the
one that started it dies asks the kernel for a signal then.

For a process that calls it itself, early (a hybrid replica's TP ranks). What a multi-threaded
gRPC process starts (the agent's workers, the job's agent and sandbox workers) runs under a guard
instead (`worker_guard.py`): no Python hook may run between fork and exec there, and the guard
also takes down whatever the child spawned.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM, parent_pid: int | None = None) -> None:
    """This process gets `sig` when its parent ends, however it ends. With `parent_pid` it also
    exits at once when that parent has already ended (before the signal was armed)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
