"""Chaos soak: 3 engines sharing one small Redis (an SSD tier each), a retriever and a gateway under
8 closed-loop clients while engines and Redis are killed with SIGKILL and SSD bits flip.

    .venv/bin/python tests/chaos/soak.py --minutes 5

Every question's greedy answers are known beforehand (full_prefill, and cacheblend with every
chunk cached); the table counts requests, errors by status, answers that differ, streams cut
mid-way and poison or orphan entries left in Redis. A benchmark; test_chaos_soak.py beside it
runs a short one. Its rules: docs/deployment.md, "Scaling engines"."""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))

from bench.paths import results_dir  # noqa: E402
from tests.chaos.cluster import (  # noqa: E402
    START_TIMEOUT_S,
    Cluster,
    ClusterConfig,
    ClusterError,
    RedisAudit,
    audit_redis,
    flip_random_bit,
)

MODES = ("full_prefill", "cacheblend")
DOCUMENT_SEEDS = (2024, 2025, 2026, 2027)  # demo.documents.build: 12 documents a seed
REQUEST_TIMEOUT_S = 60.0
REFERENCE_TRIES = 3  # cacheblend requests until one finds every chunk cached
LONG_QUESTION = "Tell me about {name} and everything."


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 300.0
    clients: int = 8
    engine_kill_every_s: float = 20.0
    redis_kill_every_s: float = 45.0
    flip_every_s: float = 5.0
    max_questions: int = 24
    long_questions: int = 4  # of them, questions the demo model answers at length
    top_k: int = 3
    max_tokens: int = 32
    redis_maxmemory: str = "2mb"
    seed: int = 0
    max_requests: int = 100_000  # per client: the loop is bounded in count as well as time


@dataclass(frozen=True)
class Reference:
    full_prefill: str
    cacheblend: str | None  # None: no request found every chunk cached; blends are only counted


@dataclass
class Outcome:
    """One request: `kind` is ok, http (a status other than 200), transport (no answer), cut
    (a stream that ended with an SSE error event) or unclean (a stream that ended otherwise)."""

    start_s: float
    end_s: float
    mode: str
    stream: bool
    kind: str
    status: int | None = None
    answer: str | None = None
    all_cached: bool = False
    question: str = ""
    detail: str = ""


@dataclass
class ChaosLog:
    engine_kills: list[float] = field(default_factory=list)  # monotonic seconds
    kills_skipped: int = 0  # engine kills left out while only one engine was up
    redis_kills: int = 0
    bit_flips: int = 0
    seen_before_redis_kills: RedisAudit = field(default_factory=RedisAudit)
    restart_failures: list[str] = field(default_factory=list)
    restarts: list[threading.Thread] = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)  # the soak is over


@dataclass(frozen=True)
class SoakReport:
    """What the table shows; `unexpected` lists failures outside every accepted window."""

    duration_s: float
    clients: int
    requests: int
    ok: int
    errors_by_status: dict[str, int]
    streams: int
    cut_streams: int
    unclean_streams: int
    unexpected: list[str]
    full_prefill_answers: int
    full_prefill_wrong: int
    cacheblend_answers: int
    cacheblend_all_cached: int
    cacheblend_wrong: int
    cacheblend_differs_from_full: int
    engine_kills: int
    engine_kills_skipped: int
    redis_kills: int
    bit_flips: int
    redis_end: RedisAudit
    seen_before_redis_kills: RedisAudit
    restart_failures: list[str]


def demo_workload(max_questions: int, long_questions: int) -> tuple[dict[str, str], list[str]]:
    """{doc_id: text} of demo.documents for DOCUMENT_SEEDS, and `max_questions` distinct
    questions about them (every seed's in turn): `long_questions` of LONG_QUESTION, which the
    demo model answers up to max_tokens (streams long enough to be cut by a kill), the others
    the demo's own, answered in a token or two."""
    from demo.documents import build

    documents: dict[str, str] = {}
    per_seed: list[list[str]] = []
    names: list[str] = []
    for seed in DOCUMENT_SEEDS:
        files, questions = build(seed)
        documents |= {f"{seed}-{name.removesuffix('.md')}": text for name, text in files.items()}
        per_seed.append([q.question for q in questions])
        names += [name.removesuffix(".md").capitalize() for name in files]
    long = [LONG_QUESTION.format(name=name) for name in names[::12][:long_questions]]
    interleaved = (q for group in itertools.zip_longest(*per_seed) for q in group if q)
    short = list(dict.fromkeys(interleaved))[: max_questions - len(long)]
    return documents, long + short


def ingest(http: httpx.Client, documents: dict[str, str], timeout_s: float = 300.0) -> None:
    """Each document ingested, then waited on until its precompute is ready."""
    for doc_id, text in documents.items():
        http.post("/v1/documents", json={"text": text, "id": doc_id}).raise_for_status()
    deadline = time.monotonic() + timeout_s
    for doc_id in documents:
        while True:
            status = http.get(f"/v1/documents/{doc_id}").json()["precompute"]["status"]
            if status == "ready":
                break
            if status != "pending" or time.monotonic() > deadline:
                raise RuntimeError(f"precompute of {doc_id}: {status}")
            time.sleep(0.2)


def query_body(question: str, mode: str, stream: bool, config: SoakConfig) -> dict:
    return {
        "question": question,
        "mode": mode,
        "stream": stream,
        "top_k": config.top_k,
        "max_tokens": config.max_tokens,
        "temperature": 0.0,
        # Lexical search: the same chunks every time, without an embedding per question.
        "retrieval": "bm25",
    }


def parse_sse(text: str) -> list[tuple[str | None, str]] | None:
    """(event, data) of each frame, or None when the text is not a whole SSE stream."""
    if not text.endswith("\n\n"):
        return None
    frames = []
    for block in text.strip("\n").split("\n\n"):
        event, data = None, []
        for line in block.split("\n"):
            name, sep, value = line.partition(": ")
            if not sep or name not in ("event", "data"):
                return None
            if name == "event":
                event = value
            else:
                data.append(value)
        frames.append((event, "\n".join(data)))
    return frames


def ask(http: httpx.Client, question: str, mode: str, stream: bool, config: SoakConfig) -> Outcome:
    """One query, never raising: what happened to it."""
    body = query_body(question, mode, stream, config)
    outcome = Outcome(time.monotonic(), 0.0, mode, stream, "ok", question=question)
    try:
        if stream:
            with http.stream("POST", "/v1/query", json=body) as response:
                outcome.status = response.status_code
                text = response.read().decode(errors="replace")
        else:
            response = http.post("/v1/query", json=body)
            outcome.status, text = response.status_code, response.text
    except httpx.HTTPError as exc:
        outcome.kind, outcome.detail = "transport", f"{type(exc).__name__}: {exc}"
        outcome.end_s = time.monotonic()
        return outcome
    outcome.end_s = time.monotonic()
    if outcome.status != 200:
        outcome.kind, outcome.detail = "http", text[:300]
        return outcome
    result = json.loads(text) if not stream else _stream_result(text, outcome)
    if result is not None:
        outcome.answer = result["answer"]
        outcome.all_cached = all(tier is not None for tier in result["chunk_tiers"])
    return outcome


def _stream_result(text: str, outcome: Outcome) -> dict | None:
    frames = parse_sse(text)
    last_event, last_data = frames[-1] if frames else (None, "")
    if last_event == "result":
        return json.loads(last_data)
    if last_event == "error" and "detail" in json.loads(last_data):
        outcome.kind, outcome.detail = "cut", json.loads(last_data)["detail"]
    else:
        outcome.kind, outcome.detail = "unclean", text[-300:]
    return None


def references(http: httpx.Client, questions: list[str], config: SoakConfig) -> dict:
    """Each question's undisturbed greedy answers, asked one at a time."""
    found = {}
    for question in questions:
        full = ask(http, question, "full_prefill", False, config)
        if full.answer is None:
            raise RuntimeError(f"the reference of {question!r} failed: {full.detail}")
        blend = None
        for _ in range(REFERENCE_TRIES):
            outcome = ask(http, question, "cacheblend", False, config)
            if outcome.all_cached:
                blend = outcome.answer
                break
        found[question] = Reference(full.answer, blend)
    return found


def run_clients(url: str, questions: list[str], config: SoakConfig, until: float) -> list[Outcome]:
    """`config.clients` closed loops, each cycling through the questions, the two modes and
    streamed or not, until `until` (monotonic) or `max_requests` each."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        with httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
            for i in range(config.max_requests):
                if time.monotonic() >= until:
                    return
                question = questions[(index * 5 + i) % len(questions)]
                outcome = ask(http, question, MODES[i % 2], (i // 2 + index) % 2 == 0, config)
                with lock:
                    outcomes.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(config.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, until - time.monotonic()) + 2 * REQUEST_TIMEOUT_S)
    return outcomes


def run_chaos(cluster: Cluster, config: SoakConfig, until: float, log: ChaosLog) -> None:
    """Until `until`: SIGKILL an engine every engine_kill_every_s (round robin over those up, never
    the last one up) and restart it at once, Redis every redis_kill_every_s (restarted empty),
    and flip a bit in a random SSD entry every flip_every_s. Engine restarts run beside the
    schedule, in `log.restarts`."""
    rng = random.Random(config.seed)
    start = time.monotonic()
    events = sorted(
        (start + k * every, kind)
        for kind, every in (
            ("engine", config.engine_kill_every_s),
            ("redis", config.redis_kill_every_s),
            ("flip", config.flip_every_s),
        )
        for k in range(1, int((until - start) / every) + 1)
        if start + k * every < until
    )
    num_layers = model_layers(cluster.config.model)
    restarting: dict[int, threading.Thread] = {}
    victims = itertools.cycle(range(len(cluster.engines)))

    def restart(index: int) -> None:
        try:
            cluster.engines[index].start()
        except Exception as exc:  # reported in the table; the run goes on with the others
            if not log.closing.is_set():  # else stopped on purpose while it started
                log.restart_failures.append(f"engine-{index}: {exc}"[:500])

    for at, kind in events:
        time.sleep(max(0.0, at - time.monotonic()))
        if kind == "flip":
            log.bit_flips += flip_random_bit(cluster.ssd_folders, rng, num_layers) is not None
        elif kind == "redis":
            log.seen_before_redis_kills = _add(
                log.seen_before_redis_kills, audit_redis(cluster.redis.port, num_layers)
            )
            cluster.redis.kill()
            log.redis_kills += 1
            try:
                cluster.redis.start()
            except ClusterError as exc:
                log.restart_failures.append(f"redis: {exc}"[:500])
        else:
            up = [i for i in range(len(cluster.engines)) if not _restarting(restarting, i)]
            if len(up) < 2:
                log.kills_skipped += 1  # never the last engine up: its requests have nowhere to go
                continue
            index = next(i for i in victims if i in up)
            log.engine_kills.append(time.monotonic())  # before the signal: no request ends first
            cluster.engines[index].kill()
            restarting[index] = threading.Thread(target=restart, args=(index,))
            restarting[index].start()
            log.restarts.append(restarting[index])


def _restarting(restarting: dict[int, threading.Thread], index: int) -> bool:
    return index in restarting and restarting[index].is_alive()


def _add(a: RedisAudit, b: RedisAudit) -> RedisAudit:
    return RedisAudit(a.entries + b.entries, a.poison + b.poison, a.orphans + b.orphans)


def model_layers(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["num_hidden_layers"])


def in_flight_at_kill(outcome: Outcome, kills: list[float]) -> bool:
    """Whether an engine was killed while the request ran: the only failures accepted."""
    return any(outcome.start_s <= kill <= outcome.end_s for kill in kills)


def summarize(
    outcomes: list[Outcome],
    refs: dict[str, Reference],
    log: ChaosLog,
    redis_end: RedisAudit,
    config: SoakConfig,
) -> SoakReport:
    statuses = Counter(str(o.status) for o in outcomes if o.kind == "http")
    statuses.update(o.kind for o in outcomes if o.kind in ("transport", "unclean"))
    # A cut stream began as a 200; the gateway counts it by the status it would have had.
    statuses.update("cut" for o in outcomes if o.kind == "cut")
    unexpected = [
        f"{o.kind} {o.status} {o.mode} stream={o.stream}: {o.detail}"[:300]
        for o in outcomes
        if o.kind in ("transport", "unclean")
        or (o.kind in ("http", "cut") and not in_flight_at_kill(o, log.engine_kills))
    ]
    answered = [o for o in outcomes if o.answer is not None]
    full = [o for o in answered if o.mode == "full_prefill"]
    blends = [o for o in answered if o.mode == "cacheblend"]
    cached = [o for o in blends if o.all_cached and refs[o.question].cacheblend is not None]
    return SoakReport(
        duration_s=config.duration_s,
        clients=config.clients,
        requests=len(outcomes),
        ok=len(answered),
        errors_by_status=dict(sorted(statuses.items())),
        streams=sum(o.stream for o in outcomes),
        cut_streams=sum(o.kind == "cut" for o in outcomes),
        unclean_streams=sum(o.kind == "unclean" for o in outcomes),
        unexpected=unexpected,
        full_prefill_answers=len(full),
        full_prefill_wrong=sum(o.answer != refs[o.question].full_prefill for o in full),
        cacheblend_answers=len(blends),
        cacheblend_all_cached=len(cached),
        cacheblend_wrong=sum(o.answer != refs[o.question].cacheblend for o in cached),
        cacheblend_differs_from_full=sum(o.answer != refs[o.question].full_prefill for o in blends),
        engine_kills=len(log.engine_kills),
        engine_kills_skipped=log.kills_skipped,
        redis_kills=log.redis_kills,
        bit_flips=log.bit_flips,
        redis_end=redis_end,
        seen_before_redis_kills=log.seen_before_redis_kills,
        restart_failures=list(log.restart_failures),
    )


def run_soak(config: SoakConfig, folder: Path, model: str | None = None) -> SoakReport:
    """Start the cluster in `folder`, ingest, take the references, soak, stop the engines (so
    their pending writes end), audit Redis; every process is stopped at the end, also on error."""
    from demo import MODEL_DIR

    model = model or str(MODEL_DIR)
    documents, questions = demo_workload(config.max_questions, config.long_questions)
    cluster_config = ClusterConfig(model, folder, redis_maxmemory=config.redis_maxmemory)
    with Cluster(cluster_config) as cluster:
        cluster.start()
        with httpx.Client(base_url=cluster.gateway.url, timeout=REQUEST_TIMEOUT_S) as http:
            ingest(http, documents)
            refs = references(http, questions, config)
        log = ChaosLog()
        until = time.monotonic() + config.duration_s
        chaos = threading.Thread(target=run_chaos, args=(cluster, config, until, log))
        chaos.start()
        try:
            outcomes = run_clients(cluster.gateway.url, questions, config, until)
        finally:
            chaos.join()
            log.closing.set()
        # SIGTERM: an engine finishes its writes to Redis before it exits; one still starting
        # after a kill exits, which ends its restart.
        for engine in cluster.engines:
            engine.stop()
        for thread in log.restarts:
            thread.join(timeout=START_TIMEOUT_S)
        redis_end = audit_redis(cluster.redis.port, model_layers(model))
    return summarize(outcomes, refs, log, redis_end, config)


def rows(r: SoakReport) -> list[tuple[str, str]]:
    """(what, value) of each line of the table."""
    return [
        ("requests / answered", f"{r.requests} / {r.ok}"),
        ("errors by status (cut: a stream cut by a kill)", _statuses(r.errors_by_status)),
        ("failures outside a kill window (must be 0)", str(len(r.unexpected))),
        ("streams / cut mid-way, each with an SSE error", f"{r.streams} / {r.cut_streams}"),
        ("streams ended without result or error (must be 0)", str(r.unclean_streams)),
        ("full_prefill answers / wrong (must be 0)", f"{r.full_prefill_answers} / "
         f"{r.full_prefill_wrong}"),
        ("cacheblend answers / with every chunk cached", f"{r.cacheblend_answers} / "
         f"{r.cacheblend_all_cached}"),
        ("cacheblend, every chunk cached, differs from the undisturbed blend (must be 0)",
         str(r.cacheblend_wrong)),
        ("cacheblend differs from full_prefill (counted only)",
         str(r.cacheblend_differs_from_full)),
        ("engine kills (skipped: one engine up) / Redis kills / SSD bit flips",
         f"{r.engine_kills} ({r.engine_kills_skipped}) / {r.redis_kills} / {r.bit_flips}"),
        ("Redis at the end: entries / poison / orphans (must be 0 / 0)", _audit(r.redis_end)),
        ("Redis before each kill, summed: entries / poison / orphans",
         _audit(r.seen_before_redis_kills)),
        ("engine restarts that failed", str(len(r.restart_failures))),
    ]  # fmt: skip


def _statuses(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items()) or "none"


def _pair(a: int, b: int) -> str:
    return f"{a} / {b}"


def _audit(audit: RedisAudit) -> str:
    return f"{audit.entries} / {audit.poison} / {audit.orphans}"


def table(report: SoakReport) -> str:
    lines = [
        f"{report.duration_s / 60:g} min, {report.clients} closed-loop clients",
        "",
        "| | |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {value} |" for name, value in rows(report)]
    return "\n".join(lines)


def write_csv(report: SoakReport, path: Path) -> None:
    """One row per run, appended."""
    row = {
        k: json.dumps(v) if isinstance(v, dict | list) else v
        for k, v in asdict(report).items()
        if k != "unexpected"
    }
    row["unexpected"] = len(report.unexpected)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(row))
        if new:
            writer.writeheader()
        writer.writerow(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--model", help="checkpoint (default: the bundled demo model)")
    parser.add_argument("--redis-maxmemory", default=SoakConfig.redis_maxmemory)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", type=Path, default=results_dir() / "chaos-cpu.csv")
    parser.add_argument("--workdir", type=Path, help="logs and data (default: a temp dir)")
    args = parser.parse_args()
    if not 0 < args.minutes <= 120 or not 1 <= args.clients <= 64:
        parser.error("--minutes must be in (0, 120] and --clients in [1, 64]")
    config = SoakConfig(
        duration_s=args.minutes * 60,
        clients=args.clients,
        redis_maxmemory=args.redis_maxmemory,
        seed=args.seed,
    )
    # SIGTERM ends the run like Ctrl-C: every process of the cluster is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="ragblend-chaos-") as scratch:
        report = run_soak(config, args.workdir or Path(scratch), args.model)
    write_csv(report, args.csv)
    print(table(report))
    for line in report.unexpected[:20] + report.restart_failures:
        print(line)


if __name__ == "__main__":
    main()
