"""`die_with_parent`: a process armed with it ends when its parent does, and exits at once when
the parent it names is already gone."""

from __future__ import annotations

import subprocess
import sys
import time

CHILD = (
    "import signal, sys, time; from libra.control.lifetime import die_with_parent; "
    "die_with_parent(signal.SIGKILL, int(sys.argv[1])); print('armed', flush=True); time.sleep(60)"
)
PARENT = (
    "import os, subprocess, sys; "
    "argv = [sys.executable, '-c', sys.argv[1], str(os.getpid())]; "
    "child = subprocess.Popen(argv, stdout=subprocess.PIPE); "
    "child.stdout.readline(); print(child.pid, flush=True)"
)


def test_armed_child_ends_with_its_parent():
    parent = subprocess.run([sys.executable, "-c", PARENT, CHILD], capture_output=True, text=True, timeout=60)
    child_pid = int(parent.stdout)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(child_pid):
        time.sleep(0.05)
    assert not _running(child_pid), "the child outlived its parent"


def test_a_named_parent_that_is_gone_ends_the_child_at_once():
    child = subprocess.run([sys.executable, "-c", CHILD, "1"], capture_output=True, text=True, timeout=60)
    assert child.returncode == 1 and "armed" not in child.stdout


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
