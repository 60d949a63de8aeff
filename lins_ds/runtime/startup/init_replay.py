"""Eager-identical initial values for a model built under ``lins_ds.init`` (``lins.init: "eager"``, the default).

Built eagerly, a model's parameters get their values from a sequence of in-place operations drawn from the CPU
generator: each module's ``reset_parameters`` at construction, then Hugging Face's ``_init_weights``. Under
``lins_ds.init`` the parameters are on the meta device and those operations compute nothing. This module records
them (a ``TorchDispatchMode`` over the context): per parameter, each in-place operation in order, with the
generator's state before each random one. So that everything after the build (PEFT's adapters, data shuffling)
draws what it would have drawn, every random operation is also run, as the eager build would, on a real scratch
tensor of the same shape, which is discarded: the generator ends where the eager build leaves it.

When the runtime materialises a parameter, ``Replay.read`` runs its operations again on one whole temporary of
that parameter, from the recorded generator states, and hands back the elements this rank keeps: the eager values,
one parameter whole at a time. A parameter whose initialisation reads another tensor not yet built (a copy from a
meta tensor, an explicit generator) is not replayable; it gets its module's own initialisation under a per-module
seed, as ``lins.init: "per_module"`` gives every parameter (fast, and the same for every world size).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .materialize import REPLAY

_RANDOM = {torch.ops.aten.normal_, torch.ops.aten.uniform_, torch.ops.aten.bernoulli_, torch.ops.aten.exponential_,
           torch.ops.aten.geometric_, torch.ops.aten.cauchy_, torch.ops.aten.log_normal_, torch.ops.aten.random_}
_OVERWRITE = _RANDOM | {torch.ops.aten.fill_, torch.ops.aten.zero_}  # write every element without reading any


def _key(t: torch.Tensor) -> int:
    """What every alias and view of a meta parameter shares: its storage."""
    return t.untyped_storage()._cdata


def _writes_self(func) -> bool:
    args = func._schema.arguments
    return bool(args) and args[0].alias_info is not None and args[0].alias_info.is_write


_scratch = {"buffer": None, "owner": None}  # one grow-only buffer for whole parameters, and whose values it holds


def _whole(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` in the shared scratch buffer (allocated again only when a larger one is
    needed: the allocator keeps no trail of one freed temporary per parameter)."""
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    buf = _scratch["buffer"]
    if buf is None or buf.numel() < nbytes:
        _scratch["buffer"] = buf = torch.empty(nbytes, dtype=torch.uint8)
    return buf[:nbytes].view(dtype).view(shape)


def release() -> None:
    """Free the scratch buffer (after the build's recording, and after materialisation)."""
    _scratch.update(buffer=None, owner=None)


class Replay:
    """One parameter's initialisation as the eager build ran it; ``read(a, b)`` gives its flat elements [a, b)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.ops: list = []  # (op, size, stride, offset, other args, kwargs, generator state or None)
        self.broken: Optional[str] = None

    @property
    def usable(self) -> bool:
        return bool(self.ops) and self.broken is None

    def record(self, func, target: torch.Tensor, args: tuple, kwargs: dict, state) -> None:
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in list(args) + list(kwargs.values())):
            self.broken = f"{func} reads a tensor that is not built yet"
        elif kwargs.get("generator") is not None:
            self.broken = f"{func} draws from its own generator"
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        self.ops.append((func, target.size(), target.stride(), target.storage_offset(), args, kwargs, state))

    def _live_ops(self) -> list:
        """The operations from the last one that overwrites the whole parameter on (earlier ones cannot show:
        ``reset_parameters``' Kaiming draws under ``_init_weights``' normal ones). Each random one starts from its
        own recorded generator state, so skipping the others changes nothing."""
        whole = (self.shape, torch.empty(self.shape, device="meta").stride(), 0)
        start = 0
        for i, (func, size, stride, offset, *_rest) in enumerate(self.ops):
            if func.overloadpacket in _OVERWRITE and (size, stride, offset) == whole:
                start = i
        return self.ops[start:]

    def full(self) -> torch.Tensor:
        values = _whole(self.shape, self.dtype)
        if _scratch["owner"] is self:
            return values.reshape(-1)
        _scratch["owner"] = self
        saved = torch.get_rng_state()
        try:
            for func, size, stride, offset, args, kwargs, state in self._live_ops():
                if state is not None:
                    torch.set_rng_state(state)
                func(values.as_strided(size, stride, offset), *args, **kwargs)
        finally:
            torch.set_rng_state(saved)  # the program's generator is left where it was
        return values.reshape(-1)

    def read(self, a: int, b: int) -> torch.Tensor:
        return self.full()[a:b]


class Recorder(TorchDispatchMode):
    """Records the in-place operations on the parameters ``track`` registers, and keeps the CPU generator moving as
    the eager build would. Only those: a tensor that is meta from birth (transformers' own loading builds on the
    meta device) is meta in the eager build too, and draws nothing there either."""

    def __init__(self):
        super().__init__()
        self.replays: dict = {}

    def track(self, param: torch.Tensor) -> None:
        replay = Replay(param.shape, param.dtype)
        self.replays[_key(param)] = replay
        setattr(param, REPLAY, replay)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].is_meta else None
        replay = self.replays.get(_key(target)) if target is not None and _writes_self(func) else None
        if replay is not None:  # a parameter the eager build would have made real: its operation, recorded
            random = func.overloadpacket in _RANDOM and kwargs.get("generator") is None
            state = torch.get_rng_state() if random else None
            replay.record(func, target, tuple(args[1:]), dict(kwargs), state)
            if random:  # the numbers the eager build draws here, drawn and dropped
                _scratch["owner"] = None
                func(_whole(target.size(), target.dtype), *args[1:], **kwargs)
        return func(*args, **kwargs)
