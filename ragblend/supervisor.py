"""How `ragblend up` watches its children: until the stack is ready, then restarting one that
dies (with backoff, up to a crash loop), and stopping them all, the gateway first."""

from __future__ import annotations

import logging
import signal
import subprocess
import time

from ragblend.children import Child, UpError, describe_exit

log = logging.getLogger("ragblend.up")

POLL_S = 0.5
# SIGTERM, then SIGKILL of the child's whole process group after this long. The services bound
# their own drain below it (common.serving.GRACEFUL_SHUTDOWN_S; the gateway's flag in up.py).
STOP_GRACE_S = 15.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# A dead child comes back after 1, 2, 4 … 30 s; one that ran this long had recovered, so its
# next death starts the count again instead of counting as one more quick failure.
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 300.0
MAX_RESTARTS = 8


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
