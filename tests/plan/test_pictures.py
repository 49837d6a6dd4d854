"""Pictures people can read: schedule drawings with chunk durations, formats by suffix,
timelines that zoom and name the replica shown.

Oracles: the closed forms of a schedule's makespan with F = 1 and B = 2 per device share
(1f1b: 3 (m + p - 1); interleaved-1f1b: 3 m + 3 (p - 1) / v, Narayanan et al. 2021) and
the files' magic bytes.
"""

from __future__ import annotations

import pytest

from hyperpipe.cli import main as cli_main
from hyperpipe.core.errors import BadInput
from hyperpipe.plan.kinds import generate
from hyperpipe.plan.plan import plan_from_dict
from hyperpipe.plan.schedule_plot import draw_schedule, unit_times
from hyperpipe.plan.trace import Trace, TraceEvent
from hyperpipe.sim.timeline import _zoom, parse_window, plot_timelines, replicas_shown


@pytest.mark.parametrize("p,m,v", [(4, 8, 2), (2, 4, 3), (4, 4, 1)])
def test_interleaved_chunks_take_one_vth_and_match_the_closed_form(p, m, v):
    kind = "interleaved-1f1b" if v > 1 else "1f1b"
    times = unit_times(generate(kind, p, m, v))
    for a, (start, end) in times.items():
        assert end - start == pytest.approx({"F": 1.0, "B": 2.0}[a.op] / v)
    makespan = max(end for _, end in times.values())
    assert makespan == pytest.approx(3 * m + 3 * (p - 1) / v)


@pytest.mark.parametrize("suffix,magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"),
                                          (".pdf", b"%PDF")])
def test_figure_format_follows_the_suffix(tmp_path, suffix, magic):
    out = tmp_path / f"s{suffix}"
    draw_schedule(generate("1f1b", 2, 2), out)
    assert out.read_bytes().startswith(magic)


def test_unknown_figure_suffix_is_refused_and_nothing_written(tmp_path, capsys):
    out = tmp_path / "s.jpg"
    assert cli_main(["schedule", "--kind", "1f1b", "--devices", "2", "--microbatches", "2",
                     "--format", "png", "--out", str(out)]) == 2
    assert ".png, .svg or .pdf" in capsys.readouterr().err and not out.exists()
    with pytest.raises(BadInput, match="START:END"):
        parse_window("2:1")


def test_timeline_zoom_keeps_the_first_k_microbatches_and_names_the_replica(tmp_path):
    ev = [TraceEvent("a/0", "F", 0, mb, mb * 1.0, mb * 1.0 + 1) for mb in range(6)]
    ev += [TraceEvent("a/0", "send", 0, mb, mb + 1.0, mb + 1.1, 8, "a/1") for mb in range(6)]
    trace = Trace(tuple(ev), {})
    kept, lo, hi = _zoom(trace, 0.0, None, 2)
    assert {e.microbatch for e in kept if e.op == "F"} == {0, 1} and (lo, hi) == (0.0, 2.0)
    assert all(e.start_s < 2.0 for e in kept)
    kept, lo, hi = _zoom(trace, 0.0, (3.5, 4.5), None)
    assert {e.microbatch for e in kept if e.op == "F"} == {3, 4} and (lo, hi) == (3.5, 4.5)
    plan = plan_from_dict({
        "format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
        "global_batch": 4, "schedule": {"kind": "1f1b", "chunks": 1},
        "pipelines": [{"micro_batch": 1, "num_microbatches": 2, "stages": [
            {"layers": [0, 8], "devices": [d]}]} for d in ("a100/0", "a100/1")]})
    one = Trace((TraceEvent("a100/0", "F", 0, 0, 0.0, 1.0),), {})
    assert replicas_shown(plan, one) == ("replica 0 of 2 (the others are identical and not "
                                         "drawn)")
    out = tmp_path / "t.svg"
    plot_timelines([trace], ["t"], out, microbatches=2)
    assert out.read_bytes().startswith(b"<?xml")


@pytest.mark.parametrize("devices,panels", [(1, 1), (2, 1), (6, 1), (2, 2)])
def test_timeline_legend_never_covers_a_title_or_a_panel(monkeypatch, tmp_path, devices,
                                                         panels):
    # every op and two chunks per device: thirteen legend entries, several rows of them
    ops = ("F", "I", "W", "B", "optimizer", "send", "recv", "allreduce", "allgather",
           "reducescatter", "alltoall")
    ev = [TraceEvent(f"a/{d}", op, stage, 0, 2.0 * i + stage, 2.0 * i + stage + 1.0, 8,
                     f"a/{(d + 1) % devices}" if op in ("send", "recv") else "")
          for d in range(devices) for i, op in enumerate(ops) for stage in (d, d + devices)]
    figures = []
    monkeypatch.setattr("hyperpipe.sim.timeline.save_figure",
                        lambda fig, path: figures.append(fig))
    titles = ["predicted: a long title " * 3, "measured"][:panels]
    plot_timelines([Trace(tuple(ev), {})] * panels, titles, tmp_path / "t.png")
    (fig,) = figures
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legend = fig.legends[0].get_window_extent(renderer)
    assert len(fig.legends[0].get_texts()) == 13
    for ax in fig.axes:
        assert not legend.overlaps(ax.title.get_window_extent(renderer))
        assert not legend.overlaps(ax.get_window_extent(renderer))
    assert legend.y1 <= fig.bbox.y1 + 1e-6         # and the legend stays on the page


def test_simulate_says_how_to_zoom_a_crowded_timeline(tmp_path, capsys):
    import json
    plan = {"format": "hyperpipe.plan/1", "model": "tiny-gpt", "cluster": "demo-hetero",
            "global_batch": 32, "schedule": {"kind": "1f1b", "chunks": 1},
            "pipelines": [{"micro_batch": 1, "num_microbatches": 32, "stages": [
                {"layers": [0, 4], "devices": ["a100/0"]},
                {"layers": [4, 8], "devices": ["a100/1"]}]}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(plan))
    for extra, hint in (([], True), (["--microbatches", "4"], False)):
        assert cli_main(["simulate", "--plan", str(path), "--timeline",
                         str(tmp_path / "t.png"), *extra]) == 0
        out = capsys.readouterr().out
        assert ("32 micro-batches drawn: zoom in with --microbatches" in out) == hint


def test_log_axes_are_labelled_in_plain_numbers(tmp_path):
    """Texts are drawn as written (no mathtext), so a log axis's default labels had read
    '$\\mathdefault{10^{0}}$' on every --failures plot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hyperpipe.core.files import save_figure
    fig, ax = plt.subplots()
    ax.plot([0.5, 3, 40], [1, 2, 3])
    ax.set_xscale("log")
    save_figure(fig, tmp_path / "f.png")
    labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
    plt.close(fig)
    assert labels and not any("$" in label for label in labels)
    assert "1" in labels and "10" in labels


def test_a_window_after_the_iteration_is_refused_and_nothing_written(tmp_path, capsys):
    """--window 5:6 on an iteration of a few milliseconds had drawn an empty picture
    with exit 0; it is refused (exit 2, naming the iteration's end) before any file."""
    png, trace = tmp_path / "t.png", tmp_path / "t.json"
    args = ["simulate", "--cluster", "demo-hetero", "--model", "tiny-gpt", "--pp", "2",
            "--micro-batch", "4", "--global-batch", "16", "--timeline", str(png),
            "--trace", str(trace)]
    assert cli_main([*args, "--window", "5:6"]) == 2
    err = capsys.readouterr().err
    assert "--window: expected a start before the iteration's end" in err
    assert len(err.strip().splitlines()) == 1 and not png.exists() and not trace.exists()
    assert cli_main([*args, "--window", "0:0.002"]) == 0 and png.exists()


def test_a_nanosecond_window_draws_without_a_library_warning(tmp_path):
    """`--window 0:1e-9` gives tick labels wider than the figure; matplotlib's "Tight
    layout not applied" UserWarning had been printed on stderr of a run that exits 0."""
    import warnings
    trace = Trace(tuple(TraceEvent("a/0", "F", 0, mb, mb * 1e-3, mb * 1e-3 + 9e-4)
                        for mb in range(4)), {})
    out = tmp_path / "t.svg"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plot_timelines([trace], ["t"], out, window=(0.0, 1e-9))
    assert [str(w.message) for w in caught] == [] and out.read_bytes().startswith(b"<?xml")
