"""The planner's gRPC servicer (`libra.v1.PlannerService`) over a `Planner`, and the conversion
between its dataclasses and the protobuf messages (validated on the way in).

The control plane knows no planner: whoever runs one on the controller (the job) builds it with
`serve_planner`, which publishes its decisions on the controller's event bus, and hands the
service adder to `Controller.start(services=...)`."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from libra.control.convert import InvalidArgument
from libra.control.events import EventBus
from libra.control.server import rpc_errors
from libra.control.types import EventKind
from libra.planner import diff
from libra.planner.config import PlanningProblem, TriggerPolicy
from libra.planner.plan import BucketPlan, Plan, RolloutInstance, TrainingPlacement
from libra.planner.planner import Adoption, Planner, PlannerEvent, PlanRescorer
from libra.planner.training_cost import TrainingConfig
from libra.v1 import planner_pb2, planner_pb2_grpc

OPERATOR_WAIT_S = 2.0
"""How long an operator's call waits for a re-plan in progress before UNAVAILABLE: a re-scoring
at a large cluster's size simulates for minutes, and the servicer's few threads must stay free."""

SERVICE_NAME = planner_pb2.DESCRIPTOR.services_by_name["PlannerService"].full_name
POLICY_FIELDS = (
    "plan_interval",
    "warmup_steps",
    "cooldown_steps",
    "min_gain_ratio",
    "reconfiguration_cost_s",
    "restart_cost_s",
    "cut_inflight",
    "auto_apply",
    "rollout_train_ratio",
    "hysteresis",
)


def plan_to_proto(plan: Plan | None, version: int) -> planner_pb2.Plan:
    if plan is None:
        return planner_pb2.Plan()
    cfg = plan.training.config
    return planner_pb2.Plan(
        version=version,
        num_devices=plan.num_devices,
        training=planner_pb2.TrainingLayout(
            tp=cfg.tp,
            pp=cfg.pp,
            dp=cfg.dp,
            micro_batch=cfg.micro_batch,
            first_device=plan.training.first_device,
            hybrid_replicas=list(plan.training.hybrid_replicas),
        ),
        instances=[
            planner_pb2.RolloutInstancePlan(
                instance_id=i.instance_id, tp=i.tp, devices=list(i.devices), node=i.node
            )
            for i in plan.instances
        ],
        buckets=[
            planner_pb2.BucketPlan(
                tp=b.tp,
                num_instances=b.num_instances,
                max_output_tokens=b.max_output_tokens,
                num_requests=b.num_requests,
                predicted_makespan_s=b.predicted_makespan_s,
            )
            for b in plan.buckets
        ],
        predicted_train_s=plan.predicted_train_s,
        predicted_rollout_s=plan.predicted_rollout_s,
        predicted_step_s=plan.predicted_step_s,
        search_time_s=plan.search_time_s,
    )


def plan_from_proto(msg: planner_pb2.Plan, devices_per_node: int) -> Plan:
    """The structure of a proposed plan; the planner validates it against the cluster and prices it."""
    t = msg.training
    if min(t.tp, t.pp, t.dp, t.micro_batch) < 1:
        raise InvalidArgument(
            f"plan.training tp, pp, dp and micro_batch must be >= 1, "
            f"got {t.tp}, {t.pp}, {t.dp}, {t.micro_batch}"
        )
    if t.first_device < 0:
        raise InvalidArgument(f"plan.training.first_device must be >= 0, got {t.first_device}")
    instances = []
    for n, i in enumerate(msg.instances):
        if i.tp < 1 or not i.devices or min(i.devices) < 0:
            raise InvalidArgument(f"plan.instances[{n}] needs tp >= 1 and non-negative devices")
        instances.append(
            RolloutInstance(
                i.instance_id or f"rollout-tp{i.tp}-d{i.devices[0]}",
                i.tp,
                tuple(i.devices),
                i.devices[0] // devices_per_node,
            )
        )
    buckets = tuple(BucketPlan(b.tp, b.num_instances, b.max_output_tokens, 0, 0.0) for b in msg.buckets)
    return Plan(
        num_devices=msg.num_devices,
        training=TrainingPlacement(
            TrainingConfig(t.tp, t.pp, t.dp, t.micro_batch), t.first_device, tuple(t.hybrid_replicas)
        ),
        instances=tuple(instances),
        buckets=buckets,
        predicted_train_s=0.0,
        predicted_rollout_s=0.0,
    )


def action_to_proto(action: diff.Action) -> planner_pb2.PlanAction:
    kinds = planner_pb2.PlanActionKind
    match action:
        case diff.ReleaseHybridReplica(replica, devices):
            return planner_pb2.PlanAction(
                kind=kinds.PLAN_ACTION_KIND_RELEASE_HYBRID_REPLICA, replica=replica, devices=devices
            )
        case diff.StopRolloutInstance(instance_id, devices, cut):
            return planner_pb2.PlanAction(
                kind=kinds.PLAN_ACTION_KIND_STOP_ROLLOUT_INSTANCE,
                instance_id=instance_id,
                devices=devices,
                cut_inflight=cut,
            )
        case diff.RestartTraining():
            return planner_pb2.PlanAction(
                kind=kinds.PLAN_ACTION_KIND_RESTART_TRAINING,
                tp=action.tp,
                devices=action.new_devices,
                detail=f"TP={action.tp} PP={action.pp} DP={action.dp} micro-batch={action.micro_batch}",
            )
        case diff.JoinHybridReplica(replica, devices):
            return planner_pb2.PlanAction(
                kind=kinds.PLAN_ACTION_KIND_JOIN_HYBRID_REPLICA, replica=replica, devices=devices
            )
        case diff.StartRolloutInstance(instance_id, tp, devices):
            return planner_pb2.PlanAction(
                kind=kinds.PLAN_ACTION_KIND_START_ROLLOUT_INSTANCE,
                instance_id=instance_id,
                tp=tp,
                devices=devices,
            )
        case diff.SetBucketThresholds(thresholds):
            return planner_pb2.PlanAction(
                kind=kinds.PLAN_ACTION_KIND_SET_BUCKET_THRESHOLDS,
                detail=", ".join(f"TP-{tp}<={limit}" for tp, limit in thresholds),
            )
    raise TypeError(f"unknown action {action!r}")


def policy_to_proto(policy: TriggerPolicy) -> planner_pb2.PlannerPolicy:
    return planner_pb2.PlannerPolicy(**{name: getattr(policy, name) for name in POLICY_FIELDS})


def policy_changes(msg: planner_pb2.PlannerPolicy, fields: list[str]) -> dict[str, object]:
    """The policy fields a SetPlannerPolicy request sets (`fields`; empty: all) and their values."""
    unknown = [f for f in fields if f not in POLICY_FIELDS]
    if unknown:
        raise InvalidArgument(f"fields names unknown policy fields {unknown}; known: {list(POLICY_FIELDS)}")
    return {name: getattr(msg, name) for name in (fields or POLICY_FIELDS)}


class PlannerServicer(planner_pb2_grpc.PlannerServiceServicer):
    def __init__(self, planner: Planner, devices_per_node: int):
        self.planner = planner
        self.devices_per_node = devices_per_node

    @rpc_errors
    def GetPlan(self, request, context: grpc.ServicerContext) -> planner_pb2.GetPlanResponse:
        state = self.planner.state  # never waits: a re-plan replaces it whole when done
        return planner_pb2.GetPlanResponse(
            current=plan_to_proto(state.current, state.version),
            candidate=plan_to_proto(state.candidate, state.version + 1),
            policy=policy_to_proto(self.planner.policy),
        )

    @rpc_errors
    def ProposePlan(self, request, context: grpc.ServicerContext) -> planner_pb2.ProposePlanResponse:
        which = request.WhichOneof("proposal")
        if which == "veto_candidate":
            self.planner.veto_candidate(request.reason, wait_s=OPERATOR_WAIT_S)
            state = self.planner.state
            return planner_pb2.ProposePlanResponse(
                plan=plan_to_proto(state.current, state.version), message="candidate vetoed"
            )
        if which == "accept_candidate":
            return _adoption_reply(self.planner.accept_candidate(request.reason, wait_s=OPERATOR_WAIT_S))
        if which == "plan":
            plan = plan_from_proto(request.plan, self.devices_per_node)
            try:
                return _adoption_reply(self.planner.propose(plan, request.reason, wait_s=OPERATOR_WAIT_S))
            except ValueError as e:
                raise InvalidArgument(f"plan: {e}") from e
        raise InvalidArgument("proposal must be one of plan, veto_candidate, accept_candidate")

    @rpc_errors
    def SetPlannerPolicy(
        self, request, context: grpc.ServicerContext
    ) -> planner_pb2.SetPlannerPolicyResponse:
        changes = policy_changes(request.policy, list(request.fields))
        try:
            policy = self.planner.update_policy(wait_s=OPERATOR_WAIT_S, **changes)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        return planner_pb2.SetPlannerPolicyResponse(policy=policy_to_proto(policy))


def _adoption_reply(adoption: Adoption) -> planner_pb2.ProposePlanResponse:
    return planner_pb2.ProposePlanResponse(
        plan=plan_to_proto(adoption.plan, adoption.version),
        actions=[action_to_proto(a) for a in adoption.actions],
        message=f"plan v{adoption.version} adopted",
    )


def add_planner_service(planner: Planner, devices_per_node: int):
    """An `add_servicers` callback for `libra.control.server.start_server`, or a service for
    `Controller.start(services=...)`."""

    def add(server: grpc.Server) -> list[str]:
        planner_pb2_grpc.add_PlannerServiceServicer_to_server(
            PlannerServicer(planner, devices_per_node), server
        )
        return [SERVICE_NAME]

    return add


EVENT_KIND_OF_PLANNER_EVENT = {
    "applied": EventKind.PLAN_APPLIED,
    "proposed": EventKind.PLAN_PROPOSED,
    "rejected": EventKind.PLAN_REJECTED,
    "vetoed": EventKind.PLAN_VETOED,
}
"""`PlannerEvent.kind` -> the controller's event kind that WatchEvents shows."""


def publish_plan_events(events: EventBus) -> Callable[[PlannerEvent], None]:
    """A `Planner`'s `on_event` that publishes its decisions on the controller's event bus."""

    def publish(event: PlannerEvent) -> None:
        events.publish(
            EVENT_KIND_OF_PLANNER_EVENT[event.kind], plan_version=event.version, message=event.message
        )

    return publish


def serve_planner(
    problem: PlanningProblem, events: EventBus, rescorer: PlanRescorer | None = None
) -> tuple[Planner, Callable[[grpc.Server], list[str]]]:
    """A planner for `problem` (re-scoring its candidates with `rescorer`, if any) whose decisions
    are published on `events` (a controller's), and the adder that serves it as `PlannerService`
    on that controller:

        controller = Controller(config)
        planner, service = serve_planner(problem, controller.events)
        controller.start(services=[service])
    """
    planner = Planner(problem, on_event=publish_plan_events(events), rescorer=rescorer)
    return planner, add_planner_service(planner, problem.cluster.devices_per_node)
