"""What the planner is told about training: shapes, dtypes, optimizer, memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .topology import PlanError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DTYPES = tuple(DTYPE_BYTES)  # the dtype names used everywhere: lins_ds/dtypes.py maps them to torch
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8}  # exp_avg + exp_avg_sq in fp32
GIB = 2**30
ALIGN_BYTES = 16  # cuBLAS's fast bf16 GEMM kernels need widths in multiples of 16 bytes (8 elements)


def _positive_int(key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{key}: {value!r} is not a positive integer")


@dataclass(frozen=True)
class TrainingSpec:
    seq_len: int
    micro_batch_size: int
    grad_accum: int = 1
    param_dtype: str = "bf16"
    grad_accum_dtype: Optional[str] = None  # None: the parameter dtype (DeepSpeed's default, get_data_types)
    grad_reduce_dtype: Optional[str] = None  # None: the parameter dtype (as FSDP; the paper's 2-byte grads)
    optimizer: str = "adamw"
    # None: the planner chooses how many layer units to checkpoint; True / False: all / none; an int: that many
    activation_checkpointing: Optional[Union[bool, int]] = None
    # the update runs one unit at a time (torch's optimizers, per-parameter state) or all at once (others)
    optimizer_per_unit: bool = True
    # sequence tiling (issue 60; ``plan.sequence``): the layers' MLPs and the logits with their loss computed this
    # many sequence tiles at a time (1: whole)
    mlp_tiles: int = 1
    logits_tiles: int = 1
    # activation offload (issue 60; ``plan.sequence``): True: the solver holds the inputs of the fewest checkpointed
    # layer units that make a plan fit in host memory; False: of none; a number: of that many (at most every
    # checkpointed one)
    activation_offload: Union[bool, int] = False
    # the offloaded units' host updates start as each unit's gradient is final in the window's last backward
    # (``gradient_clipping: 0``, no fp16 loss scaling: nothing waits for every gradient), else after the backward ends
    host_update_in_backward: bool = False

    def __post_init__(self) -> None:
        _positive_int("--seq-len", self.seq_len)
        _positive_int("--micro-batch-size", self.micro_batch_size)
        _positive_int("--grad-accum", self.grad_accum)
        for key, value in (("param_dtype", self.param_dtype), ("grad_accum_dtype", self.grad_accum_dtype),
                           ("grad_reduce_dtype", self.grad_reduce_dtype)):
            if value is not None and value not in DTYPE_BYTES:
                raise PlanError(f"{key}: {value!r} is not one of {sorted(DTYPE_BYTES)}")
        ck = self.activation_checkpointing
        if ck is not None and not isinstance(ck, bool) and (not isinstance(ck, int) or ck < 0):
            raise PlanError(f"activation_checkpointing: {ck!r} is not true, false, null or a number of units >= 0")
        ao = self.activation_offload
        if not isinstance(ao, bool) and (not isinstance(ao, int) or ao < 0):
            raise PlanError(f"activation_offload: {ao!r} is not true, false or a number of layer units >= 0")
        _positive_int("mlp_tiles", self.mlp_tiles)
        _positive_int("logits_tiles", self.logits_tiles)
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(f"optimizer: {self.optimizer!r} is not one of {sorted(OPTIMIZER_STATE_BYTES)}")

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as accumulated (the G shard)."""
        return DTYPE_BYTES[self.grad_accum_dtype or self.param_dtype]

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element on the wire (ReduceScatter and AllReduce)."""
        return DTYPE_BYTES[self.grad_reduce_dtype or self.param_dtype]

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per element of the OS shard: fp32 master (unless params are fp32) + Adam moments."""
        master = 4 if self.param_dtype != "fp32" else 0
        return master + OPTIMIZER_STATE_BYTES[self.optimizer]

    def checkpoint_choices(self, num_layers: int) -> list:
        """How many of the ``num_layers`` layer units may be checkpointed, ascending."""
        ck = self.activation_checkpointing
        if ck is None:
            return list(range(num_layers + 1))
        if isinstance(ck, bool):
            return [num_layers if ck else 0]
        if ck > num_layers:
            raise PlanError(f"activation_checkpointing: {ck} units, but the model has {num_layers} layer units")
        return [ck]

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.seq_len * self.micro_batch_size


@dataclass(frozen=True)
class MemorySpec:
    """Per-GPU budget. ``reserved_gb``: CUDA context and communicator buffers, outside the allocator.
    ``fragmentation``: allocator margin as a fraction of what the allocator holds."""

    capacity_gb: float
    reserved_gb: float = 2.0
    fragmentation: float = 0.05

    def __post_init__(self) -> None:
        if not isinstance(self.capacity_gb, (int, float)) or not self.capacity_gb > 0:
            raise PlanError(f"--gpu-memory-gb: {self.capacity_gb!r} must be a positive number of GiB")
        if self.reserved_gb < 0 or not 0 <= self.fragmentation < 1:
            raise PlanError("memory: reserved_gb must be >= 0 and fragmentation in [0, 1)")
