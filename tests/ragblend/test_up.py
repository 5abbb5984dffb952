"""`ragblend up`: the whole stack from one command, and clear refusals when it cannot start."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx

from tests.service_process import REPO_ROOT, free_port, service_env


def up_command(model: str, data_dir, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ragblend",
        "up",
        "--model",
        model,
        "--data-dir",
        str(data_dir),
        *args,
    ]


def test_up_with_a_port_in_use_exits_naming_the_port_and_service(tiny_model, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run(
            up_command(tiny_model, tmp_path, "--engine-port", str(port)),
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
    monkeypatch.setattr("demo.MODEL_DIR", tmp_path / "missing")
    try:
        resolve_model(None)
    except UpError as exc:
        assert "--model" in str(exc) and "RAGBLEND_ENGINE_MODEL" in str(exc)
    else:
        raise AssertionError("resolve_model found a model in an empty folder")


def test_up_starts_the_stack_ingests_the_samples_answers_and_stops_on_sigterm(tiny_model, tmp_path):
    samples = tmp_path / "samples"
    samples.mkdir()
    (samples / "river.md").write_text("The Zorblax river flows through Quendor.\n")
    (samples / "pass.txt").write_text("Travelers cross the Vantir mountains by the Kessa pass.\n")
    ports = {name: free_port() for name in ("gateway", "retriever", "engine")}
    port_args = [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    command = up_command(tiny_model, tmp_path / "data", "--documents", str(samples), *port_args)
    log = tmp_path / "up.log"
    with log.open("wb") as out:  # a file, not a pipe: nobody reads the services' logs here
        up = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=service_env()
        )
    try:
        deadline = time.monotonic() + 300
        while "ragblend is up" not in log.read_text(errors="replace"):
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        gateway = f"http://127.0.0.1:{ports['gateway']}"
        documents = httpx.get(f"{gateway}/v1/documents", timeout=30).json()["documents"]
        assert len(documents) == 2
        answer = httpx.post(
            f"{gateway}/v1/query",
            timeout=120,
            json={"question": "Which pass crosses the Vantir?", "top_k": 2, "max_tokens": 4},
        )
        assert answer.status_code == 200, answer.text
        assert any("Kessa" in s["text"] for s in answer.json()["sources"])
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0
    for port in ports.values():
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served"
