"""mkc: a schedule compiler for TPU decode megakernels."""
__version__ = "0.1.0"
