"""The child processes of `ragblend up`: one service's command and process, the environment the
children get, the ports they need, and how each child dies with `up`."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# Set in the children's environment: each asks the kernel to kill it when `up` dies.
PARENT_PID_ENV = "RAGBLEND_UP_PID"
PR_SET_PDEATHSIG = 1
# The shared internal token goes to each service under its own settings prefix.
INTERNAL_TOKEN_ENV = "RAGBLEND_INTERNAL_TOKEN"
SERVICE_TOKEN_ENVS = tuple(
    f"RAGBLEND_{name}_INTERNAL_TOKEN" for name in ("RETRIEVER", "ENGINE", "GATEWAY")
)


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
