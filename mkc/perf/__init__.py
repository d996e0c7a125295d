"""mkc perf: a modelled step time for a checked schedule (see `mkc.perf.sim`).

Times are modelled, not measured: chip facts come from JAX, the other constants from
`mkc/perf/data/<chip>.json`, each a TPU measurement or a stated assumption, none fitted
(`benchmarks/validate_perf.py` prices every published figure).
"""
from mkc.perf.run import model, perf_trace, report, run, step_model

__all__ = ["model", "perf_trace", "report", "run", "step_model"]
