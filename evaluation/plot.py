"""The quality / TTFT trade-off figure: one point per setting (mode, recompute ratio), one panel
per score (answer scores, then teacher-forced KL and argmax agreement), cacheblend's ratios
joined by a line, like the CacheBlend paper's figures."""

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
    blends = sorted(
        (r for r in rows if r.mode == "cacheblend"), key=lambda r: r.recompute_ratio or 0.0
    )
    for ax, (field, name, bounded) in zip(panels, SCORES, strict=False):
        if len(blends) > 1:
            ax.plot(
                [r.ttft_median_ms for r in blends],
                [getattr(r, field) for r in blends],
                color="grey",
                linewidth=1,
                zorder=2,
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
