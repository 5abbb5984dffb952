"""The settings an evaluation compares: full prefill first, cacheblend once per ratio and token
selection, each labelled so that its rows and the plot's lines tell the selections apart."""

from __future__ import annotations

from common.contract import Selection
from engine.types import Mode
from evaluation.dataset import Record
from evaluation.plot import blend_lines
from evaluation.report import summarize
from evaluation.runner import REFERENCE, Outcome, Setting, request_for, settings_for

MODES = (Mode.FULL_REUSE, Mode.CACHEBLEND)


def test_without_selections_cacheblend_runs_once_per_ratio_with_the_engines_selection():
    settings = settings_for(MODES, (0.15, 0.5))
    assert settings == [
        REFERENCE,
        Setting(Mode.FULL_REUSE),
        Setting(Mode.CACHEBLEND, 0.15),
        Setting(Mode.CACHEBLEND, 0.5),
    ]
    assert [s.label for s in settings] == [
        "full_prefill",
        "full_reuse",
        "cacheblend@0.15",
        "cacheblend@0.5",
    ]
    assert all(s.selection is None for s in settings)


def test_cacheblend_runs_once_per_ratio_and_selection_labelled_with_it():
    selections = (Selection.HKVD, Selection.WEIGHTED, Selection.HKVD)  # repeated: once
    settings = settings_for(MODES, (0.15, 0.5), selections)
    assert [s.label for s in settings] == [
        "full_prefill",
        "full_reuse",
        "cacheblend@0.15 hkvd",
        "cacheblend@0.15 weighted",
        "cacheblend@0.5 hkvd",
        "cacheblend@0.5 weighted",
    ]
    assert [s.selection for s in settings if s.mode is not Mode.CACHEBLEND] == [None, None]
    assert settings[-1] == Setting(Mode.CACHEBLEND, 0.5, Selection.WEIGHTED)


def test_every_selection_can_be_compared():
    settings = settings_for([Mode.CACHEBLEND], [0.15], list(Selection))
    assert [s.selection for s in settings[1:]] == list(Selection)
    assert len({s.label for s in settings}) == len(Selection) + 1


def test_selections_without_cacheblend_add_no_setting():
    assert settings_for([Mode.FULL_REUSE], [0.15], [Selection.RANDOM]) == [
        REFERENCE,
        Setting(Mode.FULL_REUSE),
    ]


def test_the_request_carries_the_settings_selection():
    record = Record(question="Q?", passages=["p"], answers=["a"])
    for selection in (None, *Selection):
        request = request_for(record, ["p"], Setting(Mode.CACHEBLEND, 0.15, selection), 8)
        assert request.selection is selection and request.recompute_ratio == 0.15


def outcome(setting: Setting, f1: float) -> Outcome:
    return Outcome("q", None, setting, "x", 0.0, f1, 0.0, 1.0, 0.1, 0.0, 1.0, 0.01)


def test_rows_name_the_selection_and_the_plot_draws_a_line_per_selection_by_ratio():
    settings = settings_for(MODES, (0.5, 0.15), (Selection.RANDOM, Selection.HKVD))
    rows = summarize([outcome(s, i / 10) for i, s in enumerate(settings)])
    assert [r.selection for r in rows] == [None, None, "random", "hkvd", "random", "hkvd"]
    assert [r.setting for r in rows] == [s.label for s in settings]
    lines = blend_lines(rows)
    assert list(lines) == ["random", "hkvd"]
    for selection, line in lines.items():
        assert [r.recompute_ratio for r in line] == [0.15, 0.5]
        assert {r.selection for r in line} == {selection}
    unselected = summarize([outcome(s, 0.5) for s in settings_for(MODES, (0.5, 0.15))])
    assert [r.selection for r in unselected] == [None] * 4
    assert [[r.recompute_ratio for r in line] for line in blend_lines(unselected).values()] == [
        [0.15, 0.5]
    ]
