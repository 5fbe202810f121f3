"""moetune: capture MoE blocks, specialise them per rows-per-expert regime, tune, dispatch."""

__version__ = "0.1.0"
