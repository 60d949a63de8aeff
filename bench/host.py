"""The host's speed at driving a module-by-module step: seconds per module pass of a chain of tiny modules with
forward and backward hooks, the work DeepSpeed's stage-3 code does per module fetch without its bytes.

A step that fetches module by module (DeepSpeed ZeRO-3, ZeRO++, MiCS) on a fast link is bound by the host:
Python hooks, the dispatcher and kernel launches (bench/results/simulate/README.md has the trace). Its cost moves
with the host's CPU, from one machine of a kind to the next and under load, so the simulator scales its fitted
per-fetch cost by this measurement (``bench/calibrate.py``) instead of holding it constant. The modules are
tiny, so the device finishes each kernel long before the host has launched the next: what is timed is the host.

Run by every rank at once (contention for the CPU included), in a process whose engine does not exist yet:
after it, the probe would also time the engine's own state (its hooks, its objects for the garbage collector).
So ``python -m bench profile`` and ``bench/train.py`` measure it, not the engine's start-up profiling.
"""

from __future__ import annotations

import statistics
import time

import torch

MODULES, ITERS, REPEATS = 48, 10, 9  # about 0.5-1.5 s: the median of 9 holds a host's jitter


def _chain(device) -> tuple:
    """(modules, input): ``MODULES`` tiny Linears with a forward pre-hook and a backward hook that each touch a
    tensor, as a fetch's hooks do (mark, view, launch)."""
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8, device=device) for _ in range(MODULES))
    for layer in layers:
        layer.register_forward_pre_hook(_touch)
        layer.register_full_backward_hook(lambda m, grad_in, grad_out: None)
    return layers, torch.randn(4, 8, device=device, requires_grad=True)


def _touch(module, args) -> None:
    module.weight.detach().view(-1).narrow(0, 0, 8).add_(0)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_module(device: torch.device) -> float:
    """The host's time per module pass (forward with its hook, backward with its hook), median of ``REPEATS``."""
    layers, x = _chain(device)

    def once():
        h = x
        for layer in layers:
            h = layer(h)
        h.sum().backward()

    times = []
    with torch.enable_grad():  # a caller under no_grad still gets its backward timed
        once()  # first call: allocations, autograd graph warm-up
        for _ in range(REPEATS):
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(ITERS):
                once()
            _sync(device)
            times.append((time.perf_counter() - t0) / (ITERS * MODULES))
    return statistics.median(times)


def slowest_rank(device: torch.device) -> float:
    """``seconds_per_module`` measured by every rank at once; the slowest rank's (it sets a step's pace)."""
    from lins_ds import comm

    return comm.max_over_world(seconds_per_module(device), device)
