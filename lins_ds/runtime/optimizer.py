"""The sharded optimizer (docs/design.md §3, steps 3-5): it owns the OS chunk of every unit.

The client's (or DeepSpeed's) basic optimizer keeps its param groups — same order, same
hyperparameters, so LR schedulers work unchanged — but each group's ``params`` become this rank's
fp32 master slices of that group inside its OS chunks. Deriving from ZeROOptimizer opts into the
engine's loss-scaling and backward bookkeeping.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math

import torch
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler

from .. import comm
from .config import LinsConfigError
from .offload import HostOptimizer, HostUpdater, host_empty

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


def steps_per_parameter(optimizer) -> bool:
    """Whether ``optimizer`` keeps its step count per parameter (torch.optim's do), so that it may be
    stepped over a subset of its parameters at a time."""
    return type(optimizer).__module__.startswith("torch.optim")


class MasterSlice:
    """The master tensor of one ``OSRange`` (a param group's part of one unit's OS chunk on this rank); in host
    memory (pinned where the device is a GPU) for a unit whose OS is offloaded."""

    def __init__(self, os_range, on_host: bool = False):
        self.range, self.on_host = os_range, on_host
        src = os_range.params()
        self.aliased = src.dtype == torch.float32 and not on_host  # fp32 params are their own master copy
        if on_host:
            master = host_empty(src.numel(), torch.float32, src.device)
            master.copy_(src)
        else:
            master = src if self.aliased else src.float().clone()
        self.param = torch.nn.Parameter(master)

    def grad_view(self) -> torch.Tensor:
        return self.range.grads()

    def write_back(self) -> None:
        if not self.aliased:
            self.range.params().copy_(self.param.data)


class LinsOptimizer(ZeROOptimizer):
    def __init__(self, basic, runtime, clip: float = 0.0, fp16: bool = False, static_loss_scale: float = 1.0,
                 dynamic_loss_scale: bool = False, dynamic_loss_args=None, host_optimizer: str = "torch"):
        """``basic`` must be element-wise (``check_elementwise``, which the engine runs before any collective).
        ``host_optimizer`` ("torch" or "deepspeed") updates the units whose OS the plan puts on the host."""
        super().__init__()
        self.optimizer, self.runtime, self.clip = basic, runtime, clip
        self.custom_loss_scaler, self.torch_autocast_gradscaler = False, None
        self.dynamic_loss_scale = fp16 and dynamic_loss_scale
        self.loss_scaler = (CreateLossScaler(torch.half, static_loss_scale, dynamic_loss_scale, dynamic_loss_args)
                            if fp16 else None)
        self.overflow = False
        self._global_grad_norm = None
        self.slices: list = []
        host_units = set(runtime.host_units)
        for gi, group in enumerate(basic.param_groups):
            masters = [MasterSlice(r, r.unit in host_units) for r in runtime.os_ranges(gi)]
            self.slices.extend(masters)
            group["params"] = [m.param for m in masters]
        basic.state.clear()
        self.host = self._host_updater(host_optimizer) if host_units else None
        # torch's optimizers keep their state, the step count included, per parameter: stepping them one unit
        # at a time is the same update, with one unit's fp32 gradients and temporaries alive at once instead
        # of the whole OS chunk's (docs/design.md §8). Others (DeepSpeed's FusedAdam counts steps per group)
        # take one step over everything.
        on_gpu = [s for s in self.slices if not s.on_host]
        units = list(dict.fromkeys(s.range.unit for s in on_gpu))
        self.update_batches = ([[s for s in on_gpu if s.range.unit is u] for u in units]
                               if steps_per_parameter(basic) else [on_gpu] if on_gpu else [])

    def _host_updater(self, kind: str) -> HostUpdater:
        host = [s for s in self.slices if s.on_host]
        by_group = [[s.param for s in host if s.range.group == gi] for gi in range(len(self.optimizer.param_groups))]
        opt = HostOptimizer(self.optimizer, by_group, kind, self.runtime.device)
        units = list(dict.fromkeys(s.range.unit for s in host))
        return HostUpdater(opt, [(u, [s for s in host if s.range.unit is u]) for u in units], self.runtime.device)

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
        self.runtime.begin_backward()

    def backward_epilogue(self, **kwargs) -> None:
        self.runtime.end_backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.runtime.attach_grads()

    def host_gb(self) -> float:
        """Host memory the offloaded units' state holds on this rank (0 without offload); waits for the host
        updates in flight (their optimizer state may not exist yet)."""
        if self.host is None:
            return 0.0
        self.host.join()
        return self.host.nbytes() / 2**30

    def _grad_norm(self, inv_scale: float) -> torch.Tensor:
        """Global L2 norm of the true (unscaled, averaged) gradient, on the device; each element once."""
        rt = self.runtime
        sq = torch.zeros((), dtype=torch.float32, device=rt.device)
        for g in rt.os_grads():  # accumulated in fp32 without an fp32 copy of the chunk
            sq += torch.linalg.vector_norm(g, 2, dtype=torch.float32).square()
        comm.all_reduce(rt.groups, "world", sq, tag="grad-norm")  # every OS chunk is held by world/s_os replicas
        return (sq / rt.os_replicas).sqrt() * inv_scale

    @torch.no_grad()
    def step(self, closure=None):
        """No host synchronisation except for fp16, whose overflow decides on the host whether to step."""
        rt = self.runtime
        rt.finish_gradients()  # the last step's host updates included
        if self.host is not None:
            self.host.join()
        rt.check_collectives()
        inv_scale = 1.0 / (rt.topo.world_size * self.cur_scale)
        norm = self._grad_norm(inv_scale)
        if self.loss_scaler is not None:
            self.overflow = not math.isfinite(norm.item())
            self.loss_scaler.update_scale(self.overflow)
            if self.overflow:
                rt.zero_gradients()
                return
        coef = torch.full((), inv_scale, dtype=torch.float32, device=rt.device)
        if self.clip > 0:
            coef = coef * (self.clip / (norm + 1e-6)).clamp(max=1.0)
        downloads = self.host.download(coef) if self.host is not None else None  # host units' gradients leave
        for batch in self.update_batches:
            self._update(batch, coef)
        rt.sync_parameters(self.host, downloads)
        rt.zero_gradients()
        self._global_grad_norm = norm

    def _update(self, batch: list, coef: torch.Tensor) -> None:
        """The update of these master slices: fp32 gradients for them alone, then the basic optimizer, which
        skips parameters without a gradient."""
        for s in batch:
            g = s.grad_view()
            s.param.grad = g.mul_(coef) if g.dtype == torch.float32 else g.float().mul_(coef)
        self.optimizer.step()
        for s in batch:
            s.write_back()
            s.param.grad = None

    def state_dict(self):
        raise RuntimeError("lins: optimizer state is sharded across ranks; use engine.save_checkpoint(), "
                           "which writes it layout-independently")

    def load_state_dict(self, state_dict):
        raise RuntimeError("lins: use engine.load_checkpoint() to restore sharded optimizer state")
