"""`ragblend up` refuses clearly, without starting anything, when a port is taken."""

from __future__ import annotations

import socket
import subprocess
import sys

from tests.service_process import REPO_ROOT


def test_up_with_a_port_in_use_exits_naming_the_port_and_service(tiny_model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "ragblend",
                "up",
                "--model",
                tiny_model,
                "--data-dir",
                str(tmp_path),
                "--engine-port",
                str(port),
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1
    assert f"port {port} for the engine is already in use" in done.stderr


def test_up_without_a_model_says_how_to_set_one(tmp_path, monkeypatch):
    from ragblend.up import UpError, resolve_model

    monkeypatch.delenv("RAGBLEND_ENGINE_MODEL", raising=False)
    monkeypatch.setattr("engine.demo.MODEL_DIR", tmp_path / "missing")
    try:
        resolve_model(None)
    except UpError as exc:
        assert "--model" in str(exc) and "RAGBLEND_ENGINE_MODEL" in str(exc)
    else:
        raise AssertionError("resolve_model found a model in an empty folder")
