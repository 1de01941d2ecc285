"""Runs the device checks in order and prints one line per check: `[PASS] name: figure` or
`[FAIL] name: reason`. A check that raises is a FAIL line with the exception's message, and the
checks after it still run. Exit status 1 when any check failed.

    python -m libra.checks [--backend {cpu,cuda}] [--out summary.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from libra.checks.context import CheckContext
from libra.checks.result import Check, CheckResult

logger = logging.getLogger(__name__)


def default_checks() -> list[Check]:
    from libra.checks import backend, bf16_step, job_run, model_logits, publication, rollout_engine

    return [
        Check(backend.NAME, backend.run),
        Check(model_logits.NAME, model_logits.run),
        Check(bf16_step.NAME, bf16_step.run),
        Check(rollout_engine.NAME, rollout_engine.run),
        Check(publication.NAME, publication.run),
        Check(job_run.NAME, job_run.run),
    ]


def run_checks(checks: Sequence[Check], ctx: CheckContext) -> list[CheckResult]:
    """Runs `checks` in order, printing each line as soon as it is known."""
    results = []
    for check in checks:
        try:
            result = check.run(ctx)
        except Exception as exc:
            logger.error("check %r raised", check.name, exc_info=True)
            result = CheckResult(check.name, False, f"{type(exc).__name__}: {exc}")
        results.append(result)
        print(result.line(), flush=True)
    return results


def write_summary(path: Path, backend: str, results: Sequence[CheckResult]) -> None:
    summary = {
        "backend": backend,
        "passed": all(r.passed for r in results),
        "checks": [asdict(r) for r in results],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


def main(argv: Sequence[str] | None = None, checks: Sequence[Check] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra.checks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--out", type=Path, help="also write a JSON summary of the checks here")
    parser.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="libra-checks-") as scratch:
        workdir = args.workdir or Path(scratch)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = CheckContext(args.backend, workdir)
        try:
            results = run_checks(default_checks() if checks is None else checks, ctx)
        finally:
            ctx.close()
    if args.out is not None:
        write_summary(args.out, args.backend, results)
    return 0 if all(r.passed for r in results) else 1
