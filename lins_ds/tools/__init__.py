"""Tools beside the plugin: the benchmark, the simulator, the profiler's command line and the helpers
that run DeepSpeed's baselines from the same script. The engine never imports this package."""
