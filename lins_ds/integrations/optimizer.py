"""LinsOptimizer: DeepSpeed's view of the optimizer (docs/design.md §3, steps 3-5), an adapter over LinsRuntime.

The runtime owns this rank's master slices (``Masters``: the client's basic optimizer, its param groups rebound to
them) and the host side of offload; this class gives DeepSpeed's engine what it asks of a ZeRO optimizer — the loss
scaler, the backward prologue and epilogue, ``step`` (norm, clipping, fp16 overflow), the param groups and state for
LR schedulers — and drives the runtime's step through its methods. Deriving from ZeROOptimizer opts into the
engine's loss-scaling and backward bookkeeping.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
from typing import Optional

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

from ..runtime.errors import LinsConfigError


def _known_elementwise() -> tuple:
    """Optimizer classes whose update is element-wise (by identity, not name)."""
    import torch.optim as O

    known = [O.Adam, O.AdamW, O.SGD, O.Adagrad, O.RMSprop, O.Adamax, O.NAdam, O.RAdam]
    with contextlib.suppress(ImportError):  # a DeepSpeed without these ops: torch's classes only
        from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        known += [FusedAdam, DeepSpeedCPUAdam, FusedLion, DeepSpeedCPULion]
    return tuple(known)


def _probe(optimizer, shapes: list, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Two steps of a copy of ``optimizer`` (its first group's hyperparameters, fresh state) on ``x`` held as
    parameters of ``shapes`` (flattened back to one tensor)."""
    params, grads, at = [], [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        params.append(torch.nn.Parameter(x[at:at + n].clone().view(shape)))
        grads.append(g[at:at + n].view(shape))
        at += n
    group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    if not group.get("lr", 1.0):
        group["lr"] = 1e-2  # a warm-up's zero learning rate would hide any difference
    probe = copy.copy(optimizer)
    probe.state = collections.defaultdict(dict)
    probe.param_groups = [{**group, "params": params}]
    for _ in range(2):
        for p, grad in zip(params, grads):
            p.grad = grad.clone()
        type(optimizer).step(probe)  # the class's step: an LR scheduler may have wrapped the instance's own
    return torch.cat([p.detach().reshape(-1) for p in params])


def is_elementwise(optimizer) -> bool:
    """What element-wise means, tested: two steps on a 4x4 parameter give the same values as on its two 2x4 halves
    held as separate parameters (per-tensor statistics such as LAMB's trust ratio, Adafactor's factored moments or
    Shampoo's preconditioners make them differ). A step that fails counts as not element-wise."""
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(16, generator=g), torch.randn(16, generator=g)
    try:
        with torch.no_grad():
            whole = _probe(optimizer, [(4, 4)], x, grad)
            halves = _probe(optimizer, [(2, 4), (2, 4)], x, grad)
    except Exception:  # noqa: BLE001 - an optimizer that cannot step on CPU probes is not shown element-wise
        return False
    return not torch.equal(whole, x) and torch.allclose(whole, halves, rtol=1e-5, atol=1e-7)


def check_elementwise(optimizer, declared: bool = False) -> None:
    """Lins gives each rank a slice of every tensor's optimizer state: exact only for element-wise updates."""
    if declared or isinstance(optimizer, _known_elementwise()) or is_elementwise(optimizer):
        return
    name = type(optimizer).__name__
    raise LinsConfigError(
        f"lins: optimizer {name} is not element-wise: two steps on a tensor and on its two halves as separate "
        f"tensors give different values (per-tensor statistics?) or cannot be probed on the CPU. Lins gives each rank "
        f"a slice of every tensor's optimizer state, which is exact only for element-wise updates; if {name} is "
        "element-wise, declare it with \"lins\": {\"elementwise_optimizer\": true}")


def prefer_fused_kernel(optimizer, device: torch.device) -> bool:
    """A torch Adam or AdamW whose implementation the user left open (``foreach`` and ``fused`` unset) steps the
    device's fp32 master slices with torch's fused kernel: one pass over the state instead of the multi-tensor
    path's several (docs/design.md §8). The same update as DeepSpeed's default FusedAdam; rounding may differ in the
    last bit from the multi-tensor path. Set ``"foreach": true`` in the optimizer's params to keep that path.
    Whether the groups were switched."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or device.type != "cuda":
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable")
           or g.get("capturable") for g in groups):
        return False
    for g in groups:
        g["fused"] = True
    optimizer.defaults["fused"] = True
    return True


class LinsOptimizer(ZeROOptimizer):
    def __init__(self, basic, runtime, clip: float = 0.0, fp16: bool = False, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args=None):
        """``basic`` must be element-wise (``check_elementwise``, which the engine runs before any collective); the
        runtime binds it to this rank's master slices."""
        super().__init__()
        self.optimizer, self.runtime, self.clip = basic, runtime, clip
        self.custom_loss_scaler, self.torch_autocast_gradscaler = False, None
        self.dynamic_loss_scale = fp16 and dynamic_loss_scale
        self.loss_scaler = (CreateLossScaler(torch.half, static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
                            if fp16 else None)
        self.overflow = False
        self._global_grad_norm = None
        self.fused_kernel = prefer_fused_kernel(basic, runtime.device)
        runtime.attach_optimizer(basic)

    # DeepSpeed and schedulers reach through to the basic optimizer's groups and state.
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale if self.loss_scaler is not None else 1.0

    # DeepSpeed's engine calls these around every backward (engine.backward or loss.backward).
    def backward_prologue(self) -> None:
        self.runtime.begin_backward(self.ahead_coef())

    def ahead_coef(self) -> Optional[float]:
        """The coefficient ``step()`` will scale every gradient by, where it is known before the backward: without
        clipping or a loss scale, the average over the ranks (as ``step()`` makes it: an fp32 value); else None."""
        if self.clip > 0 or self.loss_scaler is not None:
            return None
        return float(torch.full((), 1.0 / self.runtime.topo.world_size, dtype=torch.float32))

    def backward_epilogue(self, **kwargs) -> None:
        self.runtime.end_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As under ZeRO-1, the gradients accumulated so far are dropped (inside an accumulation window: a user's or a
        library's call; DeepSpeed's own, after ``step()``, finds nothing left)."""
        self.runtime.drop_gradients()
        self.runtime.attach_grads()

    @torch.no_grad()
    def step(self, closure=None):
        """No host synchronisation except for fp16, whose overflow decides on the host whether to step."""
        rt = self.runtime
        rt.finish_gradients()  # the last step's host updates included
        rt.check_host(step=True)
        rt.check_collectives()
        inv_scale = 1.0 / (rt.topo.world_size * self.cur_scale)
        norm = rt.grad_norm(inv_scale)
        if self.loss_scaler is not None:
            self.overflow = not math.isfinite(norm.item())
            self.loss_scaler.update_scale(self.overflow)
            if self.overflow:
                rt.zero_gradients()
                return
        coef = torch.full((), inv_scale, dtype=torch.float32, device=rt.device)
        if self.clip > 0:
            coef = coef * (self.clip / (norm + 1e-6)).clamp(max=1.0)
        rt.update(coef)
        self._global_grad_norm = norm

    def state_dict(self):
        raise RuntimeError("lins: optimizer state is sharded across ranks; use engine.save_checkpoint(), "
                           "which writes it layout-independently")

    def load_state_dict(self, state_dict):
        raise RuntimeError("lins: use engine.load_checkpoint() to restore sharded optimizer state")
