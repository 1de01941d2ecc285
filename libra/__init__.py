"""Libra: a runtime for agentic RL post-training of LLMs.

Components (one folder each): `control` (gRPC control plane: controller, node agents, auth),
`backends` (hardware abstraction), `scheduler` (C-MLFQ routing over TP buckets). The C++ cores
live in the extension `libra._native`; the generated gRPC stubs in `libra.v1`.
"""

__version__ = "0.1.0"
