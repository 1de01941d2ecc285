"""Logging for every Libra process: readable lines on stderr and, when `LIBRA_LOG_DIR` is set,
the same records as JSON lines in `$LIBRA_LOG_DIR/<process>-<pid>.jsonl` — one object per record
(time, level, logger, process, pid, message, exception), for `jq` and log shippers.

A job sets `LIBRA_LOG_DIR` to `RUN_DIR/logs` before it starts its controller and node agents;
node agents pass their environment to the workers they start, so the job, its rollout instances,
train ranks and sandbox workers all write structured logs into the run folder.
"""

from __future__ import annotations

import json
import logging
import os
from datetime import UTC, datetime
from pathlib import Path

LOG_DIR_ENV = "LIBRA_LOG_DIR"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonLinesFormatter(logging.Formatter):
    def __init__(self, process_name: str):
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "process": self.process_name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(process_name: str, verbose: bool = False) -> Path | None:
    """Sets up the root logger of this process (replacing earlier handlers, so a process may call
    it again once `LIBRA_LOG_DIR` is known). Returns the JSON-lines file, if any."""
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format=TEXT_FORMAT, force=True)
    log_dir = os.environ.get(LOG_DIR_ENV)
    if not log_dir:
        return None
    path = Path(log_dir) / f"{process_name}-{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(JsonLinesFormatter(process_name))
    logging.getLogger().addHandler(handler)
    return path
