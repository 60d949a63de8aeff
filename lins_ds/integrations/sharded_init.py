"""``lins_ds.init``: build (or load) a model so that no rank ever holds all of it (docs/design.md §10).

Inside the context every parameter a module registers is replaced by one on the meta device (nothing is
allocated or initialised; buffers stay real) and tagged with the seed of the moment. ``deepspeed.initialize``
with a ``lins`` config then materialises the model unit by unit (``runtime/startup/materialize.py``): each module's own
initialisation under a per-module seed, so the initial values are the same for every plan and world size.

``from_pretrained`` inside the context reads nothing: transformers' loader (``core_model_loading``) is
patched for the duration so that each checkpoint tensor stays a lazy safetensors slice attached to its meta
parameter; the runtime later reads only the rows of the elements this rank keeps. The Hugging Face Trainer
form: a live ``TrainingArguments(deepspeed=...)`` whose config has a ``lins`` block makes ``from_pretrained``
and ``from_config`` enter this context by themselves, as transformers does for ZeRO-3, where the model's whole copies
do not fit the host. That decision is each rank's own (no collective: one rank may load a model alone, for an
evaluation); ``deepspeed.initialize`` makes the ranks agree (``runtime/startup/materialize.agree``).

A model ``from_pretrained`` builds without values has a readable ``state_dict()``: each entry is computed when it is
first used (its checkpoint rows read, or its initialisation run), one tensor at a time, with the values
``deepspeed.initialize`` will give it (TRL hashes the model before precomputing its reference log-probs).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from typing import Optional

import psutil
import torch
from torch import nn
from torch.utils._pytree import tree_map

import lins_ds_autoload

from ..runtime.config import LinsConfigError, lins_block, parse_lins_config
from ..runtime.startup.materialize import SEED, SOURCE, InMemory, Materializer, is_deferred
from ..runtime.startup.init_replay import Recorder, release

_depth = 0  # nesting of init contexts (from_pretrained called inside one enters none)
_modes: list = []  # lins.init of each open init context, innermost last
_paused = 0  # nesting of paused() blocks: parameters registered inside keep their values


def active() -> bool:
    return _depth > 0


@contextlib.contextmanager
def paused():
    """Inside an init context, modules built in this block keep real parameters (PEFT's adapters: their values
    come from PEFT's own initialisation, and PEFT moves them to the meta device itself)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


class LazySlice:
    """A checkpoint tensor not read yet: a safetensors slice (rows are read on demand)."""

    def __init__(self, sl):
        self.sl, self.shape = sl, torch.Size(sl.get_shape())

    def read(self, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the row-major flattening, reading only the rows they touch."""
        if len(self.shape) == 0:
            return self.sl[...].reshape(-1)[a:b]
        row = self.shape.numel() // self.shape[0] if self.shape[0] else 1
        r0, r1 = a // row, math.ceil(b / row)
        return self.sl[r0:r1].reshape(-1)[a - r0 * row:b - r0 * row]

    def full(self) -> torch.Tensor:
        return self.sl[...]


def _load_config(config) -> Optional[dict]:
    if config is None or isinstance(config, dict):
        return config
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return load_ds_config(config)


@contextlib.contextmanager
def init(config=None, seed: Optional[int] = None):
    """Build models inside without materialising their parameters (``lins_ds.init(config=ds_config)``).

    ``config``: the DeepSpeed config (dict or path) that ``deepspeed.initialize`` will get; its ``lins`` block
    is validated now. ``seed``: the initial values' seed (default: torch's current seed)."""
    global _depth
    cfg = _load_config(config)
    mode = "eager"
    if cfg is not None:
        block = lins_block(cfg)
        if block is None:
            raise LinsConfigError("lins_ds.init: the config has no enabled \"lins\" block; it is for Lins configs")
        mode = parse_lins_config(block).init
    seed = torch.initial_seed() if seed is None else seed
    recorder = Recorder() if mode == "eager" and _depth == 0 else None  # the outermost context records

    def to_meta(module, name, param):
        if param is None or _paused:
            return None
        if param.is_meta:
            if not hasattr(param, SEED):
                setattr(param, SEED, seed)
            return None
        meta = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        setattr(meta, SEED, seed)
        if recorder is not None:
            recorder.track(meta)
        return meta

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    _depth += 1
    _modes.append(mode)
    try:
        with _deferred_hf_loading(), recorder or contextlib.nullcontext():
            yield
    finally:
        _depth -= 1
        _modes.pop()
        handle.remove()
        release()


@contextlib.contextmanager
def _deferred_hf_loading():
    """While active, transformers' from_pretrained attaches lazy slices to meta parameters instead of reading."""
    try:
        import transformers.core_model_loading as cml
    except ImportError:
        yield
        return
    expected = ("model", "target_name", "param_value", "loading_info", "hf_quantizer")
    if tuple(inspect.signature(cml.set_param_for_module).parameters)[:5] != expected:
        raise LinsConfigError("lins_ds.init: this transformers version's loader (core_model_loading.set_param_for_module) "
                              "is not the one lins_ds patches; call from_pretrained outside lins_ds.init")
    spawn, materialize_tensors, set_param = cml.spawn_materialize, cml.WeightConverter.materialize_tensors, \
        cml.set_param_for_module

    def lazy_spawn(thread_pool, tensor, device=None, dtype=None, sharding_op=None, tensor_idx=None):
        if sharding_op is None and not isinstance(tensor, torch.Tensor) and hasattr(tensor, "get_shape"):
            lazy = LazySlice(tensor)
            return lambda: lazy  # HF calls it when it wants the tensor: nothing is read
        return spawn(thread_pool, tensor, device, dtype, sharding_op=sharding_op, tensor_idx=tensor_idx)

    def real_tensors(self):  # converters (fused or split weights) need whole tensors
        out = materialize_tensors(self)
        return {k: [t.full() if isinstance(t, LazySlice) else t for t in v] for k, v in out.items()}

    @torch.no_grad()
    def attach(model, target_name, param_value, loading_info, hf_quantizer):
        ref = model.get_parameter(target_name)
        if hf_quantizer is not None or not ref.is_meta:
            value = param_value.full() if isinstance(param_value, LazySlice) else param_value
            return set_param(model, target_name, value, loading_info, hf_quantizer)
        loading_info.missing_keys.discard(target_name)
        if tuple(param_value.shape) != tuple(ref.shape):
            loading_info.mismatched_keys.add((target_name, tuple(param_value.shape), tuple(ref.shape)))
            return
        src = param_value if isinstance(param_value, LazySlice) else _InMemory(param_value)
        setattr(ref, SOURCE, src)
        ref._is_hf_initialized = True  # transformers' missing-key initialisation leaves it alone

    cml.spawn_materialize, cml.WeightConverter.materialize_tensors, cml.set_param_for_module = \
        lazy_spawn, real_tensors, attach
    kernels = _no_kernels_on_meta()
    try:
        yield
    finally:
        cml.spawn_materialize, cml.WeightConverter.materialize_tensors, cml.set_param_for_module = \
            spawn, materialize_tensors, set_param
        kernels()


def _no_kernels_on_meta():
    """transformers (5.25 on) kernelizes every loaded model, and the kernels library refuses the meta device: a
    model built without values loads unkernelized (its layers run their own forward). Returns the undo."""
    from transformers.modeling_utils import PreTrainedModel

    real = inspect.getattr_static(PreTrainedModel, "set_use_kernels", None)
    if real is None:
        return lambda: None

    def set_use_kernels(self, use_kernels, *args, **kwargs):
        if use_kernels and any(p.is_meta for p in self.parameters()):
            use_kernels = False
        return real(self, use_kernels, *args, **kwargs)

    PreTrainedModel.set_use_kernels = set_use_kernels

    def undo():
        PreTrainedModel.set_use_kernels = real
    return undo


_InMemory = InMemory  # a source already read (a converted tensor; PEFT's adapter values)


# --- a deferred model's state_dict: each entry computed when used -----------------------------------------------
class ReadOnUse(torch.Tensor):
    """A deferred parameter's entry in ``state_dict()``: a meta tensor of its shape and dtype whose every use
    (``.cpu()``, ``.to(...)``, ``copy_`` into another tensor, arithmetic) first computes its whole value on the host,
    the value ``deepspeed.initialize`` will give it. Nothing keeps it: a reader going through the entries holds one
    parameter at a time (TRL's ``hash_module``)."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, compute):
        t = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device="meta")
        t._compute = compute
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def real(x):
            return x._compute() if isinstance(x, ReadOnUse) else x
        return func(*tree_map(real, args), **tree_map(real, kwargs or {}))

    def __repr__(self) -> str:
        return f"ReadOnUse(shape={tuple(self.shape)}, dtype={self.dtype})"


def readable_state_dict(model: nn.Module, mode: str) -> None:
    """``model.state_dict()`` (and that of every model that wraps it: PEFT's) gives ``ReadOnUse`` entries for its
    meta parameters. ``mode``: the config's ``lins.init``."""
    if getattr(model, "_lins_readable", False):
        return

    def entries_on_use(module, state_dict, prefix, local_metadata):
        mat = None
        for name, p in module.named_parameters(remove_duplicate=False):
            key = prefix + name
            if not p.is_meta or key not in state_dict or state_dict[key] is p:  # keep_vars: the parameters asked for
                continue
            if mat is None:  # the seeds of initialised parameters are made of their names in the root model
                mat = Materializer(module, torch.device("cpu"), init=mode, prefix=prefix)
            if id(p) in mat.info:
                state_dict[key] = ReadOnUse(p, functools.partial(mat.value, p))

    model.register_state_dict_post_hook(entries_on_use)
    model._lins_readable = True


# --- the Hugging Face Trainer form: TrainingArguments(deepspeed=lins config) before from_pretrained ------------
def _hf_lins_config() -> Optional[dict]:
    """The config of a live HfDeepSpeedConfig (what TrainingArguments(deepspeed=...) holds) if it is a Lins one."""
    try:
        from transformers.integrations.deepspeed import deepspeed_config
    except ImportError:
        return None
    cfg = deepspeed_config()
    return cfg if isinstance(cfg, dict) and lins_block(cfg) is not None else None


def _entering(fn):
    def wrapper(cls, *args, **kwargs):
        if active():  # inside lins_ds.init: built without values, its state_dict readable
            model = fn(cls, *args, **kwargs)
            if isinstance(model, nn.Module) and is_deferred(model):
                readable_state_dict(model, _modes[-1])
            return model
        cfg = _hf_lins_config() if lins_ds_autoload.lins_on() else None
        if cfg is None:
            return fn(cls, *args, **kwargs)
        lins = parse_lins_config(lins_block(cfg))
        if lins.sharded_load is False:
            return fn(cls, *args, **kwargs)
        rng = torch.get_rng_state()
        with init(cfg):
            model = fn(cls, *args, **kwargs)
        if lins.sharded_load is None and _fits_eagerly(model):  # a normal model: code before deepspeed.initialize
            del model                                            # may use it
            torch.set_rng_state(rng)  # drawing what a load without Lins draws (the values the meta build recorded)
            return fn(cls, *args, **kwargs)
        if isinstance(model, nn.Module):
            readable_state_dict(model, lins.init)
        return model
    wrapper._lins_patched = True
    return classmethod(wrapper)


EAGER_SHARE = 0.8  # of the host's available memory, what the ranks of a node may take for their eager copies


def _fits_eagerly(model: nn.Module) -> bool:
    """Whether every rank of this node can hold its own full copy of ``model`` (built on meta: the size is known,
    nothing is read) in the host's available memory. This rank's own answer, with no collective: ``from_pretrained``
    may run on one rank alone (an evaluation after training). Ranks that answer differently (their hosts differ, or
    a rank measured after another had loaded) are reconciled where every rank is, at ``deepspeed.initialize``
    (``runtime/startup/materialize.agree``)."""
    from .. import comm

    need = sum(p.numel() * p.element_size() for p in model.parameters()) * max(1, comm.local_world_size())
    return need <= EAGER_SHARE * psutil.virtual_memory().available


def install_hf() -> None:
    """Make PreTrainedModel.from_pretrained / _from_config build sharded when a Lins TrainingArguments is live, and
    resize_token_embeddings refuse a model built without values, naming the way out."""
    from transformers.modeling_utils import PreTrainedModel

    for name in ("from_pretrained", "_from_config"):
        fn = inspect.getattr_static(PreTrainedModel, name)
        if isinstance(fn, classmethod) and not getattr(fn.__func__, "_lins_patched", False):
            setattr(PreTrainedModel, name, _entering(fn.__func__))
    resize = PreTrainedModel.resize_token_embeddings
    if not getattr(resize, "_lins_patched", False):
        def resize_token_embeddings(self, *args, **kwargs):
            if any(p.is_meta and (hasattr(p, SEED) or hasattr(p, SOURCE)) for p in self.parameters()):
                raise LinsConfigError(
                    "resize_token_embeddings: this model was built without values (lins_ds.init, or a Lins "
                    "TrainingArguments with lins.sharded_load: true), so its embeddings cannot be read here. Load it "
                    "whole (lins.sharded_load: false, or leave it null where every rank's copy fits the host), resize "
                    "it and save it once, then train from that checkpoint")
            return resize(self, *args, **kwargs)
        resize_token_embeddings._lins_patched = True
        PreTrainedModel.resize_token_embeddings = resize_token_embeddings
