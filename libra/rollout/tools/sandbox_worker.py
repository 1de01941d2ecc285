"""The sandbox worker: a long-lived process that runs untrusted Python code, one call at a time.

This file is executed by path (`python -I sandbox_worker.py ...`) by `SandboxPool`, never
imported by Libra, and uses only the standard library: whatever it imports is visible to the code
it runs, so it must not drag in Libra, torch or a token.

Start-up (as root, before serving anything) builds the walls that the calls share:
  1. child subreaper: orphans of a call re-parent to this worker, which reaps and kills them;
  2. new network namespace: no interface but a down loopback, so any connect fails at once;
  3. new mount namespace: a size-capped tmpfs on /tmp is the only writable place (the private
     directory), the other world-writable directories get a read-only empty tmpfs, /proc shows
     only the sandbox's own processes (hidepid), and the interpreter's prefix is made reachable;
  4. no_new_privs, then setgid/setuid to a sandbox uid owned by this worker alone: file
     permissions now apply, RLIMIT_NPROC binds (it does not bind root), and `kill(-1)` from the
     worker reaches exactly the processes a call left behind.
A layer that cannot be built (not root, no namespaces) is skipped and reported in the hello frame.

Each call then runs in a fresh fork (so a bomb kills only the fork) in its own session, with
rlimits (CPU, address space, processes, file size), a cleaned environment, an audit hook that
refuses sockets and writes outside the private directory (defence in depth, the kernel layers
above are the real walls), and stdout/stderr read through pipes with a byte cap. When the call
ends, times out or floods, every process of the sandbox uid is killed and the directory wiped.

Wire format on stdin/stdout: frames of a 4-byte big-endian length and a UTF-8 JSON object.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import struct
import sys
import time
import traceback

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
WORLD_WRITABLE_DIRS = ("/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue", "/run/shm")
ENV_WHITELIST = ("PATH", "LANG", "LC_ALL", "TZ")
READ_CHUNK = 65536
AF_UNIX = 1

_libc = ctypes.CDLL(None, use_errno=True)


# ---------------------------------------------------------------- framing


def read_frame(fd: int) -> dict | None:
    header = _read_exact(fd, 4)
    if header is None:
        return None
    (length,) = struct.unpack(">I", header)
    body = _read_exact(fd, length)
    if body is None:
        return None
    return json.loads(body.decode("utf-8"))


def write_frame(fd: int, message: dict) -> None:
    body = json.dumps(message).encode("utf-8")
    data = struct.pack(">I", len(body)) + body
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, size: int) -> bytes | None:
    chunks = []
    while size:
        chunk = os.read(fd, size)
        if not chunk:
            return None
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# ---------------------------------------------------------------- start-up walls


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_tmpfs(target: str, options: str, flags: int = 0) -> None:
    _check(
        _libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV | flags, options.encode()),
        f"mount tmpfs on {target}",
    )


def _expose_to_others(path: str) -> None:
    """Makes `path` (the interpreter's prefix) reachable for the sandbox uid in this mount
    namespace. An ancestor others may not traverse (e.g. /root, mode 0700, holding pyenv) is
    covered by an empty tmpfs into which only the one child on the way to `path` is bound back,
    so the rest of that directory stays hidden."""
    for _ in range(8):
        blocked = next(
            (a for a in _ancestors(path) if os.path.isdir(a) and not os.stat(a).st_mode & 0o001), None
        )
        if blocked is None:
            return
        child = path[len(blocked) :].lstrip("/").split("/")[0]
        stage = "/tmp/.libra-stage"
        os.mkdir(stage)
        _check(
            _libc.mount(f"{blocked}/{child}".encode(), stage.encode(), None, MS_BIND | MS_REC, None),
            f"bind {blocked}/{child}",
        )
        _mount_tmpfs(blocked, "size=4k,mode=0755")
        target = f"{blocked}/{child}"
        if os.path.isdir(stage):
            os.mkdir(target)
        else:
            open(target, "w").close()
        _check(_libc.mount(stage.encode(), target.encode(), None, MS_MOVE, None), f"move to {target}")
        os.rmdir(stage)
        _check(
            _libc.mount(
                b"none",
                blocked.encode(),
                None,
                MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV,
                b"size=4k,mode=0755",
            ),
            f"remount {blocked} read-only",
        )


def _mount_private_proc() -> None:
    """A /proc that shows only the sandbox uid's own processes: other processes' command lines
    (which may carry a token) and environments stay invisible."""
    flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
    for option in (b"hidepid=invisible", b"hidepid=2"):  # the name needs Linux >= 5.8
        if _libc.mount(b"proc", b"/proc", b"proc", flags, option) == 0:
            return
    _check(-1, "mount /proc with hidepid")


def _ancestors(path: str) -> list[str]:
    parts = os.path.normpath(path).split("/")[1:]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts) - 1)]


def build_walls(settings: dict) -> tuple[list[str], list[str], str]:
    """Builds the per-worker walls; returns (layers built, warnings, private directory)."""
    layers: list[str] = []
    warnings: list[str] = []
    uid = settings["uid"]
    is_root = os.geteuid() == 0
    private_dir = settings["fallback_dir"]

    if _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0:
        layers.append("subreaper")
    else:
        warnings.append("prctl(PR_SET_CHILD_SUBREAPER) failed: orphans of a call re-parent to init")

    try:
        _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        layers.append("netns")
    except OSError as exc:
        warnings.append(f"no network namespace ({exc}); only the audit hook refuses sockets")

    try:
        _check(_libc.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "make / private")
        owner = f",uid={uid},gid={uid}" if is_root else ""
        _mount_tmpfs("/tmp", f"size={settings['tmpfs_bytes']},mode=0700{owner}")
        private_dir = "/tmp"
        layers.append("mountns")
    except OSError as exc:
        warnings.append(
            f"no mount namespace ({exc}); the private directory is {private_dir} and world-writable "
            "directories stay writable to subprocesses of a call"
        )
    if "mountns" in layers:
        # Hardening inside the namespace; each step is independent of the others.
        for path in WORLD_WRITABLE_DIRS:
            if os.path.isdir(path) and not os.path.islink(path):
                try:
                    _mount_tmpfs(path, "size=4k,mode=0755", MS_RDONLY)
                except OSError as exc:
                    warnings.append(f"{path} stays writable to subprocesses of a call ({exc})")
        try:
            _mount_private_proc()
            layers.append("hidepid")
        except OSError as exc:
            warnings.append(f"/proc shows every process of the host to a call ({exc})")
        for path in settings["expose"] if is_root else ():
            try:
                _expose_to_others(path)
            except OSError as exc:
                warnings.append(f"{path} may be unreadable to the sandbox uid ({exc})")

    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0:
        layers.append("no_new_privs")
    if is_root:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
        layers.append("uid")
    else:
        warnings.append(
            "not root: cannot switch to a sandbox uid, so RLIMIT_NPROC is not applied and "
            "escaped processes are only killed by process group"
        )
    os.chdir(private_dir)
    return layers, warnings, private_dir


# ---------------------------------------------------------------- inside the fork


def _install_audit_hook(private_dir: str) -> None:
    """Refuses sockets and writes outside `private_dir` before the call's code runs."""
    root = os.path.realpath(private_dir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    realpath, fspath, join, getcwd = os.path.realpath, os.fspath, os.path.join, os.getcwd
    allowed_devices = ("/dev/null",)

    def inside(path) -> bool:
        if isinstance(path, int):
            return True  # an already open descriptor: its opening was checked
        path = fspath(path)
        if isinstance(path, bytes):
            path = path.decode("utf-8", "surrogateescape")
        full = realpath(join(getcwd(), path))
        return full == root or full.startswith(root + "/") or full in allowed_devices

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
                isinstance(flags, int) and flags & write_flags
            )
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the private directory is refused: {path}")
        elif event in (
            "os.rename",
            "os.remove",
            "os.rmdir",
            "os.mkdir",
            "os.symlink",
            "os.link",
            "os.chmod",
            "os.chown",
            "os.truncate",
            "shutil.rmtree",
            "os.utime",
        ):
            for path in args[:2]:
                if isinstance(path, (str, bytes, os.PathLike)) and not inside(path):
                    raise PermissionError(
                        f"sandbox: {event} outside the private directory is refused: {path}"
                    )
        elif event == "socket.__new__":
            family = args[1] if len(args) > 1 else None
            if family != AF_UNIX:
                raise PermissionError("sandbox: network access is disabled")
        elif event in (
            "socket.connect",
            "socket.bind",
            "socket.sendto",
            "socket.getaddrinfo",
            "socket.gethostbyname",
            "socket.gethostbyaddr",
        ):
            raise PermissionError("sandbox: network access is disabled")

    sys.addaudithook(hook)


def run_in_fork(request: dict, private_dir: str, out_w: int, err_w: int, uid_isolated: bool) -> None:
    """The child side of one call: never returns."""
    try:
        os.setsid()
        null = os.open("/dev/null", os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        limits = request["limits"]
        cpu_s = max(1, int(limits["cpu_time_s"] + 0.999))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
        if uid_isolated:
            # Counts every process of this uid: the worker, this fork and whatever it spawns.
            resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
        os.chdir(private_dir)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.stdout = open(1, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.stderr = open(2, "w", encoding="utf-8", errors="replace", closefd=False)
        sys.argv = ["<sandbox>"]
        _install_audit_hook(private_dir)
    except BaseException:  # noqa: BLE001 - the fork must never return into the worker loop
        os.write(err_w, traceback.format_exc().encode())
        os._exit(125)

    exit_code = 0
    try:
        code = compile(request["code"], "<sandbox>", "exec")
        exec(code, {"__name__": "__main__", "__builtins__": builtins})
    except SystemExit as exc:
        exit_code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException as exc:  # noqa: BLE001 - report every failure of user code as text
        try:
            # Skip this frame: the model should see its own code's frames only.
            traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        except BaseException:  # noqa: BLE001 - e.g. MemoryError while formatting
            pass
        exit_code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    os._exit(exit_code & 0xFF)


# ---------------------------------------------------------------- the worker loop


def kill_leftovers(pgid: int, uid_isolated: bool, subreaper: bool) -> None:
    """Kills the call's process group and, with a private uid, every process of that uid but us."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
    if not uid_isolated:
        _reap_all()
        return
    # kill(-1) signals every process we may signal except ourselves: with a uid of our own,
    # exactly the call's descendants, including ones that left the session with setsid(). A
    # pending SIGKILL aborts a fork in progress, so the set only shrinks. As the subreaper we
    # inherit every orphan, so "no child left" means no descendant left.
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        if not subreaper:
            break
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.0005)
    _reap_all()


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _collect_output(child: int, out_r: int, err_r: int, deadline: float, max_bytes: int):
    """Reads the child's output until it exits and its pipes are drained, or the deadline or the
    output cap is hit. Returns (stdout, stderr, total bytes, stop reason, wait status or None)."""
    buffers = {out_r: bytearray(), err_r: bytearray()}
    open_fds = [out_r, err_r]
    total = 0
    reason = None
    wait_status = None
    while open_fds and reason is None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            reason = "timeout"
            break
        # Poll the child now and then: a process it left running may hold the pipes open.
        ready, _, _ = select.select(open_fds, [], [], min(remaining, 0.05))
        if not ready and wait_status is None:
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid == child:
                wait_status = status
        if not ready and wait_status is not None:
            break  # the child is gone and nothing more is pending
        for fd in ready:
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                open_fds.remove(fd)
                continue
            total += len(chunk)
            room = max_bytes - (len(buffers[out_r]) + len(buffers[err_r]))
            buffers[fd] += chunk[: max(room, 0)]
            if total > max_bytes:
                reason = "output_limit"
    return buffers[out_r], buffers[err_r], total, reason, wait_status


def serve_call(request: dict, private_dir: str, layers: list[str]) -> dict:
    uid_isolated, subreaper = "uid" in layers, "subreaper" in layers
    start = time.monotonic()
    limits = request["limits"]
    deadline = start + limits["timeout_s"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    child = os.fork()
    if child == 0:
        os.close(out_r)
        os.close(err_r)
        run_in_fork(request, private_dir, out_w, err_w, uid_isolated)
    os.close(out_w)
    os.close(err_w)
    stdout, stderr, total, reason, wait_status = _collect_output(
        child, out_r, err_r, deadline, limits["max_output_bytes"]
    )
    if reason:
        try:
            os.killpg(child, signal.SIGKILL)
        except OSError:
            pass
    if wait_status is None:
        _, wait_status = os.waitpid(child, 0)
    kill_leftovers(child, uid_isolated, subreaper)
    os.close(out_r)
    os.close(err_r)
    _wipe(private_dir)

    exit_code = os.waitstatus_to_exitcode(wait_status)
    cpu_exceeded = exit_code in (-signal.SIGXCPU, -signal.SIGKILL) and reason is None
    if reason == "timeout" or cpu_exceeded:
        status = "timeout"
        note = "wall time limit exceeded" if reason == "timeout" else "CPU time limit exceeded"
    elif reason == "output_limit":
        status, note = "failure", f"output limit of {limits['max_output_bytes']} bytes exceeded"
    else:
        status, note = ("success" if exit_code == 0 else "failure"), ""
    return {
        "status": status,
        "stdout": stdout.decode("utf-8", "replace"),
        "stderr": stderr.decode("utf-8", "replace"),
        "exit_code": exit_code,
        "output_bytes": total,
        "truncated": total > len(stdout) + len(stderr),
        "note": note,
        "elapsed_s": time.monotonic() - start,
    }


def _wipe(private_dir: str) -> None:
    for name in os.listdir(private_dir):
        path = os.path.join(private_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass


def main() -> int:
    settings = json.loads(sys.argv[1])
    # The protocol owns fds 0 and 1; nothing else may print to fd 1.
    proto_in, proto_out = os.dup(0), os.dup(1)
    sys.stdout = sys.stderr
    layers, warnings, private_dir = build_walls(settings)
    write_frame(
        proto_out,
        {
            "hello": True,
            "layers": layers,
            "warnings": warnings,
            "private_dir": private_dir,
            "pid": os.getpid(),
        },
    )
    while True:
        request = read_frame(proto_in)
        if request is None:
            return 0
        write_frame(proto_out, serve_call(request, private_dir, layers))


if __name__ == "__main__":
    sys.exit(main())
