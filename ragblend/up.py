"""`ragblend up`: retriever, engines (and a Redis KV tier they share) and gateway on 127.0.0.1
as child processes, serving SmolLM2-135M-Instruct unless told otherwise; ingests the sample
documents on first start, restarts a child that dies, and stops every child it started."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

from ragblend.banner import banner
from ragblend.children import Child, UpError, check_port_free, child, child_env, free_port
from ragblend.model import (
    BUNDLED_MODEL_DTYPE,
    BUNDLED_MODEL_FALLBACK_DTYPE,
    NATIVE_BF16_FLAGS,
    bundled_model_dtype,
    engine_env_for,
    prepare_model,
    resolve_model,
)
from ragblend.redis_server import redis_child, wait_redis
from ragblend.sample_ingest import ingest_samples, ingested_example_question
from ragblend.supervisor import (
    MAX_RESTARTS,
    POLL_S,
    STABLE_S,
    STOP_SIGNALS,
    stop_all,
    supervise,
    wait_ready,
)

# The gateway's drain on SIGTERM, below the supervisor's STOP_GRACE_S.
GATEWAY_DRAIN_S = 10
MAX_ENGINES = 16
REMOTE_URL_ENV = "RAGBLEND_ENGINE_REMOTE_URL"
# Real documents the bundled model answers from, with their questions.json.
SAMPLES_DIR = Path(__file__).parent / "samples"


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "up",
        help="start retriever, engines and gateway on localhost",
        description=" ".join(__doc__.split()),
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
    parser.add_argument("--gateway-port", type=int, default=8000, help="the gateway's port")
    parser.add_argument("--retriever-port", type=int, default=8001, help="the retriever's port")
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
    parser.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="seconds the gateway has to answer /ready (every service loaded) before up stops "
        "(default 600)",
    )
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
        wait_redis(redis)
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
        ingest_samples(gateway.url, documents)
    print(banner(gateway.url, ingested_example_question(gateway.url, documents)), flush=True)
    while True:
        supervise(children, args.max_restarts)
        time.sleep(POLL_S)
