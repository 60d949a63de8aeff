"""What a checkpoint saves and loads, handed in as one record (issue 62: no function outside ``integrations/`` takes
the engine). ``integrations/checkpointing.py`` builds a ``Trainee`` from the engine at each save and load; a load
fills its objects in place and returns the ``Counters`` it read, which the integration sets on the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from torch import nn

if TYPE_CHECKING:
    from ..runtime.runtime import LinsRuntime


@dataclass(frozen=True)
class Counters:
    """DeepSpeed's training counters (the engine's attributes of these names), as a checkpoint keeps them."""

    global_steps: int
    global_samples: int
    skipped_steps: int


@dataclass(frozen=True, eq=False)
class Trainee:
    """One rank's training, as much of it as a checkpoint reads or writes. The objects are the engine's own (a load
    fills them in place); the rest are values read from the engine when the record is built."""

    runtime: "LinsRuntime"  # the plan's runtime: master slices, the writer role, host updates, the P-sync
    module: nn.Module  # the model the engine wraps: shapes, frozen parameters, buffers, its HF config
    optimizer: Any  # the engine's LinsOptimizer (integrations/: not imported here): param_groups, state, the
    #                client's optimizer (.optimizer), loss_scaler
    lr_scheduler: Optional[Any]  # the engine's LR scheduler, None without one
    counters: Counters  # the engine's counters now (what a save writes; a load returns the saved ones)
    ds_config: Any  # the DeepSpeed config as the engine holds it (engine.config), saved as ds_config
    mpu: Any  # DeepSpeed's model-parallel unit (engine.mpu), None without one: the pipeline and tensor degrees
    seq_dp_world_size: Optional[int]  # the engine's data-parallel world size, None where it has none
    mp_world_size: Optional[int]  # the engine's model-parallel world size (1 where it has none)
    sparse_tensor_module_names: Optional[set]  # DeepSpeed 0.19.6's (saved); None where the engine has none (0.19.8)
