"""Entry point of `libra run CONFIG [--resume RUN_DIR] [section.field=value ...]`.

A job config file defines `config() -> LibraConfig` and `job() -> JobConfig`. Overrides that
start with `job.` go to the JobConfig, the others to the LibraConfig (until `job` is a section
of `LibraConfig`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from libra.config import LibraConfig, apply_override, load_config
from libra.job.config import JobConfig


def load_job_config(path: str | Path, overrides: list[str] | None = None) -> tuple[LibraConfig, JobConfig]:
    path = Path(path)
    job_overrides = [o for o in overrides or [] if o.removeprefix("--").startswith("job.")]
    other = [o for o in overrides or [] if o not in job_overrides]
    config = load_config(path, other)
    spec = importlib.util.spec_from_file_location(f"libra_job_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "job", None)):
        raise ValueError(f"config file {path} must define `job() -> JobConfig` to be run with `libra run`")
    job = module.job()
    if not isinstance(job, JobConfig):
        raise ValueError(f"job() in {path} returned {type(job).__name__}, expected JobConfig")
    for item in job_overrides:
        job = apply_override(job, item.removeprefix("--").removeprefix("job."))
    return config, job


def run_job(config: LibraConfig, job: JobConfig, resume: bool = False):
    """Runs the job to its last step and writes the report; returns the `JobResult`."""
    from libra.job.loop import GrpoJob
    from libra.job.report import write_report

    Path(config.run_dir).mkdir(parents=True, exist_ok=True)
    result = GrpoJob(config, job, resume=resume).run()
    report = write_report(config.run_dir)
    print(f"[libra] done: {result.version} steps; report: {report}", flush=True)
    return result
