"""The user commands beside the plugin: the demo (``lins-ds demo``) and the profiler's command line
(``lins-ds profile``), with the LLaMA shapes and synthetic data they and the example script train on. The engine
never imports this package; the benchmarks and the simulator live in the repository's ``bench/``."""
