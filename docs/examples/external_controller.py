#!/usr/bin/env python3
"""A worked external controller for Libra's gRPC control plane (walked through in docs/grpc-api.md).

It talks to the controller over the wire API only: grpcio and the generated stubs `libra.v1`,
nothing of `libra.control`. In order, it

  1. reads the cluster state (GetClusterState) and starts watching events in a background thread
     from the state's `last_event_sequence`, so it misses nothing that happens afterwards;
  2. reads the current plan (PlannerService.GetPlan) if the controller serves a planner, and
     proposes the current plan back (ProposePlan: re-validated, re-priced, adopted as the next
     version, with no actions to run); a plain `libra controller` has no planner (UNIMPLEMENTED),
     and the step is skipped;
  3. starts a short Python worker on the first live agent's first free device (StartWorker), waits
     for its WORKER_STARTED event, stops it (StopWorker), waits for WORKER_STOPPED;
  4. prints what it saw and exits 0 (1 on any failure, after stopping its worker).

    python docs/examples/external_controller.py --address HOST:PORT --token-file RUN_DIR/token

With TLS on the controller (control.tls_cert_file), add `--ca-file` with the CA that signed it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from pathlib import Path

import grpc

from libra.v1 import common_pb2, controller_pb2, controller_pb2_grpc, planner_pb2, planner_pb2_grpc

RPC_TIMEOUT_S = 30.0
EVENT_TIMEOUT_S = 30.0
# The controller's limits (docs/grpc-api.md, "Limits"): messages up to 4 MiB each way; it accepts a
# keepalive ping at most every 10 s on a connection without data, so ping every 30 s like Libra.
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 4 << 20),
    ("grpc.max_send_message_length", 4 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 20_000),
]
WORKER_CODE = (
    "import os, time\n"
    "visible = {k: v for k, v in os.environ.items() if k.endswith('VISIBLE_DEVICES')}\n"
    "print('example worker up, pid', os.getpid(), visible, os.environ.get('EXAMPLE_GREETING'), flush=True)\n"
    "time.sleep(120)\n"
)


_print_lock = threading.Lock()


def say(line: str) -> None:
    """Prints one whole line (the watcher thread prints too)."""
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def kind_name(kind: int) -> str:
    return common_pb2.EventKind.Name(kind).removeprefix("EVENT_KIND_")


def state_name(state: int) -> str:
    return common_pb2.WorkerState.Name(state).removeprefix("WORKER_STATE_")


def describe(event: common_pb2.Event) -> str:
    parts = [f"#{event.sequence} {kind_name(event.kind)}"]
    if event.agent_id:
        parts.append(f"agent={event.agent_id}")
    if event.worker_id:
        parts.append(f"worker={event.worker_id}")
    if event.kind in (common_pb2.EVENT_KIND_WORKER_EXITED, common_pb2.EVENT_KIND_WORKER_STOPPED):
        parts.append(f"exit_code={event.exit_code}")
    if event.plan_version:
        parts.append(f"plan_version={event.plan_version}")
    return " ".join(parts) + (f": {event.message}" if event.message else "")


def open_channel(address: str, ca_file: str | None) -> grpc.Channel:
    """Plaintext, or TLS verified against `ca_file`. The bearer goes with each call as metadata
    (gRPC sends call credentials over TLS only, metadata over both)."""
    if ca_file:
        credentials = grpc.ssl_channel_credentials(root_certificates=Path(ca_file).read_bytes())
        return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class EventWatcher:
    """Follows WatchEvents in a background thread and keeps every event it received. A stream that
    breaks (UNAVAILABLE, or RESOURCE_EXHAUSTED for a watcher that fell 4,096 events behind) is
    reopened after the last sequence received; a jump in the sequence says events were lost."""

    def __init__(self, stub: controller_pb2_grpc.ClusterApiStub, metadata, after_sequence: int):
        self._stub = stub
        self._metadata = metadata
        self._last = after_sequence
        self._events: list[common_pb2.Event] = []
        self._changed = threading.Condition()
        self._stopping = threading.Event()
        self._call = None
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, name="event-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        attempts = 0
        while not self._stopping.is_set():
            request = controller_pb2.WatchEventsRequest(after_sequence=self._last)
            with self._changed:
                if self._stopping.is_set():
                    return
                # No deadline: the stream lasts until we cancel it.
                self._call = self._stub.WatchEvents(request, metadata=self._metadata)
            try:
                for event in self._call:
                    attempts = 0
                    if event.sequence != self._last + 1:
                        say(f"watch: events {self._last + 1}..{event.sequence - 1} were not received")
                    self._last = event.sequence
                    say(f"event {describe(event)}")
                    with self._changed:
                        self._events.append(event)
                        self._changed.notify_all()
                return  # the server ended the stream (it is shutting down)
            except grpc.RpcError as e:
                if self._stopping.is_set() or e.code() == grpc.StatusCode.CANCELLED:
                    return
                retryable = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
                attempts += 1
                if not retryable or attempts > 5:
                    with self._changed:
                        self.error = e
                        self._changed.notify_all()
                    return
                say(f"watch: {e.code().name}: {e.details()}; resuming after #{self._last}")
                time.sleep(0.5 * attempts)

    def wait_for(self, kind: int, timeout_s: float = EVENT_TIMEOUT_S, **match) -> common_pb2.Event:
        """The first event received of `kind` whose fields equal `match`."""
        deadline = time.monotonic() + timeout_s

        def found():
            return next(
                (
                    e
                    for e in self._events
                    if e.kind == kind and all(getattr(e, k) == v for k, v in match.items())
                ),
                None,
            )

        with self._changed:
            while (event := found()) is None:
                if self.error is not None:
                    raise RuntimeError(
                        f"the event stream failed: {self.error.code().name}: {self.error.details()}"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {kind_name(kind)} event {match} within {timeout_s} s")
                self._changed.wait(remaining)
            return event

    @property
    def events(self) -> list[common_pb2.Event]:
        with self._changed:
            return list(self._events)

    def stop(self) -> None:
        with self._changed:
            self._stopping.set()
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout=5)


def show_plan(label: str, plan: planner_pb2.Plan) -> None:
    t = plan.training
    say(
        f"{label}: v{plan.version} on {plan.num_devices} devices; training TP={t.tp} PP={t.pp} DP={t.dp} "
        f"from device {t.first_device}; {len(plan.instances)} rollout instance(s); "
        f"predicted step {plan.predicted_step_s:.3f} s"
    )


def planner_step(channel: grpc.Channel, metadata, watcher: EventWatcher) -> None:
    """Reads the plan and proposes the current one back, if the controller serves a planner."""
    planner = planner_pb2_grpc.PlannerServiceStub(channel)
    try:
        reply = planner.GetPlan(planner_pb2.GetPlanRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
        say("planner: not served by this controller (UNIMPLEMENTED); skipping the plan")
        return
    policy = reply.policy
    say(
        f"planner: policy auto_apply={policy.auto_apply} plan_interval={policy.plan_interval} "
        f"min_gain_ratio={policy.min_gain_ratio}"
    )
    if reply.candidate.version:
        show_plan("planner: candidate awaiting a decision", reply.candidate)
    if not reply.current.version:
        say("planner: no plan adopted yet; nothing to propose")
        return
    show_plan("planner: current plan", reply.current)
    # Propose the plan that runs: the planner validates and re-prices it and adopts it as the next
    # version; the diff from the current plan is empty, so nothing moves.
    proposed = planner.ProposePlan(
        planner_pb2.ProposePlanRequest(plan=reply.current, reason="external controller example"),
        metadata=metadata,
        timeout=RPC_TIMEOUT_S,
    )
    say(f"planner: proposed the current plan back: {proposed.message}, {len(proposed.actions)} action(s)")
    applied = watcher.wait_for(common_pb2.EVENT_KIND_PLAN_APPLIED, plan_version=proposed.plan.version)
    say(f"planner: plan v{proposed.plan.version} applied: seen as event #{applied.sequence}")


def pick_device(state: controller_pb2.ClusterState) -> tuple[str, int]:
    """The first live agent's first device that no running worker holds."""
    for agent in state.agents:
        if agent.state != common_pb2.AGENT_STATE_ALIVE:
            continue
        held = {
            d
            for w in state.workers
            if w.agent_id == agent.agent_id
            and w.state in (common_pb2.WORKER_STATE_STARTING, common_pb2.WORKER_STATE_RUNNING)
            for d in w.spec.devices
        }
        free = [d.index for d in agent.devices if d.index not in held]
        if free:
            return agent.agent_id, free[0]
    raise RuntimeError("no live agent has a free device")


def run(args: argparse.Namespace) -> int:
    token = Path(args.token_file).read_text().strip()
    metadata = (("authorization", f"Bearer {token}"),)
    channel = open_channel(args.address, args.ca_file)
    cluster = controller_pb2_grpc.ClusterApiStub(channel)

    state = cluster.GetClusterState(
        controller_pb2.GetClusterStateRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S
    )
    say(
        f"cluster: {len(state.agents)} agent(s), {len(state.workers)} worker record(s), "
        f"last event #{state.last_event_sequence}"
    )
    for agent in state.agents:
        devices = ", ".join(f"{d.index}:{d.kind}" for d in agent.devices)
        agent_state = common_pb2.AgentState.Name(agent.state).removeprefix("AGENT_STATE_")
        say(f"  agent {agent.agent_id} {agent_state} at {agent.address} ({agent.backend}): {devices}")
    for worker in state.workers:
        say(f"  worker {worker.spec.worker_id} {state_name(worker.state)} on {worker.agent_id}")

    watcher = EventWatcher(cluster, metadata, after_sequence=state.last_event_sequence)
    worker_id = f"example-{uuid.uuid4().hex[:8]}"  # fresh: a worker id is not reusable (docs)
    started = None
    try:
        planner_step(channel, metadata, watcher)

        agent_id, device = pick_device(state)
        spec = common_pb2.WorkerSpec(
            worker_id=worker_id,
            role=common_pb2.WORKER_ROLE_GENERIC,
            devices=[device],
            argv=[args.python, "-c", WORKER_CODE],
            env={"EXAMPLE_GREETING": "hello from the external controller"},
        )
        started = cluster.StartWorker(
            controller_pb2.StartWorkerRequest(agent_id=agent_id, spec=spec),
            metadata=metadata,
            timeout=RPC_TIMEOUT_S,
        )
        say(
            f"StartWorker: {worker_id} {state_name(started.state)} on {agent_id} device {device}, "
            f"pid {started.pid}, log {started.log_path}"
        )
        event = watcher.wait_for(common_pb2.EVENT_KIND_WORKER_STARTED, worker_id=worker_id)
        say(f"worker {worker_id} started: seen as event #{event.sequence}")

        stopped = cluster.StopWorker(
            controller_pb2.StopWorkerRequest(worker_id=worker_id, grace_s=2.0),
            metadata=metadata,
            timeout=RPC_TIMEOUT_S,
        )
        say(f"StopWorker: {worker_id} {state_name(stopped.state)}, exit code {stopped.exit_code}")
        event = watcher.wait_for(common_pb2.EVENT_KIND_WORKER_STOPPED, worker_id=worker_id)
        say(f"worker {worker_id} stopped: seen as event #{event.sequence} (exit code {event.exit_code})")

        final = cluster.GetClusterState(
            controller_pb2.GetClusterStateRequest(), metadata=metadata, timeout=RPC_TIMEOUT_S
        )
        record = next(w for w in final.workers if w.spec.worker_id == worker_id)
        say(f"cluster: {worker_id} is {state_name(record.state)}, last event #{final.last_event_sequence}")
    except Exception as e:  # noqa: BLE001 - one readable line, then clean up
        detail = (
            f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else f"{type(e).__name__}: {e}"
        )
        print(f"failed: {detail}", file=sys.stderr)
        if started is not None:
            try:  # leave nothing running on the agent
                cluster.StopWorker(
                    controller_pb2.StopWorkerRequest(worker_id=worker_id),
                    metadata=metadata,
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.RpcError:
                pass
        return 1
    finally:
        watcher.stop()
        channel.close()

    seen = watcher.events
    say(f"saw {len(seen)} event(s): " + ", ".join(f"#{e.sequence} {kind_name(e.kind)}" for e in seen))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", required=True, help="the controller's HOST:PORT (RUN_DIR/controller.addr)"
    )
    parser.add_argument("--token-file", required=True, help="file holding the run's token (RUN_DIR/token)")
    parser.add_argument("--ca-file", help="PEM CA that signed the controller's certificate (TLS controllers)")
    parser.add_argument(
        "--python", default="python3", help="the worker's interpreter, resolved on the agent's PATH"
    )
    try:
        return run(parser.parse_args(argv))
    except grpc.RpcError as e:  # e.g. UNAUTHENTICATED for a wrong token, UNAVAILABLE for a wrong address
        print(f"failed: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
