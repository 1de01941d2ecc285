"""Structured logs: with LIBRA_LOG_DIR set, a process's records land as JSON lines in its own file,
exceptions included; without it, only the readable stderr stream. Run in child processes, since
`configure_logging` replaces the root logger's handlers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from libra.logs import LOG_DIR_ENV

SCRIPT = """
import logging
from libra.logs import configure_logging
path = configure_logging("unit-test")
print(path)
logging.getLogger("libra.demo").info("step %d done", 3)
try:
    raise ValueError("bad input: training.lr")
except ValueError:
    logging.getLogger("libra.demo").exception("step failed")
"""


def _run(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", SCRIPT], env={**os.environ, **env}, capture_output=True, text=True, check=True
    )


def test_records_are_json_lines_in_the_log_dir(tmp_path):
    done = _run({LOG_DIR_ENV: str(tmp_path / "logs")})
    files = list((tmp_path / "logs").iterdir())
    assert [f.name for f in files] == [f"unit-test-{_pid(files[0])}.jsonl"]
    assert done.stdout.strip() == str(files[0])
    info, error = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert info["message"] == "step 3 done" and info["level"] == "INFO" and info["logger"] == "libra.demo"
    assert info["process"] == "unit-test" and info["pid"] == _pid(files[0])
    assert info["time"].endswith("+00:00")
    assert error["level"] == "ERROR" and "ValueError: bad input: training.lr" in error["exception"]
    # The readable stream is still there.
    assert "INFO libra.demo: step 3 done" in done.stderr


def test_without_a_log_dir_only_stderr(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != LOG_DIR_ENV}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "None"
    assert "step 3 done" in done.stderr


def _pid(path) -> int:
    return int(path.stem.rsplit("-", 1)[1])
