"""Sequence tiling: a decoder layer's MLP, and the logits with their loss, computed a sequence tile at a time, so that
neither the seq x intermediate tensor nor the seq x vocab logits (fp32 in the loss) is ever whole (docs/design.md §8;
issue 60). Each tile's forward runs without a graph and is recomputed, tile by tile, in the backward, as DeepSpeed's
Arctic Long Sequence Training (ALST) does; the memory these tensors take falls by the tile count, the price being one
more forward of the MLP (a third under activation checkpointing) and of the lm_head matmul.

Supported (``apply_tiling``): ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``Gemma2ForCausalLM`` of transformers,
their forward not overridden by a subclass. Refused with a ``TypeError`` naming the class: any other model (a PEFT
wrapper: pass ``get_base_model()``); an ``lm_head`` that is not a plain ``nn.Linear`` (PEFT's ``modules_to_save`` or
LoRA on the head) or a ``loss_function`` other than transformers' ``ForCausalLMLoss`` (logits tiling only: the tiled
loss is that loss). ``tile_module`` tiles any module that maps each position on its own (a gate/up/down MLP, with
LoRA or dropout inside) and returns one tensor.

The MLP: the module's own forward keeps running, per tile (``tile_module`` replaces the instance's ``forward``, not the
class's, so other instances and other models are untouched, and ``untile_module`` restores it). DeepSpeed's
``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP`` (the same in 0.19.6 and 0.19.8) is not used, because its
backward runs a nested ``torch.autograd.backward`` per tile that accumulates into each parameter's ``.grad``: every
parameter's gradient hooks fire once per tile (measured: 3 calls per parameter with 3 tiles) with a partial gradient.
Lins counts a unit's gradients in by those hooks (``Unit.grad_arrived``) and reduces the unit once every parameter
has one, so a unit whose last gradients are a tiled module's (``lins.unit_modules`` naming the MLP class) would be
reduced after the first tile and lose the rest; DeepSpeed steers its own ZeRO past this with ``ds_grad_is_ready``,
which Lins does not read. Its recompute also draws new dropout masks (no RNG state is kept), so a LoRA MLP with
dropout gets gradients of a function other than the one its forward computed. Here the parameters are inputs of the
autograd function: each tile's gradient is taken with respect to detached aliases of them and summed, and autograd
accumulates the sum once, so every hook fires once per backward with the whole gradient, as without tiling. The RNG
state (CPU and the device's) and the autocast state of the forward are restored for the recompute.

The logits and loss: equal to transformers' ``ForCausalLMLoss`` — labels shifted by one (or the caller's
``shift_labels``), ``ignore_index`` (-100) left out, the sum over tokens divided by their count or by
``num_items_in_batch`` — on the lm_head's matmul in the model's dtype, Gemma-2's ``final_logit_softcapping``
(``cap * tanh(logits / cap)``, as its forward applies it) and the cast to fp32. DeepSpeed's ``TiledFusedLogitsLoss``
is not used: it computes the gradients inside the forward with an upstream gradient of 1 and in its backward scales
only the hidden states' gradient by the real one, so the lm_head weight's gradient ignores anything that scales the
loss (the division by the token count, DeepSpeed's 1 / gradient_accumulation_steps, an fp16 loss scale; measured:
24 times too large for a loss divided by 6 tokens and scaled by 0.25); and its gradients arrive during the forward,
outside any backward, where Lins' executor refuses them. Here the backward recomputes each tile's logits (one more
lm_head matmul, about 2 % of a Llama-8B step) rather than holding a vocab x hidden gradient from the forward to the
backward, which is where the step's memory peaks.

``apply_tiling`` hooks a causal LM without its training script changing: a forward pre-hook takes ``labels`` out of
the call (so transformers' forward computes no loss) and a pre-hook on ``lm_head`` captures the final hidden states and
hands the head an empty sequence (so no logits are made); a forward hook then computes the tiled loss and puts it
first in the output, as transformers does. The forward, its signature (which HF's Trainer reads) and the class are
unchanged. Tiled only where there are labels, gradients are enabled and every position is kept (``logits_to_keep``
0, the default): evaluation and generation run untouched. With logits tiling, the output's ``logits`` are empty
(batch x 0 x vocab) in those calls: a training loop that reads them (TRL's token-accuracy metric) needs it off.
In half precision a tiled parameter's gradient is a sum of per-tile partial gradients in the parameter's dtype, as
DeepSpeed's TiledMLP's is; in fp32 tiled and untiled agree within 1e-6 (``tests/test_tiling.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

_TILED = "_lins_tiled"  # on a tiled module: (tiles, the forward it had as an instance attribute; None: the class's)
_TILING = "_lins_tiling"  # on a model apply_tiling installed anything on: the Tiling


def tile_bounds(n: int, tiles: int) -> list:
    """[start, stop) of ``tiles`` tiles over ``n`` positions, sizes differing by at most one (none empty)."""
    t = max(1, min(tiles, n))
    return [(i * n // t, (i + 1) * n // t) for i in range(t)] if n else []


class _ForwardState:
    """What a tile's recompute must see as the forward saw it: the RNG states as the forward's first tile found them
    (CPU and the device's: dropout draws the same masks, tile by tile in the same order) and autocast. The forward
    itself runs as is, advancing the RNG as an untiled forward would."""

    def __init__(self, device: torch.device, keep_rng: bool):
        self.device = device
        self.cpu_rng = torch.get_rng_state() if keep_rng else None
        self.device_rng = torch.cuda.get_rng_state(device) if keep_rng and device.type == "cuda" else None
        self.autocast = (torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type))

    @contextlib.contextmanager
    def restored(self):
        """Inside: the forward's RNG and autocast state; the RNG outside is left as it was."""
        enabled, dtype = self.autocast
        devices = [self.device] if self.device_rng is not None else []
        with torch.random.fork_rng(devices=devices, enabled=self.cpu_rng is not None), \
                torch.autocast(self.device.type, dtype=dtype, enabled=enabled):
            if self.cpu_rng is not None:
                torch.set_rng_state(self.cpu_rng)
            if self.device_rng is not None:
                torch.cuda.set_rng_state(self.device_rng, self.device)
            yield


def _aliases(names: list, params: tuple) -> dict:
    """Detached leaves sharing each parameter's memory: a tile's gradient lands on them, never on the parameter
    (whose hooks fire once, when autograd accumulates the sum the function returns)."""
    return {n: p.detach().requires_grad_(True) for n, p in zip(names, params)}


class _Positionwise(nn.Module):
    """The tiled module as a child (so ``functional_call`` can swap its parameters for aliases) and the forward it
    had before tiling (called directly: calling the module would tile again)."""

    def __init__(self, module: nn.Module, run: Callable):
        super().__init__()
        self.m = module
        self.run = run

    def forward(self, x):
        return self.run(x)


def _run_tile(shim: _Positionwise, x: torch.Tensor) -> torch.Tensor:
    out = shim.run(x)
    if not torch.is_tensor(out) or out.shape[:-1] != x.shape[:-1]:
        raise TypeError(f"lins: sequence tiling of {type(shim.m).__name__}: its forward must map each position on its "
                        f"own and return one tensor of the input's leading shape; it returned {type(out).__name__}"
                        + (f" of shape {tuple(out.shape)} for {tuple(x.shape)}" if torch.is_tensor(out) else ""))
    return out


class _TiledPositionwise(torch.autograd.Function):
    """``shim``'s forward over sequence tiles of ``x`` (dim -2); parameters as inputs so their gradient is returned
    (summed over tiles) rather than accumulated tile by tile (module docstring)."""

    @staticmethod
    def forward(ctx, shim, x, bounds, state, names, *params):
        ctx.shim, ctx.bounds, ctx.state, ctx.names, ctx.params = shim, bounds, state, names, params
        ctx.save_for_backward(x)
        return torch.cat([_run_tile(shim, x[..., a:b, :]) for a, b in bounds], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        aliases = _aliases(ctx.names, ctx.params)
        named = {"m." + n: a for n, a in aliases.items()}
        gx = torch.empty_like(x) if need_x else None
        with ctx.state.restored(), torch.enable_grad():
            for a, b in ctx.bounds:
                xt = x[..., a:b, :].detach().requires_grad_(need_x)
                out = torch.func.functional_call(ctx.shim, named, (xt,), strict=False)
                inputs = ([xt] if need_x else []) + list(aliases.values())
                if inputs:
                    torch.autograd.backward(out, grad[..., a:b, :], inputs=inputs)
                if need_x:
                    gx[..., a:b, :].copy_(xt.grad)
        return (None, gx, None, None, None) + tuple(a.grad for a in aliases.values())


def _tiled_forward(shim: _Positionwise, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``shim``'s forward over ``tiles`` tiles of ``x``'s sequence (dim -2): without a graph where no gradient is
    wanted, else through ``_TiledPositionwise``."""
    bounds = tile_bounds(x.shape[-2], tiles)
    if len(bounds) <= 1:
        return shim.run(x)
    named = [(n, p) for n, p in shim.m.named_parameters() if p.requires_grad]
    if not torch.is_grad_enabled() or not (x.requires_grad or named):
        return torch.cat([_run_tile(shim, x[..., a:b, :]) for a, b in bounds], dim=-2)
    state = _ForwardState(x.device, keep_rng=shim.m.training)
    return _TiledPositionwise.apply(shim, x, bounds, state, [n for n, _ in named], *(p for _, p in named))


def tile_module(module: nn.Module, tiles: int) -> None:
    """``module`` computes its forward over ``tiles`` sequence tiles from now on (one tensor argument; any other
    call runs as before). Its forward must map each position on its own (an MLP). Replaces an earlier tiling. The
    tiled forward is a method bound to the module, so a deep copy of the module (a reference model) is tiled alike and
    runs its own parameters."""
    _check_tiles("tiles", tiles)
    untile_module(module)
    setattr(module, _TILED, (tiles, module.__dict__.get("forward")))
    module.forward = types.MethodType(_tiled_method, module)


def _tiled_method(self: nn.Module, *args, **kwargs):
    tiles, previous = self.__dict__[_TILED]
    run = previous if previous is not None else types.MethodType(type(self).forward, self)
    if len(args) == 1 and not kwargs and torch.is_tensor(args[0]) and args[0].dim() >= 2:
        return _tiled_forward(_Positionwise(self, run), args[0], tiles)
    return run(*args, **kwargs)


def untile_module(module: nn.Module) -> None:
    """Undo ``tile_module`` (nothing where the module is not tiled)."""
    if _TILED not in module.__dict__:
        return
    _, previous = module.__dict__.pop(_TILED)
    if previous is None:
        del module.forward
    else:
        module.forward = previous


# --- the logits and the loss -----------------------------------------------------------------------------------------
def _tile_loss(h, w, b, y, softcap: Optional[float], ignore_index: int) -> torch.Tensor:
    """The summed loss of one tile of rows, by the operations transformers' forward and ``ForCausalLMLoss`` run."""
    logits = F.linear(h, w, b)
    if softcap is not None:
        logits = logits / softcap
        logits = torch.tanh(logits)
        logits = logits * softcap
    return F.cross_entropy(logits.float(), y, ignore_index=ignore_index, reduction="sum")


class _TiledLMLoss(torch.autograd.Function):
    """The causal LM loss from the final hidden states (rows) and the lm_head, over tiles of rows; the backward
    recomputes each tile's logits (module docstring)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, denom, bounds, softcap, ignore_index, state):
        ctx.bounds, ctx.softcap, ctx.ignore_index, ctx.state = bounds, softcap, ignore_index, state
        ctx.save_for_backward(rows, weight, bias, targets, denom)
        total = torch.zeros((), dtype=torch.float32, device=rows.device)
        for a, b in bounds:
            total += _tile_loss(rows[a:b], weight, bias, targets[a:b], softcap, ignore_index)
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        rows, weight, bias, targets, denom = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        scale = grad / denom
        w = weight.detach().requires_grad_(need_w)
        b = bias.detach().requires_grad_(need_b) if bias is not None else None
        gh = torch.empty_like(rows) if need_h else None
        with ctx.state.restored(), torch.enable_grad():
            for lo, hi in ctx.bounds:
                ht = rows[lo:hi].detach().requires_grad_(need_h)
                loss = _tile_loss(ht, w, b, targets[lo:hi], ctx.softcap, ctx.ignore_index)
                inputs = [t for t, need in ((ht, need_h), (w, need_w), (b, need_b)) if need]
                if inputs:
                    torch.autograd.backward(loss, scale, inputs=inputs)
                if need_h:
                    gh[lo:hi].copy_(ht.grad)
        return (gh, w.grad if need_w else None, b.grad if need_b else None) + (None,) * 6


def tiled_causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: Optional[torch.Tensor] = None, *,
                         tiles: int, bias: Optional[torch.Tensor] = None, shift_labels: Optional[torch.Tensor] = None,
                         softcap: Optional[float] = None, ignore_index: int = -100,
                         num_items_in_batch=None) -> torch.Tensor:
    """transformers' causal LM loss of ``lm_head(hidden)`` (``weight``, ``bias``; Gemma-2's ``softcap`` applied to
    the logits), computed over ``tiles`` tiles of the batch's positions: ``labels`` shifted by one, or
    ``shift_labels`` as given; ``ignore_index`` left out; divided by ``num_items_in_batch`` where given, else by the
    count of the other tokens (a batch with none gives nan, as transformers' mean does)."""
    _check_tiles("tiles", tiles)
    if shift_labels is None:
        if labels is None:
            raise ValueError("lins: tiled_causal_lm_loss needs labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.to(hidden.device).reshape(-1)
    rows = hidden.reshape(-1, hidden.shape[-1])
    if targets.shape[0] != rows.shape[0]:
        raise ValueError(f"lins: tiled_causal_lm_loss: {targets.shape[0]} labels for {rows.shape[0]} positions")
    count = num_items_in_batch if num_items_in_batch is not None else (targets != ignore_index).sum()
    denom = torch.as_tensor(count, device=hidden.device).to(torch.float32)
    state = _ForwardState(hidden.device, keep_rng=False)
    return _TiledLMLoss.apply(rows, weight, bias, targets, denom, tile_bounds(rows.shape[0], tiles),
                              None if softcap is None else float(softcap), ignore_index, state)


# --- installing both on a Hugging Face causal LM ------------------------------------------------------------------
@dataclass
class Tiling:
    """What ``apply_tiling`` installed on a model: tile counts (1: that part untouched) and how to take it off."""
    mlp_tiles: int
    logits_tiles: int
    modules: list = field(default_factory=list, repr=False)  # the tiled MLPs
    handles: list = field(default_factory=list, repr=False)  # the loss hooks


def _supported() -> dict:
    """The causal LM classes ``apply_tiling`` knows -> whether their forward soft-caps the final logits."""
    import transformers

    names = {"LlamaForCausalLM": False, "Qwen2ForCausalLM": False, "Gemma2ForCausalLM": True}
    return {getattr(transformers, n): cap for n, cap in names.items() if hasattr(transformers, n)}


def _check_tiles(name: str, tiles) -> None:
    if isinstance(tiles, bool) or not isinstance(tiles, int) or tiles < 1:
        raise ValueError(f"lins: {name} must be an integer >= 1, got {tiles!r}")


def _model_class(model: nn.Module):
    supported = _supported()
    cls = next((c for c in supported if isinstance(model, c)), None)
    names = ", ".join(sorted(c.__name__ for c in supported))
    if cls is None:
        raise TypeError(f"lins: sequence tiling does not support {type(model).__name__}: it tiles {names} (a PEFT "
                        "model: pass model.get_base_model())")
    if type(model).forward is not cls.forward:
        raise TypeError(f"lins: sequence tiling does not support {type(model).__name__}: it overrides "
                        f"{cls.__name__}.forward, whose structure the tiling relies on")
    return cls


def _check_head(model: nn.Module) -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__
    if type(getattr(model, "lm_head", None)) is not nn.Linear:
        raise TypeError(f"lins: logits tiling on {name}: lm_head is {type(getattr(model, 'lm_head', None)).__name__}, "
                        "not a plain nn.Linear (PEFT's modules_to_save or LoRA on the head?): the tiled loss would "
                        "not be the model's")
    if model.loss_function is not ForCausalLMLoss:
        raise TypeError(f"lins: logits tiling on {name}: its loss_function is {model.loss_function!r}, not "
                        "transformers' ForCausalLMLoss, which the tiled loss computes")


@dataclass
class _Call:
    labels: Optional[torch.Tensor]
    shift_labels: Optional[torch.Tensor]
    ignore_index: int
    num_items_in_batch: object
    hidden: Optional[torch.Tensor] = None


class _LossHooks:
    """The three hooks of logits tiling (module docstring), with a stack of the calls in flight (one per model
    forward; ``None`` for a call left untouched)."""

    def __init__(self, model: nn.Module, tiles: int, softcaps: bool):
        self.model, self.tiles, self.softcaps = model, tiles, softcaps
        params = list(inspect.signature(type(model).forward).parameters)[1:]  # without self
        self.names = params
        self.stack: list = []

    def install(self) -> list:
        m = self.model
        return [m.register_forward_pre_hook(self.pre_forward, with_kwargs=True, prepend=True),
                m.lm_head.register_forward_pre_hook(self.head_input, prepend=True),
                m.register_forward_hook(self.post_forward, prepend=True, always_call=True)]

    def pre_forward(self, module, args, kwargs):
        moved = {n: a for n, a in zip(self.names, args)}
        labels = kwargs.get("labels", moved.get("labels"))
        keep = kwargs.get("logits_to_keep", moved.get("logits_to_keep", 0))
        if labels is None or not torch.is_grad_enabled() or not (isinstance(keep, int) and keep == 0):
            self.stack.append(None)
            return None
        _check_head(self.model)
        self.stack.append(_Call(labels, kwargs.get("shift_labels"), kwargs.get("ignore_index", -100),
                                kwargs.get("num_items_in_batch")))
        kwargs = {**kwargs, **moved, "labels": None}  # positional arguments by name: labels taken out of them too
        return (), kwargs

    def head_input(self, module, args):
        call = self.stack[-1] if self.stack else None
        if call is None or call.hidden is not None or len(args) != 1:
            return None
        call.hidden = args[0]
        return (args[0].narrow(-2, 0, 0),)  # the head makes batch x 0 x vocab logits: none

    def post_forward(self, module, args, output):
        call = self.stack.pop() if self.stack else None
        if call is None or output is None:
            return None
        if call.hidden is None:
            raise RuntimeError(f"lins: logits tiling on {type(self.model).__name__}: lm_head never ran in this "
                               "forward, so there are no hidden states to compute the loss from")
        head = self.model.lm_head
        softcap = getattr(self.model.config, "final_logit_softcapping", None) if self.softcaps else None
        loss = tiled_causal_lm_loss(call.hidden, head.weight, call.labels, tiles=self.tiles, bias=head.bias,
                                    shift_labels=call.shift_labels, softcap=softcap, ignore_index=call.ignore_index,
                                    num_items_in_batch=call.num_items_in_batch)
        return _with_loss(output, loss)


def _with_loss(output, loss: torch.Tensor):
    """``output`` with ``loss`` first, as transformers returns it with labels (a ModelOutput, or a tuple)."""
    if isinstance(output, tuple):
        return (loss,) + output
    fields = {k: v for k, v in output.items() if k != "loss"}
    return type(output)(loss=loss, **fields)


def unsupported(model: nn.Module) -> str:
    """Why ``apply_tiling`` would refuse to tile ``model``'s MLPs and logits ('' where it would not): what the planner
    asks before it offers tiling (``lins.tiling``)."""
    try:
        _model_class(model)
        _check_head(model)
    except (TypeError, ImportError) as e:
        return str(e)
    return ""


def apply_tiling(model: nn.Module, mlp_tiles: int, logits_tiles: int) -> Optional[Tiling]:
    """Tile ``model``'s MLPs over ``mlp_tiles`` sequence tiles and its logits and loss over ``logits_tiles`` (1: that
    part untouched), replacing an earlier tiling. Returns what it installed, None where both are 1 (nothing is).
    Raises ``TypeError`` for a model it does not support (module docstring)."""
    _check_tiles("mlp_tiles", mlp_tiles)
    _check_tiles("logits_tiles", logits_tiles)
    cls = _model_class(model)
    if logits_tiles > 1:
        _check_head(model)
    remove_tiling(model)
    if mlp_tiles == 1 and logits_tiles == 1:
        return None
    tiling = Tiling(mlp_tiles, logits_tiles)
    if mlp_tiles > 1:
        for layer in model.model.layers:
            tile_module(layer.mlp, mlp_tiles)
            tiling.modules.append(layer.mlp)
    if logits_tiles > 1:
        tiling.handles = _LossHooks(model, logits_tiles, _supported()[cls]).install()
    setattr(model, _TILING, tiling)
    return tiling


def remove_tiling(model: nn.Module) -> None:
    """Undo ``apply_tiling`` (nothing where the model is not tiled)."""
    tiling = model.__dict__.pop(_TILING, None)
    if tiling is None:
        return
    for module in tiling.modules:
        untile_module(module)
    for handle in tiling.handles:
        handle.remove()


def tiling_of(model: nn.Module) -> Optional[Tiling]:
    """What ``apply_tiling`` installed on ``model``, or None."""
    return model.__dict__.get(_TILING)
