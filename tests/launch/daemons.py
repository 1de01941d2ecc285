"""Private daemons for the launcher tests, everything in one scratch folder and on loopback: a
one-node Slurm (munged, slurmctld, slurmd; /work/shared/PLATFORM.md "Slurm on one machine") and an
sshd that lets in root with a generated key.

Every process started here (and, through Slurm's and ssh's environment propagation, every process
of the launched job) carries `MARKER=<scratch folder>` in its environment, so `reap` finds whatever
is left however it was reparented. `scripts/install_test_deps.sh` installs the packages (as root,
with apt-get); without them, or not root, `slurm_unavailable` / `sshd_unavailable` say why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.control.helpers import wait_for

MARKER = "LIBRA_LAUNCH_TEST"
SSHD = "/usr/sbin/sshd"
SBIN = "/usr/sbin:/sbin"


class Unavailable(RuntimeError):
    """The daemons cannot run on this machine; the message says why."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _path() -> str:
    """PATH with the daemons' folders (a root shell may lack them)."""
    return f"{os.environ.get('PATH', '')}:{SBIN}"


def _env(root: Path) -> dict[str, str]:
    """This environment, the daemons' folders on PATH, and the marker."""
    return {**os.environ, "PATH": _path(), MARKER: str(root)}


def _missing(*commands: str) -> list[str]:
    return [c for c in commands if not shutil.which(c, path=_path())]


def _needs_root_and(what: str, package: str, *commands: str) -> str | None:
    if os.geteuid() != 0:
        return f"{what} needs root (it runs as root with its state in a scratch folder)"
    missing = _missing(*commands)
    if missing:
        return (
            f"{what}: {', '.join(missing)} not installed (apt-get install {package}; "
            "scripts/install_test_deps.sh does it as root)"
        )
    return None


def slurm_unavailable() -> str | None:
    """Why a one-node Slurm cannot start here, or None."""
    return _needs_root_and(
        "one-node Slurm", "slurm-wlm munge", "munged", "slurmctld", "slurmd", "salloc", "srun", "sinfo"
    )


def sshd_unavailable() -> str | None:
    """Why a private sshd cannot start here, or None."""
    return _needs_root_and("private sshd", "openssh-server openssh-client", SSHD, "ssh", "ssh-keygen")


def marked_pids(root: Path) -> list[int]:
    """Processes whose environment carries `MARKER=root`, or whose command line names `root`."""
    tag, text = f"{MARKER}={root}".encode(), str(root).encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:  # gone, or a kernel thread
            continue
        if tag in environ or text in cmdline:
            found.append(int(entry.name))
    return found


def describe(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append(f"{pid}: {cmdline.strip()[:200]}")
    return out


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def reap(root: Path, grace_s: float = 10.0) -> list[str]:
    """SIGTERMs every process marked with `root`, SIGKILLs those left after `grace_s`; returns what
    it found."""
    pids = marked_pids(root)
    found = describe(pids)
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = marked_pids(root)
    _signal(pids, signal.SIGKILL)
    return found


def _stop_pid_file(path: Path, timeout_s: float = 20.0) -> None:
    try:
        pid = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return
    _signal([pid], signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)


def _wait(predicate, timeout_s: float, what: str, log: Path | None = None):
    try:
        return wait_for(predicate, timeout_s, what)
    except AssertionError:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log and log.is_file() else ""
        raise Unavailable(f"{what} did not come up within {timeout_s:.0f} s\n{tail}") from None


def _run(argv: list[str], env: dict[str, str], timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)


class SlurmCluster:
    """munged, slurmctld and slurmd under `root` (config, state, spool, logs, pid files): one node,
    this host, reached on 127.0.0.1 on two free ports. `env` is what clients (salloc, srun, sinfo)
    need: SLURM_CONF and the marker."""

    def __init__(self, root: Path):
        self.root = root
        self.node = socket.gethostname().split(".")[0]  # as slurmctld and slurmd name this host
        self.conf = root / "slurm.conf"
        self.socket = root / "munge" / "munge.socket"
        self.env = {**_env(root), "SLURM_CONF": str(self.conf)}
        self.pid_files = [root / "slurmd.pid", root / "slurmctld.pid", root / "munge" / "munged.pid"]

    def _munged(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        argv = ["munged", "--force", f"--key-file={key}", f"--socket={self.socket}"]
        argv += [f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}"]
        argv += [f"--seed-file={munge / 'munged.seed'}"]
        done = _run(argv, self.env)
        if done.returncode != 0:
            raise Unavailable(f"munged failed ({done.returncode}): {done.stderr.strip()}")
        _wait(self.socket.exists, 20, "munged", munge / "munged.log")

    def _write_conf(self) -> None:
        for name in ("state", "spool"):
            (self.root / name).mkdir()
        r = self.root
        self.conf.write_text(
            f"""ClusterName=librat
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=10
StateSaveLocation={r / "state"}
SlurmdSpoolDir={r / "spool"}
SlurmctldPidFile={r / "slurmctld.pid"}
SlurmdPidFile={r / "slurmd.pid"}
SlurmctldLogFile={r / "slurmctld.log"}
SlurmdLogFile={r / "slurmd.log"}
SlurmctldDebug=info
SlurmdDebug=info
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def node_state(self) -> str:
        done = _run(["sinfo", "-h", "-N", "-o", "%T"], self.env, timeout_s=30)
        return done.stdout.strip() if done.returncode == 0 else ""

    def start(self, timeout_s: float = 90.0) -> SlurmCluster:
        """Starts the daemons and waits for the node to be idle; `Unavailable` if they do not come up
        (call `stop` then)."""
        self._munged()
        self._write_conf()
        for daemon, extra in (("slurmctld", []), ("slurmd", ["-N", self.node])):
            done = _run([daemon, "-f", str(self.conf), *extra], self.env)
            if done.returncode != 0:
                raise Unavailable(f"{daemon} failed ({done.returncode}): {done.stderr.strip()}")
            _wait((self.root / f"{daemon}.pid").is_file, 30, daemon, self.root / f"{daemon}.log")
        _wait(
            lambda: self.node_state() == "idle", timeout_s, "the Slurm node (idle)", self.root / "slurmd.log"
        )
        return self

    def stop(self) -> list[str]:
        """Stops slurmd, slurmctld and munged by their pid files, then reaps anything else marked;
        returns what was still running after the daemons stopped."""
        for path in self.pid_files:
            _stop_pid_file(path)
        return reap(self.root)


class PrivateSshd:
    """An sshd on a free 127.0.0.1 port with its own config, host key and authorised client key
    (root) under `root`. `options` is what ssh needs to reach it (LIBRA_SSH_OPTS): port, key, pinned
    host key, no user config, and the marker forwarded to the session (AcceptEnv/SendEnv)."""

    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.log = root / "sshd.log"
        self.env = _env(root)
        self.process: subprocess.Popen | None = None
        known_hosts, key = root / "known_hosts", root / "client_key"
        self.options = [
            "-F", "/dev/null", "-p", str(self.port), "-i", str(key), "-o", "IdentitiesOnly=yes",
            "-o", f"UserKnownHostsFile={known_hosts}", "-o", "StrictHostKeyChecking=yes",
            "-o", f"SendEnv={MARKER}", "-o", "ConnectTimeout=20",
        ]  # fmt: skip

    def start(self, timeout_s: float = 30.0) -> PrivateSshd:
        r = self.root
        for name in ("host_key", "client_key"):
            done = _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(r / name)], self.env)
            if done.returncode != 0:
                raise Unavailable(f"ssh-keygen failed: {done.stderr.strip()}")
        (r / "authorized_keys").write_text((r / "client_key.pub").read_text())
        host_key = (r / "host_key.pub").read_text().split()
        (r / "known_hosts").write_text(f"[127.0.0.1]:{self.port} {host_key[0]} {host_key[1]}\n")
        (r / "sshd_config").write_text(
            f"""Port {self.port}
ListenAddress 127.0.0.1
HostKey {r / "host_key"}
PidFile {r / "sshd.pid"}
AuthorizedKeysFile {r / "authorized_keys"}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitTTY yes
AcceptEnv {MARKER}
PrintMotd no
LogLevel VERBOSE
"""
        )
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation folder
        argv = [SSHD, "-D", "-f", str(r / "sshd_config"), "-E", str(self.log)]
        self.process = subprocess.Popen(argv, env=self.env, stdin=subprocess.DEVNULL)

        def listening() -> bool:
            if self.process.poll() is not None:
                raise Unavailable(f"sshd exited ({self.process.returncode}): {self.log.read_text()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        _wait(listening, timeout_s, "sshd", self.log)
        return self

    def ssh(self, command: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
        argv = ["ssh", "-o", "BatchMode=yes", *self.options, "127.0.0.1", command]
        return _run(argv, self.env, timeout_s)

    def stop(self) -> list[str]:
        """Stops sshd, then reaps anything else marked; returns what was still running then."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return reap(self.root)


@contextlib.contextmanager
def started_or_skipped(daemon, unavailable: str | None, what: str):
    """Yields `daemon` started, skipping the tests (with the reason) where it cannot run; stops it
    after."""
    if unavailable:
        pytest.skip(unavailable)
    try:
        try:
            daemon.start()
        except Unavailable as e:
            pytest.skip(f"{what} did not start: {e}")
        yield daemon
    finally:
        daemon.stop()
