"""Draw a modelled step as a PNG (`mkc perf SPEC --plot F`), for one rank.

Three panels over the step, sharing the time axis (ms):
  1. VMEM bytes live, stacked by buffer class (each pool split into its open view and the rest),
     with the budget (limit - reserve) and the limit;
  2. a Gantt chart: the layer loop (coloured by layer kind), stalls and collectives of compute,
     then one row per DMA destination with each copy's bytes in flight;
  3. HBM bandwidth utilisation: bytes the DMA queue moves per time bin, as % of the HBM peak.

It reads only the simulator's result (timeline and VMEM marks), the schedule IR and the chip's
HBM peak. Times are modelled; the title says so.
"""
from __future__ import annotations

import io
from pathlib import Path

from mkc import ir
from mkc.perf.perfetto import dma_class, vmem_series
from mkc.perf.sim import Result

MIB = 2 ** 20
_MS = 1e3                    # seconds to the axes' milliseconds
# layer kinds: none of the buffer-class colours (tab20) nor the stall red
_KIND_COLOURS = ["#6a3d9a", "#e6ab02", "#1b9e77", "#b15928", "#7570b3", "#a6761d", "#666666"]


def _class_colours(classes: list[str]) -> dict[str, str]:
    import matplotlib
    cmap = matplotlib.colormaps["tab20"]
    fixed = {"ring": 0, "parity": 4, "activation": 14, "collective": 8, "state": 6, "kv": 2,
             "output": 16, "compiler": 11, "input": 17}
    out, spare = {}, iter(i for i in range(20) if i not in fixed.values())
    for c in classes:
        if c.endswith(" free"):
            out[c] = "#dddddd"
            continue
        key = c.split()[0] if c.startswith("pool ") else c
        idx = fixed.get(key)
        out[c] = matplotlib.colors.to_hex(cmap(idx if idx is not None else next(spare, 19)))
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
    spans: dict[int, list] = {}
    for iv in res.timeline:
        if iv.track != "dma" and iv.layer >= 0:
            sp = spans.setdefault(iv.layer, [iv.start, iv.end, iv.kind])
            sp[0], sp[1] = min(sp[0], iv.start), max(sp[1], iv.end)
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


def _gantt_rows(s: ir.ScheduleIR, res: Result) -> tuple[list, dict[str, str]]:
    """[(label, [(start ms, width ms)], colours)] top to bottom, and the layer-kind colours."""
    kinds = sorted({iv.kind for iv in res.timeline if iv.track != "dma" and iv.layer >= 0})
    kind_colour = {k: _KIND_COLOURS[i % len(_KIND_COLOURS)] for i, k in enumerate(kinds)}
    spans: dict[int, list] = {}
    for iv in res.timeline:
        if iv.track != "dma" and iv.layer >= 0:
            sp = spans.setdefault(iv.layer, [iv.start, iv.end, iv.kind])
            sp[0], sp[1] = min(sp[0], iv.start), max(sp[1], iv.end)
    rows = [("layers (by kind)", [(a * _MS, (b - a) * _MS) for a, b, _ in spans.values()],
             [kind_colour[k] for _, _, k in spans.values()])]
    for track, label, colour in (("stall", "compute stalled", "crimson"),
                                 ("collective", "collectives (ICI)", "#555555")):
        bars = [(iv.start * _MS, (iv.end - iv.start) * _MS) for iv in res.timeline
                if iv.track == track]
        rows.append((f"{label}: {sum(w for _, w in bars):.2f} ms", bars, [colour] * len(bars)))
    dma: dict[str, list] = {}
    moved: dict[str, int] = {}
    for iv in res.timeline:
        if iv.track == "dma":
            dma.setdefault(iv.name, []).append((iv.start * _MS, (iv.end - iv.start) * _MS))
            moved[iv.name] = moved.get(iv.name, 0) + iv.nbytes
    base = {n: dma_class(s, n).replace(" store", "") for n in dma}
    colours = _class_colours(sorted(set(base.values())))
    for name in sorted(dma, key=lambda n: (-moved[n], n)):
        rows.append((f"DMA {name}: {moved[name] / 1e6:.1f} MB", dma[name],
                     [colours[base[name]]] * len(dma[name])))
    return rows, kind_colour


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
    expected = res
    res = res.concrete()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 2, figsize=(19, 11), sharex="col",
                             gridspec_kw={"height_ratios": [3, 4, 2], "width_ratios": [3, 2],
                                          "hspace": 0.14, "wspace": 0.04})
    z0, z1, zlayers = zoom_window(res)
    _draw_vmem(axes[0], s, res, batch)
    _draw_gantt(axes[1], s, res)
    _draw_hbm(axes[2], res, peak_bytes_per_s, floor_s, [(0.0, res.step_s), (z0, z1)])
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
                 f"(modelled, not measured){experts}", fontsize=13)
    fig.subplots_adjust(left=0.13, right=0.86, top=0.90 if experts else 0.93, bottom=0.06)
    _save(fig, path)



def _draw_vmem(axes, s: ir.ScheduleIR, res: Result, batch: int) -> None:
    """Panel 1: VMEM live, stacked by buffer class, with the budget, the limit and the peak."""
    vs = vmem_series(s, res, batch)
    xs: list[float] = []
    for i, t in enumerate(vs.times):
        xs += [t * _MS, (vs.times[i + 1] if i + 1 < len(vs.times) else t) * _MS]
    classes = [c for c in vs.classes if any(r[c] for r in vs.rows)]
    # Steady classes at the bottom, largest first; the ones that change (views, scoped) on top.
    steady = sorted((c for c in classes if len({r[c] for r in vs.rows}) == 1),
                    key=lambda c: (-vs.rows[0][c], c))
    order = steady + [c for c in classes if c not in steady]
    colours = _class_colours(order)
    ys = [[v / MIB for r in vs.rows for v in (r[c], r[c])] for c in order]
    peak = max(vs.totals())
    labels = [f"{c} ({max(r[c] for r in vs.rows) / MIB:.2f} MiB max)" for c in order]
    for ax in axes:
        ax.stackplot(xs, ys, labels=labels, colors=[colours[c] for c in order], linewidth=0)
        ax.axhline(vs.budget / MIB, color="crimson", ls="--", lw=1.2)
        ax.axhline(vs.limit / MIB, color="black", ls=":", lw=1.0)
        ax.axhline(peak / MIB, color="black", ls="-", lw=0.6)
        ax.set_ylim(0, vs.limit / MIB * 1.1)
    ax = axes[0]
    ax.text(0.005, vs.budget / MIB, f"budget {vs.budget / MIB:.2f} MiB (usable - reserve)",
            color="crimson", va="bottom", fontsize=8, transform=ax.get_yaxis_transform())
    ax.text(0.005, vs.limit / MIB, f"usable {vs.limit / MIB:.2f} MiB (limit within what XLA "
            "gives)", va="bottom", fontsize=8,
            transform=ax.get_yaxis_transform())
    ax.set_ylabel("VMEM live (MiB)")
    ax.set_title(f"VMEM live by buffer class: peak {peak / MIB:.2f} MiB (solid line; the "
                 f"checker's peak at batch {batch})", fontsize=10, loc="left")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _draw_gantt(axes, s: ir.ScheduleIR, res: Result) -> None:
    """Panel 2: the layers, stalls and collectives of compute, then a row per DMA destination."""
    from matplotlib.patches import Patch

    rows, kind_colour = _gantt_rows(s, res)
    for col, ax in enumerate(axes):
        for i, (label, bars, cols) in enumerate(rows):
            y = len(rows) - 1 - i
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
                      "destination (bar: bytes flowing; "
                      + ("the queue drains in issue order)" if queues == 1 else
                         f"{queues} queues, each in issue order, share the bandwidth)"),
                      fontsize=10, loc="left")
    axes[1].legend(handles=[Patch(color=c, label=f"layer kind {k}")
                            for k, c in kind_colour.items()],
                   loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)


def _draw_hbm(axes, res: Result, peak_bytes_per_s: float, floor_s: float | None,
              windows: list[tuple[float, float]]) -> None:
    """Panel 3: HBM bandwidth utilisation per time bin of each column's window."""
    mean = 100 * res.hbm_bytes / (res.step_s * peak_bytes_per_s)
    for col, ax in enumerate(axes):
        lo, hi = windows[col]
        starts, pct = utilisation(res, peak_bytes_per_s, bins=400 if col == 0 else 200,
                                  window=(lo, hi))
        width = (hi - lo) / len(starts) * _MS
        ax.bar([t * _MS for t in starts], pct, width=width, align="edge", color="#4e79a7",
               linewidth=0)
        ax.axhline(mean, color="black", ls="--", lw=1.0)
        ax.set_ylim(0, 110)
        ax.set_xlabel("time in the step (ms, modelled)")
    axes[0].text(0.995, 0.97, f"dashed: step mean {mean:.0f}% of peak", ha="right",
                 va="top", fontsize=8, transform=axes[0].transAxes,
                 bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85})
    axes[0].set_ylabel("HBM bandwidth\n(% of peak)")
    axes[1].tick_params(labelleft=False)
    note = (f"; HBM floor {floor_s * _MS:.2f} ms = {100 * floor_s / res.step_s:.0f}% of the step"
            if floor_s else "")
    axes[0].set_title(f"HBM bandwidth utilisation ({peak_bytes_per_s / 1e12:.2f} TB/s peak "
                      f"per core; {res.hbm_bytes / 1e9:.3f} GB moved{note})", fontsize=10,
                      loc="left")


def _experts_note(expected: Result, res: Result) -> str:
    """The title's line on routed experts: the pictured step's count and, for an expectation
    over routing, the expected step ("" without routed experts)."""
    if expected is not res:
        return (f"\na step whose slowest expert group runs {res.experts} routed experts per "
                f"MoE layer; the expected step over routing ({expected.experts:.2f} experts): "
                f"{expected.step_s * _MS:.3f} ms")
    if res.experts:
        return f"\nthe slowest expert group runs {res.experts} routed experts per MoE layer"
    return ""


def _save(fig, path: str | Path) -> None:
    """Rendered in memory and written atomically: a failed run leaves no partial picture, and
    the metadata that would carry a date or version is dropped (same step, same bytes)."""
    import matplotlib
    import matplotlib.pyplot as plt

    fmt = picture_format(path)
    buf = io.BytesIO()
    with matplotlib.rc_context({"svg.hashsalt": "mkc"}):
        fig.savefig(buf, format=fmt, dpi=100, metadata=PICTURE_FORMATS[fmt])
    plt.close(fig)
    from mkc.compiler import write_atomically
    write_atomically(Path(path), buf.getvalue())
