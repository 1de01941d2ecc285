"""Launching multi-process training jobs for the tests: one subprocess per rank, gloo on loopback,
one OpenMP thread each."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

JOB_TIMEOUT_S = 240
_HERE = Path(__file__).parent
_REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(spec: dict, out_dir: Path, script: str = "rank_job.py") -> list[subprocess.Popen]:
    out_dir.mkdir(parents=True, exist_ok=True)
    world = spec.get("tp", 1) * spec.get("pp", 1) * spec.get("dp", 1)
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO), "PYTHONWARNINGS": "ignore"}
    procs = []
    for rank in range(world):
        rank_spec = {**spec, "rank": rank, "port": port, "out_dir": str(out_dir)}
        log = open(out_dir / f"rank{rank}.log", "w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(_HERE / script), json.dumps(rank_spec)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=_REPO,
            )
        )
    return procs


def wait_job(procs: list[subprocess.Popen], out_dir: Path) -> dict:
    try:
        for p in procs:
            p.wait(timeout=JOB_TIMEOUT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if failed:
        logs = "\n".join((out_dir / f"rank{i}.log").read_text()[-3000:] for i in failed)
        raise AssertionError(f"ranks {failed} failed:\n{logs}")
    return torch.load(out_dir / "result.pt", weights_only=False)


def run_job(spec: dict, out_dir: Path, script: str = "rank_job.py") -> dict:
    return wait_job(start_job(spec, out_dir, script), out_dir)
