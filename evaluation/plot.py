"""The quality / TTFT trade-off figure: one point per setting (mode, recompute ratio, token
selection), one panel per score (answer scores, then teacher-forced KL and argmax agreement),
cacheblend's ratios joined by a line per token selection, like the CacheBlend paper's figures."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from evaluation.report import Row

# (field, axis label, bounded to [0, 1]); a row of the figure per three panels.
SCORES = (
    ("exact_match", "exact match", True),
    ("f1", "token F1", True),
    ("rouge_l", "ROUGE-L", True),
    ("tf_kl", "teacher-forced KL from full prefill (nats)", False),
    ("tf_argmax_agreement", "teacher-forced argmax agreement", True),
)
PANELS_PER_ROW = 3
MARKERS = {"full_prefill": "s", "prefix_cache": "D", "full_reuse": "v", "cacheblend": "o"}
LINE_STYLES = ("-", "--", ":", "-.")


class MissingDependencyError(RuntimeError):
    """An optional library the requested output needs is not installed."""


def require_matplotlib() -> None:
    """Fail before any work is done when the plot cannot be drawn."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(
            "matplotlib is not installed: the quality/TTFT plot needs it "
            "(pip install 'ragblend[eval]', or pass --no-plot)"
        ) from None


def blend_lines(rows: Sequence[Row]) -> dict[str | None, list[Row]]:
    """Cacheblend's rows by token selection (None: the engine's), in the order they come, each
    sorted by ratio: one line each."""
    lines: dict[str | None, list[Row]] = {}
    for row in rows:
        if row.mode == "cacheblend":
            lines.setdefault(row.selection, []).append(row)
    return {s: sorted(line, key=lambda r: r.recompute_ratio or 0.0) for s, line in lines.items()}


def plot_tradeoff(rows: Sequence[Row], path: Path, title: str) -> None:
    """`rows`: one per setting (all questions)."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    num_rows = -(-len(SCORES) // PANELS_PER_ROW)
    figure, axes = plt.subplots(
        num_rows, PANELS_PER_ROW, figsize=(4.5 * PANELS_PER_ROW + 2, 4 * num_rows), squeeze=False
    )
    panels = axes.reshape(-1)
    for unused in panels[len(SCORES) :]:
        unused.set_visible(False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    lines = blend_lines(rows)
    for ax, (field, name, bounded) in zip(panels, SCORES, strict=False):
        for j, (selection, line) in enumerate(lines.items()):
            if len(line) > 1:
                ax.plot(
                    [r.ttft_median_ms for r in line],
                    [getattr(r, field) for r in line],
                    color="grey",
                    linestyle=LINE_STYLES[j % len(LINE_STYLES)],
                    linewidth=1,
                    zorder=2,
                    # Named in the legend only when there is more than one line to tell apart.
                    label=f"cacheblend {selection}" if len(lines) > 1 else None,
                )
        for i, row in enumerate(rows):
            ax.scatter(
                row.ttft_median_ms,
                getattr(row, field),
                marker=MARKERS.get(row.mode, "o"),
                color=colors[i % len(colors)],
                s=50,
                zorder=3,
                label=row.setting,
            )
        ax.set_xlabel("TTFT, median (ms)")
        ax.set_ylabel(name)
        if bounded:
            ax.set_ylim(-0.02, 1.05)
        else:
            ax.set_ylim(bottom=0.0)
        ax.grid(alpha=0.3)
    handles, labels = panels[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="center right", fontsize=8)
    figure.suptitle(title)
    figure.tight_layout(rect=(0, 0, 1 - 1.6 / figure.get_figwidth(), 1))
    figure.savefig(path, dpi=120)
    plt.close(figure)
