"""Draw a modelled step as a PNG (`mkc perf SPEC --plot F`), for one rank.

Three panels over the step, sharing the time axis (ms):
  1. VMEM bytes live, stacked by buffer class (each pool split into its open view and the rest),
     with the usable VMEM, the budget (usable - reserve) and the peak as labelled lines (the axis
     scaled to the peak where it is a small share of the budget);
  2. a Gantt chart: the layer loop (coloured by layer kind), stalls and collectives of compute,
     then one row per DMA destination (coloured by its buffer class) with each copy's bytes in
     flight;
  3. HBM bandwidth utilisation: bytes the DMA queue moves per time bin, as % of the HBM peak.

A colour means one thing in a picture (`palette`), the same in every panel; labels sit in the
legends right of the panels, never over a line or a bar. It reads only the simulator's result
(timeline and VMEM marks), the schedule IR and the chip's HBM peak. Times are modelled; the
title says so and how far the constants are validated on the chip.
"""
from __future__ import annotations

import io
from pathlib import Path

from mkc import ir
from mkc.perf.perfetto import VmemSeries, buffer_class, vmem_series
from mkc.perf.sim import Result

MIB = 2 ** 20
_MS = 1e3                    # seconds to the axes' milliseconds

# Meanings drawn in every picture, besides buffer classes and layer kinds.
REFERENCE, STALL, COLLECTIVES, HBM_MOVED = ("reference line", "compute stalled",
                                            "collectives (ICI)", "HBM bytes moved")
POOL_FREE = "pool free"
# One colour per meaning (Trubetskoy's 20 distinct colours less maroon, so red is the stalls'
# alone). These meanings keep their colour in every picture; layer kinds take bold colours,
# pool views and any other class pale ones (a view is a large area of the VMEM stack), each
# the first not taken.
_FIXED = {REFERENCE: "#000000", STALL: "#e6194b", COLLECTIVES: "#000075", HBM_MOVED: "#469990",
          POOL_FREE: "#dddddd", "ring": "#4363d8", "kv": "#f58231", "parity": "#3cb44b",
          "state": "#9a6324", "collective": "#911eb4", "activation": "#a9a9a9",
          "output": "#808000", "compiler": "#dcbeff", "input": "#ffd8b1", "other": "#aaffc3"}
_KIND_COLOURS = ["#ffe119", "#f032e6", "#42d4f4", "#bfef45"]
_VIEW_COLOURS = ["#fabed4", "#fffac8"]
_ALWAYS = (REFERENCE, STALL, COLLECTIVES, HBM_MOVED)


def class_meaning(cls: str) -> str:
    """What a VMEM class's colour means: every pool's free region is one meaning."""
    return POOL_FREE if cls.startswith("pool ") and cls.endswith(" free") else cls


def kind_meaning(kind: str) -> str:
    return f"layer kind {kind}"


def palette(classes: list[str], kinds: list[str]) -> dict[str, str]:
    """Meaning -> colour for a picture with these buffer classes and layer kinds: one colour
    per meaning (past the 20 distinct colours, matplotlib's tab20b and tab20c)."""
    import matplotlib
    meanings = list(dict.fromkeys([*_ALWAYS, *map(class_meaning, classes)]))
    out = {m: _FIXED[m] for m in meanings if m in _FIXED}
    unused = [c for m, c in _FIXED.items() if m not in out]
    extra = [matplotlib.colors.to_hex(matplotlib.colormaps[name](i))
             for name in ("tab20b", "tab20c") for i in range(20)]

    def take(preferred: list[str]) -> str:
        return next(c for c in [*preferred, *unused, *_KIND_COLOURS, *_VIEW_COLOURS, *extra]
                    if c not in out.values())

    for k in kinds:
        out[kind_meaning(k)] = take(_KIND_COLOURS)
    for m in meanings:
        if m not in out:
            out[m] = take(_VIEW_COLOURS[:1])
    return out


def utilisation(res: Result, peak_bytes_per_s: float, bins: int = 400,
                window: tuple[float, float] | None = None) -> tuple[list[float], list[float]]:
    """(bin starts in seconds, % of the HBM peak moved in each bin) over `window` (default:
    the step): each copy's bytes spread evenly over the time they flow."""
    t0, t1 = window or (0.0, res.step_s)
    width = (t1 - t0) / bins
    moved = [0.0] * bins
    for iv in res.timeline:
        if iv.track != "dma" or iv.end <= iv.start or iv.end <= t0 or iv.start >= t1:
            continue
        rate = iv.nbytes / (iv.end - iv.start)
        i = max(0, int((iv.start - t0) / width))
        while i < bins and t0 + i * width < iv.end:
            lo, hi = max(iv.start, t0 + i * width), min(iv.end, t0 + (i + 1) * width)
            if hi > lo:
                moved[i] += rate * (hi - lo)
            i += 1
    return ([t0 + i * width for i in range(bins)],
            [100 * b / (width * peak_bytes_per_s) for b in moved])


def zoom_window(res: Result) -> tuple[float, float, list[int]]:
    """A steady-state stretch of the step to show close up: from a layer in the middle, the
    fewest consecutive layers that include every layer kind occurring more than once."""
    spans = _layer_spans(res)
    layers = sorted(spans)
    if not layers:
        return 0.0, res.step_s, []
    count: dict[str, int] = {}
    for lay in layers:
        count[spans[lay][2]] = count.get(spans[lay][2], 0) + 1
    want = {k for k, n in count.items() if n > 1} or set(count)
    first = layers[len(layers) // 2]
    chosen, seen = [], set()
    for lay in layers[layers.index(first):]:
        chosen.append(lay)
        seen.add(spans[lay][2])
        if want <= seen and len(chosen) >= 2:
            break
    return spans[chosen[0]][0], spans[chosen[-1]][1], chosen


def _layer_spans(res: Result) -> dict[int, list]:
    """Layer -> [start, end, kind] of the layer loop's iterations."""
    spans: dict[int, list] = {}
    for iv in res.timeline:
        if iv.track != "dma" and iv.layer >= 0:
            sp = spans.setdefault(iv.layer, [iv.start, iv.end, iv.kind])
            sp[0], sp[1] = min(sp[0], iv.start), max(sp[1], iv.end)
    return spans


def stall_label(res: Result) -> str:
    """The Gantt chart's stall row: the pictured step's stall total, `mkc perf`'s definition
    (`stall_seconds`; the title gives the expected one for an expectation over routing)."""
    from mkc.perf.run import stall_seconds
    return f"{STALL}: {stall_seconds(res) * _MS:.3f} ms"


def _gantt_rows(s: ir.ScheduleIR, res: Result) -> list[tuple[str, list, list[str]]]:
    """[(label, [(start ms, width ms)], meaning of each bar)] top to bottom: the layers, stalls,
    collectives, then one row per DMA destination, most bytes first."""
    spans = _layer_spans(res).values()
    rows = [("layers (by kind)", [(a * _MS, (b - a) * _MS) for a, b, _ in spans],
             [kind_meaning(k) for _, _, k in spans])]
    for track, meaning in (("stall", STALL), ("collective", COLLECTIVES)):
        bars = [(iv.start * _MS, (iv.end - iv.start) * _MS) for iv in res.timeline
                if iv.track == track]
        label = (stall_label(res) if track == "stall" else
                 f"{meaning}: {sum(w for _, w in bars):.2f} ms")
        rows.append((label, bars, [meaning] * len(bars)))
    dma: dict[str, list] = {}
    moved: dict[str, int] = {}
    for iv in res.timeline:
        if iv.track == "dma":
            dma.setdefault(iv.name, []).append((iv.start * _MS, (iv.end - iv.start) * _MS))
            moved[iv.name] = moved.get(iv.name, 0) + iv.nbytes
    for name in sorted(dma, key=lambda n: (-moved[n], n)):
        cls = buffer_class(s, name.removesuffix(" (store)"))
        rows.append((f"DMA {name}: {moved[name] / 1e6:.1f} MB", dma[name],
                     [class_meaning(cls)] * len(dma[name])))
    return rows


def picture_palette(s: ir.ScheduleIR, res: Result, vs: VmemSeries) -> dict[str, str]:
    """The palette of the picture of `res` (its VMEM classes, DMA classes and layer kinds)."""
    dma = sorted({buffer_class(s, iv.name.removesuffix(" (store)")) for iv in res.timeline
                  if iv.track == "dma"})
    kinds = sorted({k for _, _, k in _layer_spans(res).values()})
    return palette(vs.classes + dma, kinds)


# Picture formats by file suffix, each with the metadata keys that would make bytes differ.
PICTURE_FORMATS = {"png": {"Software": None}, "svg": {"Date": None, "Creator": None},
                   "pdf": {"CreationDate": None, "Creator": None, "Producer": None}}


def picture_format(path: str | Path) -> str:
    """The format a picture path asks for by its suffix; ValueError if mkc does not draw it."""
    fmt = Path(path).suffix.lower().lstrip(".")
    if fmt not in PICTURE_FORMATS:
        raise ValueError(f"{path}: mkc draws {', '.join('.' + f for f in PICTURE_FORMATS)} files")
    return fmt


def draw(path: str | Path, s: ir.ScheduleIR, res: Result, batch: int, tokens: int,
         peak_bytes_per_s: float, floor_s: float | None = None) -> None:
    """Write the picture (PNG, SVG or PDF by suffix): the whole step on the left, a steady-state
    stretch of a few layers (every recurring layer kind) on the right, on the same three panels.
    An expectation over routing is drawn as the simulated step it holds for pictures (`Result.concrete()`)."""
    fig = figure(s, res, batch, tokens, peak_bytes_per_s, floor_s)
    _save(fig, path, caveat(s))


def caveat(s: ir.ScheduleIR) -> str:
    """The picture's and the trace's line on what its times are."""
    from mkc.perf.run import validation_caveat
    return f"modelled, not measured; {validation_caveat(s.chip)}"


def figure(s: ir.ScheduleIR, res: Result, batch: int, tokens: int, peak_bytes_per_s: float,
           floor_s: float | None = None):
    """The picture's matplotlib figure (see `draw`)."""
    expected = res
    res = res.concrete()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(19, 11), sharex="col",
                             gridspec_kw={"height_ratios": [3, 4, 2], "width_ratios": [3, 2],
                                          "hspace": 0.16, "wspace": 0.1})
    z0, z1, zlayers = zoom_window(res)
    vs = vmem_series(s, res, batch)
    colours = picture_palette(s, res, vs)
    _draw_vmem(axes[0], vs, batch, colours)
    _draw_gantt(axes[1], s, res, colours)
    _draw_hbm(axes[2], res, peak_bytes_per_s, floor_s, [(0.0, res.step_s), (z0, z1)], colours)
    axes[0][0].set_xlim(0, res.step_s * _MS)
    axes[0][1].set_xlim(z0 * _MS, z1 * _MS)
    if zlayers:
        kinds = ", ".join(s.layer_kinds[i] for i in zlayers)
        axes[0][1].set_title(f"close-up of the steady state: layer-loop iterations "
                             f"{zlayers[0]}-{zlayers[-1]} ({kinds})", fontsize=10, loc="left")
    for row in axes:
        for ax in row:
            ax.grid(axis="x", color="#eeeeee", lw=0.6)
            ax.set_axisbelow(True)
        row[1].sharey(row[0])
    experts = _experts_note(expected, res)
    fig.suptitle(f"{s.source} ({s.model}, {s.topology}): batch {batch}, {tokens} cached tokens, "
                 f"rank 0 -- modelled step {res.step_s * _MS:.3f} ms, {batch / res.step_s:.0f} tok/s "
                 f"\n{caveat(s)}{experts}", fontsize=12)
    fig.subplots_adjust(left=0.13, right=0.84, top=0.88 if experts else 0.91, bottom=0.06)
    return fig


# The VMEM panel's axis scales to the peak where the peak is under this share of the budget.
SCALED_BELOW = 0.25


def _ref_line(ax, y: float, ls: str, lw: float, label: str | None = None) -> None:
    ax.axhline(y, color=_FIXED[REFERENCE], ls=ls, lw=lw, label=label)


def _draw_vmem(axes, vs: VmemSeries, batch: int, colours: dict[str, str]) -> None:
    """Panel 1: VMEM live, stacked by buffer class, with the usable VMEM, the budget and the
    peak as reference lines (black, told apart by their dashes, labelled in the legend)."""
    xs: list[float] = []
    for i, t in enumerate(vs.times):
        xs += [t * _MS, (vs.times[i + 1] if i + 1 < len(vs.times) else t) * _MS]
    classes = [c for c in vs.classes if any(r[c] for r in vs.rows)]
    # Steady classes at the bottom, largest first; the ones that change (views, scoped) on top.
    steady = sorted((c for c in classes if len({r[c] for r in vs.rows}) == 1),
                    key=lambda c: (-vs.rows[0][c], c))
    order = steady + [c for c in classes if c not in steady]
    ys = [[v / MIB for r in vs.rows for v in (r[c], r[c])] for c in order]
    peak = max(vs.totals())
    labels = [f"{c} ({max(r[c] for r in vs.rows) / MIB:.2f} MiB max)" for c in order]
    lines = [(vs.limit, ":", 1.0, f"usable {vs.limit / MIB:.2f} MiB\n(the spec's limit "
                                  "within what XLA gives)"),
             (vs.budget, "--", 1.2, f"budget {vs.budget / MIB:.2f} MiB\n(usable - reserve)"),
             (peak, "-", 0.6, f"peak {peak / MIB:.2f} MiB\n(the checker's at batch {batch})")]
    # The axis reaches the usable VMEM where the peak is a fair share of the budget; below
    # that the stack would be a sliver at the bottom (a MINI kernel: 1.3 of 58 MiB), so the
    # axis scales to the peak and the title says the budget lies above it.
    top = vs.limit if peak >= SCALED_BELOW * vs.budget else peak
    for col, ax in enumerate(axes):
        ax.stackplot(xs, ys, labels=labels if col else (),
                     colors=[colours[class_meaning(c)] for c in order], linewidth=0)
        for y, ls, lw, label in lines:
            _ref_line(ax, y / MIB, ls, lw, label if col else None)
        ax.set_ylim(0, top / MIB * 1.1)
    axes[1].tick_params(labelleft=False)
    axes[0].set_ylabel("VMEM live (MiB)")
    above = ("" if top == vs.limit else
             f" (the axis scales to it: the {vs.budget / MIB:.2f} MiB budget lies above)")
    axes[0].set_title(f"VMEM live by buffer class: peak {peak / MIB:.2f} MiB{above}", fontsize=10,
                      loc="left")
    # the reference lines first (added last), then the classes from the top of the stack down
    handles, names = axes[1].get_legend_handles_labels()
    k = len(order)
    axes[1].legend(handles[k:] + handles[k - 1::-1], names[k:] + names[k - 1::-1],
                   loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _draw_gantt(axes, s: ir.ScheduleIR, res: Result, colours: dict[str, str]) -> None:
    """Panel 2: the layers, stalls and collectives of compute, then a row per DMA destination."""
    from matplotlib.patches import Patch

    rows = _gantt_rows(s, res)
    for col, ax in enumerate(axes):
        for i, (label, bars, meanings) in enumerate(rows):
            y = len(rows) - 1 - i
            cols = [colours[m] for m in meanings]
            # an edge as wide as a line keeps short copies visible at the whole-step scale
            edge = "white" if i == 0 else cols        # layers: a gap between neighbours
            ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=cols, edgecolors=edge,
                           linewidth=0.4 if col == 0 else 0.2)
        ax.set_ylim(-0.6, len(rows) - 0.4)
        ax.axhline(len(rows) - 3.5, color="#999999", lw=0.6)
    axes[0].set_yticks(range(len(rows)))
    axes[0].set_yticklabels([r[0] for r in reversed(rows)], fontsize=8)
    axes[1].set_yticks(range(len(rows)))
    axes[1].tick_params(labelleft=False)
    queues = 1 + max((iv.queue for iv in res.timeline if iv.track == "dma"), default=0)
    axes[0].set_title("Gantt: layers, compute stalls, collectives; one row per DMA "
                      "destination, coloured by its buffer class (bar: bytes flowing; "
                      + ("the queue drains in issue order)" if queues == 1 else
                         f"up to {queues} copies in flight share the bandwidth)"),
                      fontsize=10, loc="left")
    kinds = dict.fromkeys(m for m in rows[0][2])
    axes[1].legend(handles=[Patch(color=colours[m], label=m) for m in sorted(kinds)],
                   loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _draw_hbm(axes, res: Result, peak_bytes_per_s: float, floor_s: float | None,
              windows: list[tuple[float, float]], colours: dict[str, str]) -> None:
    """Panel 3: HBM bandwidth utilisation per time bin of each column's window, with the
    step's mean as % of peak bandwidth and (in the title) the step as % of the HBM floor."""
    mean = 100 * res.hbm_bytes / (res.step_s * peak_bytes_per_s)
    for col, ax in enumerate(axes):
        lo, hi = windows[col]
        starts, pct = utilisation(res, peak_bytes_per_s, bins=400 if col == 0 else 200,
                                  window=(lo, hi))
        width = (hi - lo) / len(starts) * _MS
        ax.bar([t * _MS for t in starts], pct, width=width, align="edge",
               color=colours[HBM_MOVED], linewidth=0,
               label="bytes moved per time bin,\n% of peak bandwidth" if col else None)
        _ref_line(ax, mean, "--", 1.0, f"step mean: {mean:.0f}% of peak bandwidth\n(bytes "
                  "moved / (step x peak))" if col else None)
        ax.set_ylim(0, 110)
        ax.set_xlabel("time in the step (ms, modelled)")
    axes[0].set_ylabel("HBM bandwidth\n(% of peak)")
    axes[1].tick_params(labelleft=False)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    note = (f"; {100 * floor_s / res.step_s:.0f}% of the HBM floor: floor {floor_s * _MS:.2f} ms "
            "(the step's bytes at peak bandwidth) over the step" if floor_s else "")
    axes[0].set_title(f"HBM bandwidth ({peak_bytes_per_s / 1e12:.2f} TB/s peak per core; "
                      f"{res.hbm_bytes / 1e9:.3f} GB moved{note})", fontsize=10, loc="left")


def _experts_note(expected: Result, res: Result) -> str:
    """The title's line on routed experts: the pictured step's count and, for an expectation
    over routing, the expected step ("" without routed experts)."""
    from mkc.perf.run import stall_seconds
    if expected is not res:
        return (f"\na step whose slowest expert group runs {res.experts} routed experts per "
                f"MoE layer; the expected step over routing ({expected.experts:.2f} experts): "
                f"{expected.step_s * _MS:.3f} ms, stalls {stall_seconds(expected) * _MS:.3f} ms")
    if res.experts:
        return f"\nthe slowest expert group runs {res.experts} routed experts per MoE layer"
    return ""


def _save(fig, path: str | Path, description: str) -> None:
    """Rendered in memory and written atomically: a failed run leaves no partial picture, and
    the metadata that would carry a date or version is dropped (same step, same bytes); the
    file's description (PNG, SVG) or subject (PDF) carries `description`."""
    import matplotlib
    import matplotlib.pyplot as plt

    fmt = picture_format(path)
    buf = io.BytesIO()
    meta = PICTURE_FORMATS[fmt] | {"Subject" if fmt == "pdf" else "Description": description}
    with matplotlib.rc_context({"svg.hashsalt": "mkc"}):
        fig.savefig(buf, format=fmt, dpi=100, metadata=meta)
    plt.close(fig)
    from mkc.files import write_atomically
    write_atomically(Path(path), buf.getvalue())
