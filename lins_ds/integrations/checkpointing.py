"""LinsEngine's ``save_checkpoint`` and ``load_checkpoint`` (docs/design.md §9): the engine's checks (an optimizer,
every rank arriving), then ``checkpoint.save`` / ``checkpoint.load`` on a ``Trainee`` built from the engine here, the
one place that reads the engine for a checkpoint; a load's counters are set back on the engine here too."""

from __future__ import annotations

from .. import comm
from ..checkpoint.load import load
from ..checkpoint.save import save
from ..checkpoint.trainee import Counters, Trainee
from ..runtime.config import LinsConfigError


def trainee_of(engine) -> Trainee:
    """What a checkpoint of ``engine`` reads and writes: its runtime, module, optimizer and LR scheduler, DeepSpeed's
    counters and what DeepSpeed saves of the launch (its config, model parallelism, world sizes)."""
    return Trainee(runtime=engine.lins, module=engine.module, optimizer=engine.optimizer,
                   lr_scheduler=engine.lr_scheduler,
                   counters=Counters(engine.global_steps, engine.global_samples, engine.skipped_steps),
                   ds_config=getattr(engine, "config", None), mpu=getattr(engine, "mpu", None),
                   seq_dp_world_size=getattr(engine, "seq_dp_world_size", None),
                   mp_world_size=getattr(engine, "mp_world_size", 1),
                   sparse_tensor_module_names=getattr(engine, "sparse_tensor_module_names", None))


def set_counters(engine, counters: Counters) -> None:
    """A load's counters, on the engine (DeepSpeed's attributes of the same names)."""
    engine.global_steps, engine.global_samples = counters.global_steps, counters.global_samples
    engine.skipped_steps = counters.skipped_steps


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
    """``LinsEngine.save_checkpoint``: every rank calls it. Each rank of one OS replica writes its own chunk; the tag
    directory appears only once complete, then ``latest``."""
    require_optimizer(engine, "save_checkpoint")
    comm.all_ranks_arrive(comm.Arrival.SAVE, "call it on every rank (each writes its own part: accelerate's "
                          "save_state and the Trainer do); for the weights alone on one rank, take "
                          "engine.module.state_dict() on every rank and write it on that one")
    return save(trainee_of(engine), save_dir, tag, client_state, save_latest, exclude_frozen_parameters)


def load_checkpoint(engine, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                    load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
    """``LinsEngine.load_checkpoint``: ``(path, client_state)`` as DeepSpeed returns them; loads into the engine's
    plan and world size whatever plan and world size wrote the checkpoint."""
    require_optimizer(engine, "load_checkpoint")
    comm.all_ranks_arrive(comm.Arrival.LOAD, "call it on every rank (each reads its own part)")
    if custom_load_fn is not None:
        raise LinsConfigError("load_checkpoint: custom_load_fn is not supported by LinsEngine")
    path, client_state, counters = load(trainee_of(engine), load_dir, tag, load_module_strict, load_optimizer_states,
                                        load_lr_scheduler_states, load_module_only,
                                        trust_pickle=engine.lins_config.checkpoint_pickle)
    if counters is not None:
        set_counters(engine, counters)
    return path, client_state


def require_optimizer(engine, what: str) -> None:
    if engine.optimizer is None:
        raise LinsConfigError(f"lins: {what} of an engine without an optimizer (forward only); its parameters are "
                              "engine.module.state_dict() (every rank), or load them into the model before "
                              "deepspeed.initialize")
