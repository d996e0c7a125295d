"""mkc perf: a modelled step time for a checked schedule (see `mkc.perf.sim`).

Times are modelled, not measured: chip facts come from JAX, a few constants from
`mkc/perf/data/<chip>.json`, fitted to published step times (`benchmarks/calibrate_perf.py`).
"""
from mkc.perf.run import model, perf_trace, report, run, step_model

__all__ = ["model", "perf_trace", "report", "run", "step_model"]
