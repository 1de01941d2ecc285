"""A hybrid replica of the elastic hybrid pool as a worker process, started by the plan executor
through a node agent on devices taken from rollout.

    python -m libra.training.hybrid_worker --hf-model DIR --lane HOST:PORT [--lane HOST:PORT ...] \
        --replica R --generation G [--training JSON] [--backend cpu] [--ready-file F] [--result-file F]

One `--lane` per TP rank of the core replica it pairs with, in TP order: the replica has the
core's TP = T (PP = 1) and is T processes in its own torch.distributed world (the core's process
groups are never touched). The process the agent starts is TP rank 0 on the worker's first device;
it starts ranks 1..T-1 as its children on the next devices (they die with it, and stopping the
worker stops its whole process group) and exits as soon as one of them fails. Each rank builds
the same engine as its core rank, connects to its core rank's lane and follows the join protocol
(`libra.training.hybrid.run_hybrid_replica`) until the core releases it (exit 0); rank 0 writes
the ready file once the replica's world is up. A lost lane or any failure exits non-zero; the
core has rolled the whole replica back by then. `--training` must be the core's TrainingConfig
(parallel sizes aside), or the replicas would not step in lockstep.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from libra.control.lifetime import die_with_parent
from libra.logs import configure_logging

logger = logging.getLogger(__name__)


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
    lanes: tuple[str, ...],
    replica: int,
    generation: int,
    training: str,
    ready_file: str,
    backend: str = "cpu",
) -> list[str]:
    """The command line that starts this worker (what `main` parses): `lanes` are the addresses of
    the paired core replica's lanes, one per TP rank."""
    return [
        sys.executable,
        "-m",
        "libra.training.hybrid_worker",
        "--hf-model",
        hf_model,
        *(arg for lane in lanes for arg in ("--lane", lane)),
        "--replica",
        str(replica),
        "--generation",
        str(generation),
        "--training",
        training,
        "--backend",
        backend,
        *(("--ready-file", ready_file) if ready_file else ()),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m libra.training.hybrid_worker", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--hf-model", required=True, help="HF model folder the core started from")
    parser.add_argument(
        "--lane", action="append", required=True, help="host:port of a core rank's lane, one per TP rank"
    )
    parser.add_argument("--replica", type=int, required=True, help="its DP replica index")
    parser.add_argument("--generation", type=int, required=True, help="the join's generation")
    parser.add_argument("--training", default="", help="JSON object of the core's TrainingConfig fields")
    parser.add_argument("--backend", default="cpu")
    parser.add_argument(
        "--ready-file", default=None, help="written with the lane addresses once the replica's world is up"
    )
    parser.add_argument("--result-file", default=None, help="torch.save of the steps run and their losses")
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.replica < 1 or args.generation < 1:
        parser.error(f"--replica and --generation must be >= 1, got {args.replica}, {args.generation}")
    tp, rank = len(args.lane), args.tp_rank
    if not 0 <= rank < tp:
        parser.error(f"--tp-rank must be in [0, {tp}) for {tp} --lane addresses, got {rank}")
    if rank > 0 and (args.master_port is None or args.parent_pid is None):
        parser.error("--tp-rank > 0 needs the --master-port and --parent-pid of rank 0")
    if rank > 0:
        # A rank left alone would wait in the replica's rendezvous or a collective on devices
        # already handed back.
        die_with_parent(signal.SIGKILL, args.parent_pid)
    configure_logging(f"hybrid-replica-{args.replica}-tp{rank}")
    master_port = args.master_port or _free_port()
    children = _start_other_ranks(args, master_port) if rank == 0 else []

    from libra.backends import get_backend

    os.environ["LOCAL_RANK"] = str(rank)  # the worker's devices: TP rank t takes the t-th
    backend = get_backend(args.backend)
    backend.prepare_worker()
    from transformers import AutoConfig

    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.hybrid import run_hybrid_replica
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize, shutdown
    from libra.training.worker import training_config_from_json

    cfg = training_config_from_json(args.training, tensor_parallel=tp, pipeline_parallel=1, data_parallel=1)
    info = initialize(
        tp,
        1,
        rank=rank,
        world_size=tp,
        master_addr="127.0.0.1",
        master_port=master_port,
        backend=backend.distributed_backend,
        seed=cfg.seed,
    )
    arch = ModelArchitecture.from_hf_config(AutoConfig.from_pretrained(args.hf_model))
    # No optimizer: the replica takes its weights from its core rank (`libra.training.hybrid`).
    engine = TrainEngine(arch, cfg, info, device=backend.torch_device(rank), with_optimizer=False)
    engine.load_hf(hf_tensor_reader(args.hf_model))
    if args.ready_file and rank == 0:
        _write_atomically(args.ready_file, ",".join(args.lane))
    losses: dict[int, float] = {}
    num_steps = run_hybrid_replica(
        engine,
        args.lane[rank],
        replica=args.replica,
        generation=args.generation,
        on_step=lambda step, result: losses.__setitem__(step, result.loss),
    )
    print(
        f"hybrid replica {args.replica} TP rank {rank} (generation {args.generation}) "
        f"released after {num_steps} steps"
    )
    if args.result_file and rank == 0:
        import torch

        torch.save({"steps": num_steps, "losses": losses}, args.result_file)
    shutdown()
    # Released together: each rank exits 0 after its own release.
    return 1 if any(child.wait() != 0 for child in children) else 0


def _start_other_ranks(args: argparse.Namespace, master_port: int) -> list[subprocess.Popen]:
    """Starts TP ranks 1..T-1 of the replica (rank 0's command line without the files it writes)
    and watches them: one that fails ends this process, and with it the replica (a rank left alone
    would wait for its peers in a collective until a timeout)."""
    argv = hybrid_worker_argv(
        args.hf_model, tuple(args.lane), args.replica, args.generation, args.training, "", args.backend
    )
    children = [
        subprocess.Popen(
            [
                *argv,
                "--tp-rank",
                str(rank),
                "--master-port",
                str(master_port),
                "--parent-pid",
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
        )
        for rank in range(1, len(args.lane))
    ]

    def watch(rank: int, child: subprocess.Popen) -> None:
        if child.wait() != 0:
            logger.error(
                "TP rank %d of the hybrid replica exited with %d; ending the replica", rank, child.returncode
            )
            os._exit(1)

    for rank, child in enumerate(children, start=1):
        threading.Thread(target=watch, args=(rank, child), daemon=True, name=f"watch-tp{rank}").start()
    return children


if __name__ == "__main__":
    raise SystemExit(main())
