"""TLS on the control plane, and the `libra` commands a user runs (controller, agent, status) as
real processes."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from libra.config import LibraConfig
from libra.control import ClusterClient, Controller
from libra.control.auth import open_channel
from libra.control.config import ControlConfig
from libra.v1 import controller_pb2, controller_pb2_grpc
from tests.control.helpers import TOKEN, wait_for

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def test_tls_controller_serves_only_tls_clients(tmp_path, certificate):
    cert, key = certificate
    control = ControlConfig(port=0, token=TOKEN, tls_cert_file=str(cert), tls_key_file=str(key))
    controller = Controller(LibraConfig(run_dir=str(tmp_path), control=control)).start()
    try:
        with ClusterClient(controller.address, TOKEN, control) as client:
            assert client.cluster_state().agents == []
        with ClusterClient(controller.address, "wrong", control) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.cluster_state()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        plaintext = controller_pb2_grpc.ClusterApiStub(open_channel(controller.address, TOKEN))
        with pytest.raises(grpc.RpcError) as err:
            plaintext.GetClusterState(controller_pb2.GetClusterStateRequest(), timeout=3)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        controller.stop()


def libra(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "libra.cli", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def test_commands_form_a_cluster_from_the_run_folder(tmp_path):
    run_dir = tmp_path / "run"
    controller = libra("controller", f"run_dir={run_dir}", "control.port=0")
    agent = None
    try:
        wait_for(lambda: (run_dir / "controller.addr").is_file(), what="controller address file")
        token_file = run_dir / "token"
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        agent = libra("agent", f"run_dir={run_dir}", "backend.num_devices=2")
        address = (run_dir / "controller.addr").read_text().strip()
        with ClusterClient(address, token_file.read_text().strip()) as client:
            wait_for(lambda: client.cluster_state().agents, what="agent registration")

        status = libra("status", f"run_dir={run_dir}")
        output, _ = status.communicate(timeout=60)
        assert status.returncode == 0, output
        assert "Agents (1 alive)" in output and "2 × cpu-slot" in output

        no_token = libra("status", "--controller", address, f"run_dir={tmp_path / 'elsewhere'}")
        output, _ = no_token.communicate(timeout=60)
        assert no_token.returncode == 2 and "no token" in output
        wrong = libra("status", "--controller", address, env={"LIBRA_TOKEN": "wrong"})
        output, _ = wrong.communicate(timeout=60)
        assert wrong.returncode == 1 and "UNAUTHENTICATED" in output
    finally:
        for process in (agent, controller):
            if process is not None:
                process.terminate()
                process.wait(timeout=15)
    assert controller.returncode == 0 and agent.returncode == 0


def test_bad_override_is_a_clear_error():
    process = libra("controller", "control.prot=1")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    assert "unknown config option 'control.prot'" in output
