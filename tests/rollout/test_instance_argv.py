"""`instance_argv`: the one place that turns an `InstanceConfig` into an instance's command line
(used by the job's setup and the rollout benchmark) gives back the same config when parsed."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from libra.rollout.config import InstanceConfig
from libra.rollout.instance_server import build_parser, config_from_args, instance_argv


@pytest.mark.parametrize(
    "config",
    [
        InstanceConfig(model="/models/tiny"),
        InstanceConfig(
            model="/models/x y",
            dtype="bfloat16",
            max_model_len=77,
            tensor_parallel_size=2,
            kv_cache_gib=3,
            max_num_seqs=9,
            enforce_eager=False,
            seed=5,
            stats_window_s=0.25,
        ),  # fmt: skip
    ],
)
def test_argv_round_trips_every_field(config, tmp_path):
    argv = instance_argv(config, tmp_path / "instance.addr", host="10.0.0.7")
    assert argv[:3] == [sys.executable, "-m", "libra.rollout.instance_server"]
    args = build_parser().parse_args(argv[3:])
    assert config_from_args(args) == config
    assert (args.host, args.address_file, args.port) == ("10.0.0.7", str(tmp_path / "instance.addr"), 0)
    assert {f.name for f in dataclasses.fields(InstanceConfig)} <= set(vars(args)) | {"model"}
