"""A hybrid replica of the elastic hybrid pool as a worker process, started by the plan executor
through a node agent on devices taken from rollout.

    python -m libra.training.hybrid_worker --hf-model DIR --lane HOST:PORT --replica R \
        --generation G [--training JSON] [--backend cpu] [--ready-file F] [--result-file F]

It builds the same engine as a core rank (TP = PP = 1, its own torch.distributed world of one
rank: the core's process groups are never touched), writes its ready file, connects to the core
rank's lane and follows the join protocol (`libra.training.hybrid.run_hybrid_replica`) until the
core releases it (exit 0). A lost lane or any failure exits non-zero; the core has rolled the
replica back by then. `--training` must be the core's TrainingConfig (parallel sizes aside), or
the replicas would not step in lockstep.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

from libra.logs import configure_logging


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_atomically(path: str, text: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def hybrid_worker_argv(
    hf_model: str,
    lane: str,
    replica: int,
    generation: int,
    training: str,
    ready_file: str,
    backend: str = "cpu",
) -> list[str]:
    """The command line that starts this worker (what `main` parses)."""
    return [
        sys.executable,
        "-m",
        "libra.training.hybrid_worker",
        "--hf-model",
        hf_model,
        "--lane",
        lane,
        "--replica",
        str(replica),
        "--generation",
        str(generation),
        "--training",
        training,
        "--backend",
        backend,
        "--ready-file",
        ready_file,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m libra.training.hybrid_worker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hf-model", required=True, help="HF model folder the core started from")
    parser.add_argument("--lane", required=True, help="host:port of the core rank's lane")
    parser.add_argument("--replica", type=int, required=True, help="its DP replica index")
    parser.add_argument("--generation", type=int, required=True, help="the join's generation")
    parser.add_argument("--training", default="", help="JSON object of the core's TrainingConfig fields")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument("--ready-file", default=None, help="written with the lane address once built")
    parser.add_argument("--result-file", default=None, help="torch.save of the steps run and their losses")
    args = parser.parse_args(argv)
    if args.replica < 1 or args.generation < 1:
        parser.error(f"--replica and --generation must be >= 1, got {args.replica}, {args.generation}")
    configure_logging(f"hybrid-replica-{args.replica}")

    from libra.backends import get_backend

    backend = get_backend(args.backend)
    backend.prepare_worker()
    from transformers import AutoConfig

    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.hybrid import run_hybrid_replica
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown
    from libra.training.worker import training_config_from_json

    cfg = training_config_from_json(args.training, tensor_parallel=1, pipeline_parallel=1, data_parallel=1)
    info = initialize(
        1,
        1,
        rank=0,
        world_size=1,
        master_addr="127.0.0.1",
        master_port=_free_port(),
        backend=backend.distributed_backend,
        seed=cfg.seed,
    )
    arch = ModelArchitecture.from_hf_config(AutoConfig.from_pretrained(args.hf_model))
    engine = TrainEngine(arch, cfg, info, device=backend.torch_device(0))
    engine.load_hf(hf_tensor_reader(args.hf_model))
    if args.ready_file:
        _write_atomically(args.ready_file, args.lane)
    losses: dict[int, float] = {}
    num_steps = run_hybrid_replica(
        engine,
        args.lane,
        replica=args.replica,
        generation=args.generation,
        on_step=lambda step, result: losses.__setitem__(step, result.loss),
    )
    print(f"hybrid replica {args.replica} (generation {args.generation}) released after {num_steps} steps")
    if args.result_file:
        import torch

        torch.save({"steps": num_steps, "losses": losses}, args.result_file)
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
