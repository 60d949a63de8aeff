"""Selective activation checkpointing: the first k of the N layer units recompute their forward in backward
(docs/design.md §8). The solver picks k; 0 and N are the all-or-nothing cases. Where the model checkpoints k units
already (``activation_checkpointing_enable``, every n-th with ``every_n_layers``), it keeps those.

Hugging Face layers (``GradientCheckpointingLayer``: a ``gradient_checkpointing`` flag and a
``_gradient_checkpointing_func``) are switched with their own flag, which also turns their cache off
under checkpointing. They run the checkpoint function the model was given (``activation_checkpointing_enable``:
its ``activation_checkpointing_kwargs``, and ``offload=True``, the saved activations in pinned host memory), else
``torch.utils.checkpoint`` (non-reentrant); any other module gets its forward wrapped in the latter.
Either way the module's hooks stay outside the checkpointed function, so Lins' gather hooks run once per
forward, and the unit is gathered again before its backward (and so before the recompute).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

_WRAPPED = "_lins_checkpointed_forward"


def _is_hf_layer(module: nn.Module) -> bool:
    return hasattr(type(module), "gradient_checkpointing") and hasattr(module, "gradient_checkpointing")


def checkpointed_units(layer_modules: list) -> list:
    """The indices of the layer units the model checkpoints already: every one after HF's
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``), every n-th with its ``every_n_layers``."""
    return [i for i, mods in enumerate(layer_modules)
            if all((_is_hf_layer(m) and m.gradient_checkpointing) or hasattr(m, _WRAPPED) for m in mods)]


_DEFAULT = functools.partial(checkpoint, use_reentrant=False)


def model_function(layer_modules: list):
    """The checkpoint function the model's Hugging Face layers were given, or None: what
    ``activation_checkpointing_enable`` built from its kwargs and ``offload`` (the same for every layer; it stays
    in a layer a plan has turned off). Not the engine's own, nor the bare ``checkpoint`` that
    ``activation_checkpointing_disable`` leaves behind."""
    for mods in layer_modules:
        for m in mods:
            func = getattr(m, "_gradient_checkpointing_func", None) if _is_hf_layer(m) else None
            if func is not None and func is not _DEFAULT and func is not checkpoint:
                return func
    return None


def _set(module: nn.Module, on: bool, func=None) -> None:
    """Checkpointing on or off; ``func`` (on) is a Hugging Face layer's checkpoint function, which stays as it is
    without one."""
    if _is_hf_layer(module):
        module.gradient_checkpointing = on
        if on and func is not None:
            module._gradient_checkpointing_func = func
        return
    if on and not hasattr(module, _WRAPPED):
        forward = module.forward

        @functools.wraps(forward)
        def checkpointed(*args, **kwargs):
            if module.training and torch.is_grad_enabled():
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)

        setattr(module, _WRAPPED, forward)
        module.forward = checkpointed
    elif not on and hasattr(module, _WRAPPED):
        module.forward = getattr(module, _WRAPPED)
        delattr(module, _WRAPPED)


@contextlib.contextmanager
def disabled(module: nn.Module):
    """``module`` runs without checkpointing inside the block (the memory probe measures both ways itself)."""
    hf = _is_hf_layer(module) and module.gradient_checkpointing
    wrapped = hasattr(module, _WRAPPED)
    _set(module, False)
    try:
        yield
    finally:
        if hf or wrapped:
            _set(module, True)


def apply(layer_modules: list, k: int, keep_own: bool = False) -> None:
    """Checkpoint ``k`` layer units (each a list of modules), not the others: the first ``k``, or with ``keep_own``
    those the model checkpoints already where they are ``k`` (a pattern such as HF's ``every_n_layers``). Every
    Hugging Face layer it checkpoints runs the checkpoint function the model was given, where it was given one."""
    own = set(checkpointed_units(layer_modules))
    units = own if keep_own and len(own) == k else set(range(k))
    func = model_function(layer_modules) or _DEFAULT
    for i, mods in enumerate(layer_modules):
        for m in mods:
            _set(m, i in units, func)
