"""PEFT on a model built without values (``lins_ds.init``, a Lins ``TrainingArguments``): adapters keep the values
PEFT gives them (docs/design.md §10).

PEFT creates an adapter's modules with real values, runs its own initialisation (LoRA: ``lora_A`` Kaiming,
``lora_B`` zero), then moves them to the device of the base layer's weight, which for a deferred model is the
meta device: the values would be lost and the runtime would give the adapters the base model's
``_init_weights``. So the move keeps each adapter value as the parameter's source, which the runtime reads
(this rank's share) as it reads checkpoint tensors. Inside ``lins_ds.init`` adapters are created with real
values too (the context's deferral pauses while PEFT injects them). An initialisation that reads the base
weights (PiSSA, OLoRA, LoftQ, CorDA, EVA, DoRA's magnitude) finds none on a deferred model: it is refused,
naming the adapter, instead of training from values computed on nothing.
"""

from __future__ import annotations

import functools

from torch import nn

from ..runtime.config import LinsConfigError
from ..runtime.startup.materialize import SEED, SOURCE
from . import sharded_init


def _adapter_params(layer, adapter_name: str) -> dict:
    """{name: parameter} of one adapter's entry in an adapter container (ModuleDict / ParameterDict)."""
    if not isinstance(layer, (nn.ModuleDict, nn.ParameterDict)) or adapter_name not in layer:
        return {}
    item = layer[adapter_name]
    return dict(item.named_parameters()) if isinstance(item, nn.Module) else {"": item}


def _built_by_lins(layer) -> bool:
    """The tuner layer's base weight is a parameter of a model lins_ds builds (deferred: a seed or a source)."""
    weight = getattr(layer.get_base_layer(), "weight", None)
    return weight is not None and weight.is_meta and (hasattr(weight, SEED) or hasattr(weight, SOURCE))


def _keeping_values(move):
    @functools.wraps(move)
    def _move_adapter_to_device_of_base_layer(self, adapter_name, device=None):
        if not _built_by_lins(self):
            return move(self, adapter_name, device)
        names = list(self.adapter_layer_names) + list(self.other_param_names)
        before = {n: _adapter_params(getattr(self, n, None), adapter_name) for n in names}
        for n, params in before.items():
            if any(p.is_meta for p in params.values()):
                raise LinsConfigError(
                    f"lins: PEFT adapter {adapter_name!r} ({n}) of {type(self).__name__} has no values: it was "
                    "created on the meta device, or initialised from base weights that a sharded load has not read "
                    "(init_lora_weights = \"pissa\", \"olora\", \"loftq\", \"corda\", \"eva\", DoRA's magnitude, ...). "
                    "Use PEFT's default or \"gaussian\" initialisation, or load the base model eagerly")
        values = {(n, k): p.detach() for n, params in before.items() for k, p in params.items()}
        move(self, adapter_name, device)
        for n in names:
            for k, p in _adapter_params(getattr(self, n, None), adapter_name).items():
                if p.is_meta and (n, k) in values:  # what PEFT computed, in the dtype the move gave it
                    setattr(p, SOURCE, sharded_init._InMemory(values[(n, k)].to(p.dtype)))

    _move_adapter_to_device_of_base_layer._lins_patched = True
    return _move_adapter_to_device_of_base_layer


READS_BASE = ("pissa", "corda", "olora", "loftq", "eva", "lora_ga", "mica")  # init_lora_weights that read base weights


def _refuse_base_reading_init(tuner, model, adapter_name) -> None:
    """An adapter initialisation that reads the base weights cannot run on a model lins_ds builds (its weights are
    not read yet): refused before PEFT runs it, naming the option."""
    built_by_lins = any(p.is_meta and (hasattr(p, SEED) or hasattr(p, SOURCE)) for p in model.parameters())
    config = getattr(tuner, "peft_config", {}).get(adapter_name)
    if not built_by_lins or config is None:
        return
    init = getattr(config, "init_lora_weights", None)
    what = (f"init_lora_weights={init!r}" if isinstance(init, str) and init.lower().startswith(READS_BASE)
            else "use_dora=True" if getattr(config, "use_dora", False) else None)
    if what:
        raise LinsConfigError(
            f"lins: PEFT adapter {adapter_name!r}: {what} initialises the adapter from the base weights, which a "
            "sharded load reads only at deepspeed.initialize, one rank's share at a time. Use PEFT's default or "
            "\"gaussian\" initialisation, or load the base model eagerly (outside lins_ds.init and without a Lins "
            "TrainingArguments alive)")


def _with_real_adapters(inject):
    @functools.wraps(inject)
    def inject_adapter(self, model, adapter_name, *args, **kwargs):
        _refuse_base_reading_init(self, model, adapter_name)
        with sharded_init.paused():
            return inject(self, model, adapter_name, *args, **kwargs)

    inject_adapter._lins_patched = True
    return inject_adapter


def install() -> None:
    from peft.tuners.tuners_utils import BaseTuner, BaseTunerLayer

    move = BaseTunerLayer._move_adapter_to_device_of_base_layer
    if not getattr(move, "_lins_patched", False):
        BaseTunerLayer._move_adapter_to_device_of_base_layer = _keeping_values(move)
    inject = BaseTuner.inject_adapter
    if not getattr(inject, "_lins_patched", False):
        BaseTuner.inject_adapter = _with_real_adapters(inject)
