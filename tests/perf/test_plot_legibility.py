"""The picture reads unambiguously: no label collides with another or sits over a panel, a
colour means one thing (red only the stalls), and the picture and the trace say how far the
chip's constants are calibrated (v6e: not at all)."""
import json

import matplotlib
import pytest

from mkc import target
from mkc.cli import main
from mkc.compiler import check_spec
from mkc.perf import plot
from mkc.perf.run import published_steps, validation_caveat, validation_note, step_model
from tests_support import K3_SPEC, ROOT

V6E_SPEC = ROOT / "schedules" / "qwen3_8_27b_v6e.sched"
TPU7X_SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
CAVEAT = {V6E_SPEC: "unvalidated on v6e: no v6e step measured",
          TPU7X_SPEC: "nothing fitted; off by up to"}


def _picture(spec, batch=8, tokens=512):
    s = check_spec(spec).ir
    res = step_model(s, batch, tokens)
    fig = plot.figure(s, res, batch, tokens, target.chip(s.chip).hbm_bytes_per_s, 1e-3)
    fig.canvas.draw()
    return s, res, fig


def _drawn_texts(fig) -> list:
    """The texts the picture shows: tick labels only for ticks inside their axis's view (the
    others exist but are not drawn)."""
    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis, i in ((ax.xaxis, 0), (ax.yaxis, 1)):
            lo, hi = sorted(axis.get_view_interval())
            for t in axis.get_ticklabels(which="both"):
                ticks.add(t)
                if lo <= t.get_position()[i] <= hi:
                    drawn.append(t)
    drawn += [t for t in fig.findobj(matplotlib.text.Text) if t not in ticks]
    return [t for t in drawn if t.get_visible() and t.get_text()]


def _overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.fixture(scope="module", params=[V6E_SPEC, K3_SPEC], ids=["qwen_v6e", "kimi_k3"])
def picture(request):
    yield _picture(request.param)
    matplotlib.pyplot.close("all")


def test_no_label_collides_or_covers_a_panel(picture):
    """Every text (titles, tick labels, legend entries) is inside the figure, clear of every
    other and of every panel (so of its lines and bars); legends clear of each other."""
    _, _, fig = picture
    r = fig.canvas.get_renderer()
    boxes = [(t.get_text(), t.get_window_extent(r)) for t in _drawn_texts(fig)]
    whole = fig.bbox
    panels = [ax.get_window_extent(r) for ax in fig.axes]
    legends = [ax.get_legend().get_window_extent(r) for ax in fig.axes if ax.get_legend()]
    assert len(legends) == 3 and any("usable" in t for t, _ in boxes)
    for i, (text, box) in enumerate(boxes):
        assert whole.x0 <= box.x0 and box.x1 <= whole.x1 and box.y1 <= whole.y1, text
        assert not any(_overlap(box, p) for p in panels), f"{text!r} covers a panel"
        for other, b in boxes[i + 1:]:
            assert not _overlap(box, b), (text, other)
    for i, a in enumerate(legends):
        assert not any(_overlap(a, p) for p in panels)
        assert not any(_overlap(a, b) for b in legends[i + 1:])


def test_title_carries_the_validation_caveat(picture):
    s, _, fig = picture
    assert f"modelled, not measured; {validation_caveat(s.chip)}" in fig._suptitle.get_text()


def test_the_caveat_states_the_model_s_worst_error():
    """The picture's caveat states the worst error the validation recorded at a published step,
    never rounded down."""
    import re

    from mkc.perf import constants
    errors = [abs(p["error_percent"]) for p in published_steps(constants.validation("tpu7x"))]
    stated = [float(x) for x in re.findall(r"([0-9.]+)%", validation_caveat("tpu7x"))]
    assert stated[0] == max(stated) and max(errors) <= stated[0] < max(errors) + 0.1


def test_a_colour_means_one_thing_and_red_only_the_stalls(picture):
    s, res, fig = picture
    colours = plot.picture_palette(s, res, plot.vmem_series(s, res, 8))
    assert len(set(colours.values())) == len(colours)               # injective
    assert colours[plot.STALL] == "#e6194b" and "state" in colours
    # what is drawn is the palette: the Gantt's stall row and a state DMA row
    gantt = fig.axes[2]
    labels = [t.get_text() for t in gantt.get_yticklabels()][::-1]   # top to bottom
    bars = gantt.collections                                         # one per row, same order
    face = {lab: matplotlib.colors.to_hex(b.get_facecolor()[0])
            for lab, b in zip(labels, bars) if len(b.get_facecolor())}
    red = [k for k, v in face.items() if v == colours[plot.STALL]]
    assert len(red) == 1 and red[0].startswith("compute stalled")
    state = [v for k, v in face.items() if "rec_buf" in k]
    assert state and set(state) == {colours["state"]}


def test_palette_stays_injective_past_its_distinct_colours():
    classes = [f"pool p.v{i}" for i in range(12)] + ["ring", "kv", "pool p free", "pool q free",
                                                      "scratch"]
    colours = plot.palette(classes, [f"k{i}" for i in range(20)])
    assert len(set(colours.values())) == len(colours) == 4 + 16 + 20
    assert colours["pool free"] == "#dddddd" and "pool p free" not in colours


@pytest.mark.parametrize("spec", [V6E_SPEC, TPU7X_SPEC], ids=["v6e", "tpu7x"])
def test_picture_and_trace_carry_the_validation_caveat(spec, tmp_path, capsys):
    png, trace = tmp_path / "step.png", tmp_path / "step.json"
    assert main(["perf", str(spec), "--batch", "1", "--context", "256", "--plot", str(png),
                 "--trace", str(trace), "--json"]) == 0
    capsys.readouterr()
    chip = check_spec(spec).ir.chip
    caveat = validation_caveat(chip)
    assert caveat.startswith(CAVEAT[spec]) and chip in caveat
    from PIL import Image
    assert caveat in Image.open(png).text["Description"]
    doc = json.loads(trace.read_text())
    process = next(e["args"]["name"] for e in doc["traceEvents"]
                   if e["ph"] == "M" and e["name"] == "process_name")
    assert caveat in process and "modelled, not measured" in process
    assert doc["otherData"]["validation"] == validation_note(chip)


def test_table_labels_both_hbm_percentages(capsys):
    assert main(["perf", str(TPU7X_SPEC), "--batch", "1", "--context", "256"]) == 0
    out = capsys.readouterr().out
    assert "% of the HBM floor (" in out and "% of peak bandwidth;" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("% of the HBM floor:"))
    assert "% of peak bandwidth: bytes moved over (step x peak)" in line
    assert main(["perf", str(TPU7X_SPEC), "--batch", "1", "--context", "256", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)["perf"]
    assert 0 < rep["percent_of_peak_bandwidth"] <= 100


def test_the_vmem_axis_scales_to_the_data(picture):
    """A kernel whose peak is a fair share of the budget (these full-size ones) is drawn against
    the usable VMEM; a MINI kernel's (1.3 MiB of a 58 MiB budget: a sliver at the bottom of a
    70 MiB axis) against its peak, the title saying the budget lies above."""
    s, res, fig = picture
    vs = plot.vmem_series(s, res, 8)
    assert fig.axes[0].get_ylim()[1] == pytest.approx(vs.limit / plot.MIB * 1.1)
    mini = check_spec(TPU7X_SPEC, "qwen3_8_mini").ir
    res = step_model(mini, 8, 512)
    fig = plot.figure(mini, res, 8, 512, target.chip(mini.chip).hbm_bytes_per_s, 1e-3)
    vs = plot.vmem_series(mini, res, 8)
    peak = max(vs.totals())
    assert peak < plot.SCALED_BELOW * vs.budget
    assert fig.axes[0].get_ylim()[1] == pytest.approx(peak / plot.MIB * 1.1)
    assert f"the {vs.budget / plot.MIB:.2f} MiB budget lies above" in fig.axes[0].get_title(loc="left")
    matplotlib.pyplot.close(fig)
