"""`InstanceSpec`: the one place that turns a rollout instance's config into its command line (the
job's setup, the rollout benchmark, the tests) gives back the same spec in the instance process,
the control plane's TLS settings included."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from libra.backends import BackendConfig
from libra.control.config import ControlConfig
from libra.rollout.config import InstanceConfig
from libra.rollout.instance_server import InstanceSpec


@pytest.mark.parametrize(
    "spec",
    [
        InstanceSpec(InstanceConfig(model="/models/tiny"), BackendConfig()),
        InstanceSpec(
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
            ),
            backend=BackendConfig(name="cpu", num_devices=3),
            control=ControlConfig(tls_cert_file="/etc/cert.pem", tls_key_file="/etc/key.pem"),
            host="10.0.0.7",
            address_file="/run/instance.addr",
        ),
    ],
)
def test_argv_round_trips_every_field(spec):
    argv = spec.to_argv()
    assert argv[:3] == [sys.executable, "-m", "libra.rollout.instance_server"]
    assert InstanceSpec.from_argv(argv[3:]) == spec


def test_a_bad_field_is_named():
    argv = InstanceSpec(InstanceConfig(model="/m"), BackendConfig()).to_argv()
    broken = argv[-1].replace('"max_num_seqs"', '"max_seqs"')
    with pytest.raises(ValueError, match=r"InstanceSpec.instance has no field\(s\) \['max_seqs'\]"):
        InstanceSpec.from_argv([argv[-2], broken])
    assert dataclasses.fields(InstanceSpec)
