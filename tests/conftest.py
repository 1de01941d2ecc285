"""Session set-up shared by every test folder: the warm-started tiny policy is built before the
first test that needs it (marker `warm_start`), outside any test's timeout.

Cold, the build takes ~5 min on two idle cores and more than twice that on a loaded box (it is
cached per machine, `libra.tasks.warm_start`): inside the first job test's 300 s timeout it did
not fit. It runs in a child process (it sets torch's thread count, which would leak into the
tests), with its evaluations as progress lines. If it fails, the tests that need it fail with its
output; the others run.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import deque

import pytest

WARM_START_BUILD_TIMEOUT_S = 2400
"""A cold build on a box loaded 3x over (~15 min) with room to spare."""
_BUILD = (
    "import logging, sys\n"
    "logging.basicConfig(level=logging.INFO, stream=sys.stdout, format='[libra] warm start: %(message)s')\n"
    "from libra.tasks.warm_start import cached_warm_start\n"
    "print('[libra] warm start: built in', cached_warm_start(), flush=True)\n"
)
_build_failure: str | None = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    global _build_failure
    if session.config.option.collectonly or not any(
        i.get_closest_marker("warm_start") for i in session.items
    ):
        return
    from libra.tasks.warm_start import REPORT_FILE, warm_start_dir

    target = warm_start_dir()
    if (target / REPORT_FILE).is_file():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else print
    say(
        f"[libra] building the warm-started tiny policy into {target} before the tests that need it "
        "(once per machine: ~5 min on two idle cores, longer under load)"
    )
    _build_failure = _build_warm_start(say)
    if _build_failure is not None:
        say(f"[libra] {_build_failure}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _build_failure is not None and item.get_closest_marker("warm_start"):
        pytest.fail(_build_failure, pytrace=False)


def _build_warm_start(say) -> str | None:
    """Runs the build in a child, echoing its `[libra]` lines; None on success, else why not."""
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", _BUILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timer = threading.Timer(WARM_START_BUILD_TIMEOUT_S, child.kill)
    timer.start()
    tail: deque[str] = deque(maxlen=40)
    try:
        for line in child.stdout:
            tail.append(line)
            if line.startswith("[libra]"):
                say(line.rstrip())
        child.wait()
    finally:
        timer.cancel()
    elapsed = time.monotonic() - started
    if child.returncode == 0:
        say(f"[libra] warm start: {elapsed:.0f} s")
        return None
    if elapsed >= WARM_START_BUILD_TIMEOUT_S:
        return f"the warm-started tiny policy did not build within {WARM_START_BUILD_TIMEOUT_S} s"
    return f"the warm-started tiny policy failed to build (exit {child.returncode}):\n{''.join(tail)}"
