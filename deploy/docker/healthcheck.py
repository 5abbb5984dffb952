"""HEALTHCHECK of the ragblend image: finds which service PID 1 runs and its port (flag, env or
docs/design.md default), then asks its /health (/ready for `ragblend up`); exit 0 when it is 200."""

import os
import sys
import urllib.request

DEFAULT_PORTS = {"gateway": 8000, "retriever": 8001, "engine": 8002, "up": 8000}


def service_and_port() -> tuple[str, int]:
    with open("/proc/1/cmdline", "rb") as f:
        argv = [a.decode() for a in f.read().split(b"\0") if a]
    name = next((a for a in argv if a in DEFAULT_PORTS), "gateway")
    flag = "--gateway-port" if name == "up" else "--port"
    for i, arg in enumerate(argv[:-1]):
        if arg == flag:
            return name, int(argv[i + 1])
        if arg.startswith(flag + "="):
            return name, int(arg.split("=", 1)[1])
    env = os.environ.get(f"RAGBLEND_{'GATEWAY' if name == 'up' else name.upper()}_PORT")
    return name, int(env) if env else DEFAULT_PORTS[name]


def main() -> int:
    name, port = service_and_port()
    path = "/ready" if name == "up" else "/health"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"{name} on port {port}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
