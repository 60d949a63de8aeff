"""Giving values to a model built without them (docs/design.md §10).

A model built under ``lins_ds.init`` (or on ``torch.device("meta")``) has its parameters on the meta
device. The runtime materialises it one unit at a time: the unit's flat buffer is allocated on the device,
its meta parameters are replaced in the model by parameters that are views into it, each module that owns a parameter without a checkpoint source runs its own initialisation
(Hugging Face's ``_init_weights``, else ``reset_parameters``) under a generator seeded by (seed, module
name), parameters read from a checkpoint get this rank's P chunk only, and the rest of the buffer is freed.

So the initial values depend on the seed and the module names alone: the same for every plan and world
size, and every rank computes the same values for the chunks it keeps.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import torch
from torch import nn

from ..errors import LinsConfigError

SOURCE = "_lins_source"  # a meta parameter's checkpoint source: an object with read(a, b) -> flat elements [a, b)
SEED = "_lins_seed"  # the seed a meta parameter was built under (lins_ds.init)
REPLAY = "_lins_replay"  # a meta parameter's recorded eager initialisation (integrations/init_replay.Replay)
INIT_MODES = ("eager", "per_module")


def is_deferred(module: nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def module_seed(seed: int, name: str) -> int:
    """A 63-bit seed for module ``name``: the same on every rank, plan and world size."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def owners(model: nn.Module) -> dict:
    """id(parameter) -> [(module, attribute)] for every place a parameter is registered (tied: several)."""
    out: dict = {}
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((m, name))
    return out


def replace(where: dict, old: nn.Parameter, new: nn.Parameter) -> None:
    """Register ``new`` wherever ``old`` is (the Parameter objects change: DeepSpeed keeps weak references to
    the originals, which forbid swapping them in place)."""
    for m, name in where.get(id(old), []):
        m._parameters[name] = new


class Materializer:
    """Remembers, before anything is replaced, what each meta parameter needs: its name, owning module,
    seed and checkpoint source; then fills units as the runtime builds them."""

    def __init__(self, model: nn.Module, device: torch.device, default_seed: Optional[int] = None,
                 init: str = "eager"):
        """``init``: "eager" gives a parameter whose eager initialisation was recorded (lins_ds.init) exactly those
        values; "per_module" (and any parameter without a usable record) its module's own initialisation under a
        seed of (seed, module name)."""
        self.model, self.device = model, device
        self.modules = dict(model.named_modules())
        self.where = owners(model)
        self.info: dict = {}  # id(param) -> (name, module name, checkpoint source)
        seeds = {getattr(p, SEED) for p in model.parameters() if p.is_meta and hasattr(p, SEED)}
        self.seed = seeds.pop() if len(seeds) == 1 else torch.initial_seed() if default_seed is None else default_seed
        for name, p in model.named_parameters():  # tied parameters: the first name owns them
            if p.is_meta:
                source = getattr(p, SOURCE, None)
                replay = getattr(p, REPLAY, None)
                if source is None and init == "eager" and replay is not None and replay.usable:
                    source = replay  # read like a checkpoint tensor: this rank's elements of the eager values
                self.info[id(p)] = (name, name.rsplit(".", 1)[0] if "." in name else "", source)
        self._initialised: set = set()

    def materialise(self, param: nn.Parameter, view: torch.Tensor) -> nn.Parameter:
        """A parameter that is ``view`` takes ``param``'s places in the model; it inherits what is known of it."""
        new = nn.Parameter(torch.empty(0, dtype=view.dtype, device=view.device), requires_grad=param.requires_grad)
        new.data = view  # as the eager path: storage shared with the unit's buffer, its own version counter
        replace(self.where, param, new)
        self.where[id(new)] = self.where.get(id(param), [])
        self.info[id(new)] = self.info[id(param)]
        return new

    def fill(self, unit) -> None:
        """Values for the unit's parameters that were meta (now views into ``unit.full``): initialised where
        they have no source, this rank's P chunk read where they have one."""
        slots = [s for s in unit.slots if id(s.param) in self.info]
        owners = sorted({self.info[id(s.param)][1] for s in slots if self.info[id(s.param)][2] is None})
        for owner in owners:
            self.initialise(owner)
        spec = unit.spec  # this rank keeps its P chunk (the whole unit when P is not sharded)
        lo, hi = (spec.p_start, spec.p_start + spec.p_size) if unit.sharded_p else (0, spec.padded)
        for slot, (a, b), _ in unit.slices_by_parameter(lo, hi):
            source = self.info.get(id(slot.param), (None,) * 3)[2]
            if source is not None:
                unit.full[slot.offset + a:slot.offset + b].copy_(source.read(a, b).to(unit.full.dtype))

    def fill_shard(self, unit) -> None:
        """Like ``fill`` for a unit whose P is sharded, without ever allocating the unit whole: each owning
        module gets whole temporaries, runs its initialisation, and this rank's part goes to ``unit.p_shard``."""
        by_owner: dict = {}
        for slot in unit.slots:
            info = self.info.get(id(slot.param))
            if info is not None and info[2] is None:
                by_owner.setdefault(info[1], []).append(slot)
        for owner in sorted(by_owner):
            temps = {id(s.param): nn.Parameter(torch.empty(s.shape, dtype=unit.dtype, device=self.device),
                                               requires_grad=s.param.requires_grad) for s in by_owner[owner]}
            places = [(m, n, p) for p in (s.param for s in by_owner[owner]) for m, n in self.where.get(id(p), [])]
            for m, n, p in places:
                m._parameters[n] = temps[id(p)]
            try:
                self.initialise(owner)
            finally:
                for m, n, p in places:
                    m._parameters[n] = p
            for s in by_owner[owner]:
                unit.p_shard_write(s, temps[id(s.param)].detach().reshape(-1))
        lo, hi = unit.spec.p_start, unit.spec.p_start + unit.spec.p_size
        for slot, (a, b), (s, e) in unit.slices_by_parameter(lo, hi):
            source = self.info.get(id(slot.param), (None,) * 3)[2]
            if source is not None:
                unit.p_shard[s:e].copy_(source.read(a, b).to(unit.dtype))

    def initialise(self, owner: str) -> None:
        """Run module ``owner``'s own initialisation under its seed, once."""
        if owner in self._initialised:
            return
        self._initialised.add(owner)
        module = self.modules[owner]
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, owner))
            _init_module(self.model, module, owner or type(module).__name__)

    def materialise_buffers(self) -> None:
        """Buffers on the meta device (a model built on torch.device("meta")): allocated on the device and
        recomputed by their module's initialisation (HF's rotary embeddings recompute inv_freq)."""
        for owner, m in self.modules.items():
            meta = [n for n, b in m._buffers.items() if b is not None and b.is_meta]
            for n in meta:
                m._buffers[n] = torch.zeros_like(m._buffers[n], device=self.device)
            if meta:
                self.initialise(owner)

    def materialise_whole(self, param: nn.Parameter) -> None:
        """A parameter outside every unit (frozen): whole, on the device, initialised or read."""
        name, owner, source = self.info[id(param)]
        new = self.materialise(param, torch.empty(param.shape, dtype=param.dtype, device=self.device))
        if source is not None:
            with torch.no_grad():
                new.copy_(source.read(0, param.numel()).view(param.shape).to(param.dtype))
        else:
            self.initialise(owner)


def _hf_owner(model: nn.Module, module: nn.Module):
    """The Hugging Face PreTrainedModel whose ``_init_weights`` applies to ``module`` (the model itself)."""
    return model if hasattr(model, "_init_weights") and hasattr(model, "config") else None


def _init_module(model: nn.Module, module: nn.Module, name: str) -> None:
    hf = _hf_owner(model, module)
    if hf is not None:
        guard = _hf_init_guard()
        with guard():
            hf._init_weights(module)
        return
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
        return
    raise LinsConfigError(f"lins: module {name} ({type(module).__name__}) was built on the meta device and has "
                          "neither reset_parameters() nor a Hugging Face _init_weights to give it values; build it "
                          "outside lins_ds.init, or load it from a checkpoint")


def _hf_init_guard():
    """transformers' guard that keeps tensors flagged as loaded untouched by init functions (if it has one)."""
    import contextlib

    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:
        return contextlib.nullcontext
    return guard_torch_init_functions
