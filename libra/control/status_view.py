"""Readable terminal views of the cluster state and its events (`libra status`)."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Iterable

from rich.console import Console
from rich.table import Table

from libra.control.types import AgentState, ClusterState, Event, WorkerState

_AGENT_STYLE = {AgentState.ALIVE: "green", AgentState.LOST: "red", AgentState.LEFT: "dim"}
_WORKER_STYLE = {
    WorkerState.STARTING: "yellow",
    WorkerState.RUNNING: "green",
    WorkerState.EXITED: "dim",
    WorkerState.STOPPED: "dim",
    WorkerState.LOST: "red",
}


def _console() -> Console:
    # Piped output (logs, scripts) gets the full table instead of one wrapped to 80 columns.
    return Console() if sys.stdout.isatty() else Console(width=200)


def render_state(state: ClusterState, console: Console | None = None) -> None:
    console = console or _console()
    now = time.time()
    agents = Table(title=f"Agents ({sum(a.state == AgentState.ALIVE for a in state.agents)} alive)")
    for column in ("agent", "state", "address", "backend", "devices", "memory/device", "last beat"):
        agents.add_column(column)
    for a in sorted(state.agents, key=lambda a: a.registered_at):
        memory = f"{a.devices[0].memory_bytes / 2**30:.1f} GiB" if a.devices else "-"
        agents.add_row(
            a.agent_id,
            f"[{_AGENT_STYLE[a.state]}]{a.state.name.lower()}[/]",
            a.address,
            a.backend,
            f"{len(a.devices)} × {a.devices[0].kind}" if a.devices else "0",
            memory,
            f"{now - a.last_heartbeat_at:.1f} s ago",
        )
    console.print(agents)
    workers = Table(title=f"Workers ({sum(not w.state.ended for w in state.workers)} running)")
    for column in ("worker", "role", "agent", "devices", "state", "pid", "exit", "uptime"):
        workers.add_column(column)
    for w in sorted(state.workers, key=lambda w: w.started_at):
        end = w.ended_at if w.state.ended else now
        workers.add_row(
            w.spec.worker_id,
            w.spec.role.name.lower(),
            w.agent_id,
            ",".join(map(str, w.spec.devices)),
            f"[{_WORKER_STYLE[w.state]}]{w.state.name.lower()}[/]",
            str(w.pid),
            str(w.exit_code) if w.state in (WorkerState.EXITED, WorkerState.STOPPED) else "",
            f"{end - w.started_at:.1f} s",
        )
    console.print(workers)


def render_events(events: Iterable[Event], console: Console | None = None) -> None:
    console = console or _console()
    for e in events:
        stamp = datetime.datetime.fromtimestamp(e.time).strftime("%H:%M:%S.%f")[:-3]
        subject = " ".join(x for x in (e.agent_id, e.worker_id) if x)
        console.print(f"{stamp} #{e.sequence} [bold]{e.kind.name.lower()}[/] {subject} {e.message}")
