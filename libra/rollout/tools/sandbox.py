"""The sandbox pool: asyncio front of N long-lived sandbox workers (`sandbox_worker.py`).

`await pool.run(code)` takes an idle worker, sends it the code and the limits, and returns a
`SandboxResult` with a status (success / failure / timeout) and the payload size that the
scheduler's tool-return state needs. A worker that dies, hangs past its deadline or whose caller
is cancelled is killed with every process of its uid and replaced, so the pool keeps serving.

What each layer does and why is described in `sandbox_worker.py`. Here: the environment the
workers start with (a whitelist, so no token or key of the run is inherited), and the uids they
run as: one per worker, leased through a lock file so two pools on a host never share a uid
(`kill(-1)` in a worker must reach only its own calls' processes). Each worker runs under a guard
(`libra.control.worker_guard`, as this process's user, root included) that kills the worker and
everything its calls left when this process dies, however it dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import pwd
import shutil
import signal
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from libra.control.worker_guard import guarded
from libra.rollout.tools.config import SandboxConfig
from libra.trajectory import ToolStatus

logger = logging.getLogger(__name__)

WORKER_SCRIPT = Path(__file__).with_name("sandbox_worker.py")
UID_LOCK_DIR = Path("/tmp/libra-sandbox-uids")
"""Lock files of the leased uids; a fixed path (not $TMPDIR) so every pool on the host sees them."""
REPLY_GRACE_S = 5.0
"""How long past a call's own timeout the pool waits for the worker's reply before calling the
worker hung (the worker enforces the timeout itself; this only catches a broken worker)."""
_STATUS = {"success": ToolStatus.SUCCESS, "failure": ToolStatus.FAILURE, "timeout": ToolStatus.TIMEOUT}


@dataclass(frozen=True)
class SandboxResult:
    status: ToolStatus
    stdout: str
    stderr: str
    exit_code: int | None
    """Exit code of the call's process; negative: killed by that signal; None: the worker died."""
    payload_bytes: int
    """UTF-8 bytes of stdout + stderr as returned (after the output cap)."""
    output_bytes: int
    """Bytes the call wrote in all (more than `payload_bytes` when it was cut)."""
    truncated: bool
    note: str
    """Why the call was stopped, if it was ("wall time limit exceeded", …); empty otherwise."""
    latency_s: float
    """Wall time of `run`, queueing for a worker included."""


def clean_environment(private_dir: str) -> dict[str, str]:
    """The only variables a sandboxed call sees: nothing of the run's environment but PATH."""
    path_dirs = [str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
    return {
        "PATH": ":".join(dict.fromkeys(path_dirs)),
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": private_dir,
        "TMPDIR": private_dir,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "OMP_NUM_THREADS": "1",
    }


class _UidLease:
    """Exclusive use of one uid for one worker, held through an flock on a file named after it."""

    def __init__(self, config: SandboxConfig) -> None:
        UID_LOCK_DIR.mkdir(mode=0o700, exist_ok=True)
        if UID_LOCK_DIR.lstat().st_uid != os.geteuid() or UID_LOCK_DIR.is_symlink():
            raise RuntimeError(f"{UID_LOCK_DIR} is not a directory owned by this user: refusing to use it")
        for uid in range(config.uid_base, config.uid_base + config.uid_range):
            if _uid_has_account(uid):
                continue  # a real account: its files and processes are not ours to touch
            fd = os.open(UID_LOCK_DIR / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(
            f"no free sandbox uid in {config.uid_base}..{config.uid_base + config.uid_range - 1}: "
            "raise tools.sandbox.uid_range or stop other pools"
        )

    def release(self) -> None:
        os.close(self._fd)


def _uid_has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


class _Worker:
    """One worker process and the pipes to it; used by one call at a time."""

    def __init__(self, process: asyncio.subprocess.Process, uid: int | None, hello: dict, fallback_dir: str):
        self.process = process
        """The worker's guard, which leads the worker's process group."""
        self.pid: int = hello["pid"]
        """The worker's own pid."""
        self.uid = uid
        self.private_dir: str = hello["private_dir"]
        self.layers: list[str] = hello["layers"]
        self.warnings: list[str] = hello["warnings"]
        self.fallback_dir = fallback_dir

    @classmethod
    async def spawn(cls, config: SandboxConfig, uid: int | None) -> _Worker:
        fallback_dir = tempfile.mkdtemp(prefix="libra-sandbox-")
        if uid is not None:
            os.chown(fallback_dir, uid, uid)
        # The base interpreter, not a virtual environment's: the sandbox runs standard-library
        # code only, and a venv may sit below /tmp (a CI checkout), which the sandbox covers.
        python = config.python_executable or os.path.realpath(sys.executable)
        expose = sorted({sys.base_prefix, os.path.dirname(os.path.realpath(python))})
        settings = {
            "uid": uid,
            "fallback_dir": fallback_dir,
            "tmpfs_bytes": config.tmpfs_mb * 2**20,
            "expose": expose,
        }
        # The guard removes the directory with the worker's tree, also when this process is
        # SIGKILLed (the pool's own `kill` never runs then).
        process = await asyncio.create_subprocess_exec(
            *guarded([python, "-I", str(WORKER_SCRIPT), json.dumps(settings)], private_tmp=fallback_dir),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=clean_environment(fallback_dir),
            cwd="/",
            start_new_session=True,
        )
        try:
            hello = await asyncio.wait_for(_read_frame(process.stdout), timeout=30.0)
        except (TimeoutError, asyncio.IncompleteReadError) as exc:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
            raise RuntimeError(f"sandbox worker did not start ({type(exc).__name__})") from exc
        return cls(process, uid, hello, fallback_dir)

    async def call(self, request: dict, timeout_s: float) -> dict:
        body = json.dumps(request).encode("utf-8")
        self.process.stdin.write(struct.pack(">I", len(body)) + body)
        await self.process.stdin.drain()
        return await asyncio.wait_for(_read_frame(self.process.stdout), timeout=timeout_s)

    async def kill(self) -> None:
        """Kills the worker (its process group, with its guard) and everything running under its
        uid (the parent is root then)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self.uid is not None:
            for proc in psutil.process_iter(["uids"]):
                uids = proc.info["uids"]
                if uids is not None and self.uid in (uids.real, uids.effective):
                    with contextlib.suppress(psutil.Error):
                        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        await self.process.wait()
        shutil.rmtree(self.fallback_dir, ignore_errors=True)

    async def close(self) -> None:
        """Asks the worker to exit (EOF on its stdin), then makes sure it did."""
        with contextlib.suppress(Exception):
            self.process.stdin.close()
            await asyncio.wait_for(self.process.wait(), timeout=2.0)
        await self.kill()


async def _read_frame(reader: asyncio.StreamReader) -> dict:
    (length,) = struct.unpack(">I", await reader.readexactly(4))
    return json.loads((await reader.readexactly(length)).decode("utf-8"))


class SandboxPool:
    """Runs Python code in sandboxed workers. Use as `async with SandboxPool(config) as pool`."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.num_replaced = 0
        """Workers replaced because they died, hung, or their call was cancelled."""
        self.layers: list[str] = []
        """Isolation layers the workers built (see `sandbox_worker.build_walls`)."""
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._leases: list[_UidLease] = []
        self._pending: set[asyncio.Task] = set()
        self._last_spawn_error = ""
        self._closed = False

    async def start(self) -> SandboxPool:
        if os.geteuid() == 0:
            self._leases = [_UidLease(self.config) for _ in range(self.config.num_workers)]
            uids: list[int | None] = [lease.uid for lease in self._leases]
        else:
            uids = [None] * self.config.num_workers
        workers = await asyncio.gather(*(_Worker.spawn(self.config, uid) for uid in uids))
        for worker in workers:
            self._workers.add(worker)
            self._idle.put_nowait(worker)
        self.layers = workers[0].layers
        for warning in workers[0].warnings:
            logger.warning("sandbox: %s", warning)
        return self

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*self._pending, return_exceptions=True)
        await asyncio.gather(*(worker.close() for worker in list(self._workers)))
        self._workers.clear()
        for lease in self._leases:
            lease.release()
        self._leases = []

    @property
    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self._workers]

    @property
    def worker_uids(self) -> list[int]:
        return [worker.uid for worker in self._workers if worker.uid is not None]

    async def run(self, code: str, timeout_s: float | None = None) -> SandboxResult:
        """Runs `code` as a `__main__` module in a fresh fork of a sandbox worker.

        `timeout_s` (default and maximum: `config.timeout_s`) is the wall-clock limit. Never
        raises for what the code does; raises RuntimeError only when the pool is closed or a
        worker cannot be started.
        """
        if self._closed:
            raise RuntimeError("SandboxPool.run called after close()")
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"SandboxPool.run: timeout_s must be > 0, got {timeout_s}")
        if not self._workers and not self._pending:
            raise RuntimeError(f"SandboxPool has no workers left: {self._last_spawn_error}")
        config = self.config
        timeout_s = min(timeout_s or config.timeout_s, config.timeout_s)
        start = time.monotonic()
        worker = await self._idle.get()
        if worker.process.returncode is not None:  # died while idle: replace it before use
            worker = await self._respawn(worker)
        request = {
            "code": code,
            "env": clean_environment(worker.private_dir),
            "limits": {
                "timeout_s": timeout_s,
                "cpu_time_s": config.cpu_time_s,
                "memory_bytes": config.memory_mb * 2**20,
                "max_processes": config.max_processes,
                "max_output_bytes": config.max_output_bytes,
                "file_bytes": config.max_file_bytes,
            },
        }
        reply = None
        try:
            reply = await worker.call(request, timeout_s + REPLY_GRACE_S)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            logger.warning("sandbox worker pid %d lost during a call (%r): replacing it", worker.pid, exc)
        finally:
            if reply is None:
                # Cancelled, hung or dead: its pipe is in an unknown state, so it cannot be reused.
                task = asyncio.ensure_future(self._replace(worker))
                self._pending.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(self._pending.discard)
            else:
                self._idle.put_nowait(worker)
        return _to_result(reply, time.monotonic() - start)

    async def _replace(self, worker: _Worker) -> None:
        """Kills `worker` and puts a fresh one on its uid into the idle queue."""
        if self._closed:
            await worker.kill()
            return
        try:
            self._idle.put_nowait(await self._respawn(worker))
        except Exception as exc:  # noqa: BLE001 - logged; run() reports it once no worker is left
            self._last_spawn_error = repr(exc)
            logger.error("sandbox: cannot replace a worker (%r); the pool shrinks", exc)

    async def _respawn(self, worker: _Worker) -> _Worker:
        self._workers.discard(worker)
        self.num_replaced += 1
        await worker.kill()
        fresh = await _Worker.spawn(self.config, worker.uid)
        self._workers.add(fresh)
        return fresh


def _to_result(reply: dict | None, latency_s: float) -> SandboxResult:
    if reply is None:
        note = "the sandbox worker died or hung; it was replaced"
        return SandboxResult(ToolStatus.FAILURE, "", note, None, len(note), 0, False, note, latency_s)
    stdout, stderr = reply["stdout"], reply["stderr"]
    if reply["note"]:
        stderr = f"{stderr}\n[sandbox: {reply['note']}]" if stderr else f"[sandbox: {reply['note']}]"
    return SandboxResult(
        status=_STATUS[reply["status"]],
        stdout=stdout,
        stderr=stderr,
        exit_code=reply["exit_code"],
        payload_bytes=len(stdout.encode("utf-8")) + len(stderr.encode("utf-8")),
        output_bytes=reply["output_bytes"],
        truncated=reply["truncated"],
        note=reply["note"],
        latency_s=latency_s,
    )
