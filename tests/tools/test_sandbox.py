"""The sandbox against hostile code: each attack is stopped or refused, reported with the right
status, leaves no process behind, and the pool keeps serving. Needs root (CI runs as root): the
uid, namespace and mount layers are built only then."""

from __future__ import annotations

import ast
import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from libra.trajectory import ToolStatus
from tests.tools.conftest import SECRETS
from tests.tools.helpers import assert_nothing_left

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's uid/namespace layers need root"),
]


def run(loop, pool, code: str, timeout_s: float | None = None):
    result = loop.run_until_complete(pool.run(textwrap.dedent(code), timeout_s))
    assert_nothing_left(pool)
    return result


def assert_still_serving(loop, pool) -> None:
    result = run(loop, pool, "print(6 * 7)")
    assert (result.status, result.stdout) == (ToolStatus.SUCCESS, "42\n")


def test_all_layers_are_built(pool):
    assert set(pool.layers) >= {"subreaper", "netns", "mountns", "hidepid", "no_new_privs", "uid"}
    assert len(set(pool.worker_uids)) == len(pool.worker_uids) == 2
    assert all(uid >= 61000 for uid in pool.worker_uids)


def test_success_reports_output_and_payload_size(loop, pool):
    result = run(loop, pool, "print('héllo'); import sys; print('warn', file=sys.stderr)")
    assert result.status == ToolStatus.SUCCESS and result.exit_code == 0
    assert result.stdout == "héllo\n" and result.stderr == "warn\n"
    assert result.payload_bytes == len("héllo\nwarn\n".encode()) == result.output_bytes
    assert not result.truncated


def test_exception_is_a_failure_with_the_users_traceback(loop, pool):
    result = run(loop, pool, "def f():\n    return 1 / 0\nf()")
    assert result.status == ToolStatus.FAILURE and result.exit_code == 1
    assert "ZeroDivisionError" in result.stderr and 'File "<sandbox>", line 2' in result.stderr
    assert "sandbox_worker" not in result.stderr


def test_infinite_loop_times_out(loop, pool):
    result = run(loop, pool, "while True: pass", timeout_s=0.5)
    assert result.status == ToolStatus.TIMEOUT
    assert result.note == "wall time limit exceeded"
    assert 0.5 <= result.latency_s < 2.0
    assert_still_serving(loop, pool)


def test_cpu_limit_stops_a_spinner_before_the_wall_clock(loop):
    from libra.rollout.tools.config import SandboxConfig
    from libra.rollout.tools.sandbox import SandboxPool

    async def spin():
        async with SandboxPool(SandboxConfig(num_workers=1, timeout_s=20, cpu_time_s=1)) as small:
            return await small.run("while True: pass")

    result = loop.run_until_complete(spin())
    assert result.status == ToolStatus.TIMEOUT and result.note == "CPU time limit exceeded"
    assert result.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert result.latency_s < 10


def test_memory_bomb_fails_with_memory_error(loop, pool):
    result = run(
        loop,
        pool,
        """
        blocks = []
        while True:
            blocks.append(bytearray(50 * 2**20))
    """,
    )
    assert result.status == ToolStatus.FAILURE and "MemoryError" in result.stderr
    assert_still_serving(loop, pool)


def test_fork_bomb_hits_the_process_limit_and_is_cleaned_up(loop, pool):
    result = run(
        loop,
        pool,
        """
        import os
        while True:
            os.fork()
    """,
    )
    assert result.status in (ToolStatus.FAILURE, ToolStatus.TIMEOUT)
    assert "Resource temporarily unavailable" in result.stderr or result.status == ToolStatus.TIMEOUT
    assert_still_serving(loop, pool)


def test_escaped_daemons_are_killed(loop, pool):
    # Double fork + setsid leaves the call's process group; the uid sweep must still get them.
    result = run(
        loop,
        pool,
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("parent done")
    """,
    )
    assert result.status == ToolStatus.SUCCESS and result.stdout == "parent done\n"


def test_output_flood_is_cut_and_stopped(loop, pool):
    result = run(loop, pool, "while True: print('x' * 1000)")
    assert result.status == ToolStatus.FAILURE and result.truncated
    assert "output limit" in result.note
    assert len(result.stdout) <= pool.config.max_output_bytes
    assert result.payload_bytes <= pool.config.max_output_bytes + 100
    assert_still_serving(loop, pool)


def test_writing_outside_the_private_directory_is_refused(loop, pool, tmp_path):
    targets = [
        tmp_path / "escape.txt",
        "/var/tmp/libra-escape.txt",
        "/work/libra-escape.txt",
        "/dev/shm/libra-escape.txt",
    ]
    for target in targets:
        result = run(loop, pool, f"open({str(target)!r}, 'w').write('x')")
        assert result.status == ToolStatus.FAILURE, target
        assert "PermissionError" in result.stderr or "FileNotFoundError" in result.stderr
    # A subprocess has no audit hook: the kernel layers (uid, read-only mounts) must hold alone.
    shell = "; ".join(f"echo x > {t}" for t in targets)
    result = run(
        loop,
        pool,
        f"""
        import subprocess
        done = subprocess.run(['sh', '-c', {shell!r}], capture_output=True, text=True)
        print(done.stderr)
    """,
    )
    assert result.status == ToolStatus.SUCCESS
    assert result.stdout.count("Read-only file system") + result.stdout.count(
        "Permission denied"
    ) + result.stdout.count("Directory nonexistent") == len(targets)
    for target in targets:
        assert not os.path.exists(target), target


def test_private_directory_is_writable_and_wiped_between_calls(loop, pool):
    for _ in range(3):  # both workers, whichever serves
        result = run(
            loop,
            pool,
            """
            import os
            print(sorted(os.listdir('.')), os.getcwd() == os.environ['HOME'] == os.environ['TMPDIR'])
            open('scratch.txt', 'w').write('x')
        """,
        )
        assert result.stdout == "[] True\n"


def test_no_secret_of_the_parent_is_visible(loop, pool):
    assert os.environ["LIBRA_TOKEN"] == SECRETS["LIBRA_TOKEN"]  # the pool started with them set
    # A process of the run holding a token on its command line, as `--token` flags do.
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", SECRETS["LIBRA_TOKEN"]])
    try:
        result = run(
            loop,
            pool,
            """
            import os
            print(dict(os.environ))
            pids = [p for p in os.listdir('/proc') if p.isdigit()]
            print('visible', sorted(pids))
            for pid in [str(os.getppid()), '1'] + pids:
                for name in ('environ', 'cmdline'):
                    try:
                        print(open(f'/proc/{pid}/{name}', 'rb').read())
                    except OSError:
                        pass
            try:
                print(open('/root/.bash_history').read())
            except OSError as exc:
                print('refused', type(exc).__name__)
        """,
        )
    finally:
        holder.kill()
        holder.wait()
    assert result.status == ToolStatus.SUCCESS
    for secret in SECRETS.values():
        assert secret not in result.stdout
    assert "LIBRA_TOKEN" not in result.stdout and "refused" in result.stdout
    visible = ast.literal_eval(result.stdout.split("visible ")[1].splitlines()[0])
    assert 1 <= len(visible) <= 2 and str(holder.pid) not in visible  # only the sandbox's own


def test_network_is_refused_before_connecting(loop, pool):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        # In-process: the audit hook refuses the socket before any syscall.
        result = run(
            loop,
            pool,
            f"""
            import socket
            socket.create_connection(('127.0.0.1', {port}), timeout=2)
        """,
        )
        assert result.status == ToolStatus.FAILURE and "network access is disabled" in result.stderr
        # A subprocess (no hook): the empty network namespace fails the connect at once.
        result = run(
            loop,
            pool,
            f"""
            import subprocess, sys
            code = "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
            done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)
            print(done.returncode, done.stderr.strip().splitlines()[-1])
        """,
        )
        assert result.status == ToolStatus.SUCCESS
        assert "Network is unreachable" in result.stdout, result.stdout
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


def test_a_killed_worker_is_replaced(loop, pool):
    replaced = pool.num_replaced
    victim = pool.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    loop.run_until_complete(asyncio.sleep(0.1))
    for _ in range(4):
        assert_still_serving(loop, pool)
    assert pool.num_replaced == replaced + 1 and victim not in pool.worker_pids


def test_a_worker_dying_mid_call_gives_failure_and_is_replaced(loop, pool):
    replaced = pool.num_replaced

    async def kill_during_call():
        call = asyncio.ensure_future(pool.run("import time; time.sleep(2)"))
        await asyncio.sleep(0.3)
        busy = [pid for pid in pool.worker_pids if pid in {p.pid for p in _busy_workers(pool)}]
        os.kill(busy[0], signal.SIGKILL)
        return await call

    result = loop.run_until_complete(kill_during_call())
    assert result.status == ToolStatus.FAILURE and result.exit_code is None
    loop.run_until_complete(asyncio.sleep(0.5))
    assert_still_serving(loop, pool)
    assert pool.num_replaced == replaced + 1


def _busy_workers(pool):
    """Worker processes that have a child (i.e. a call running)."""
    import psutil

    return [psutil.Process(pid) for pid in pool.worker_pids if psutil.Process(pid).children()]


def test_cancelled_call_replaces_its_worker(loop, pool):
    replaced = pool.num_replaced

    async def cancel():
        call = asyncio.ensure_future(pool.run("import time; time.sleep(2)"))
        await asyncio.sleep(0.2)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0.5)

    loop.run_until_complete(cancel())
    assert_still_serving(loop, pool)
    assert pool.num_replaced == replaced + 1
    assert len(pool.worker_pids) == 2


def test_concurrent_calls_share_the_workers(loop, pool):
    async def many():
        return await asyncio.gather(*(pool.run(f"print({i} ** 2)") for i in range(12)))

    results = loop.run_until_complete(many())
    assert [r.stdout for r in results] == [f"{i**2}\n" for i in range(12)]
    assert_nothing_left(pool)


def test_two_pools_never_share_a_uid(loop, pool):
    from libra.rollout.tools.config import SandboxConfig
    from libra.rollout.tools.sandbox import SandboxPool

    async def second():
        async with SandboxPool(SandboxConfig(num_workers=2)) as other:
            result = await other.run("import os; print(os.getuid())")
            return other.worker_uids, result

    uids, result = loop.run_until_complete(second())
    assert not set(uids) & set(pool.worker_uids)
    assert int(result.stdout) in uids
    assert_still_serving(loop, pool)
