"""Routing of live trajectories across TP buckets of rollout instances.

Owns C-MLFQ (a facade over the C++ core in `libra._native`): tool-return states, the causal
prefix trees learned from completed trajectories, bucket routing, the instance load table
(loads weighted by instance capacity, capped by trajectories, by each instance's fair share of
them and by the KV the engines report)
and run-time bucket updates when a plan changes them.
Also owns the baseline policies behind the same `Router` interface, and a synthetic agentic
workload to compare them. Depends only on `libra.trajectory` for the shared `ToolStatus`.
"""

from libra.scheduler.baselines import LeastLoadRouter, LengthMlfqRouter, OracleRouter, RoundRobinRouter
from libra.scheduler.cmlfq import CmlfqRouter, Prediction
from libra.scheduler.config import BucketConfig, BucketSpeed, CmlfqConfig, fair_queue_length
from libra.scheduler.factory import RouterKind, make_router
from libra.scheduler.interface import Decision, Reason, Router
from libra.scheduler.tool_state import SizeClass, ToolReturnState, infer_status

__all__ = [
    "BucketConfig",
    "BucketSpeed",
    "CmlfqConfig",
    "CmlfqRouter",
    "Decision",
    "LeastLoadRouter",
    "LengthMlfqRouter",
    "OracleRouter",
    "Prediction",
    "Reason",
    "RoundRobinRouter",
    "Router",
    "RouterKind",
    "SizeClass",
    "ToolReturnState",
    "fair_queue_length",
    "infer_status",
    "make_router",
]
