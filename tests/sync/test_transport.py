"""Transports and manifests without an engine: checksums catch short, stale and zeroed buckets;
each transport delivers a published buffer byte for byte; the shm receiver's view is private."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from libra.sync.collective import CollectiveReceiver, CollectiveSender
from libra.sync.grpc_stream import GrpcReceiver, GrpcSender
from libra.sync.load_request import LoadRequest
from libra.sync.publisher import WeightPublisher, buffer_key
from libra.sync.shm import ShmReceiver, ShmSender, pid_namespace
from libra.sync.transport import BufferManifest, TransferError, checksum, verify_staged
from libra.sync.wire import load_request_from_proto, load_request_to_proto
from tests.sync.helpers import plan_for
from tests.sync.reference_reshard import make_megatron_shards
from tests.sync.test_executor import SHAPE

TOKEN = "transport-test-token"


@pytest.fixture(scope="module")
def published_inputs():
    shards = make_megatron_shards(SHAPE, 2, 1, 128, torch.float32, seed=9)
    plans = {tp: plan_for(SHAPE, 2, 1, tp, torch.float32, bucket_bytes=2048) for tp in (1, 2)}
    return plans, shards


@pytest.mark.parametrize("algorithm", ["xor64", "crc32"])
def test_checksum_sees_changes_and_truncation(algorithm):
    data = torch.arange(1001, dtype=torch.uint8)
    base = checksum(data, algorithm)
    changed = data.clone()
    changed[500] ^= 1
    assert checksum(changed, algorithm) != base
    assert checksum(data[:-8], algorithm) != base
    assert checksum(torch.zeros(16, dtype=torch.uint8), algorithm) != checksum(
        torch.zeros(8, dtype=torch.uint8), algorithm
    )
    with pytest.raises(ValueError, match="checksum algorithm"):
        checksum(data, "md5")


def test_manifest_round_trip_and_validation(published_inputs):
    plans, shards = published_inputs
    sender = ShmSender()
    try:
        publication = WeightPublisher(plans, sender, torch.float32).publish(3, shards)
        for manifest in publication.manifests.values():
            assert BufferManifest.from_dict(manifest.to_dict()) == manifest
            assert len(manifest.buckets) > 1, "the test wants several buckets"
        request = publication.load_request(2)
        assert [r.manifest.key for r in request.ranks] == [buffer_key(2, 0), buffer_key(2, 1)]
        assert LoadRequest.from_dict(request.to_dict()) == request
        assert load_request_from_proto(load_request_to_proto(request)) == request
        with pytest.raises(ValueError, match="TP=4"):
            publication.load_request(4)
        with pytest.raises(ValueError, match="greater than"):
            publisher = WeightPublisher(plans, sender, torch.float32)
            publisher.publish(5, shards)
            publisher.publish(5, shards)
    finally:
        sender.close()
    bad = publication.manifests[buffer_key(1, 0)].to_dict()
    bad["num_bytes"] += 4
    with pytest.raises(ValueError, match="buckets cover"):
        BufferManifest.from_dict(bad)


def _round_trip(sender, receiver, plans, shards, version=1):
    publication = WeightPublisher(plans, sender, torch.float32).publish(version, shards)
    for key, manifest in publication.manifests.items():
        staged = receiver.fetch(manifest, publication.handles[key])
        verify_staged(staged, manifest)
        yield key, manifest, staged


def test_shm_delivers_and_isolates(published_inputs):
    plans, shards = published_inputs
    sender = ShmSender()
    try:
        staged_by_key = {}
        for key, manifest, staged in _round_trip(sender, ShmReceiver(), plans, shards):
            staged_by_key[key] = (manifest, staged)
        # The receiver's copy-on-write view: writing it leaves the publisher's file intact.
        manifest, staged = staged_by_key[buffer_key(1, 0)]
        staged[:8] = 0
        again = ShmReceiver().fetch(manifest, {"kind": "shm", "path": str(sender.path(1, manifest.key))})
        verify_staged(again, manifest)
        with pytest.raises(TransferError, match="incomplete or stale"):
            verify_staged(staged, manifest)
        sender.release(1)
        assert not sender.path(1, manifest.key).exists()
        with pytest.raises(TransferError, match="gone"):
            ShmReceiver().fetch(manifest, {"kind": "shm", "path": str(sender.path(1, manifest.key))})
        verify_staged(again, manifest)  # an existing mapping survives the release
    finally:
        sender.close()


def test_shm_publisher_removes_orphans_and_never_collides(tmp_path):
    """A SIGKILLed publisher leaves its files; a new one whose pid is reused must neither fail on
    them nor leave them, and must not touch a live publisher's files, nor those of another PID
    namespace (whose pids it cannot check)."""
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    namespace = pid_namespace()
    orphan = tmp_path / f"libra-w{namespace}.{int(dead.stdout)}-0badf00d-v2-tp2_rank0"
    live = tmp_path / f"libra-w{namespace}.{os.getpid()}-feedbeef-v2-tp2_rank0"
    elsewhere = tmp_path / f"libra-w{namespace + 1}.{int(dead.stdout)}-0badf00d-v2-tp2_rank0"
    unrelated = tmp_path / "other-file"
    for path in (orphan, live, elsewhere, unrelated):
        path.write_bytes(b"x")
    first, second = ShmSender(directory=tmp_path), ShmSender(directory=tmp_path)
    try:
        assert not orphan.exists()
        assert first.prefix != second.prefix
        first.allocate(2, "tp2_rank0", 8)
        second.allocate(2, "tp2_rank0", 8)  # same pid, version and key: different files
    finally:
        first.close()
        second.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, elsewhere, unrelated))


def test_grpc_delivers_and_refuses_unknown(published_inputs):
    plans, shards = published_inputs
    sender = GrpcSender(TOKEN, chunk_bytes=1000, advertise_token=True)
    try:
        delivered = list(_round_trip(sender, GrpcReceiver(timeout_s=30), plans, shards, version=4))
        assert len(delivered) == 3
        manifest = delivered[0][1]
        handle = {"kind": "grpc", "address": sender.address, "token": TOKEN}
        missing = BufferManifest.from_dict({**manifest.to_dict(), "version": 99})
        with pytest.raises(TransferError, match="NOT_FOUND"):
            GrpcReceiver(timeout_s=30).fetch(missing, handle)
        with pytest.raises(TransferError, match="UNAUTHENTICATED"):
            GrpcReceiver(timeout_s=30).fetch(manifest, {**handle, "token": "wrong"})
    finally:
        sender.close()


def test_collective_delivers_between_threads(published_inputs):
    from tests.training.jobs import free_port

    plans, shards = published_inputs
    port = free_port()
    sender = CollectiveSender("127.0.0.1", port, num_receivers=1, timeout_s=30)
    joined = threading.Thread(target=CollectiveReceiver.join, args=("127.0.0.1", port, 1, 2, 30))
    joined.start()
    joined.join(60)
    assert sender.wait_ready(60)
    receiver = CollectiveReceiver.for_handle({"kind": "collective"})
    delivered = list(_round_trip(sender, receiver, plans, shards, version=2))
    assert {key for key, _, _ in delivered} == {buffer_key(1, 0), buffer_key(2, 0), buffer_key(2, 1)}
    with pytest.raises(TransferError, match="does not have it"):
        receiver.fetch(
            BufferManifest.from_dict({**delivered[0][1].to_dict(), "version": 77}), {"kind": "collective"}
        )
    CollectiveReceiver.leave()
