"""The step-time model against every published TPU7x figure, with nothing fitted to them.

    .venv/bin/python benchmarks/validate_perf.py            # price, print, record in the data file
    .venv/bin/python benchmarks/validate_perf.py --dry-run  # price and print only
    .venv/bin/python benchmarks/validate_perf.py --markdown # docs/perf.md's tables, as recorded

Every constant in `mkc/perf/data/tpu7x.json` is a measurement (with its derivation) or an
assumption (with a range). This prices, through the functions `mkc perf` uses:

- the published micro-cases (`micro` in `mkc/perf/data/published_points.json`: remote copies,
  the reference kernel's all-gathers and all-reduces as it builds them, its dense ring, a small
  matmul) on the 8 cores of one TPU7x host;
- the published decode steps of the hand-written Kimi K3 kernel (`steps`), modelled on the
  calibration spec that mirrors its layout (`spec`), under the compiled price;
- how far the steps move across each assumed constant's range (`range` in the data file): the
  calibration spec at batch 1 and 8 and the shipped Qwen3.8 spec at batch 1;
- the hold-out (`hold_out`): the hand-written Muse Spark kernel's published steps in its three
  weight sets (each a set of `format` lines on its calibration spec), priced per op as `mkc
  perf --routing one` prices them, and its batch-1 phase breakdown against the modelled step's
  time by op, stall and collective. Nothing shaped the model on them.

Output: a `validation` record in `mkc/perf/data/<chip>.json` (each figure's error, the
sensitivities, the libtpu version of the compiled measures). The calibration spec's kernels are
compiled once (cached; the shipped measures in mkc/perf/data/bundles/ spare it).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The hold-out's ops are compiled alone into a cache of the validation's own: an op's key leaves
# out a ring's or pool's depth, so a shared cache can hold a body compiled at another depth (the
# shipped Muse Spark spec's ring ops are 2-4 % apart), and the record would follow what else the
# machine priced.
os.environ.setdefault("MKC_OP_CACHE", str(Path(os.environ.get("XDG_CACHE_HOME")
                                              or Path.home() / ".cache") / "mkc" / "ops-validation"))
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mkc import ir  # noqa: E402
from mkc.compiler import check_source, check_spec  # noqa: E402
from mkc.perf import constants  # noqa: E402
from mkc.perf.run import ROUTINGS, compiled_measure, kernel_measure, step_model  # noqa: E402
from mkc.perf.sim import DmaEngine, Model, Result  # noqa: E402
from mkc.perf.work import Work  # noqa: E402
from mkc.steps.collectives import Round  # noqa: E402

POINTS = constants.DATA / "published_points.json"
COMMAND = ".venv/bin/python benchmarks/validate_perf.py"
HOST_SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"      # tpu7x 2x2x1: the micro-cases' host
SENSITIVITY_STEPS = (("kimi_k3 (calibration)", None, 1), ("kimi_k3 (calibration)", None, 8),
                     ("qwen3_8_27b", HOST_SPEC, 1))


def reference_rounds(case: dict, cores: int = 8) -> tuple[Round, ...]:
    """The rounds of a published collective as the reference kernel builds it
    (musespark/collectives.py): a direct all-gather sends the shard to the 7 others; a
    hierarchical one gathers across the 4 chips, then the chip's 4 shards over the sibling; the
    direct all-reduce is a reduce-scatter of W/8 column blocks and an all-gather of the reduced
    blocks, both in the wire dtype; the hierarchical one halves over the sibling, quarters the
    half across the chips, then gathers back the same way."""
    rows, width = case["rows"], case["width"]
    if "allgather" in case:
        shard = rows * width * ir.DTYPE_BYTES["bf16"]
        if case["allgather"] == "direct":
            return (Round(cores, 1, shard),)
        return Round(cores // 2, 2, shard), Round(2, 1, cores // 2 * shard)
    wire = ir.DTYPE_BYTES[case["wire"]]
    if case["allreduce"] == "direct":
        block = rows * width // cores
        return Round(cores, 1, block * wire, (cores - 1) * block), Round(cores, 1, block * wire)
    half, quarter = rows * width // 2, rows * width // cores
    return (Round(2, 1, half * wire, half), Round(cores // 2, 2, quarter * wire, 3 * quarter),
            Round(cores // 2, 2, quarter * wire), Round(2, 1, half * wire))


def micro_seconds(case: dict, m: Model) -> float:
    """The model's price of one published micro-case on the host `m` models (rank 0)."""
    r = m.rates
    if "copy" in case:
        return r.collective_entry_s + m.stage_seconds(
            2, 1 if case["copy"] == "sibling" else m.s.cores_per_chip, case["bytes"])
    if "stream" in case:
        eng = DmaEngine(r.hbm_stream_bytes_per_s, r.dma_issue_s, r.dma_overhead_bytes,
                        int(r.dma_queues))
        ids = [eng.issue(0.0, case["load"]) for _ in range(case["stream"] // case["load"])]
        return max(eng.landing(i) for i in ids)
    if "matmul" in case:
        rows, k, n = case["matmul"]
        return r.op_overhead_s + m.seconds(Work(matrix={("bf16", rows): float(k * n)}))
    if "push" in case:
        k, n, pushed = case["push"]
        return m.feed_seconds(Work(matrix={(pushed, 8): float(k * n)}))
    if "ring" in case:
        return ring_seconds(published()["rings"][case["ring"]], m, case.get("dma_only", False))
    return m.collective_seconds(reference_rounds(case, len(m.chip_coords)))


@lru_cache(maxsize=None)
def published() -> dict:
    """published_points.json, read once."""
    return json.loads(POINTS.read_text())


def ring_seconds(ring: dict, m: Model, dma_only: bool = False) -> float:
    """A layer of the reference kernel's dense ring (stream.py): each layer's matrices in
    loads of one or more copies, `slots` loads in flight (a load refilled as soon as its dot is
    done), each load's dot taking its values' MXU pushes (`Model.feed_seconds`; none with
    `dma_only`, as the kernel's copies-only run); the run's time over its layers, prime and
    drain included."""
    r = m.rates
    eng = DmaEngine(r.hbm_stream_bytes_per_s, r.dma_issue_s, r.dma_overhead_bytes,
                    int(r.dma_queues))
    loads = [(f["copies"], f["copy_bytes"], f["copies"] * f["copy_bytes"] / f["bytes_per_value"])
             for f in ring["families"] for _ in range(f["loads"])] * ring["layers"]
    slots, t, issued = ring["slots"], 0.0, []
    for copies, nbytes, _ in loads[:slots]:
        issued.append([eng.issue(0.0, nbytes) for _ in range(copies)])
    for i, (_, _, values) in enumerate(loads):
        t = max([t] + [eng.landing(c) for c in issued[i]])
        if not dma_only:
            t += m.feed_seconds(Work(matrix={(ring["pushed"], 8): values}))
        if i + slots < len(loads):
            copies, nbytes, _ = loads[i + slots]
            issued.append([eng.issue(t, nbytes) for _ in range(copies)])
    return t / ring["layers"]


def host_model(rates: constants.Rates | None = None) -> Model:
    s = check_spec(HOST_SPEC).ir
    return Model(s, 1, 0, rates or constants.rates(s.chip))


def error_percent(got: float, published: float) -> float:
    return round(100.0 * (got / published - 1.0), 2)


class Steps:
    """Modelled steps at published points: traces and compiled measures built once (neither
    depends on the constants)."""

    def __init__(self, c_ir, tokens: int) -> None:
        self.ir, self.tokens = c_ir, tokens
        self.traces: dict = {}
        self.measures: dict = {}

    def step(self, batch: int, sequences: int | None, rates: constants.Rates) -> float:
        key = (batch, sequences)
        if key not in self.measures:
            self.measures[key] = compiled_measure(self.ir, batch, sequences, compile_missing=True)
        return step_model(self.ir, batch, self.tokens, rates, keep_timeline=False,
                          traces=self.traces, sequences=sequences,
                          compiled=self.measures[key]).step_s


def _label(p: dict) -> str:
    return f"verify {p['batch']}" if p.get("sequences") else f"B{p['batch']}"


def weight_set_text(text: str, formats: dict[str, str]) -> str:
    """The spec with each class's `format` line set to `formats[class]`: the line rewritten
    where the spec has one, else added before the schedule's closing brace."""
    lines = text.rstrip("\n").split("\n")
    assert lines[-1] == "}", "the spec does not end with its schedule's brace"
    for cls, fmt in formats.items():
        at = [i for i, ln in enumerate(lines) if ln.split()[:2] == ["format", cls]]
        if at:
            lines[at[0]] = f"{lines[at[0]][:lines[at[0]].index('format')]}format {cls} {fmt}"
        else:
            lines.insert(len(lines) - 1, f"  format {cls} {fmt}")
    return "\n".join(lines) + "\n"


def batch_edits(hold: dict, batch: int) -> tuple[tuple[str, str], ...]:
    """The (old, new) spec lines the hand kernel changes from some batch on
    (`hold_out.batch_edits`): what a spec, one layout for every batch, cannot say."""
    return tuple((e["old"], e["new"]) for e in hold.get("batch_edits", ())
                 if batch >= e["from_batch"])


def weight_set_ir(hold: dict, name: str, batch: int = 1, exact: bool = False):
    """The hold-out's calibration spec in weight set `name` (`hold_out.weight_sets`), as the
    kernel runs it at `batch` rows (`batch_edits`); with `exact`, holding the experts the
    checkpoint keeps bf16 so, as the shipped spec does (`exact_edits`: the same formats)."""
    ws = next(w for w in hold["weight_sets"] if w["name"] == name)
    path = ROOT / hold["spec"]
    text = weight_set_text(path.read_text(), ws["formats"])
    edits = [(e["old"], e["new"]) for e in hold["exact_edits"]["edits"]] if exact else []
    for old, new in edits:
        assert text.count(old) == 1, f"{path.name}: {old!r} is not there once"
        text = text.replace(old, new)
    for old, new in batch_edits(hold, batch):
        assert old in text, f"{path.name}: {old!r} is not there"
        text = text.replace(old, new)         # in every MoE kind's phase
    return check_source(text, str(path), ws["model"]).ir


def hold_out_step(c_ir, batch: int, hold: dict) -> Result:
    """One published hold-out step as `mkc perf --batch B --context T --routing R` models it:
    priced per op (each op body compiled alone, cached), the rows routed as `hold["routing"]`."""
    measure, why = kernel_measure(c_ir, batch)
    assert measure is not None, f"{c_ir.name} at {batch} rows is not priced compiled: {why}"
    return step_model(c_ir, batch, hold["tokens_in_cache"], keep_timeline=False,
                      compiled=measure, routed_rows=ROUTINGS[hold["routing"]](batch, None))


def step_phases(c_ir, res: Result) -> dict[str, float]:
    """The modelled step split as the hand kernel's phase table splits it (seconds a step):
    the ops fed by the weight ring and the stalls on it (dense ring); the routed experts and
    the stalls on their slots (expert phase); the attention op and the stalls on KV tiles;
    routing; every collective wait in the layers; the launch, the tail and the lm_head
    (fixed); the rest (norms, gates, residuals) as other."""
    ring_ops = {(k, f.name) for k, fams in c_ir.stream.families.items() for f in fams}
    layer_kinds = set(c_ir.kinds)
    out = dict.fromkeys(("dense ring", "collectives", "expert phase", "attention", "routing",
                         "fixed", "other"), 0.0)
    for (kind, op), c in res.op_costs.items():
        if kind not in layer_kinds:
            continue
        phase = ("dense ring" if (kind, op) in ring_ops else "expert phase"
                 if op == "routed_experts" else "attention" if op == "attention" else
                 "routing" if op == "route" else "other")
        out[phase] += c.seconds
    for st in res.stalls:
        if st.kind not in layer_kinds:
            continue
        phase = ("dense ring" if st.buffer == c_ir.stream.ring else
                 "attention" if "_kv_" in st.buffer else "expert phase")
        out[phase] += st.seconds
    for kind, causes in res.by_kind.items():
        if kind in layer_kinds:
            out["collectives"] += causes["collectives"]
        else:
            out["fixed"] += sum(causes.values())
    out["other"] += res.step_s - sum(out.values())
    return out


def validate_hold_out(hold: dict) -> dict:
    """The hold-out's published steps and batch-1 phases, modelled (`hold_out` in
    published_points.json); nothing is tuned on them."""
    irs = {(w["name"], p["batch"]): weight_set_ir(hold, w["name"], p["batch"])
           for w in hold["weight_sets"] for p in hold["steps"] if p["weights"] == w["name"]}
    labels = {w["name"]: w["label"] for w in hold["weight_sets"]}
    points = []
    print(f"hold-out steps ({hold['reference']}; modelled on {hold['spec']}, "
          f"{hold['tokens_in_cache']} cached tokens, routing {hold['routing']}):")
    for p in hold["steps"]:
        got = hold_out_step(irs[p["weights"], p["batch"]], p["batch"], hold).step_s
        points.append({"weights": p["weights"], "batch": p["batch"],
                       "published_step_s": p["step_s"], "modelled_step_s": float(f"{got:.6g}"),
                       "error_percent": error_percent(got, p["step_s"])})
        print(f"  {labels[p['weights']]:32s} B{p['batch']} published {p['step_s'] * 1e3:.3f} ms, "
              f"modelled {got * 1e3:.3f} ms ({points[-1]['error_percent']:+.1f}%)")
    ph = hold["phases"]
    c_ir = irs[ph["weights"], ph["batch"]]
    modelled = step_phases(c_ir, hold_out_step(c_ir, ph["batch"], hold))
    layers = len(c_ir.layer_kinds) // 2      # a model layer is two sublayers (attention, moe)
    phases = []
    for row in ph["published"] + [{"phase": "other", "per": "layer", "s": None}]:
        got = modelled[row["phase"]] / (layers if row["per"] == "layer" else 1)
        phases.append({**row, "modelled_s": float(f"{got:.4g}"),
                       "error_percent": error_percent(got, row["s"]) if row["s"] else None})
        print(f"  B{ph['batch']} {row['phase']:13s} a {row['per']}: published "
              + (f"{row['s'] * 1e6:.1f} us" if row["s"] else "-")
              + f", modelled {got * 1e6:.1f} us")
    return {"reference": hold["reference"], "spec": hold["spec"],
            "tokens_in_cache": hold["tokens_in_cache"], "routing": hold["routing"],
            "points": points, "phases": phases}


def validate(cfg: dict, dry_run: bool) -> int:
    chip = cfg["chip"]
    rates = constants.rates(chip)
    host = host_model(rates)
    micro = []
    print(f"micro-cases ({cfg['micro_topology']}; measured: {cfg['micro_source']}):")
    for case in cfg["micro"]:
        got = micro_seconds(case, host)
        micro.append({"case": case["case"], "measured_s": case["measured_s"],
                      "modelled_s": float(f"{got:.6g}"),
                      "error_percent": error_percent(got, case["measured_s"])})
        print(f"  {case['case']:64s} {case['measured_s'] * 1e6:9.2f} us measured, "
              f"{got * 1e6:9.2f} modelled ({micro[-1]['error_percent']:+.1f}%)")
    c_ir = check_spec(ROOT / cfg["spec"], cfg.get("model")).ir
    tokens = cfg.get("tokens_in_cache") or c_ir.context
    steps = Steps(c_ir, tokens)
    points = []
    print(f"published steps ({cfg['reference']}; modelled on {cfg['spec']}):")
    for p in cfg["steps"]:
        got = steps.step(p["batch"], p.get("sequences"), rates)
        points.append({"step": _label(p), "batch": p["batch"], "sequences": p.get("sequences"),
                       "published_step_s": p["step_s"], "modelled_step_s": float(f"{got:.6g}"),
                       "error_percent": error_percent(got, p["step_s"])})
        print(f"  {_label(p):9s} published {p['step_s'] * 1e3:.3f} ms, modelled {got * 1e3:.3f} ms "
              f"({points[-1]['error_percent']:+.1f}%)")
    qwen = Steps(check_spec(HOST_SPEC).ir, tokens)
    data_consts = constants.load_data(chip)["constants"]
    sensitivity = {}
    print("assumed constants across their ranges (modelled step, ms):")
    for name, c in data_consts.items():
        if "range" not in c:
            continue
        row = {}
        for label, spec, batch in SENSITIVITY_STEPS:
            at = (qwen if spec else steps)
            ends = [at.step(batch, None, constants.rates(chip, {name: v})) for v in c["range"]]
            row[f"{label} B{batch}"] = [float(f"{e * 1e3:.4g}") for e in ends]
        sensitivity[name] = {"range": c["range"], "value": c["value"], "steps_ms": row}
        print(f"  {name} {c['range'][0]:g} .. {c['range'][1]:g} (at {c['value']:g}): "
              + "; ".join(f"{k} {a:.3f} .. {b:.3f}" for k, (a, b) in row.items()))
    hold_out = validate_hold_out(cfg["hold_out"])
    if dry_run:
        return 0
    path = constants.data_path(chip)
    data = json.loads(path.read_text())
    data.pop("calibration", None)
    data["validation"] = {
        "reference": cfg["reference"], "spec": cfg["spec"], "tokens_in_cache": tokens,
        "fitted": [], "clock_hz": rates.clock_hz,
        "clock_source": rates.provenance["clock_hz"],
        "libtpu": next(iter(steps.measures.values()))["libtpu"] if steps.measures else "",
        "routing": "expected over uniform routing: the slowest expert group of the reduce "
                   "peers (mkc/perf/routing.py), steps at the two whole expert counts around "
                   "it weighted",
        "points": points, "micro": micro, "sensitivity": sensitivity, "hold_out": hold_out,
        "command": COMMAND}
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f} us" if seconds >= 1e-6 else f"{seconds * 1e9:.0f} ns"


def markdown(chip: str = "tpu7x") -> list[str]:
    """docs/perf.md's tables from the recorded validation: the published steps, the
    micro-cases (each with what it shaped) and the assumed constants' sensitivities."""
    val = constants.validation(chip)
    cfg = json.loads(POINTS.read_text())
    shaped = {m["case"]: m["shaped"] for m in cfg["micro"]}
    lines = ["| published step | published | modelled | error | shaped the model |",
             "| --- | --- | --- | --- | --- |"]
    for p, src in zip(val["points"], cfg["steps"]):
        lines.append(f"| {p['step']} | {p['published_step_s'] * 1e3:.2f} ms | "
                     f"{p['modelled_step_s'] * 1e3:.2f} ms | {p['error_percent']:+.1f} % | "
                     f"{src['shaped']} |")
    lines += ["", "| micro-case | measured | modelled | error | shaped the model |",
              "| --- | --- | --- | --- | --- |"]
    for m in val["micro"]:
        lines.append(f"| {m['case']} | {_us(m['measured_s'])} | {_us(m['modelled_s'])} | "
                     f"{m['error_percent']:+.1f} % | {shaped[m['case']]} |")
    lines += ["", "| assumed constant | value | range | "
              + " | ".join(f"{label} B{b} (ms)" for label, _, b in SENSITIVITY_STEPS) + " |",
              "| --- | --- | --- | " + " | ".join("---" for _ in SENSITIVITY_STEPS) + " |"]
    for name, row in val["sensitivity"].items():
        lo, hi = row["range"]
        lines.append(f"| `{name}` | {row['value']:g} | {lo:g} .. {hi:g} | "
                     + " | ".join(f"{a:.3f} .. {b:.3f}" for a, b in row["steps_ms"].values())
                     + " |")
    return lines


def growth(hold_out: dict) -> list[tuple[str, float, float]]:
    """Per weight set of a recorded hold-out: (name, published, modelled) step growth from its
    fewest rows to its most, seconds."""
    out = []
    for ws in dict.fromkeys(p["weights"] for p in hold_out["points"]):
        pts = sorted((p for p in hold_out["points"] if p["weights"] == ws),
                     key=lambda p: p["batch"])
        out.append((ws, pts[-1]["published_step_s"] - pts[0]["published_step_s"],
                    pts[-1]["modelled_step_s"] - pts[0]["modelled_step_s"]))
    return out


def hold_out_markdown(chip: str = "tpu7x") -> list[str]:
    """docs/perf.md's hold-out tables from the recorded validation: the published steps by
    weight set and batch (error in brackets), and the batch-1 phases."""
    val = constants.validation(chip)["hold_out"]
    hold = json.loads(POINTS.read_text())["hold_out"]
    batches = sorted({p["batch"] for p in val["points"]})
    lines = ["| weights | " + " | ".join(f"B{b} published / modelled (error)" for b in batches)
             + " |", "| --- | " + " | ".join("---" for _ in batches) + " |"]
    for ws in hold["weight_sets"]:
        cells = {p["batch"]: p for p in val["points"] if p["weights"] == ws["name"]}
        lines.append(f"| {ws['label']} | " + " | ".join(
            f"{cells[b]['published_step_s'] * 1e3:.3f} / {cells[b]['modelled_step_s'] * 1e3:.3f}"
            f" ms ({cells[b]['error_percent']:+.1f} %)" for b in batches) + " |")
    lines += ["", "| weights | published growth, B1 to B8 | modelled growth | error |",
              "| --- | --- | --- | --- |"]
    for ws, pub, got in growth(val):
        lines.append(f"| {next(w['label'] for w in hold['weight_sets'] if w['name'] == ws)} | "
                     f"+{pub * 1e3:.2f} ms | +{got * 1e3:.2f} ms | "
                     f"{error_percent(got, pub):+.0f} % |")
    label = next(w["label"] for w in hold["weight_sets"] if w["name"] == hold["phases"]["weights"])
    lines += ["", f"| B{hold['phases']['batch']} phase, {label} | published | modelled | error |",
              "| --- | --- | --- | --- |"]
    for ph in val["phases"]:
        published = f"{ph['s'] * 1e6:.1f} us" if ph["s"] else "-"
        error = f"{ph['error_percent']:+.0f} %" if ph["error_percent"] is not None else "-"
        lines.append(f"| {ph['phase']} a {ph['per']} | {published} | "
                     f"{ph['modelled_s'] * 1e6:.1f} us | {error} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=str(POINTS), help="published figures (JSON)")
    ap.add_argument("--dry-run", action="store_true", help="print only, write nothing")
    ap.add_argument("--markdown", action="store_true",
                    help="print docs/perf.md's tables from the recorded validation")
    args = ap.parse_args()
    if args.markdown:
        print("\n".join(markdown() + [""] + hold_out_markdown()))
        return 0
    return validate(json.loads(Path(args.points).read_text()), args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
