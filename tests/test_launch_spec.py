"""`libra.launch_spec`: the JSON round trip every worker's launch spec goes through."""

from __future__ import annotations

import dataclasses
import json

import pytest

from libra.config import LibraConfig
from libra.launch_spec import SPEC_FLAG, ArgvSpec, decode, encode


def test_every_config_section_survives_the_round_trip():
    config = LibraConfig()
    config = dataclasses.replace(
        config,
        control=dataclasses.replace(config.control, tls_cert_file="/etc/libra/cert.pem", tls_key_file="/k"),
        training=dataclasses.replace(config.training, tensor_parallel=2, lr=3e-6),
    )
    assert decode(LibraConfig, json.loads(json.dumps(encode(config))), "config") == config


@dataclasses.dataclass(frozen=True)
class _Spec(ArgvSpec):
    module = "libra.example_worker"
    name: str
    devices: tuple[int, ...] = ()
    rate: float = 1.0
    note: str | None = None


def test_to_argv_and_from_argv_are_one_round_trip():
    spec = _Spec("a", (0, 1), 2, None)
    argv = spec.to_argv(python="py")
    assert argv[:4] == ["py", "-m", "libra.example_worker", SPEC_FLAG]
    assert _Spec.from_argv(argv[3:]) == spec
    assert isinstance(_Spec.from_argv(argv[3:]).rate, float)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--spec", '{"name": "a", "colour": 1}'], r"_Spec has no field\(s\) \['colour'\]"),
        (["--spec", '{"name": "a", "devices": [0, "x"]}'], r"_Spec.devices\[1\] must be int"),
        (["--spec", '{"name": 3}'], "_Spec.name must be str"),
        (["--spec", "{"], "--spec: not JSON"),
        (["--name", "a"], "takes exactly `--spec JSON`"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(argv, message):
    with pytest.raises(ValueError, match=message):
        _Spec.from_argv(argv)


def test_a_train_rank_spec_carries_its_layout_tls_and_backend_options():
    from libra.backends.config import BackendConfig
    from libra.control.config import ControlConfig
    from libra.training.config import TrainingConfig
    from libra.training.elastic import ElasticConfig
    from libra.training.worker import TrainRankSpec

    spec = TrainRankSpec(
        hf_model="/models/m",
        rank=3,
        master_port=29500,
        training=TrainingConfig(tensor_parallel=2, pipeline_parallel=2, train_batch_size=8),
        backend=BackendConfig(name="cpu", num_devices=4),
        control=ControlConfig(tls_cert_file="/c.pem", tls_key_file="/k.pem"),
        elastic=ElasticConfig(),
    )
    argv = spec.to_argv()
    assert argv[1:3] == ["-m", "libra.training.worker"]
    assert TrainRankSpec.from_argv(argv[3:]) == spec
    with pytest.raises(ValueError, match="rank must be in 0..3"):
        dataclasses.replace(spec, rank=4)


def test_a_hybrid_replica_spec_carries_the_cores_training_and_backend_options():
    from libra.backends.config import BackendConfig
    from libra.training.config import GrpoConfig, TrainingConfig
    from libra.training.hybrid_worker import HybridReplicaSpec

    core = TrainingConfig(tensor_parallel=2, data_parallel=1, lr=3e-6, grpo=GrpoConfig(clip_high=0.28))
    spec = HybridReplicaSpec(
        hf_model="/models/m",
        lanes=("10.0.0.1:7001", "10.0.0.1:7002"),
        replica=1,
        generation=3,
        training=core,
        backend=BackendConfig(name="cpu", num_devices=4),
        ready_file="/run/hybrid-1.ready",
    )
    argv = spec.to_argv()
    assert argv[1:3] == ["-m", "libra.training.hybrid_worker"]
    assert HybridReplicaSpec.from_argv(argv[3:]) == spec
    # Rank 0 starts rank 1 of the same replica; only rank 0 writes the files.
    other = spec.other_rank(1, master_port=29600, parent_pid=42)
    assert (other.tp_rank, other.master_port, other.parent_pid, other.ready_file) == (1, 29600, 42, None)
    assert (other.lanes, other.training) == (spec.lanes, core)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 2\)"):
        dataclasses.replace(spec, tp_rank=2, master_port=1, parent_pid=1)
    with pytest.raises(ValueError, match="needs the master_port and parent_pid"):
        dataclasses.replace(spec, tp_rank=1)
    with pytest.raises(ValueError, match="replica and generation must be >= 1"):
        dataclasses.replace(spec, replica=0)
