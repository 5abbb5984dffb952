"""`ragblend up`: start retriever, engine and gateway on localhost as child processes, ingest
the sample documents on first start, wait until ready, and stop all three on Ctrl-C/SIGTERM."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STOP_TIMEOUT_S = 30.0
POLL_S = 0.5


class UpError(RuntimeError):
    """A start-up problem the user can fix (a port in use, no model); printed, exit 1."""


@dataclass
class Child:
    name: str
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start retriever, engine and gateway on localhost",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--model",
        help="engine checkpoint (default: RAGBLEND_ENGINE_MODEL, else the bundled demo model)",
    )
    parser.add_argument(
        "--data-dir", default="data", help="retriever index and KV store (default ./data)"
    )
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--retriever-port", type=int, default=8001)
    parser.add_argument("--engine-port", type=int, default=8002)
    parser.add_argument(
        "--documents", help="folder ingested on first start (default: the bundled sample documents)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.set_defaults(run=run)


def resolve_model(explicit: str | None) -> str:
    model = explicit or os.environ.get("RAGBLEND_ENGINE_MODEL")
    if model:
        return model
    from demo import MODEL_DIR

    if (MODEL_DIR / "config.json").is_file():
        return str(MODEL_DIR)
    raise UpError(
        f"no model: the demo model is missing at {MODEL_DIR}. Pass --model PATH or set "
        "RAGBLEND_ENGINE_MODEL to a Hugging Face checkpoint directory."
    )


def check_port_free(name: str, port: int) -> None:
    with socket.socket() as sock:
        # As uvicorn does: a port whose old connections linger in TIME_WAIT is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UpError(
                f"port {port} for the {name} is already in use ({exc.strerror}); stop what "
                f"uses it or pass --{name}-port"
            ) from None


def start(name: str, port: int, args: list[str], log_level: str) -> Child:
    cmd = [
        sys.executable,
        "-m",
        "ragblend",
        "--log-level",
        log_level,
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    # Own process group: a Ctrl-C in the terminal reaches only us, and we stop the children
    # in order instead of all at once.
    proc = subprocess.Popen(cmd, start_new_session=True)
    return Child(name, port, proc)


def wait_ready(children: list[Child], gateway: Child, timeout_s: float) -> None:
    import httpx
    from rich.console import Console

    deadline = time.monotonic() + timeout_s
    with Console(stderr=True).status("waiting for the services (loading models)…") as status:
        while time.monotonic() < deadline:
            check_alive(children)
            try:
                response = httpx.get(f"{gateway.url}/ready", timeout=2.0)
                if response.status_code == 200:
                    return
                status.update(f"waiting: {response.json().get('detail', response.text)}")
            except httpx.HTTPError:
                status.update("waiting for the gateway to listen…")
            time.sleep(POLL_S)
    raise UpError(f"the services were not ready after {timeout_s:.0f} s")


def check_alive(children: list[Child]) -> None:
    for child in children:
        code = child.proc.poll()
        if code is not None:
            raise UpError(f"the {child.name} exited with code {code}; see its log above")


def ingest_samples(gateway: Child, folder: Path) -> None:
    """Ingest every supported file of `folder` when the collection is empty (first start)."""
    import httpx
    from tqdm import tqdm

    from retriever.extract import ExtractionError, extract_text, is_supported

    with httpx.Client(base_url=gateway.url, timeout=600.0) as client:
        if client.get("/v1/documents", params={"limit": 1}).json()["total"] > 0:
            return
        files = sorted(p for p in folder.rglob("*") if p.is_file() and is_supported(p.name))
        failed = 0
        for path in tqdm(files, desc="ingesting sample documents", unit="doc", file=sys.stderr):
            try:
                extracted = extract_text(path.name, path.read_bytes())
            except (ExtractionError, OSError) as exc:
                failed += 1
                print(f"  {path.name}: {exc}", file=sys.stderr)
                continue
            response = client.post(
                "/v1/documents",
                json={
                    "text": extracted.text,
                    "metadata": {**extracted.metadata, "source": path.name},
                },
            )
            if response.status_code != 200:
                failed += 1
                print(
                    f"  {path.name}: HTTP {response.status_code} {response.text[:200]}",
                    file=sys.stderr,
                )
        if failed:
            print(f"{failed} of {len(files)} sample documents failed", file=sys.stderr)


def stop_all(children: list[Child]) -> None:
    """SIGTERM the gateway first (it drains its streams), then the others; SIGKILL on timeout."""
    # A second Ctrl-C must not abandon the children half-stopped; the timeout bounds the wait.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    for child in reversed(children):
        try:
            child.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(
                f"the {child.name} did not stop in {STOP_TIMEOUT_S:.0f} s; killing it",
                file=sys.stderr,
            )
            child.proc.kill()
            child.proc.wait()


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def _raise_stop(signum, _frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    data_dir = Path(args.data_dir).resolve()
    ports = {
        "gateway": args.gateway_port,
        "retriever": args.retriever_port,
        "engine": args.engine_port,
    }
    children: list[Child] = []
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    try:
        model = resolve_model(args.model)
        for name, port in ports.items():
            check_port_free(name, port)
        level = args.log_level
        # Chunks are sized in the model's own tokens, so top_k of them fit its context.
        children.append(
            start(
                "retriever",
                ports["retriever"],
                [
                    "--data-dir",
                    str(data_dir / "retriever"),
                    "--tokenizer",
                    model,
                ],
                level,
            )
        )
        children.append(
            start(
                "engine",
                ports["engine"],
                ["--model", model, "--store-path", str(data_dir / "kv")],
                level,
            )
        )
        gateway = start(
            "gateway",
            ports["gateway"],
            [
                "--retriever-url",
                children[0].url,
                "--engine-urls",
                children[1].url,
            ],
            level,
        )
        children.append(gateway)
        wait_ready(children, gateway, args.ready_timeout_s)
        documents = Path(args.documents) if args.documents else _demo_documents()
        if documents is not None and documents.is_dir():
            ingest_samples(gateway, documents)
        print(_banner(gateway), flush=True)
        while True:
            check_alive(children)
            time.sleep(POLL_S)
    except _Stop as stop:
        print(f"\n{stop}: stopping the services…", file=sys.stderr)
        stop_all(children)
        return 0
    except UpError as exc:
        print(f"ragblend up: {exc}", file=sys.stderr)
        stop_all(children)
        return 1


def _demo_documents() -> Path | None:
    from demo import DOCUMENTS_DIR

    return DOCUMENTS_DIR


def _banner(gateway: Child) -> str:
    return (
        f"\nragblend is up: gateway {gateway.url} (Ctrl-C stops all three)\n"
        "Try:\n"
        f"  curl -s {gateway.url}/v1/query -H 'Content-Type: application/json' \\\n"
        '    -d "{\\"question\\": \\"What is the job of Goulpu?\\", \\"top_k\\": 3}"\n'
    )
