"""The job's weight publication (`libra.job.publication`) without processes: a failed load is retried with the
ledger's back-off while the instance keeps its version, an instance that keeps failing is given
up on, and one that is lost mid-retry is dropped (fake instance clients)."""

from __future__ import annotations

import asyncio

from libra.control.config import ControlConfig
from libra.job.publication import WeightPublication
from libra.rollout import InstanceUnavailable
from libra.sync.instance_update import LoadResult
from libra.sync.load_request import LoadRequest, RankLoad
from libra.sync.transport import BucketDigest, BufferManifest


class _Recorder:
    def __init__(self):
        self.events: list[tuple[str, str]] = []

    def event(self, kind: str, message: str, **extra) -> None:
        self.events.append((kind, message))


class _FlakyClient:
    """Fails the first `failures` loads (a result with ok=False, or the instance unreachable)."""

    def __init__(self, failures: int, unreachable: bool = False):
        self.failures, self.unreachable, self.calls = failures, unreachable, []

    async def load_weights(self, request: LoadRequest) -> LoadResult:
        self.calls.append(request.version)
        if len(self.calls) <= self.failures:
            if self.unreachable:
                raise InstanceUnavailable("127.0.0.1:1: UNAVAILABLE")
            return LoadResult(False, 0, "rank 0: TransferError: bucket 1 ... incomplete or stale transfer")
        return LoadResult(True, request.version, seconds=0.01)


def _request(version: int) -> LoadRequest:
    manifest = BufferManifest(version, "tp1/rank0", "float32", 8, (BucketDigest(0, 8, 1),), ())
    return LoadRequest(version, (RankLoad(manifest, {"kind": "shm", "path": "/dev/shm/x"}),))


def _publication(clients: dict[int, _FlakyClient], max_attempts: int = 3) -> WeightPublication:
    publication = WeightPublication(
        _Recorder(), "token", ControlConfig(), keep_versions=2, max_attempts=max_attempts, backoff_s=0.01
    )
    for instance_id, client in clients.items():
        publication.subscribe(instance_id, client, tp_size=1)
    publication.ledger.publish(1)
    publication.loads = {1: _request(1)}
    return publication


def test_failed_loads_are_retried_until_the_instance_runs_the_version():
    flaky, unreachable, healthy = _FlakyClient(2), _FlakyClient(1, unreachable=True), _FlakyClient(0)
    publication = _publication({0: flaky, 1: unreachable, 2: healthy})

    async def scenario():
        return await asyncio.gather(*(publication.bring_up_to_date(i) for i in (0, 1, 2)))

    assert asyncio.run(scenario()) == [True, True, True]
    assert (flaky.calls, unreachable.calls, healthy.calls) == ([1, 1, 1], [1, 1], [1])
    assert all(publication.ledger.version_of(str(i)) == 1 for i in (0, 1, 2))
    failed = sorted(m for kind, m in publication.recorder.events if kind == "load_failed")
    assert [m.split(":")[0] for m in failed] == [
        "rollout-0 attempt 1 of version 1",
        "rollout-0 attempt 2 of version 1",
        "rollout-1 attempt 1 of version 1",
    ]
    assert "stale" in failed[0] and "UNAVAILABLE" in failed[2]


def test_an_instance_that_keeps_failing_is_given_up_and_a_lost_one_dropped():
    stuck = _FlakyClient(100)
    publication = _publication({0: stuck, 1: _FlakyClient(100)}, max_attempts=3)

    async def scenario():
        gave_up = await publication.bring_up_to_date(0)
        # Instance 1 is lost (the watchdog removes it) while its retries back off.
        task = asyncio.create_task(publication.bring_up_to_date(1))
        await asyncio.sleep(0.005)
        publication.leave(1)
        return gave_up, await task

    assert asyncio.run(scenario()) == (False, False)
    assert stuck.calls == [1, 1, 1]
    assert publication.ledger.version_of("0") == 0 and "stale" in publication.ledger.given_up()["0"]
