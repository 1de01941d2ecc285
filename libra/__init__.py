"""Libra: a runtime for agentic RL post-training of LLMs.

Components, bottom to top (imports point down; docs/layers.md, checked by tests/test_layers.py):
`logs`, `trajectory` and `launch_spec` (what everything shares), `trace` (a trajectory's timed
record, which the job writes and the simulator replays), `backends` (hardware abstraction),
`control` (gRPC control plane: controller, node agents, auth), `scheduler` (C-MLFQ routing over TP
buckets) and `sync` (weight publication), `rollout` (instances, pool, agent loop, tools) and
`training` (Megatron ranks, GRPO, staleness, the elastic hybrid pool), `tasks` (datasets,
rewards), `planner` (cost models, search, plan execution), `config` (the root config composing
each component's section), `sim` (the simulator), `job` (`libra run`) and `cli`. The C++ cores
live in the extension `libra._native`; the generated gRPC stubs in `libra.v1`.
"""

__version__ = "0.1.0"
