"""Giving values to a model built without them (docs/design.md §10).

A model built under ``lins_ds.init`` (or on ``torch.device("meta")``) has its parameters on the meta
device. The runtime materialises it one unit at a time: the unit's flat buffer is allocated on the device,
its meta parameters are replaced in the model by parameters that are views into it, each module that owns a parameter without a checkpoint source runs its own initialisation
(Hugging Face's ``_init_weights``, else ``reset_parameters``) under a generator seeded by (seed, module
name), parameters read from a checkpoint get this rank's P chunk only, and the rest of the buffer is freed.

So the initial values depend on the seed and the module names alone: the same for every plan and world
size, and every rank computes the same values for the chunks it keeps. ``Materializer.value`` computes one
parameter's whole value ahead of that (a deferred model's ``state_dict`` read before ``deepspeed.initialize``).

``agree`` runs at engine start-up on every rank, before anything depends on it: whether the model was built without
values must be the same on every rank (DeepSpeed broadcasts a model that has values, and the runtime builds one that
has none unit by unit: ranks that differ would issue different collectives). Ranks that decided alone (a Lins
``TrainingArguments``' ``from_pretrained`` decides on each rank from its host's free memory) may differ; then the
ranks that hold values defer them too, keeping those values as the parameters' sources.
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


class InMemory:
    """A source already read (a converted checkpoint tensor, PEFT's adapter values, a rank's own eager values)."""

    def __init__(self, t: torch.Tensor):
        self.t = t.detach().reshape(-1)

    def read(self, a: int, b: int) -> torch.Tensor:
        return self.t[a:b]

    def full(self) -> torch.Tensor:
        return self.t


def replace(where: dict, old: nn.Parameter, new: nn.Parameter) -> None:
    """Register ``new`` wherever ``old`` is (the Parameter objects change: DeepSpeed keeps weak references to
    the originals, which forbid swapping them in place)."""
    for m, name in where.get(id(old), []):
        m._parameters[name] = new


class Materializer:
    """Remembers, before anything is replaced, what each meta parameter needs: its name, owning module,
    seed and checkpoint source; then fills units as the runtime builds them."""

    def __init__(self, model: nn.Module, device: torch.device, default_seed: Optional[int] = None,
                 init: str = "eager", prefix: str = ""):
        """``init``: "eager" gives a parameter whose eager initialisation was recorded (lins_ds.init) exactly those
        values; "per_module" (and any parameter without a usable record) its module's own initialisation under a
        seed of (seed, module name). ``prefix``: ``model``'s name in the model the engine will get (a PEFT model
        wraps it): the module names the seeds are made of."""
        self.model, self.device, self.prefix = model, device, prefix
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
            temps = self._on_temporaries(owner, [s.param for s in by_owner[owner]], unit.dtype, self.initialise)
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
        self._run_init(owner)

    def _run_init(self, owner: str) -> None:
        module = self.modules[owner]
        name = self.prefix + owner if owner else self.prefix.rstrip(".")
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(module_seed(self.seed, name))
            _init_module(self.model, module, owner or type(module).__name__)

    def value(self, param: nn.Parameter) -> torch.Tensor:
        """The whole value the runtime will give ``param`` (meta), computed now as a new tensor on the device: read
        from its source, else its module's initialisation run on temporaries (the model is left as it was)."""
        _, owner, source = self.info[id(param)]
        if source is not None:
            return source.read(0, param.numel()).reshape(param.shape).to(param.dtype, copy=True)
        params = [p for p in self.modules[owner]._parameters.values()
                  if p is not None and p.is_meta and self.info.get(id(p), (None,) * 3)[2] is None]
        return self._on_temporaries(owner, params, None, self._run_init)[id(param)].detach()

    def _on_temporaries(self, owner: str, params: list, dtype, run) -> dict:
        """``run(owner)`` (its module's initialisation) with ``params`` (meta) replaced wherever they are by empty
        tensors on the device (``dtype``, else each one's own), put back afterwards: id(param) -> its temporary."""
        temps = {id(p): nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device=self.device),
                                     requires_grad=p.requires_grad) for p in params}
        places = [(m, n, p) for p in params for m, n in self.where.get(id(p), [])]
        for m, n, p in places:
            m._parameters[n] = temps[id(p)]
        try:
            run(owner)
        finally:
            for m, n, p in places:
                m._parameters[n] = p
        return temps

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


# --- engine start-up: every rank builds the model the same way ------------------------------------------------
def agree(model: nn.Module, init: str = "eager") -> None:
    """At engine start-up, on every rank, before anything depends on it: make ``is_deferred(model)`` the same on
    every rank. Where only some ranks built the model without values (each rank of a Lins ``TrainingArguments``
    decides alone in ``from_pretrained``, from its host's free memory), the others defer theirs: each parameter
    becomes meta (the same object: optimizers that hold it keep it) with its values as its source, so every rank
    starts from the same values without a broadcast. A parameter that a deferred rank initialises (no checkpoint
    source: a key the checkpoint lacks) is initialised on every rank as there (its module's initialisation, the
    deferred ranks' seed). Models that differ (a whole copy resized, say) raise the same error on every rank."""
    import torch.distributed as tdist

    from ... import comm

    if not (tdist.is_available() and tdist.is_initialized()) or comm.world_size() == 1:
        return
    deferred = is_deferred(model)
    if comm.max_over_world_cpu(int(deferred)) == -comm.max_over_world_cpu(-int(deferred)):
        return  # the same on every rank (two small CPU all-reduces)
    mat = Materializer(model, torch.device("cpu"), init=init) if deferred else None
    mine = (_signature(model), sorted(n for n, _, s in mat.info.values() if s is None) if mat else None,
            mat.seed if mat else None)
    everyone = comm.all_gather_object(mine, cpu=True)
    ranks = {d: [r for r, (_, names, _) in enumerate(everyone) if (names is not None) == d] for d in (True, False)}
    how = (f"ranks {ranks[True]} built the model without values (lins_ds.init, a sharded load) and ranks "
           f"{ranks[False]} with them (an eager load)")
    if len({sig for sig, _, _ in everyone}) > 1:
        raise LinsConfigError(
            f"lins: {how}, and their models differ (parameter names, shapes or dtypes; resize_token_embeddings on the "
            "whole copies?). Every rank must load the same way: set lins.sharded_load to true or false")
    error = None
    if not deferred:
        initialised = set().union(*(names for _, names, _ in everyone if names is not None))
        seed = next(seed for _, names, seed in everyone if names is not None)
        try:
            _defer(model, initialised, seed)
        except RuntimeError as e:  # torch.utils.swap_tensors refuses a parameter something holds a weak reference to
            error = f"lins: {how}, and rank {comm.rank()} could not defer its copy to match: {e}"
    error = _agree_cpu(error)
    if error:
        raise LinsConfigError(error + ". Set lins.sharded_load to true or false so that every rank loads the same way")
    if comm.rank() == 0:
        print(f"lins_ds: {how}, each deciding from its host's free memory; the whole copies are deferred too, keeping "
              "their values (lins.sharded_load: true or false makes every rank load the same way)", flush=True)


def _signature(model: nn.Module) -> str:
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    return hashlib.sha256(repr(shapes).encode()).hexdigest()


def _agree_cpu(error: Optional[str]) -> Optional[str]:
    """comm.agree over the CPU group (the device may not be set yet at engine start-up)."""
    from ... import comm

    everyone = comm.all_gather_object(error, cpu=True)
    return next((e for e in everyone if e), None)


@torch.no_grad()
def _defer(model: nn.Module, initialised: set, seed: int) -> None:
    """Every parameter of ``model`` on the meta device, the same Parameter objects (``torch.utils.swap_tensors``):
    its values kept as its source, except the parameters named in ``initialised``, which get their module's
    initialisation under ``seed`` as on the ranks that built the model without values."""
    for name, p in list(model.named_parameters()):
        if p.is_meta:
            continue
        meta = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
        meta.__dict__.update(p.__dict__)  # swap_tensors swaps the attributes too: the parameter keeps its own
        values = p.detach()
        torch.utils.swap_tensors(p, meta)
        setattr(p, SEED, seed)
        if name not in initialised:
            setattr(p, SOURCE, InMemory(values))


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
