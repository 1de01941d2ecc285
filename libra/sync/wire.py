"""`LoadRequest` <-> `libra.v1.VersionLoad` (protos/libra/v1/weights.proto): the one conversion
between the typed load request and the wire, used by the trainer's PublishWeights reply, the
controller, and the rollout instance's LoadWeights. Malformed messages raise ValueError naming
the field."""

from __future__ import annotations

from typing import Any

from libra.sync.load_request import LoadRequest, RankLoad
from libra.sync.plan import ParamSlot
from libra.sync.transport import BucketDigest, BufferManifest
from libra.v1 import weights_pb2


def manifest_to_proto(manifest: BufferManifest) -> weights_pb2.BufferManifest:
    return weights_pb2.BufferManifest(
        version=manifest.version,
        key=manifest.key,
        dtype=manifest.dtype,
        num_bytes=manifest.num_bytes,
        buckets=[
            weights_pb2.BucketDigest(start=b.start, end=b.end, checksum=b.checksum) for b in manifest.buckets
        ],
        params=[
            weights_pb2.ParamSlot(name=p.name, offset=p.offset, shape=list(p.shape)) for p in manifest.params
        ],
        checksum=manifest.checksum,
    )


def manifest_from_proto(msg: weights_pb2.BufferManifest) -> BufferManifest:
    return BufferManifest(
        version=msg.version,
        key=msg.key,
        dtype=msg.dtype,
        num_bytes=msg.num_bytes,
        buckets=tuple(BucketDigest(b.start, b.end, b.checksum) for b in msg.buckets),
        params=tuple(ParamSlot(p.name, p.offset, tuple(p.shape)) for p in msg.params),
        checksum=msg.checksum or "xor64",
    )


def handle_to_proto(handle: dict[str, Any]) -> weights_pb2.TransportHandle:
    kind = handle.get("kind")
    if kind == "shm":
        return weights_pb2.TransportHandle(shm=weights_pb2.ShmHandle(path=str(handle["path"])))
    if kind == "grpc":
        return weights_pb2.TransportHandle(
            grpc=weights_pb2.GrpcStreamHandle(
                address=str(handle["address"]),
                chunk_bytes=int(handle.get("chunk_bytes", 0)),
                token=str(handle.get("token", "")),
            )
        )
    if kind == "collective":
        return weights_pb2.TransportHandle(collective=weights_pb2.CollectiveHandle())
    raise ValueError(f"handle kind must be shm, grpc or collective, got {kind!r}")


def handle_from_proto(msg: weights_pb2.TransportHandle, where: str) -> dict[str, Any]:
    kind = msg.WhichOneof("kind")
    if kind == "shm":
        return {"kind": "shm", "path": msg.shm.path}
    if kind == "grpc":
        handle: dict[str, Any] = {
            "kind": "grpc",
            "address": msg.grpc.address,
            "chunk_bytes": msg.grpc.chunk_bytes,
        }
        if msg.grpc.token:
            handle["token"] = msg.grpc.token
        return handle
    if kind == "collective":
        return {"kind": "collective"}
    raise ValueError(f"{where}.handle: no transport set")


def load_request_to_proto(request: LoadRequest) -> weights_pb2.VersionLoad:
    return weights_pb2.VersionLoad(
        version=request.version,
        ranks=[
            weights_pb2.RankLoad(
                manifest=manifest_to_proto(r.manifest), handle=handle_to_proto(dict(r.handle))
            )
            for r in request.ranks
        ],
    )


def load_request_from_proto(msg: weights_pb2.VersionLoad) -> LoadRequest:
    ranks = []
    for i, rank in enumerate(msg.ranks):
        where = f"ranks[{i}]"
        if not rank.HasField("manifest"):
            raise ValueError(f"{where}.manifest must be set")
        try:
            manifest = manifest_from_proto(rank.manifest)
        except ValueError as e:
            raise ValueError(f"{where}.manifest: {e}") from None
        ranks.append(RankLoad(manifest, handle_from_proto(rank.handle, where)))
    return LoadRequest(msg.version, tuple(ranks))
