"""The host update of offloaded units as memory traffic (docs/design.md §13, issue 59). Pure Python: the runtime
names its paths from here (``runtime/step/host_optimizer.py``).

**Bytes per element.** The host optimizer is memory-bound: per element of an offloaded OS chunk it does a few flops
per byte it moves, so its time is at least the bytes it must move over the host's memory bandwidth (measured by
``lins_ds.profiler.host_bandwidth``). What a path moves per element in host memory, with g the gradient's bytes as
it lies on the host (2 for bf16, 4 for an fp32 accumulator), p the bytes of the parameter copy that goes up (2 for
bf16; 0 for fp32 parameters, whose master goes up itself: no cast pass runs) and S the fp32 master and optimizer
state the step reads and writes (4 + 8 = 12 for Adam, 16 with amsgrad). Writes are counted once, as STREAM counts
them, without the read a store's cache line costs first:

    path      pass (over the piece, or per cache-sized block)    reads      writes     bf16 Adam
    staged    gradient -> fp32 scratch (copy_)                  g          4           2 + 4
              scratch *= coef (mul_)                            4          4           4 + 4
              optimizer step (fused Adam: grad, master, moments) 4 + S     S           16 + 12
              master -> parameter dtype (copy_)                 4          p           4 + 2
                                                                                       = 48
    piece     gradient -> fp32 scratch, scaled, one block at a  g          4           2 + 4
              time: the mul_ reads and writes cache
              optimizer step over the whole piece               4 + S      S           16 + 12
              master -> parameter dtype                         4          p           4 + 2
                                                                                       = 40
    blocks    per block of ``HostOptimizer.block`` elements:    g + S      S + p       14 + 14
              copy_, mul_, the fused Adam kernel on the block's
              views, the cast; the block's fp32 gradient and
              master stay in cache between the passes
                                                                                       = 28

"staged" is the update before issue 59 (its ~50 bytes per element, inferred on an H200 host); "piece" is what an
optimizer without the fused kernel on block views still needs (DeepSpeedCPUAdam, another torch optimizer: its step
must see the whole piece's gradient); "blocks" is torch's fused CPU Adam/AdamW, whose kernel is element-wise, so that it
runs on views of a block and gives the same bits. 28 = g + 2S + p is the floor for Adam: read the gradient, read and
write the master and both moments, write the parameter copy. Not counted: the gradient's copy down and the
parameters' copy up, on the GPU's copy engines (g written, p read: 4 more bytes that share the same bandwidth).

What a step waits for of it (the overlap with the next forward and, without clipping, the last backward) is
``lins_ds.plan.offload``'s: it prices each unit's host time from these bytes' measured rate.
"""

from __future__ import annotations

from dataclasses import dataclass

STAGED, PIECE, BLOCKS = "staged", "piece", "blocks"
PATHS = (STAGED, PIECE, BLOCKS)
FP32 = 4
ADAM_STATE_BYTES = 4 + 8  # the fp32 master and Adam's two fp32 moments (amsgrad: + 4, its running maximum)


@dataclass(frozen=True)
class Pass:
    """One pass of a path over host memory: bytes per element it reads and writes there."""

    what: str
    reads: int
    writes: int


def passes(path: str, grad_bytes: int = 2, param_bytes: int = 2, state_bytes: int = ADAM_STATE_BYTES) -> tuple:
    """The passes of ``path`` (the module docstring's table) for a gradient of ``grad_bytes`` per element, a
    parameter copy of ``param_bytes`` (0: none, the fp32 master goes up itself, and no cast pass runs) and
    ``state_bytes`` of master and optimizer state that the step reads and writes."""
    cast = (Pass("cast up", FP32, param_bytes),) if param_bytes else ()
    if path == STAGED:
        return (Pass("gradient to fp32", grad_bytes, FP32), Pass("scaled by the coefficient", FP32, FP32),
                Pass("optimizer step", FP32 + state_bytes, state_bytes)) + cast
    if path == PIECE:
        return (Pass("gradient to fp32, scaled in cache", grad_bytes, FP32),
                Pass("optimizer step", FP32 + state_bytes, state_bytes)) + cast
    if path == BLOCKS:
        return (Pass("per block: gradient to fp32 scaled, fused step, cast up", grad_bytes + state_bytes,
                     state_bytes + param_bytes),)
    raise ValueError(f"host update path {path!r} is not one of {PATHS}")


def bytes_per_element(path: str, grad_bytes: int = 2, param_bytes: int = 2,
                      state_bytes: int = ADAM_STATE_BYTES) -> int:
    """Host memory bytes ``path`` moves per element (reads + writes of ``passes``)."""
    return sum(p.reads + p.writes for p in passes(path, grad_bytes, param_bytes, state_bytes))


def floor_seconds(elements: float, bandwidth_gbs: float, path: str, grad_bytes: int = 2, param_bytes: int = 2,
                  state_bytes: int = ADAM_STATE_BYTES) -> float:
    """The least time ``path`` can update ``elements`` in, at ``bandwidth_gbs`` (GB/s, 1e9 bytes: the host's
    measured copy bandwidth, whose reads and writes come one to one as the update's do)."""
    if not bandwidth_gbs > 0:
        raise ValueError(f"host memory bandwidth {bandwidth_gbs!r} GB/s is not positive")
    return elements * bytes_per_element(path, grad_bytes, param_bytes, state_bytes) / (bandwidth_gbs * 1e9)


def achieved_fraction(elements_per_s: float, bandwidth_gbs: float, path: str, grad_bytes: int = 2,
                      param_bytes: int = 2, state_bytes: int = ADAM_STATE_BYTES) -> float:
    """The fraction of ``bandwidth_gbs`` an update at ``elements_per_s`` achieves for the bytes ``path`` moves:
    1.0 is the floor."""
    return elements_per_s * floor_seconds(1.0, bandwidth_gbs, path, grad_bytes, param_bytes, state_bytes)

