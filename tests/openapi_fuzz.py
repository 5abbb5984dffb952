"""Fuzzing of a live service's OpenAPI spec with schemathesis: valid and invalid requests of
every operation must get a status the spec declares, and never a 5xx. (tests.openapi_fuzz)"""

from __future__ import annotations

from collections.abc import Callable

import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import status_code_conformance

# Bounded: examples per operation and mode, the same ones on every run (derandomized).
EXAMPLES = 25
CHECKS = [not_a_server_error, status_code_conformance]
Skip = Callable[[str, str], bool]  # (method, path) -> True to leave that operation out


def fuzz(
    base_url: str,
    *,
    headers: dict[str, str] | None = None,
    examples: int = EXAMPLES,
    skip: Skip = lambda method, path: False,
) -> list[str]:
    """Fuzz every operation of `base_url`'s /openapi.json with valid (positive) and invalid
    (negative) requests; returns one line per operation and mode that failed a check."""
    headers = headers or {}
    # An explicit config: no schemathesis.toml of the working directory is read.
    schema = schemathesis.openapi.from_url(
        f"{base_url}/openapi.json", config=SchemathesisConfig(), headers=headers
    )
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if skip(operation.method.upper(), operation.path):
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=examples,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case: schemathesis.Case) -> None:
                case.call_and_validate(
                    base_url=base_url, headers=headers, checks=CHECKS, timeout=60
                )

            try:
                run()
            except Unsatisfiable:
                continue  # no invalid request exists (e.g. GET /health has no parameters)
            # schemathesis raises its failed checks as a BaseExceptionGroup.
            except (Exception, BaseExceptionGroup) as exc:  # collect; fuzz the other operations
                first = str(exc).strip().splitlines()
                failures.append(
                    f"{operation.method.upper()} {operation.path} ({mode.value}): "
                    + " | ".join(first[:6])
                )
    return failures
