"""Activation memory measured on the model's own code (docs/design.md §8).

Activation memory depends on what the model's code keeps for backward (HF LLaMA upcasts its norms to
fp32, SwiGLU keeps several intermediates, the loss upcasts the logits), so the planner measures it rather
than assuming it. For one micro-batch of the real shape:

1. the model runs up to its first layer unit, whose inputs (hidden states, position embeddings, masks) are
   captured;
2. that layer runs forward and backward on them, plain and under ``torch.utils.checkpoint``: what it saves
   for backward (counted by ``saved_tensors_hooks``, each storage once, parameters excluded) and, on a
   GPU, the extra peak of its backward;
3. the model runs with every layer unit replaced by the identity: what the rest (embedding, final norm,
   logits, the loss's fp32 copies and their gradients) costs at its peak;
4. on a GPU, that layer's forward and backward is timed (``ActivationProfile.timed``): the rate the solver
   prices compute at (``plan.context.compute_for``), so what it says the backward and forward hide is this
   device's, not a cluster model's assumed share of the peak.

Values do not matter, shapes and code do: a unit built on the meta device is materialised empty for the
probe and returned to meta. Parameter gradients are dropped as soon as autograd produces them (what
remains is the transient of computing one, as in training, where they go to the G accumulator).
Without a GPU the peaks cannot be read; the transients are then taken as one layer's saved bytes and the
head's saved bytes once more (the source says "saved-tensors").
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import torch
from torch import nn

from ... import comm
from ...plan import PlanError
from ...plan.memory import ActivationProfile, fitted
from ...plan.model import from_hf_config
from ...version import __version__
from ..step import recompute, tiling


class _Captured(Exception):
    pass


class _Ledger:
    """Bytes of the distinct storages autograd saves for backward, parameters and ``exclude`` left out."""

    def __init__(self, exclude):
        self.seen = {t.untyped_storage().data_ptr() for t in exclude}
        self.bytes = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.seen and t.device.type != "meta":
            self.seen.add(ptr)
            self.bytes += t.untyped_storage().nbytes()
        return t


@contextlib.contextmanager
def _saved(ledger: _Ledger):
    with torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t):
        yield


@contextlib.contextmanager
def _drop_param_grads(module: nn.Module):
    """Each parameter gradient freed the moment autograd has made it; ``.grad`` restored afterwards."""
    params = [p for p in module.parameters() if p.requires_grad]
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    handles = [p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None)) for p in params]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, saved):
            p.grad = g


class _Peak:
    """Allocated bytes above the start, now and at the peak (GPU); zeros elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)

    def now(self) -> int:
        return torch.cuda.memory_allocated() - self.base if self.cuda else 0

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated() - self.base if self.cuda else 0


def _tensors(obj) -> list:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _capture_layer_inputs(model: nn.Module, layer: nn.Module, batch: dict) -> tuple:
    """(args, kwargs) of ``layer``'s first call in a forward of ``model`` on ``batch`` (stops there)."""
    box = {}

    def hook(mod, args, kwargs):
        box["call"] = (args, kwargs)
        raise _Captured

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad(), contextlib.suppress(_Captured):
            model(**batch)
    finally:
        handle.remove()
    if "call" not in box:
        raise RuntimeError(f"memory probe: {type(layer).__name__} was not called by the model's forward")
    return box["call"]


CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "layer_past")  # HF's names for a KV cache


def _is_cache(value) -> bool:
    """A Hugging Face KV cache object (``transformers.cache_utils.Cache``), however the layer is handed it."""
    return any(c.__name__ == "Cache" and c.__module__.endswith("cache_utils") for c in type(value).__mro__)


def _hidden_first(args, kwargs) -> tuple:
    """The layer call with its hidden states as a fresh leaf that requires grad, and no KV cache, by keyword or
    by position (GPT-2's blocks take it second): each probe run would append its keys and values to the cache
    the capture made, and the next run attend to them and backward through the run before's freed graph."""
    kwargs = {k: (None if k in CACHE_KWARGS or _is_cache(v) else v) for k, v in kwargs.items()}
    if args:
        x = args[0].detach().clone().requires_grad_(True)
        return x, (x,) + tuple(None if _is_cache(a) else a for a in args[1:]), kwargs
    x = kwargs["hidden_states"].detach().clone().requires_grad_(True)
    return x, (), {**kwargs, "hidden_states": x}


def _layer_run(layer: nn.Module, args, kwargs, device, checkpointed: bool) -> tuple:
    """(saved bytes, extra peak of the backward beyond what the forward left allocated)."""
    x, a, kw = _hidden_first(args, kwargs)
    ledger = _Ledger(list(layer.parameters()) + [t for t in _tensors((a[1:], kw)) if t is not x])
    meter = _Peak(device)
    with _drop_param_grads(layer):
        with _saved(ledger):
            if checkpointed:
                out = torch.utils.checkpoint.checkpoint(layer, *a, use_reentrant=False, **kw)
            else:
                out = layer(*a, **kw)
        after_forward = meter.now()
        hidden = out if isinstance(out, torch.Tensor) else out[0]
        hidden.backward(torch.ones_like(hidden))
    return ledger.bytes, max(0, meter.peak() - after_forward), type(out)


class _Identity:
    """A layer's forward replaced by passing its hidden states through, in the layer's output structure."""

    def __init__(self, out_type):
        self.out_type = out_type

    def __call__(self, *args, **kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        return x if self.out_type is torch.Tensor or issubclass(self.out_type, torch.Tensor) else (x,)


def _head_run(model: nn.Module, layers: list, batch: dict, device, out_type) -> tuple:
    """(saved bytes, peak) of the model with every layer unit an identity: what lies outside the layers."""
    originals = [m.__dict__.get("forward") for m in layers]
    for m in layers:
        m.forward = _Identity(out_type)
    ledger = _Ledger(list(model.parameters()))
    meter = _Peak(device)
    try:
        with _drop_param_grads(model):
            with _saved(ledger):
                out = model(**batch)
            loss = out["loss"] if isinstance(out, dict) or hasattr(out, "keys") else out[0]
            loss.backward()
    finally:
        for m, f in zip(layers, originals):
            if f is None:
                del m.forward
            else:
                m.forward = f
    return ledger.bytes, meter.peak()


@contextlib.contextmanager
def _materialised(model: nn.Module, layers: list, device: torch.device):
    """What the probe runs (everything but layer units 1..N-1) gets empty storage on ``device`` where it is
    on the meta device (a model built under lins_ds.init); the meta parameters are put back afterwards."""
    skip = {id(m) for layer in layers[1:] for m in layer.modules()}
    params = [(m, n, p) for m in model.modules() if id(m) not in skip for n, p in m._parameters.items()
              if p is not None and p.is_meta]
    buffers = [(m, n, b) for m in model.modules() if id(m) not in skip for n, b in m._buffers.items()
               if b is not None and b.is_meta]
    real: dict = {}
    for m, n, p in params:  # tied parameters share one stand-in
        if id(p) not in real:
            real[id(p)] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)
        m._parameters[n] = real[id(p)]
    for m, n, b in buffers:
        m._buffers[n] = torch.zeros_like(b, device=device)
    try:
        yield
    finally:
        for m, n, p in params:
            m._parameters[n] = p
        for m, n, b in buffers:
            m._buffers[n] = b


HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called")


@contextlib.contextmanager
def _without_hooks(model: nn.Module):
    """The top module's forward hooks (DeepSpeed's engine prologue, among others) set aside: the probe measures
    the model's own code, before the engine is complete."""
    saved = {name: dict(getattr(model, name)) for name in HOOK_DICTS if hasattr(model, name)}
    for name in saved:
        getattr(model, name).clear()
    try:
        yield
    finally:
        for name, items in saved.items():
            getattr(model, name).update(items)


def probe(model: nn.Module, layers: list, micro_batch: int, seq_len: int, vocab: int,
          device: torch.device, time_layer: bool = True) -> ActivationProfile:
    """Measure ``model`` (a causal LM taking ``input_ids`` and ``labels``) whose layer units are ``layers``, at
    ``seq_len`` and at half of it, and split each term into its linear and quadratic parts in the length
    (``plan.memory.fitted``): eager attention keeps seq x seq tensors, and a re-size for a longer batch must grow
    them as the square of the length, not linearly. A length whose logits would not fit beside what the device holds
    already is measured at the longest half, quarter, ... that does (``probe_length``): the fitted profile scales to
    the length asked for, as it does for every re-size. ``time_layer`` (on a GPU): time one layer's forward and
    backward (``ActivationProfile.timed``); not where the GEMMs run in another dtype than the parameters (DeepSpeed's
    torch_autocast, which the probe runs outside of)."""
    seq_len = probe_length(seq_len, micro_batch, vocab, device)
    at_full = _probe_once(model, layers, micro_batch, seq_len, vocab, device, time_layer)
    half = seq_len // 2
    if half < SHORTEST_FIT_SEQ:
        return at_full
    return fitted(at_full, _probe_once(model, layers, micro_batch, half, vocab, device, time_layer=False))


SHORTEST_FIT_SEQ = 8  # below this the two lengths are too close to constant buffers to split the terms
HEAD_BYTES_PER_LOGIT = 2 + 4 + 4 + 4  # the logits (bf16), the loss's fp32 copy, its log-softmax and their gradient
PROBE_SHARE = 0.5  # of the device memory free, what the probe's head may take


def probe_length(seq_len: int, micro_batch: int, vocab: int, device: torch.device) -> int:
    """The length the probe measures at: ``seq_len``, halved while the head's seq x vocab tensors at that length
    would take more than ``PROBE_SHARE`` of the device memory free now (a 64k-token Llama-3 head needs 31 GiB for the
    loss's fp32 copy alone: the probe itself ran out of memory where the plan it was measuring for fits)."""
    if device.type != "cuda":
        return seq_len
    free = torch.cuda.mem_get_info(device)[0]
    length = seq_len
    while length // 2 >= 2 * SHORTEST_FIT_SEQ and micro_batch * length * vocab * HEAD_BYTES_PER_LOGIT > PROBE_SHARE * free:
        length //= 2  # the fit needs this length and its half, both above SHORTEST_FIT_SEQ
    return length


def _probe_once(model: nn.Module, layers: list, micro_batch: int, seq_len: int, vocab: int,
                device: torch.device, time_layer: bool = True) -> ActivationProfile:
    tokens = torch.randint(0, vocab, (micro_batch, seq_len), device=device)
    batch = {"input_ids": tokens, "labels": tokens}
    was_training = model.training
    model.train()
    try:
        with _without_hooks(model), _materialised(model, layers, device), recompute.disabled(layers[0]):
            args, kwargs = _capture_layer_inputs(model, layers[0], batch)
            s, t, out_type = _layer_run(layers[0], args, kwargs, device, checkpointed=False)
            s_ckpt, _, _ = _layer_run(layers[0], args, kwargs, device, checkpointed=True)
            timed = ((_layer_seconds(layers[0], args, kwargs), micro_batch * seq_len, seq_len)
                     if device.type == "cuda" and time_layer else ())
            del args, kwargs
            head_saved, head_peak = _head_run(model, layers, batch, device, out_type)
            tiled = _tiled_head(model, layers, batch, device, out_type) if device.type == "cuda" else ()
    finally:
        model.train(was_training)
    if device.type != "cuda":  # no peaks to read: one layer's saved bytes of workspace, the head's twice
        t, head_peak = s, 2 * head_saved
    source = f"measured:{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'saved-tensors'}"
    return ActivationProfile(source, micro_batch * seq_len, float(s), float(s_ckpt), float(t), float(head_peak),
                             seq_len=seq_len, tiled_head=tiled, timed=timed)


TIMED_RUNS = 3  # one layer's forward + backward timed this many times (after the two runs above warmed it): the median


def _layer_seconds(layer: nn.Module, args, kwargs) -> float:
    """One layer unit's forward and backward (no checkpoint) on the GPU, in seconds: the median of ``TIMED_RUNS``
    between CUDA events. The solver prices compute at this rate (``plan.context.compute_for``): the recompute, what
    hides communication and the host's update."""
    times = []
    for _ in range(TIMED_RUNS):
        x, a, kw = _hidden_first(args, kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with _drop_param_grads(layer):
            start.record()
            out = layer(*a, **kw)
            hidden = out if isinstance(out, torch.Tensor) else out[0]
            hidden.backward(torch.ones_like(hidden))
            end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
        del x, a, kw, out, hidden
    return sorted(times)[len(times) // 2]


TILE_COUNTS = (2, 4)  # the logits tilings the probe measures the head under, to split a tile's bytes from the rest


def _tiled_head(model: nn.Module, layers: list, batch: dict, device, out_type) -> tuple:
    """The head under logits tiling (``ActivationProfile.tiled_head``): its peak at two tile counts, H(t) = B + W +
    N x vocab x b / t over N tokens, gives b, the bytes per logit of one tile, and B, what grows with the tokens
    alone; W, the lm_head gradient the tiles accumulate, is the planner's (``plan.memory.tiled_head_bytes``). ()
    where the model cannot be tiled, or its tiled head fails to run here (out of memory): the planner then uses its
    constant. A tiling the model has is put back."""
    if tiling.unsupported(model):
        return ()
    had = tiling.tiling_of(model)
    peaks = []
    try:
        for tiles in TILE_COUNTS:
            tiling.apply_tiling(model, 1, tiles)
            peaks.append(_head_run(model, layers, batch, device, out_type)[1])
    except (RuntimeError, TypeError, ValueError):  # torch.OutOfMemoryError is a RuntimeError
        return ()
    finally:
        tiling.remove_tiling(model)
        if had is not None:
            tiling.apply_tiling(model, had.mlp_tiles, had.logits_tiles)
    return tiled_terms(peaks, batch["input_ids"].numel(), model.get_output_embeddings().weight)


def tiled_terms(peaks: list, tokens: int, head_weight: torch.Tensor) -> tuple:
    """(B, b) from the head's peaks at ``TILE_COUNTS`` (``_tiled_head``), each at least 0."""
    (t1, h1), (t2, h2) = zip(TILE_COUNTS, peaks)
    vocab = head_weight.shape[0]
    per_logit = max(0.0, (h1 - h2) / (tokens * vocab * (1 / t1 - 1 / t2)))
    weight_grad = head_weight.numel() * head_weight.element_size()
    base = max(0.0, h2 - weight_grad - tokens * vocab * per_logit / t2)
    return (float(base), float(per_logit))


def cache_key(model: nn.Module, micro_batch: int, seq_len: int, device: torch.device, time_layer: bool = True) -> dict:
    """What the measurement depends on: the model's code and shapes, dtype, batch, device and versions."""
    import transformers  # its version changes the model's code

    cfg = getattr(model, "config", None)
    try:
        shape = json.dumps(from_hf_config(cfg.to_dict(), "").to_json(), sort_keys=True)
    except (AttributeError, PlanError):
        shape = repr(model)
    return {"model": type(model).__name__, "shape": hashlib.sha256(shape.encode()).hexdigest()[:16],
            "attention": str(getattr(cfg, "_attn_implementation", None)),
            "dtype": str(next(model.parameters()).dtype), "micro_batch": micro_batch, "seq_len": seq_len,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "lins_ds": __version__,
            "fit": "linear+quadratic in the length; tiled head at 2 and 4 tiles; one layer timed",  # older: not reused
            "timed": bool(time_layer and device.type == "cuda")}


def cache_path(key: dict, directory: str) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(directory, f"memory-{digest}.json")


def obtain(model: nn.Module, layers: list, micro_batch: int, seq_len: int, vocab: int, device: torch.device,
           cache_dir: str, log=print, time_layer: bool = True) -> ActivationProfile:
    """Rank 0's cached measurement for this model and batch, else measured now by rank 0 and cached; every
    rank returns rank 0's profile, so every rank plans alike."""
    found = None
    if comm.rank() == 0:
        key = cache_key(model, micro_batch, seq_len, device, time_layer)
        path = cache_path(key, cache_dir)
        found = _read(path, key)
        if found is None:
            found = probe(model, layers, micro_batch, seq_len, vocab, device, time_layer).to_json()
            failed = _write(path, key, found)
            log(f"lins memory profile: {found['source']}, " + (f"saved {path}" if failed is None else
                f"warning: not cached ({failed}); lins.profile_cache names a writable directory"))
        else:
            log(f"lins memory profile: cache hit {path}")
    return ActivationProfile.from_json(comm.broadcast_object(found))


def _read(path: str, key: dict):
    try:
        with open(path) as f:
            obj = json.load(f)
        return obj["profile"] if obj.get("key") == key else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(path: str, key: dict, profile: dict):
    """The measurement cached; the reason it could not be (nothing raised), or None."""
    from ...profiler.cache import write_json_atomically

    return write_json_atomically(path, {"key": key, "profile": profile})
