"""The worker guard (`libra/control/worker_guard.py`): nothing a worker started outlives the
worker, its node agent or the job, and the /dev/shm files the tree leaked and its private temp
directory go with it.

The tree tests start a worker that starts two children, one in the worker's process group and
one in a session of its own (setsid()), each holding a fresh `/dev/shm/psm_*` file mapped, and
that binds a Unix socket in its temp directory (as vLLM's ZMQ does, and never unlinks when
killed); then they end the worker or its owner in different ways and poll (up to 15 s) until
every process of the tree is gone and the files are removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from libra.control import WorkerRole, WorkerSpec, WorkerState
from libra.control.worker_guard import PRIVATE_TMP_FLAG, PRIVATE_TMP_PREFIX, shm_inodes, sweep_shm
from tests.control.helpers import wait_for

pytestmark = pytest.mark.multiprocess

DEADLINE_S = 15.0
"""How long a tree may take to die and its files to go."""
STARTUP_S = 60.0
"""How long an agent, a job or a sandbox may take to start a tree on a loaded machine."""
HOLD = """
import mmap, os, sys, time
path = '/dev/shm/psm_' + os.urandom(8).hex()
fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
held = mmap.mmap(fd, 4096)
os.close(fd)
with open(sys.argv[1] + '.tmp', 'w') as f:
    f.write(f'{os.getpid()} {path}')
os.rename(sys.argv[1] + '.tmp', sys.argv[1])
time.sleep(120)
"""
"""A process that maps a new /dev/shm file, writes "PID PATH" to argv[1], and sleeps."""


@dataclass
class Tree:
    """What a tree worker recorded: its pid and its children's, and their /dev/shm files."""

    pids: list[int]
    shm_paths: list[str]
    tmp_dir: str
    """The worker's temp directory, private to it (a socket bound in it)."""

    @property
    def files(self) -> list[str]:
        """What must go with the tree."""
        return [*self.shm_paths, self.tmp_dir]


def tree_worker(out_dir: Path, then: str) -> str:
    """Code of a worker that starts the two children, records the tree in `out_dir`, then runs
    `then` (one line)."""
    return textwrap.dedent(f"""
        import os, socket, subprocess, sys, tempfile, time
        out = {str(out_dir)!r}
        held_socket = socket.socket(socket.AF_UNIX)
        held_socket.bind(os.path.join(tempfile.gettempdir(), 'ipc-socket'))
        with open(os.path.join(out, 'tmpdir'), 'w') as f:
            f.write(tempfile.gettempdir())
        hold = [sys.executable, '-c', {HOLD!r}]
        subprocess.Popen([*hold, os.path.join(out, 'child')])
        subprocess.Popen([*hold, os.path.join(out, 'setsid')], start_new_session=True)
        while not all(os.path.exists(os.path.join(out, name)) for name in ('child', 'setsid')):
            time.sleep(0.02)
        with open(os.path.join(out, 'worker.tmp'), 'w') as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(out, 'worker.tmp'), os.path.join(out, 'worker'))
        {then}
    """)


def read_tree(out_dir: Path) -> Tree:
    wait_for(lambda: (out_dir / "worker").exists(), timeout_s=STARTUP_S, what="the worker's tree")
    pids, shm_paths = [int((out_dir / "worker").read_text())], []
    for name in ("child", "setsid"):
        pid, path = (out_dir / name).read_text().split()
        pids.append(int(pid))
        shm_paths.append(path)
    tree = Tree(pids, shm_paths, (out_dir / "tmpdir").read_text())
    assert all(_alive(pid) for pid in pids) and all(os.path.exists(p) for p in tree.files)
    # Private: a directory of its owner's temp directory, made for it.
    assert Path(tree.tmp_dir).name.startswith(PRIVATE_TMP_PREFIX)
    return tree


def assert_gone(pids: list[int], files: list[str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alive = [pid for pid in pids if _alive(pid)]
        left = [path for path in files if os.path.exists(path)]
        if not alive and not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert alive == [], f"processes outlived their owner: {alive}"
    assert left == [], f"files left behind: {left}"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _spec(worker_id: str, code: str) -> WorkerSpec:
    return WorkerSpec(worker_id, WorkerRole.GENERIC, (0,), (sys.executable, "-c", code))


def _ended(client, worker_id: str):
    workers = client.cluster_state().workers
    return next((w for w in workers if w.spec.worker_id == worker_id and w.state.ended), None)


def test_a_killed_agent_takes_its_workers_whole_trees_and_shm_files(client, spawn_agent, tmp_path):
    agent = spawn_agent()
    started = client.start_worker(agent.agent_id, _spec("tree", tree_worker(tmp_path, "time.sleep(120)")))
    tree = read_tree(tmp_path)
    agent.kill()
    assert_gone([started.pid, *tree.pids], tree.files)


def test_a_worker_that_exits_leaves_nothing_behind(client, spawn_agent, tmp_path):
    agent = spawn_agent()
    code = tree_worker(tmp_path, "while not os.path.exists(os.path.join(out, 'go')): time.sleep(0.02)")
    client.start_worker(agent.agent_id, _spec("leaver", code))
    tree = read_tree(tmp_path)
    (tmp_path / "go").touch()
    exited = wait_for(lambda: _ended(client, "leaver"), timeout_s=DEADLINE_S, what="the worker's exit")
    assert exited.state == WorkerState.EXITED and exited.exit_code == 0
    assert_gone(tree.pids, tree.files)


def test_a_stop_past_its_grace_kills_the_whole_tree(client, spawn_agent, tmp_path):
    agent = spawn_agent()
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + tree_worker(
        tmp_path, "time.sleep(120)"
    )
    client.start_worker(agent.agent_id, _spec("stubborn", code))
    tree = read_tree(tmp_path)
    stopped = client.stop_worker("stubborn", grace_s=1.0)
    assert stopped.state == WorkerState.STOPPED and stopped.exit_code == -signal.SIGKILL
    assert_gone(tree.pids, tree.files)


def test_a_worker_killed_by_a_signal_reports_it_negative(client, spawn_agent):
    agent = spawn_agent()
    code = "import os, resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); os.abort()"
    client.start_worker(agent.agent_id, _spec("aborter", code))
    ended = wait_for(lambda: _ended(client, "aborter"), timeout_s=DEADLINE_S, what="the worker's end")
    assert ended.state == WorkerState.EXITED and ended.exit_code == -signal.SIGABRT


def test_a_private_temp_directory_keeps_torchs_compile_cache_and_yields_to_a_spec_that_names_one(
    client, spawn_agent, tmp_path, monkeypatch
):
    """The private TMPDIR leaves torch's compile cache where the owner's temp directory has it
    (a worker must not compile cold); a spec that sets TMPDIR gets that one, kept after it."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the agent inherits ours
    agent = spawn_agent()
    record = textwrap.dedent(f"""
        import os, tempfile
        with open({str(tmp_path / "seen")!r}, 'w') as f:
            f.write(tempfile.gettempdir() + '\\n' + os.environ.get('TORCHINDUCTOR_CACHE_DIR', ''))
    """)
    client.start_worker(agent.agent_id, _spec("private", record))
    wait_for(lambda: _ended(client, "private"), timeout_s=DEADLINE_S, what="the worker's end")
    private, cache = (tmp_path / "seen").read_text().split("\n")
    assert Path(private).name.startswith(PRIVATE_TMP_PREFIX) and not os.path.exists(private)
    assert Path(cache).parent == Path(private).parent and Path(cache).name.startswith("torchinductor_")

    own = tmp_path / "own-tmp"
    own.mkdir()
    spec = WorkerSpec("own", WorkerRole.GENERIC, (0,), (sys.executable, "-c", record), {"TMPDIR": str(own)})
    client.start_worker(agent.agent_id, spec)
    wait_for(lambda: _ended(client, "own"), timeout_s=DEADLINE_S, what="the worker's end")
    assert (tmp_path / "seen").read_text().split("\n")[0] == str(own) and own.is_dir()


def test_a_guard_killed_with_its_worker_has_the_worker_temp_directory_removed_by_its_agent(
    client, spawn_agent, tmp_path
):
    """A whole process group SIGKILLed at once, the guard with it, which then cannot clean up:
    the agent, which made the worker's temp directory, removes it once the guard ended."""
    agent = spawn_agent()
    seen, part = tmp_path / "tmp", tmp_path / "tmp.part"
    code = textwrap.dedent(f"""
        import os, socket, tempfile, time
        held = socket.socket(socket.AF_UNIX)
        held.bind(os.path.join(tempfile.gettempdir(), 'ipc-socket'))
        with open({str(part)!r}, 'w') as f:
            f.write(tempfile.gettempdir())
        os.rename({str(part)!r}, {str(seen)!r})
        time.sleep(120)
    """)
    started = client.start_worker(agent.agent_id, _spec("group-killed", code))
    wait_for(seen.exists, timeout_s=STARTUP_S, what="the worker's temp directory")
    private = seen.read_text()
    assert Path(private).name.startswith(PRIVATE_TMP_PREFIX) and os.path.isdir(private)
    os.killpg(started.pid, signal.SIGKILL)  # the guard leads the group
    ended = wait_for(lambda: _ended(client, "group-killed"), timeout_s=DEADLINE_S, what="the worker's end")
    assert ended.exit_code == -signal.SIGKILL
    assert_gone([], [private])


JOB = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from libra.backends.config import BackendConfig
    from libra.config import LibraConfig
    from libra.control import WorkerRole, WorkerSpec
    from libra.control.config import ControlConfig
    from libra.job.cluster import JobCluster
    run_dir = Path(sys.argv[1])
    (run_dir / "logs").mkdir(parents=True)
    backend = BackendConfig(name="cpu", num_devices=1)
    config = LibraConfig(run_dir=str(run_dir), control=ControlConfig(port=0), backend=backend)
    cluster = JobCluster(config).start()
    argv = [sys.executable, "-c", sys.argv[2]]
    placement = cluster.place(1, "the tree worker")
    spec = WorkerSpec("tree", WorkerRole.GENERIC, placement.devices, tuple(argv), {})
    cluster.client.start_worker(placement.agent_id, spec)
    time.sleep(120)
""")


def test_a_killed_job_takes_its_agent_and_every_worker_tree(tmp_path):
    out_dir = tmp_path / "tree"
    out_dir.mkdir()
    job = subprocess.Popen(
        [sys.executable, "-c", JOB, str(tmp_path / "run"), tree_worker(out_dir, "time.sleep(120)")]
    )
    try:
        tree = read_tree(out_dir)
        # The job's agent has a private directory too, and the worker's is inside it.
        agent_tmp = str(Path(tree.tmp_dir).parent)
        assert Path(agent_tmp).name.startswith(PRIVATE_TMP_PREFIX)
        agent_tree = [p.pid for p in psutil.Process(job.pid).children(recursive=True)]
        job.kill()
        job.wait()
        assert_gone([*agent_tree, *tree.pids], [*tree.files, agent_tmp])
    finally:
        job.kill()


SANDBOX = textwrap.dedent("""
    import asyncio, sys, time
    from libra.rollout.tools.sandbox import SandboxPool
    from libra.rollout.tools.config import SandboxConfig
    SLEEPER = "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(99)'], start_new_session=1)"
    CALL = f"import subprocess, sys, time; {SLEEPER}; time.sleep(99)"
    async def main():
        pool = await SandboxPool(SandboxConfig(num_workers=1, timeout_s=120)).start()
        call = asyncio.ensure_future(pool.run(CALL))
        await asyncio.sleep(0.5)
        print(pool.worker_pids[0], flush=True)
        await call
    asyncio.run(main())
""")


def test_a_killed_job_takes_its_sandbox_workers_and_their_calls(tmp_path):
    job = subprocess.Popen([sys.executable, "-c", SANDBOX], stdout=subprocess.PIPE, text=True)
    try:
        guard = psutil.Process(int(job.stdout.readline())).parent()

        def call_started():
            tree = guard.children(recursive=True)
            return tree if len(tree) >= 3 else None  # the worker, the call's fork, its child

        tree = [p.pid for p in wait_for(call_started, timeout_s=STARTUP_S, what="the sandbox call")]
        # The worker's own temp directory (its HOME and TMPDIR) goes too: the pool cannot remove it.
        flag = PRIVATE_TMP_FLAG
        (worker_tmp,) = [a[len(flag) :] for a in guard.cmdline() if a.startswith(flag)]
        assert Path(worker_tmp).is_dir()
        job.kill()
        job.wait()
        assert_gone([guard.pid, *tree], [worker_tmp])
    finally:
        job.kill()


@pytest.fixture
def shm_dir():
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="guard-test-") as directory:
        yield Path(directory)


def _make(directory: Path, name: str) -> Path:
    path = directory / name
    path.write_bytes(bytes(4096))
    return path


def test_the_sweep_removes_only_new_unused_files_of_our_stack(shm_dir):
    older = _make(shm_dir, "psm_older")
    existing = shm_inodes(str(shm_dir))
    mapped, held_open, foreign = (_make(shm_dir, n) for n in ("psm_mapped", "sem.mp-opened", "not_ours"))
    names = ("psm_1a2b3c", "sem.mp-x1y2", "vllm_dist_ab12-tp:0-[0-1]-cpushm_0", "4711-tp:0-[0-1]-cpushm_1")
    unused = [_make(shm_dir, name) for name in (*names, "vllm_offload_e1.mmap", "libra-w1.2-ab-v3-key")]
    mapper = subprocess.Popen(
        [sys.executable, "-c", f"{MAP_AND_WAIT}", str(mapped)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert mapper.stdout.readline() == b"mapped\n"
        with open(held_open, "rb"):
            removed = sweep_shm(str(shm_dir), existing)
    finally:
        mapper.communicate(b"")
    assert removed == sorted(path.name for path in unused)
    assert [p.exists() for p in (older, mapped, held_open, foreign)] == [True] * 4


MAP_AND_WAIT = (
    "import mmap, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); m = mmap.mmap(fd, 4096); os.close(fd); "
    "print('mapped', flush=True); sys.stdin.read()"
)
"""Maps argv[1] (with no descriptor left open) until its stdin closes."""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_the_sweep_leaves_other_users_files(shm_dir):
    theirs = _make(shm_dir, "psm_theirs")
    os.chown(theirs, 54321, 54321)
    assert sweep_shm(str(shm_dir), set()) == [] and theirs.exists()
