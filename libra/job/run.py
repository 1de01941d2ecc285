"""Entry point of `libra run CONFIG [--resume RUN_DIR] [section.field=value ...]`.

The config file defines `config() -> LibraConfig`, the job's section included
(`job=JobConfig(...)`); `libra.config.load_config` reads it and applies every override, the
`job.` ones like any other section's."""

from __future__ import annotations

import sys
from pathlib import Path

from libra.config import LibraConfig


def run_job(config: LibraConfig, resume: bool = False):
    """Runs the job to its last step and writes the report; returns the `JobResult`. A run that
    fails after it started writes the report of what it did before the error propagates."""
    from libra.job.loop import GrpoJob
    from libra.job.report import write_report

    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    grpo = GrpoJob(config, resume=resume)  # bad config is refused here, before anything runs
    try:
        result = grpo.run()
    except BaseException:
        report = write_report(config.run_dir)
        print(f"[libra] stopped before its last step; report: {report}", file=sys.stderr, flush=True)
        raise
    report = write_report(config.run_dir)
    print(f"[libra] done: {result.version} steps; report: {report}", flush=True)
    return result
