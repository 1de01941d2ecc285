"""What a job run in this test process leaves behind: `RunWatch` records, while the job runs, every
process that runs under a worker guard (the agents' workers and what they spawned, the job's own
agent and sandbox workers) and the /dev/shm files of our stack those processes map or hold open;
once the job has ended, `leftovers` lists those still there.

Polled once a second: a process or file that lives for less than that may go unseen.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import psutil

from libra.control.worker_guard import OUR_SHM_FILE, SHM_DIR


class RunWatch:
    def __init__(self, interval_s: float = 1.0):
        self.interval_s = interval_s
        self.processes: dict[psutil.Process, str] = {}
        """Each with its command line when it was seen."""
        self.shm_files: dict[str, int] = {}
        """Path -> inode, so a later file under the same name is not taken for it."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="run-watch", daemon=True)

    def __enter__(self) -> RunWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def engines(self) -> list[psutil.Process]:
        return [p for p, cmdline in self.processes.items() if cmdline.startswith("VLLM::EngineCore")]

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            guarded = set()
            for proc in psutil.Process().children(recursive=True):
                if "worker_guard.py" in _cmdline(proc):
                    guarded.add(proc)
                    guarded.update(_children(proc))
            for proc in guarded:
                # The latest: a vLLM engine renames itself once it started.
                self.processes[proc] = _cmdline(proc) or self.processes.get(proc, "")
                for path in _shm_files_of(proc.pid):
                    try:
                        self.shm_files.setdefault(path, os.stat(path).st_ino)
                    except OSError:
                        pass  # removed meanwhile

    def leftovers(self, timeout_s: float = 15.0) -> tuple[list[str], list[str]]:
        """(processes still running, /dev/shm files still there), once both are empty or after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            processes = [f"{p.pid} {cmdline[:80]}" for p, cmdline in self.processes.items() if _running(p)]
            files = [path for path, inode in self.shm_files.items() if _inode(path) == inode]
            if not processes and not files or time.monotonic() > deadline:
                return processes, files
            time.sleep(0.2)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def _children(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _inode(path: str) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def _shm_files_of(pid: int) -> set[str]:
    prefix = SHM_DIR + "/"
    paths = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
        with open(f"/proc/{pid}/maps") as maps:
            paths.update(line.split(maxsplit=5)[-1].rstrip("\n") for line in maps if prefix in line)
    except OSError:
        pass  # ended meanwhile
    return {p for p in paths if p.startswith(prefix) and OUR_SHM_FILE.fullmatch(Path(p).name)}
