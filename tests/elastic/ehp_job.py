"""Processes of the elastic hybrid pool test (run as scripts by test_hybrid_pool.py).

    python ehp_job.py static SPEC_JSON   one rank of a static DP=2 job (rank from the spec)
    python ehp_job.py core SPEC_JSON     one rank of the core (DP = the spec's core_ranks, default
                                         1), driving the joins of its lane's hybrid replica
    python ehp_job.py hybrid SPEC_JSON   a hybrid replica process (started by a core rank)
    python ehp_job.py core_agent SPEC_JSON  the core replica with a controller and a node agent:
                                         the plan executor moves a device from rollout to a hybrid
                                         replica (`libra.training.hybrid_worker`), which is then
                                         killed through the agent, and gives it back to rollout

Every job trains the same tiny Qwen2 (tied embeddings) on the same batch per step, 12
trajectories, two mini-batches per step. Results go to `result_<name>.pt` in the spec's out_dir
(`core`, or `core<rank>` for a core of several ranks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

_REPO = Path(__file__).resolve().parents[2]
LANE_TOKEN = "ehp-lane-token-0123456789"
"""The run's token both ends of a lane prove (`libra.training.grad_channel`)."""


def batch_for_step(step: int):
    from tests.training.tiny_models import make_batch

    batch = make_batch(seed=100 + step)
    for t in batch:  # one-step-off async RL: sampled by the previous policy version
        t.policy_versions = [max(step - 1, 0) if v >= 0 else v for v in t.policy_versions]
    return batch


def training_config(data_parallel: int, tensor_parallel: int = 1, overlap_grad_reduce: bool = False):
    from libra.training.config import GrpoConfig, TrainingConfig

    return TrainingConfig(
        data_parallel=data_parallel,
        tensor_parallel=tensor_parallel,
        overlap_grad_reduce=overlap_grad_reduce,
        lr=1e-3,
        adam_eps=1e-6,
        num_minibatches=2,
        max_tokens_per_microbatch=96,
        max_staleness=1,
        train_batch_size=12,
        grpo=GrpoConfig(clip_high=0.28, kl_coef=0.05, entropy_coef=0.01),
    )


def build_engine(spec: dict, rank: int, world_size: int, port: int, tp: int = 1, with_optimizer: bool = True):
    from libra.backends import get_backend

    get_backend("cpu").prepare_worker()
    from libra.model_spec import ModelSpec
    from libra.training.engine import TrainEngine
    from libra.training.hf_weights import hf_tensor_reader
    from libra.training.model import ModelArchitecture
    from libra.training.parallel import initialize

    info = initialize(tp, 1, rank=rank, world_size=world_size, master_addr="127.0.0.1", master_port=port)
    arch = ModelArchitecture.from_spec(ModelSpec.from_hf_dir(spec["model"]))
    cfg = training_config(world_size // tp, tp, spec.get("overlap_grad_reduce", False))
    engine = TrainEngine(arch, cfg, info, with_optimizer=with_optimizer)
    engine.load_hf(hf_tensor_reader(spec["model"]))
    return engine


def run_static(spec: dict) -> None:
    import torch

    from libra.training.parallel import shutdown

    engine = build_engine(spec, spec["rank"], 2, spec["port"])
    losses = [engine.train_step(batch_for_step(step)).loss for step in range(spec["steps"])]
    if spec["rank"] == 0:
        torch.save({"losses": losses}, Path(spec["out_dir"]) / "result_static.pt")
    shutdown()


def _all_ranks(value: int, op) -> int:
    """`value` reduced over the core's ranks (the drivers of a multi-rank core agree on when to
    activate and when to stop, or their collectives would part)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(flag, op=op)
    return int(flag.item())


def run_core(spec: dict) -> None:
    """Joins hybrid replicas to this rank's lane as the spec's plan says, by state rather than by
    step number (a replica process takes seconds to start while the core keeps stepping), then
    trains `tail_steps` more steps; at most `max_steps` in all. In a core of several ranks a lane
    activates only when every rank's lane is ready to (so the hybrids' active steps overlap),
    and the ranks stop together."""
    import torch
    import torch.distributed as dist

    from libra.training.elastic import ElasticConfig, ReplicaState
    from libra.training.hybrid import CoreLane
    from libra.training.parallel import shutdown
    from tests.training.jobs import free_port
    from tests.training.tiny_models import make_batch

    ranks, rank, tp = spec.get("core_ranks", 1), spec.get("rank", 0), spec.get("core_tp", 1)
    name = "core" if ranks == 1 else f"core{rank}"
    engine = build_engine(spec, rank, ranks, spec["port"], tp)
    lane = CoreLane(engine, ElasticConfig(gradient_timeout_s=20, activation_timeout_s=60), token=LANE_TOKEN)
    replica = engine.info.dp_size + engine.info.dp_rank
    out_dir = Path(spec["out_dir"])
    plan = list(spec["joins"])  # one dict per join: zero_sync_steps, active_steps, kill_after
    record: dict = {"losses": [], "states": [], "times": [], "events": [], "payloads": [], "shares": []}
    procs: list[subprocess.Popen] = []
    active_seen = 0
    current: dict = {}
    wait_after_rollback = 0
    tail_left = spec["tail_steps"]
    for step in range(spec["max_steps"]):
        state = lane.state()
        idle = state is None or state in (ReplicaState.ROLLED_BACK, ReplicaState.RELEASED)
        if idle and not plan:
            tail_left -= 1
        go_on = tail_left >= 0
        if ranks > 1:
            go_on = bool(_all_ranks(int(go_on), dist.ReduceOp.MAX))
        if not go_on:
            break
        if plan and idle and step >= spec["first_join_step"]:
            if wait_after_rollback > 0:
                wait_after_rollback -= 1
            else:
                join = plan.pop(0)
                generation = lane.request_join(replica)
                tag = f"gen{generation}" if ranks == 1 else f"replica{replica}_gen{generation}"
                # A hybrid of TP > 1: this rank starts the hybrid's rank of its own TP rank; the
                # hybrid's ranks meet on the generation's port, the same on every core rank.
                killed = join.get("kill_tp_rank", engine.info.tp_rank) == engine.info.tp_rank
                hybrid_spec = {
                    **spec,
                    "address": lane.address,
                    "replica": replica,
                    "generation": generation,
                    "port": spec["hybrid_ports"][generation - 1] if tp > 1 else free_port(),
                    "hybrid_tp": tp,
                    "hybrid_rank": engine.info.tp_rank,
                    "kill_after": join.get("kill_after") if killed else None,
                    "tag": tag if tp == 1 else f"{tag}_tp{engine.info.tp_rank}",
                }
                log = open(out_dir / f"hybrid_{hybrid_spec['tag']}.log", "w")
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "hybrid", json.dumps(hybrid_spec)],
                        env=os.environ,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=_REPO,
                    )
                )
                current, active_seen = join, 0
                record["events"].append((step, f"join gen{generation}"))
        ready = False
        if state is ReplicaState.ZERO_SYNC:
            current["zero_sync_left"] = current.get("zero_sync_left", current["zero_sync_steps"]) - 1
            ready = current["zero_sync_left"] <= 0
        if ranks > 1:
            ready = bool(_all_ranks(int(ready), dist.ReduceOp.MIN))
        if ready:
            lane.request_activation()
        if state is ReplicaState.ACTIVE:
            active_seen += 1
            if current.get("active_steps") and active_seen > current["active_steps"]:
                lane.request_release()
        batch = batch_for_step(step)
        accepted_before = lane.counters.accepted_payloads
        start = time.perf_counter()
        lane.begin_step(step, batch)
        state_in_step = lane.state()
        released = state is not ReplicaState.RELEASED and state_in_step is ReplicaState.RELEASED
        if ranks > 1:  # scoring is collective: every rank scores when any rank released
            released = bool(_all_ranks(int(released), dist.ReduceOp.MAX))
        if released:
            record.setdefault("logprobs_at_release", engine.compute_logprobs(make_batch(seed=7)))
        result = engine.train_step(batch)
        record["times"].append(time.perf_counter() - start)
        record["losses"].append(result.loss)
        record["states"].append(None if state_in_step is None else state_in_step.name)
        record["payloads"].append(lane.counters.accepted_payloads - accepted_before)
        record["shares"].append(lane.share())
        if lane.state() is ReplicaState.ROLLED_BACK and state is not ReplicaState.ROLLED_BACK:
            record["events"].append((step, "rolled back: " + lane.counters.rollbacks[-1]))
            wait_after_rollback = 2  # the slot rests two steps before the next join
    record["filled_in"] = lane.counters.filled_in_shares
    record["rollbacks"] = lane.counters.rollbacks
    record["dropped"] = dict(lane.pool.dropped_payloads)
    record["epoch"] = lane.pool.epoch
    record["final_state"] = None if lane.state() is None else lane.state().name
    record["logprobs_end"] = engine.compute_logprobs(make_batch(seed=7))
    torch.save(record, out_dir / f"result_{name}.pt")
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
    record["hybrid_exit_codes"] = [p.returncode for p in procs]
    torch.save(record, out_dir / f"result_{name}.pt")
    lane.listener.close()
    shutdown()


def run_hybrid(spec: dict) -> None:
    """A hybrid replica: its own torch.distributed world of one rank. With `kill_after` = k it
    dies in its k-th active step, after announcing its gradient (header written, body not)."""
    import torch

    from libra.training import grad_channel
    from libra.training.hybrid import run_hybrid_replica
    from libra.training.parallel import shutdown
    from tests.training.tiny_models import make_batch

    tp = spec.get("hybrid_tp", 1)
    engine = build_engine(spec, spec.get("hybrid_rank", 0), tp, spec["port"], tp, with_optimizer=False)
    kill_after = spec.get("kill_after")
    if kill_after:
        active_grads = {"n": 0}
        write = grad_channel.Channel.write_frame

        def dying_write(self, frame):
            if frame.kind == "grads":
                active_grads["n"] += 1
                if active_grads["n"] >= 2 * kill_after - 1:  # 2 mini-batches per step
                    header = json.dumps({"kind": frame.kind, "meta": frame.meta}).encode()
                    self._sock.sendall(grad_channel._HEADER.pack(len(header)) + header)
                    os._exit(17)
            write(self, frame)

        grad_channel.Channel.write_frame = dying_write
    losses: dict[int, float] = {}
    num = run_hybrid_replica(
        engine,
        spec["address"],
        replica=spec.get("replica", 1),
        generation=spec["generation"],
        token=LANE_TOKEN,
        on_step=lambda step, result: losses.__setitem__(step, result.loss),
    )
    out = {"steps": num, "losses": losses, "logprobs_end": engine.compute_logprobs(make_batch(seed=7))}
    torch.save(out, Path(spec["out_dir"]) / f"result_hybrid_{spec['tag']}.pt")
    shutdown()


if __name__ == "__main__":
    sys.path.insert(0, str(_REPO))
    from tests.elastic.agent_run import run_core_agent

    mode, spec_json = sys.argv[1], sys.argv[2]
    runners = {"static": run_static, "core": run_core, "hybrid": run_hybrid, "core_agent": run_core_agent}
    runners[mode](json.loads(spec_json))
