"""The guard of one process tree: the small parent that every worker of a node agent (and every
child the job starts) runs under, so that nothing it started outlives it or its owner.

    python -I -S worker_guard.py OWNER_PID [--private-tmp=DIR] COMMAND...

The guard makes itself a child subreaper, asks the kernel for `KILL_TREE_SIGNAL` when its parent
(OWNER_PID, the agent or the job) dies, and starts COMMAND as its child, in the guard's own process
group (the guard is started with `start_new_session=True`, so the owner's group signals reach the
worker and what it spawned). With `--private-tmp=DIR` (a directory its owner made for it:
`make_private_tmp`, or the sandbox pool's own for a worker of another uid) the worker's TMPDIR
is DIR, so what its libraries leave in the temp directory
(vLLM's ZMQ sockets and `vllm_dist_*` stores, which a killed engine never unlinks) goes with the
tree: the guard removes DIR, and so does the owner once the guard ended, should it have been
SIGKILLed with its worker (a whole process group killed at once); torch's compile
cache stays where it was (`TORCHINDUCTOR_CACHE_DIR`, unless set); vLLM's model-loading file
locks, kept in the temp directory, are then per worker (Libra's instances load safetensors, which
take no lock). Then it waits:

- the worker exits: whatever is left of its tree is SIGKILLed (every descendant: the process
  group, and processes that left it with setsid(), which re-parent to the guard), reaped, then
  the /dev/shm files it leaked and its private TMPDIR are removed (`sweep_shm`), and the guard
  ends as the worker did:
  same exit code, or killed by the same signal (the owner reads a negative return code then);
- its parent dies, or `KILL_TREE_SIGNAL` comes (the owner's stop grace ran out): the whole tree is
  SIGKILLed at once, reaped and swept, and the guard ends as the killed worker did;
- SIGTERM, SIGINT, SIGHUP: for the worker, which gets them through the process group; the guard
  keeps waiting. A guard that is SIGKILLed cannot clean up: the worker dies with it (its own
  parent-death signal), and the owner's group SIGKILL takes the rest of the group.

Run by path with `-I -S` it starts in milliseconds, sees no PYTHON* variables, no site packages
and not its own folder (`libra/control/types.py` would shadow the standard `types`), so it uses
the standard library only. Libra imports it for `guarded` and its constants.
"""

from __future__ import annotations

import ctypes
import getpass
import os
import re
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Collection, Sequence

KILL_TREE_SIGNAL = signal.SIGUSR1
"""Sent by the kernel when the guard's parent dies, or by the owner: kill the tree now."""
KILL_TIMEOUT_S = 30.0
"""How long the guard keeps killing a tree that does not die (processes in uninterruptible sleep,
or not ours to kill) before it gives up and ends; they re-parent to init then."""
SHM_DIR = "/dev/shm"
PRIVATE_TMP_FLAG = "--private-tmp="
PRIVATE_TMP_PREFIX = "libra-"
"""Short: vLLM binds Unix sockets in the directory (a 36-character name), a socket's path is
limited to 107 bytes, and a worker's directory sits in its agent's."""
OUR_SHM_FILE = re.compile(r"(psm_|sem\.mp-|vllm_|libra-w).*|.*-cpushm_\d+")
"""/dev/shm names our stack creates: multiprocessing.shared_memory segments (`psm_`, vLLM's
message queues and caches among them) and semaphores (`sem.mp-`), vLLM's mmap regions
(`vllm_offload_*`, `vllm_ec_*`) and its CPU TP groups (`{VLLM_DIST_IDENT}-tp:0-[0-1]-cpushm_N`,
the ident a `vllm_dist_*` file-store name or a port), and `libra.sync.shm`'s `libra-w*` buffers."""

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_WAITED = {signal.SIGCHLD, KILL_TREE_SIGNAL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def make_private_tmp() -> str:
    """A new directory of this process's TMPDIR, for one guarded worker's (`guarded`); remove it
    (`remove_private_tmp`) once the guard ended."""
    return tempfile.mkdtemp(prefix=PRIVATE_TMP_PREFIX)


def remove_private_tmp(private_tmp: str | None) -> None:
    """Removes a `make_private_tmp` directory (nothing for None, or one already gone). A guard
    that ends normally removes its own; its owner removes it too once the guard ended, for a
    guard SIGKILLed outright (a whole process group killed at once), which cannot."""
    if private_tmp is not None:
        shutil.rmtree(private_tmp, ignore_errors=True)


def guarded(argv: Sequence[str], private_tmp: str | None = None) -> list[str]:
    """The command line that runs `argv` under a guard owned by this process (`private_tmp`: a
    `make_private_tmp` directory for its TMPDIR, removed with the tree; for a worker that changes
    its uid, one its owner gave to that uid). Start it with
    `start_new_session=True` and no `preexec_fn` (a Python hook between fork and exec runs gRPC's
    fork handlers in a multi-threaded process and can abort it), from a thread that lives as
    long as the guard: the kernel ties the parent-death signal to the thread that forked."""
    flag = [PRIVATE_TMP_FLAG + private_tmp] if private_tmp else []
    return [sys.executable, "-I", "-S", os.path.abspath(__file__), str(os.getpid()), *flag, *argv]


def signal_group(process, sig: signal.Signals) -> None:
    """`sig` to the process group a guard (`process`, a Popen) leads; nothing if it is gone."""
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def end_guarded(process, grace_s: float) -> None:
    """Ends a guarded tree from its owner (`process`: the guard's Popen): SIGTERM to its group
    (the worker's own shutdown); after `grace_s`, `KILL_TREE_SIGNAL` to the guard, which kills
    the whole tree (the group alone would miss what left it with setsid()) and removes what it
    leaked, which a SIGKILLed guard could not; SIGKILL to the group only should the guard not
    end. Returns once the guard ended."""
    import subprocess  # only owners call this; the guard itself starts without it

    if process.poll() is None:
        signal_group(process, signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
        return
    except subprocess.TimeoutExpired:
        process.send_signal(KILL_TREE_SIGNAL)
    try:
        process.wait(timeout=KILL_TIMEOUT_S + 5.0)
    except subprocess.TimeoutExpired:
        signal_group(process, signal.SIGKILL)
        process.wait()


def shm_inodes(directory: str = SHM_DIR) -> set[int]:
    """Inode numbers of the files in `directory` now: what a later sweep must leave alone."""
    try:
        with os.scandir(directory) as entries:
            return {entry.inode() for entry in entries}
    except OSError:
        return set()


def sweep_shm(directory: str = SHM_DIR, existing_before: Collection[int] = ()) -> list[str]:
    """Removes the files of `directory` that our stack creates (`OUR_SHM_FILE`), that this user
    owns, that were not there before (inode not in `existing_before`) and that no live process
    holds open or mapped (processes this user cannot inspect are skipped), so the segments of a
    concurrent worker, which holds them mapped or open while it uses them, stay. Returns the
    names removed.

    Meant for tmpfs: on overlayfs /proc/PID/maps names the lower file, which would not match."""
    uid = os.geteuid()
    candidates: dict[tuple[int, int], str] = {}
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if not OUR_SHM_FILE.fullmatch(entry.name) or entry.inode() in existing_before:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                    candidates[(st.st_dev, st.st_ino)] = entry.name
    except OSError:
        return []
    if candidates:
        for in_use in _files_in_use(set(candidates)):
            del candidates[in_use]
    removed = []
    for name in candidates.values():
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            continue  # removed by its owner meanwhile
        removed.append(name)
    return sorted(removed)


def _files_in_use(files: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """Those of `files` ((device, inode) pairs) that a live process holds open or mapped."""
    in_use: set[tuple[int, int]] = set()
    inodes = {str(inode) for _, inode in files}
    for pid in _pids():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) in files:
                    in_use.add((st.st_dev, st.st_ino))
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    # start-end perms offset major:minor inode [path]
                    fields = line.split(maxsplit=5)
                    if len(fields) > 4 and fields[4] in inodes:
                        major, minor = fields[3].split(":")
                        key = (os.makedev(int(major, 16), int(minor, 16)), int(fields[4]))
                        if key in files:
                            in_use.add(key)
        except OSError:
            continue  # ended meanwhile, or not ours to inspect
    return in_use


def _pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        frontier = [child for pid in frontier for child in children.get(pid, ())]
        found.extend(frontier)
    return found


class _Tree:
    """The guard's children: the worker, and every orphan of its tree (the guard is their
    subreaper, so as long as a descendant lives, the guard has a child)."""

    def __init__(self, worker_pid: int):
        self.worker_pid = worker_pid
        self.worker_status: int | None = None
        self.killed: set[int] = set()

    def reap(self) -> bool:
        """Reaps every child that ended; True while some child lives."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return False
            if pid == 0:
                return True
            if pid == self.worker_pid:
                self.worker_status = status

    def kill(self) -> None:
        """SIGKILLs every descendant until none is left. A process forked after a scan is found by
        the next one: its parent was killed, so it re-parents here."""
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while self.reap():
            if time.monotonic() > deadline:
                print(f"worker guard: {_descendants(os.getpid())} did not die; giving up", file=sys.stderr)
                return
            for pid in _descendants(os.getpid()):
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.killed.add(pid)
                except OSError:
                    pass  # ended meanwhile, or not ours to kill
            signal.sigtimedwait({signal.SIGCHLD}, 0.1)


def main(argv: list[str]) -> int:
    owner_pid, command = int(argv[1]), argv[2:]
    private_tmp = None
    if command and command[0].startswith(PRIVATE_TMP_FLAG):
        private_tmp, command = command[0][len(PRIVATE_TMP_FLAG) :], command[1:]
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _WAITED)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, KILL_TREE_SIGNAL)
    if os.getppid() != owner_pid:  # the owner died before the signal was armed: start nothing
        remove_private_tmp(private_tmp)
        return 1
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)
    existing_shm = shm_inodes()
    tree = _Tree(_spawn(command, mask, libc, _worker_env(private_tmp)))
    # Only the worker holds its stdin and stdout: a reader of its stdout (the sandbox pool) sees
    # the end when the worker dies, not when the guard is done cleaning up.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    while tree.reap() and tree.worker_status is None:
        if signal.sigwaitinfo(_WAITED).si_signo == KILL_TREE_SIGNAL:
            tree.kill()
    tree.kill()
    removed = sweep_shm(SHM_DIR, existing_shm)
    remove_private_tmp(private_tmp)
    if tree.killed or removed:
        print(
            f"worker guard: SIGKILLed {sorted(tree.killed)}; removed from {SHM_DIR}: {removed}",
            file=sys.stderr,
        )
    return _end_like(tree.worker_status, libc)


def _worker_env(private_tmp: str | None) -> dict[str, str]:
    """The guard's environment, with the private TMPDIR if there is one. torch keys its compile
    cache on the temp directory (`torchinductor_USER` in it): that stays where the guard's is, or
    every worker would compile cold."""
    env = dict(os.environ)
    if private_tmp is not None:
        try:
            user = getpass.getuser()
        except (KeyError, OSError):
            user = f"uid_{os.getuid()}"
        user = re.sub(r'[\\/:*?"<>|]', "_", user)  # as torch names it
        env.setdefault(
            "TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
        )
        env["TMPDIR"] = private_tmp
    return env


def _spawn(command: list[str], mask: set[signal.Signals], libc, env: dict[str, str]) -> int:
    guard_pid = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        # Python ignores these at start-up; an ignored disposition would survive the exec.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        # A guard killed on its own takes the worker with it.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == guard_pid:
            os.execvpe(command[0], command, env)
    except BaseException as e:  # noqa: BLE001 - the child must never return into the guard
        os.write(2, f"worker guard: cannot start {command[0]!r}: {e}\n".encode())
    os._exit(127)


def _end_like(status: int | None, libc) -> int:
    """The worker's exit code; for a worker killed by a signal, the guard kills itself with that
    signal, so its owner reads the same negative return code as for an unguarded worker."""
    if status is None:  # the worker outlived every attempt to kill it
        return 128 + signal.SIGKILL
    if not os.WIFSIGNALED(status):
        return os.waitstatus_to_exitcode(status)
    sig = os.WTERMSIG(status)
    libc.prctl(_PR_SET_DUMPABLE, 0)  # a SIGSEGV or SIGABRT of the worker dumps no core of the guard
    if sig != signal.SIGKILL:
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
    return 128 + sig  # a signal whose default action killed the worker kills us before this


if __name__ == "__main__":
    sys.exit(main(sys.argv))
