"""Worker processes of one node agent: spawn on given devices, reap, stop, report.

Each worker runs under its guard (`worker_guard.py`), which leads a new session and process group
(so stopping it also stops whatever it spawned) and, when the worker ends or the agent dies,
kills the worker's whole tree and removes the /dev/shm files it leaked and its private TMPDIR
(unless its spec sets TMPDIR). The worker gets the backend's visible-devices environment for
exactly its devices, stdout/stderr to a log file. A thread per worker spawns it, waits for the
exit and calls `on_change`, which the agent forwards to the controller. The pid reported is the
guard's, which is also the process group's id.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

from libra.backends.base import Backend
from libra.control.auth import TOKEN_ENV
from libra.control.convert import InvalidArgument
from libra.control.types import WorkerSpec, WorkerState, WorkerStatus
from libra.control.worker_guard import (
    end_guarded,
    guarded,
    make_private_tmp,
    remove_private_tmp,
    signal_group,
)

logger = logging.getLogger(__name__)

DEFAULT_STOP_GRACE_S = 5.0


@dataclasses.dataclass
class _Worker:
    status: WorkerStatus
    process: subprocess.Popen
    stop_requested: bool = False


class WorkerSupervisor:
    def __init__(
        self,
        backend: Backend,
        device_indices: set[int],
        log_dir: Path,
        on_change: Callable[[WorkerStatus], None],
    ):
        self._backend = backend
        self._device_indices = device_indices
        self._log_dir = log_dir
        self._on_change = on_change
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self.agent_id = ""

    def start(self, spec: WorkerSpec) -> WorkerStatus:
        """Spawns the worker; raises InvalidArgument for devices it does not have or that a running
        worker holds, and for a worker id in use."""
        with self._lock:
            unknown = sorted(set(spec.devices) - self._device_indices)
            if unknown:
                raise InvalidArgument(f"spec.devices {unknown} do not exist on this agent")
            if spec.worker_id in self._workers and not self._workers[spec.worker_id].status.state.ended:
                raise InvalidArgument(f"spec.worker_id {spec.worker_id!r} is already running")
            busy = sorted(set(spec.devices) & self._busy_devices())
            if busy:
                raise InvalidArgument(f"spec.devices {busy} are held by a running worker")
            log_path = self._log_dir / f"{spec.worker_id}.log"
            env = {**_inherited_environment(), **self._backend.worker_env(list(spec.devices)), **spec.env}
            _check_command(spec.argv[0], env, spec.cwd)
            spawned: futures.Future[subprocess.Popen] = futures.Future()
            threading.Thread(
                target=self._run,
                args=(spec, env, log_path, spawned),
                name=f"worker-{spec.worker_id}",
                daemon=True,
            ).start()
            try:
                process = spawned.result()
            except (OSError, ValueError) as e:
                raise InvalidArgument(f"spec.argv cannot be started: {e}") from None
            status = WorkerStatus(
                spec=spec,
                agent_id=self.agent_id,
                state=WorkerState.RUNNING,
                pid=process.pid,
                started_at=time.time(),
                log_path=str(log_path),
            )
            self._workers[spec.worker_id] = _Worker(status=status, process=process)
        logger.info(
            "worker %s started: pid %d on devices %s", spec.worker_id, process.pid, list(spec.devices)
        )
        return dataclasses.replace(status)

    def _busy_devices(self) -> set[int]:
        return {d for w in self._workers.values() if not w.status.state.ended for d in w.status.spec.devices}

    def _run(self, spec: WorkerSpec, env: dict[str, str], log_path: Path, spawned: futures.Future) -> None:
        """Spawns the worker's guard and waits for it, in a thread that lives exactly as long as
        the guard: the kernel's parent-death signal is tied to the spawning thread, so a worker is
        killed when its agent dies (its work has been handed back by then) but not before."""
        # A TMPDIR of its own, removed with it, unless its spec names one.
        private_tmp = make_private_tmp() if "TMPDIR" not in spec.env else None
        try:
            with open(log_path, "ab") as log:
                process = subprocess.Popen(
                    guarded(spec.argv, private_tmp),
                    env=env,
                    cwd=spec.cwd or None,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
        except Exception as e:  # whatever it is, start() waits for it while holding the lock
            remove_private_tmp(private_tmp)
            spawned.set_exception(e)
            return
        spawned.set_result(process)
        returncode = process.wait()
        # The worker's devices count as free once it ended. Its guard killed what the worker left
        # and removed its TMPDIR, unless the guard itself was SIGKILLed: then the rest of its
        # group must not keep running, and the directory is ours to remove.
        signal_group(process, signal.SIGKILL)
        remove_private_tmp(private_tmp)
        with self._lock:  # start() holds the lock until it has recorded the worker
            worker = self._workers[spec.worker_id]
            worker.status.state = WorkerState.STOPPED if worker.stop_requested else WorkerState.EXITED
            worker.status.exit_code = returncode
            worker.status.ended_at = time.time()
            status = dataclasses.replace(worker.status)
        logger.info("worker %s %s with code %d", spec.worker_id, status.state.name.lower(), returncode)
        self._on_change(status)

    def stop(self, worker_id: str, grace_s: float = 0.0) -> WorkerStatus:
        """SIGTERM to the worker's process group; after `grace_s` its guard SIGKILLs the worker's
        whole tree (the group alone would miss what left it with setsid()), and the group is
        SIGKILLed should the guard not end. Returns once it ended."""
        with self._lock:
            worker = self._workers.get(worker_id)
            if worker is None:
                raise LookupError(f"unknown worker_id {worker_id!r}")
            if worker.status.state.ended:
                return dataclasses.replace(worker.status)
            worker.stop_requested = True
        end_guarded(worker.process, grace_s or DEFAULT_STOP_GRACE_S)
        # The reaper records the final state; wait for it so the caller sees STOPPED.
        deadline = time.monotonic() + 5.0
        while not worker.status.state.ended and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            return dataclasses.replace(worker.status)

    def list(self) -> list[WorkerStatus]:
        with self._lock:
            return [dataclasses.replace(w.status) for w in self._workers.values()]

    def running_ids(self) -> list[str]:
        with self._lock:
            return [wid for wid, w in self._workers.items() if not w.status.state.ended]

    def stop_all(self, grace_s: float = 2.0) -> None:
        for worker_id in self.running_ids():
            self.stop(worker_id, grace_s)


def _inherited_environment() -> dict[str, str]:
    """The agent's environment without its secrets: a worker gets the run's token only when its
    spec passes it explicitly."""
    return {name: value for name, value in os.environ.items() if name != TOKEN_ENV}


def _check_command(argv0: str, env: dict[str, str], cwd: str) -> None:
    """Raises InvalidArgument when `argv0` names no executable (the exec happens in the child, too
    late to tell the caller)."""
    if "/" in argv0:
        path = argv0 if os.path.isabs(argv0) or not cwd else os.path.join(cwd, argv0)
        found = os.path.isfile(path) and os.access(path, os.X_OK)
    else:
        found = shutil.which(argv0, path=env.get("PATH", os.defpath)) is not None
    if not found:
        raise InvalidArgument(f"spec.argv cannot be started: no executable {argv0!r}")
