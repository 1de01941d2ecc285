"""Helpers for sandbox tests: who is still running under the sandbox uids."""

from __future__ import annotations

import time

import psutil


def sandbox_processes(uids: list[int], exclude: list[int]) -> list[psutil.Process]:
    """Live (non-zombie) processes running as one of `uids`, other than the pids in `exclude`."""
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        info = proc.info
        if info["uids"] is None or proc.pid in exclude or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if info["uids"].real in uids or info["uids"].effective in uids:
            found.append(proc)
    return found


def assert_nothing_left(pool, settle_s: float = 0.2) -> None:
    """Only the workers themselves may run under the sandbox uids once a call has returned."""
    deadline = time.monotonic() + settle_s
    while True:
        left = sandbox_processes(pool.worker_uids, pool.worker_pids)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert left == [], f"processes left behind: {[(p.pid, p.name()) for p in left]}"
