"""Plan devices -> node agents' devices.

A plan numbers devices node-major across the cluster (`libra.planner.plan`); a node agent numbers
its own from 0. The map lays the registered agents end to end in registration order, each agent's
devices in index order, so that with identical agents global device d is local device
d % devices_per_node of the (d // devices_per_node)-th agent — the planner's numbering.

An agent that was lost (or left) keeps its place: the numbers of the other agents' devices must
not shift under a plan when a node dies. Its devices cannot be used (`locate` refuses them) and
hold no running worker (`global_devices` skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

from libra.control.types import AgentState, ClusterState


@dataclass(frozen=True)
class DeviceMap:
    slots: tuple[tuple[str, int], ...]
    """(agent id, local device index) of each global device."""

    gone: frozenset[str] = frozenset()
    """Agents no longer alive: their slots keep their numbers but take no worker."""

    @classmethod
    def from_cluster_state(cls, state: ClusterState) -> DeviceMap:
        slots = [
            (agent.agent_id, device.index)
            for agent in state.agents
            for device in sorted(agent.devices, key=lambda d: d.index)
        ]
        gone = frozenset(a.agent_id for a in state.agents if a.state != AgentState.ALIVE)
        return cls(tuple(slots), gone)

    def usable(self, device: int) -> bool:
        """The device exists and its agent is alive."""
        return 0 <= device < len(self.slots) and self.slots[device][0] not in self.gone

    @property
    def num_devices(self) -> int:
        return len(self.slots)

    def locate(self, devices: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        """The one agent holding every device in `devices` and their local indices; ValueError
        when a device does not exist or they span agents (a worker runs on one host)."""
        if not devices:
            raise ValueError("a worker needs at least one device")
        missing = [d for d in devices if not 0 <= d < len(self.slots)]
        if missing:
            raise ValueError(
                f"devices {missing} do not exist: the registered agents hold {len(self.slots)} devices"
            )
        lost = sorted({self.slots[d][0] for d in devices} & self.gone)
        if lost:
            raise ValueError(f"devices {list(devices)} belong to agents {lost}, which are no longer alive")
        agents = {self.slots[d][0] for d in devices}
        if len(agents) != 1:
            raise ValueError(f"devices {list(devices)} span agents {sorted(agents)}; a worker runs on one")
        return agents.pop(), tuple(self.slots[d][1] for d in devices)

    def global_devices(self, agent_id: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The global numbers of an agent's devices (none for an agent no longer alive)."""
        if agent_id in self.gone:
            return ()
        index = {slot: d for d, slot in enumerate(self.slots)}
        return tuple(index[(agent_id, i)] for i in local if (agent_id, i) in index)
