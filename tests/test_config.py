"""Config loading, overrides and validation errors that name the option."""

from __future__ import annotations

import pytest

from libra.config import LibraConfig, apply_override, load_config, load_from_file
from libra.control.config import ControlConfig


def test_overrides_parse_types_and_revalidate():
    cfg = apply_override(LibraConfig(), "control.port=0")
    cfg = apply_override(cfg, "--backend.num_devices=3")
    cfg = apply_override(cfg, "control.token=none")
    cfg = apply_override(cfg, "run_dir=/tmp/x")
    assert (cfg.control.port, cfg.backend.num_devices, cfg.control.token, cfg.run_dir) == (
        0,
        3,
        None,
        "/tmp/x",
    )


@pytest.mark.parametrize(
    "override, message",
    [
        ("control.port=70000", "control.port"),
        ("control.prot=1", "unknown config option 'control.prot'"),
        ("control.port=abc", "cannot read 'abc' as int"),
        ("backend.num_devices=0", "backend.num_devices"),
        ("control.heartbeat_interval_s=-1", "control.heartbeat_interval_s"),
        ("control.port", "section.field=value"),
        ("run_dir.x=1", "not a section"),
        ("job.rollout_tp_sizes=1,x", "'job.rollout_tp_sizes': cannot read 'x' as int"),
        ("scheduler.buckets=short", "'scheduler.buckets' has no command-line form"),
    ],
)
def test_bad_overrides_name_the_option(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        apply_override(LibraConfig(), override)


def test_sequences_parse_comma_separated():
    cfg = apply_override(LibraConfig(), "job.rollout_tp_sizes=1, 2,4")
    cfg = apply_override(cfg, "tools.enabled=python,calculator")
    assert cfg.job.rollout_tp_sizes == (1, 2, 4) and cfg.tools.enabled == ["python", "calculator"]


def test_tls_files_come_in_pairs():
    with pytest.raises(ValueError, match="tls_cert_file and control.tls_key_file"):
        ControlConfig(tls_cert_file="cert.pem")


def test_config_file_must_define_config(tmp_path):
    good = tmp_path / "good.py"
    good.write_text(
        "from libra.config import LibraConfig\nfrom libra.control.config import ControlConfig\n"
        "def config():\n    return LibraConfig(control=ControlConfig(port=1234))\n"
    )
    assert load_config(good, ["control.heartbeat_interval_s=0.5"]).control.port == 1234
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ValueError, match="must define a function `config"):
        load_config(bad)
    with pytest.raises(ValueError, match="not found"):
        load_config(tmp_path / "missing.py")
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def config():\n    return 1\n")
    with pytest.raises(ValueError, match="config\\(\\) in .* returned int, expected LibraConfig"):
        load_config(wrong)
    with pytest.raises(ValueError, match="must define a function `sim_config\\(\\) -> LibraConfig`"):
        load_from_file(good, "sim_config", LibraConfig)


def test_sampling_and_scoring_temperatures_must_agree():
    with pytest.raises(ValueError, match=r"training.grpo.temperature \(1.0\) must equal rollout.agent"):
        load_config(None, ["rollout.agent.temperature=0.6"])
    cfg = load_config(None, ["rollout.agent.temperature=0.6", "training.grpo.temperature=0.6"])
    assert cfg.training.grpo.temperature == cfg.rollout.agent.temperature == 0.6
    # Greedy rollouts (evaluation) score at any temperature.
    assert load_config(None, ["rollout.agent.temperature=0"]).training.grpo.temperature == 1.0


def test_fields_that_go_together_can_be_overridden_together():
    config = load_config(
        None, ["control.tls_cert_file=/c.pem", "control.tls_key_file=/k.pem", "control.port=0"]
    )
    assert (config.control.tls_cert_file, config.control.tls_key_file, config.control.port) == (
        "/c.pem",
        "/k.pem",
        0,
    )
    with pytest.raises(
        ValueError, match="control.tls_cert_file and control.tls_key_file must be set together"
    ):
        load_config(None, ["control.tls_cert_file=/c.pem"])


def test_an_environment_and_an_agent_cannot_both_answer_turns():
    overrides = ["tasks.environment=examples.custom_environment:MathWithFeedback", "endpoint.agent=a.b:agent"]
    with pytest.raises(ValueError, match="tasks.environment and endpoint.agent both answer"):
        load_config(None, overrides)
