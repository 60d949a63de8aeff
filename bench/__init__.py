"""lins_ds' benchmarks, simulator and their calibration: beside the plugin, in a clone of the repository, never
installed (bench/README.md). Run from the repository root: ``python -m bench {run,memory,simulate,profile,unused-params}``."""
