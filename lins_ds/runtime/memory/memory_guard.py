"""The memory guard: after the second optimizer step (the first whose forward and backward run with the
optimizer's state allocated; the first step's peak is below every later one's) every rank compares its measured
peak with the plan's prediction; rank 0 logs both, and warns when the run exceeds its budget, naming the excess
and a plan that would fit (docs/design.md §8). Measured where the device reports it (CUDA); elsewhere there is
nothing to compare and the guard stays silent.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch
from deepspeed.utils import logger

from ... import comm
from ...plan import NoFeasiblePlan, Plan
from ...plan.context import reserved_gb

GIB = 2**30


def measured(device: torch.device) -> Optional[tuple]:
    """(max allocated, max reserved by the allocator) in GiB on this rank, or None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.max_memory_reserved(device) / GIB


def plan_block(plan: Plan) -> str:
    """The ``lins`` keys that fix ``plan`` in a DeepSpeed config."""
    return json.dumps({"plan": {s: [f.intra, f.inter] for s, f in plan.layout.factors().items()},
                       "activation_checkpointing": plan.activation_checkpointing_units})


def verdict(plan: Plan, allocated_gb: float, reserved_by_allocator_gb: float, capacity_gb: Optional[float],
            reserved_gb: float, solve=None, fragmentation: float = 0.05, capped: bool = False) -> tuple:
    """(over budget?, message). Where the budget is below the card (``capped``: the allocator is held to it less
    the reserve) what the allocator holds, with the reserve, is what the card gives the run, and that is judged;
    elsewhere the allocator caches freely, so the measured peak with the plan's allocator margin and reserve (the
    quantity the plan's total predicts) is judged, and what the allocator holds is reported. ``solve(capacity)``
    re-solves with a smaller budget (None: nothing to re-solve)."""
    line = (f"lins memory: measured peak {allocated_gb:.2f} GiB allocated ({reserved_by_allocator_gb:.2f} GiB held "
            f"by the allocator) vs predicted {plan.predicted_peak_gb:.2f} GiB allocated "
            f"({100 * (allocated_gb / plan.predicted_peak_gb - 1) if plan.predicted_peak_gb else 0:+.1f} %); "
            f"activation memory: {plan.memory_profile or 'not modelled (fixed plan)'}")
    if capacity_gb is None:
        return False, line
    # with lins.gpu_memory_gb below the card the allocator is held to the budget less the reserve (``cap_allocator``):
    # what it holds is the run's use, and the plan's margin has done its job if that fits
    used = (reserved_by_allocator_gb if capped else allocated_gb * (1 + fragmentation)) + reserved_gb
    if used <= capacity_gb:
        how = "held by the allocator, with the reserve" if capped else "needed with margin and reserve"
        return False, line + f"; {used:.2f} of {capacity_gb:g} GiB (lins.gpu_memory_gb) {how}"
    excess = used - capacity_gb
    held = (f"{reserved_by_allocator_gb:.2f} held by the allocator" if capped else
            f"{100 * fragmentation:g} % allocator margin")
    msg = (line + f". Over budget: the run needs {used:.2f} GiB ({allocated_gb:.2f} allocated, {held}, "
           f"{reserved_gb:g} reserved), {excess:.2f} GiB more than lins.gpu_memory_gb = {capacity_gb:g}.")
    if solve is not None and plan.memory_gb > 0:
        under = used - plan.memory_gb  # what the prediction missed, taken off the budget
        try:
            fits = solve(capacity_gb - under).plan
            msg += (f" A plan that would fit with the measured excess taken into account: {fits.layout}, "
                    f"{fits.activation_checkpointing_units} of {fits.num_layers} layer units checkpointed "
                    f"(\"lins\": {plan_block(fits)}).")
        except NoFeasiblePlan as e:
            msg += f" No plan fits once the measured excess is taken into account: {e}"
    else:
        msg += " Shard more (a larger P, G or OS factor) or checkpoint more layer units."
    return True, msg


ALLOC_ENV = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's name, and the older one it still reads


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # torch >= 2.9
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def setup_allocator() -> str:
    """Expandable segments for torch's CUDA caching allocator, before the plan allocates anything (the engine calls
    this first thing, and again before its first plan): the plan budgets what is allocated, and without them the
    blocks the allocator has cached but cannot reuse for a larger request (a 4 GiB fp32 logits tensor among freed
    layer activations) count against the cap as well — 3.8 GiB of a 24 GiB budget and 10.9 of 40 on Gemma-2-2B, an
    out-of-memory error from a plan that fits (issue 61). With expandable segments a segment grows and shrinks in
    place, so what is free is usable. A user's own setting of ``expandable_segments`` (``PYTORCH_ALLOC_CONF`` or
    ``PYTORCH_CUDA_ALLOC_CONF``) is kept. Returns the line the start-up summary prints (empty off CUDA)."""
    if not torch.cuda.is_available():
        return ""
    named = {k: os.environ[k] for k in ALLOC_ENV if "expandable_segments" in os.environ.get(k, "")}
    if named:
        key, value = next(iter(named.items()))
        if "expandable_segments:true" in value.lower().replace(" ", ""):
            return f"  allocator: expandable segments ({key}={value})"
        return (f"  allocator: expandable segments off ({key}={value}): blocks the allocator caches but cannot reuse "
                "count against lins.gpu_memory_gb and are not in the plan, so a plan that fits can still run out of "
                "memory; unset it to let Lins turn them on")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        return f"  allocator: {backend} (no expandable segments; its own pool reuses freed memory)"
    _set_allocator_settings("expandable_segments:True")
    return ("  allocator: expandable segments on (set by Lins: freed memory is reusable whatever its size, so "
            "fragmentation cannot push a planned peak over the budget; PYTORCH_ALLOC_CONF=expandable_segments:False "
            "keeps torch's default)")


def cap_allocator(budget_gb: Optional[float], device: torch.device, reserved: Optional[float] = None) -> Optional[float]:
    """Hold torch's caching allocator to ``budget_gb`` (lins.gpu_memory_gb) less the reserve (``reserved``:
    lins.reserved_gb, else the device's default: the CUDA context and the communicators, outside the allocator) where the budget is below the card: a GPU shared
    with another process (an inference engine beside RL training) or a budget for a smaller card is then what the run
    takes, not what the allocator would cache. The plan keeps its allocated peak and margin within that share, and
    with expandable segments (``setup_allocator``) the allocator gives back cached pages before it fails, so what it
    holds stays within the budget with the reserve. The fraction set, or None (no budget, or not below the card, or
    not CUDA)."""
    if device.type != "cuda" or budget_gb is None:
        return None
    total = torch.cuda.get_device_properties(device).total_memory / GIB
    if budget_gb >= total:
        return None
    fraction = max(budget_gb - reserved_gb(reserved, device.type), 0.5 * budget_gb) / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def report_startup(runtime, context, seconds: float) -> None:
    """Rank 0 reports the engine's start-up time and the peaks since the process began (the worst rank's GPU
    peak; its own host RSS), and warns when the GPU peak with the reserve already exceeds the budget."""
    import resource

    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    mine = measured(runtime.device)
    gpu = comm.max_over_world(mine[0], runtime.device) if mine is not None else None
    if comm.rank() != 0:
        return
    msg = f"lins start-up: engine built in {seconds:.1f} s; peak host memory {host:.2f} GiB (rank 0)"
    if gpu is not None:
        msg += f", peak GPU memory {gpu:.2f} GiB allocated (worst rank)"
        if context is not None and gpu + context.mem.reserved_gb > context.mem.capacity_gb:
            msg += (f", over lins.gpu_memory_gb = {context.mem.capacity_gb:g} with the reserve: build the model under "
                    "lins_ds.init(config=...) so that no rank holds it whole")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
    logger.info(msg)
    print(msg, flush=True)


def check(plan: Plan, context, device: torch.device, host_gb: float = 0.0) -> None:
    """Run on every rank after the second optimizer step; the worst rank's peak is reported, and with offload the
    host memory this rank's offloaded state holds (``host_gb``) next to the plan's."""
    if host_gb and comm.rank() == 0:
        msg = (f"lins host memory: offloaded optimizer state holds {host_gb:.2f} GiB on rank 0 vs predicted "
               f"{plan.host_gb:.2f} GiB ({100 * (host_gb / plan.host_gb - 1) if plan.host_gb else 0:+.1f} %)")
        logger.info(msg)
        print(msg, flush=True)
    mine = measured(device)
    if mine is None:
        return
    allocated = comm.max_over_world(mine[0], device)
    held = comm.max_over_world(mine[1], device)
    capacity = context.mem.capacity_gb if context is not None else None
    reserved = context.mem.reserved_gb if context is not None else 0.0
    capped = capacity is not None and capacity < torch.cuda.get_device_properties(device).total_memory / GIB
    over, msg = verdict(plan, allocated, held, capacity, reserved, context.solve if context is not None else None,
                        context.mem.fragmentation if context is not None else 0.05, capped)
    if comm.rank() == 0:
        logger.info(msg)
        print(msg, flush=True)
        if over:
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
