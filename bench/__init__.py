"""moetune's benchmark harness: named suites behind one entry point, `python -m bench <suite>` (bench/README.md).

Every suite is a client of the package: the floor (`moetune.targets.floor`), the timer
(`moetune.search.timing`), the presets (`moetune.ir.presets`) and the tuner's spaces are imported, never
copied here.
"""
