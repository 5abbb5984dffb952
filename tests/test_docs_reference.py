"""The reference tables in docs/ against the code they describe: every service's settings table
lists exactly its settings class's fields, and every metric a service registers is documented
(and no documented one is gone), so a table cannot drift from what the code does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

from engine.api.main import build_engine
from engine.api.metrics import EngineMetrics
from engine.api.settings import EngineSettings
from gateway.metrics import GatewayMetrics
from gateway.settings import GatewaySettings
from retriever.metrics import RetrieverMetrics
from retriever.settings import RetrieverSettings

DOCS = Path(__file__).resolve().parent.parent / "docs"


def table_after(page: str, header: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table whose header row starts with
    `header` on docs/`page`."""
    lines = (DOCS / page).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def names_in_first_column(rows: list[list[str]]) -> set[str]:
    return {name.lower() for row in rows for name in re.findall(r"`([A-Za-z0-9_]+)`", row[0])}


@pytest.mark.parametrize(
    ("settings", "page", "header"),
    [
        (EngineSettings, "engine.md", "| setting | default | meaning |"),
        (GatewaySettings, "gateway.md", "| setting | environment variable |"),
        (RetrieverSettings, "retriever.md", "| setting | default | meaning |"),
    ],
    ids=["engine", "gateway", "retriever"],
)
def test_each_service_settings_table_lists_exactly_its_settings(
    settings: type[BaseSettings], page: str, header: str
):
    documented = names_in_first_column(table_after(page, header))
    fields = set(settings.model_fields)
    assert fields - documented == set(), f"settings missing from docs/{page}"
    assert documented - fields == set(), f"docs/{page} lists settings that do not exist"


def registered(registry) -> set[str]:
    """Every metric name a registry exposes, counters under their `_total` name."""
    names = set()
    for family in registry.collect():
        names.add(f"{family.name}_total" if family.type == "counter" else family.name)
    return names


def documented_metrics(page: str, prefix: str) -> set[str]:
    """The metric names docs/`page` gives in backticks (labels in braces allowed after them)."""
    text = (DOCS / page).read_text()
    return set(re.findall(rf"`({prefix}[a-z0-9_]+)(?:\{{[^`]*\}})?`", text))


def test_every_gateway_metric_is_documented_and_every_documented_one_exists():
    assert registered(GatewayMetrics().registry) == documented_metrics(
        "metrics.md", "ragblend_gateway_"
    )


def test_every_retriever_metric_is_documented_and_every_documented_one_exists():
    assert registered(RetrieverMetrics().registry) == documented_metrics(
        "retriever.md", "ragblend_retriever_"
    )


def test_every_engine_metric_is_documented_and_every_documented_one_exists(
    checkpoint_dir, tmp_path
):
    # With a remote tier (nothing listens on port 1: the tier starts unreachable), so that
    # the metrics registered only for one are there too.
    settings = EngineSettings(
        model=checkpoint_dir("llama"),
        store_path=str(tmp_path / "kv"),
        remote_url="redis://127.0.0.1:1/0",
        remote_timeout_s=0.2,
    )
    engine = build_engine(settings)
    try:
        metrics = EngineMetrics(engine)
        assert registered(metrics.registry) == documented_metrics("engine.md", "ragblend_engine_")
    finally:
        engine.close()
