"""What DeepSpeed knows of a launch, read once by the engine (``integrations/engine.py``) into one frozen record: the
planning functions read it, never the engine (issue 62: no function outside ``integrations/`` takes the engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ...plan import Topology


@dataclass(frozen=True, eq=False)
class LaunchFacts:
    module: nn.Module  # the model the engine wraps
    optimizer: Optional[torch.optim.Optimizer]  # the client's (basic) optimizer; None: a forward-only engine
    micro_batch: int  # train_micro_batch_size_per_gpu
    grad_accum: int  # gradient_accumulation_steps
    param_dtype: str  # "bf16", "fp16" or "fp32": the parameters'
    accum_dtype: torch.dtype  # the gradient accumulation dtype (data_types.grad_accum_dtype, else the parameters')
    reduce_dtype: torch.dtype  # the gradient reduction dtype (lins.grad_reduce_dtype, else the parameters')
    gemm_dtype: torch.dtype  # the dtype the model's GEMMs run in (DeepSpeed's torch_autocast where it is on)
    device: torch.device
    topology: Topology
    gradient_clipping: float = 1.0  # DeepSpeed's gradient_clipping (1.0 where the key is absent)
