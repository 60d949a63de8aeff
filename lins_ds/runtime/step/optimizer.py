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

from ... import comm
from ..errors import LinsConfigError
from .offload import HOST_PIECE, HostOptimizer, HostUpdater, host_empty

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


class MasterSlice:
    """The master tensor of one ``OSRange`` (a param group's part of one unit's OS chunk on this rank); in host
    memory (pinned where the device is a GPU) for a unit whose OS is offloaded."""

    def __init__(self, os_range, on_host: bool = False):
        self.range, self.on_host = os_range, on_host
        src = os_range.params()
        self.aliased = src.dtype == torch.float32 and not on_host  # fp32 params are their own master copy
        if on_host:
            master = host_empty(src.numel(), torch.float32, os_range.unit.device)  # src is on the host with P there
            master.copy_(src)
        else:
            master = src if self.aliased else src.float().clone()
        self.param = torch.nn.Parameter(master)

    def grad_view(self) -> torch.Tensor:
        return self.range.grads()

    def write_back(self) -> None:
        if not self.aliased:
            self.range.params().copy_(self.param.data)


def scalar_state(value, param: torch.Tensor, group: dict):
    """A copy of scalar optimizer state (Adam's step) for ``param``: where torch keeps it — on the parameter's
    device for fused or capturable optimizers, on the CPU otherwise (``Optimizer.load_state_dict``'s rule)."""
    if not torch.is_tensor(value):  # DeepSpeedCPUAdam's int step: torch's optimizers take a float32 tensor
        value = torch.tensor(float(value), dtype=torch.float32)
    on_device = group.get("fused") or group.get("capturable")
    return value.to(param.device if on_device else "cpu", copy=True)


def _moved(os_range, old: list, to_host: bool, state: dict, group: dict) -> list:
    """New master slices of ``os_range`` (on the host in pieces, or on the device whole) holding the values and
    optimizer state of the ``old`` slices that cover it."""
    out = []
    for r in (os_range.pieces(HOST_PIECE) if to_host else [os_range]):
        m = MasterSlice(r, on_host=to_host)
        moved: dict = {}
        for sl in old:
            a, b = max(sl.range.lo, r.lo), min(sl.range.hi, r.hi)
            if a >= b:
                continue
            src, dst = slice(a - sl.range.lo, b - sl.range.lo), slice(a - r.lo, b - r.lo)
            m.param.data[dst].copy_(sl.param.data[src])
            for k, v in state.get(sl.param, {}).items():
                if torch.is_tensor(v) and v.shape == sl.param.shape:
                    moved.setdefault(k, torch.zeros_like(m.param.data))[dst].copy_(v[src])
                else:
                    moved.setdefault(k, scalar_state(v, m.param, group))
        if moved:
            state[m.param] = moved
        out.append(m)
    return out


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
        self.host_optimizer_kind = host_optimizer  # "torch" or "deepspeed": what updates the units on the host
        self.fused_kernel = prefer_fused_kernel(basic, runtime.device)
        self.rebuild()

    def rebuild(self) -> None:
        """This rank's master slices over the runtime's current units (at start-up, and after a re-layout,
        which then writes their values and state: ``lins_ds.runtime.switch.relayout``). The basic optimizer keeps its
        param groups (hyperparameters, LR schedulers); its ``params`` and state start over."""
        runtime, basic = self.runtime, self.optimizer
        self.slices = []
        host_units = set(runtime.host_units)
        for gi, group in enumerate(basic.param_groups):
            masters = [MasterSlice(r, r.unit in host_units) for r in runtime.os_ranges(gi)]
            self.slices.extend(masters)
            group["params"] = [m.param for m in masters]
        basic.state.clear()
        self._batches()

    def _batches(self) -> None:
        """The host updater over the slices on the host, and the update batches of the others."""
        self.host = self._host_updater(self.host_optimizer_kind) if any(s.on_host for s in self.slices) else None
        # torch's optimizers keep their state, the step count included, per parameter: stepping them one unit
        # at a time is the same update, with one unit's fp32 gradients and temporaries alive at once instead
        # of the whole OS chunk's (docs/design.md §8). Others (DeepSpeed's FusedAdam counts steps per group)
        # take one step over everything.
        on_gpu = [s for s in self.slices if not s.on_host]
        units = list(dict.fromkeys(s.range.unit for s in on_gpu))
        self.update_batches = ([[s for s in on_gpu if s.range.unit is u] for u in units]
                               if steps_per_parameter(self.optimizer) else [on_gpu] if on_gpu else [])

    @torch.no_grad()
    def place_units(self) -> None:
        """After the runtime's host units changed under the same layout: each unit whose OS placement changed moves
        (to the host first, then to the device, one unit at a time: one unit's state extra at most); the others
        keep their masters and state untouched. Idempotent: it moves what differs from the runtime's placement."""
        rt, state = self.runtime, self.optimizer.state
        want = set(rt.host_units)
        by_unit: dict = {}
        for sl in self.slices:
            by_unit.setdefault(sl.range.unit, []).append(sl)
        moving = [u for u in rt.units if u in by_unit and by_unit[u][0].on_host != (u in want)]
        self.host = None  # its pinned copies go with the slices that move
        groups = self.optimizer.param_groups
        for u in sorted(moving, key=lambda u: u not in want):
            new = []
            try:
                for gi in dict.fromkeys(sl.range.group for sl in by_unit[u]):
                    new += _moved(u.os_range(gi), [sl for sl in by_unit[u] if sl.range.group == gi], u in want,
                                  state, groups[gi])
            except BaseException:
                for m in new:  # this unit stays where it was, its state untouched
                    state.pop(m.param, None)
                raise
            for sl in by_unit[u]:
                state.pop(sl.param, None)
            by_unit[u] = new
            self._adopt(by_unit)  # consistent after every unit: a failure later leaves no slice without its state
        self._adopt(by_unit)
        self._batches()

    def _adopt(self, by_unit: dict) -> None:
        """``by_unit``'s slices become the optimizer's (group-major, units in order)."""
        units = self.runtime.units
        self.slices = [sl for gi in range(len(self.optimizer.param_groups)) for u in units
                       for sl in by_unit.get(u, []) if sl.range.group == gi]
        for gi, group in enumerate(self.optimizer.param_groups):
            group["params"] = [sl.param for sl in self.slices if sl.range.group == gi]

    def release(self) -> None:
        """Drop every master slice and its state (a re-layout, which staged them, builds new ones)."""
        for group in self.optimizer.param_groups:
            group["params"] = []
        self.optimizer.state.clear()
        self.slices, self.update_batches, self.host = [], [], None

    def check_host(self) -> None:
        """The last host update finished on every rank, or every rank raises the failing rank's error (a failure on one
        rank alone would leave the others waiting in a collective). Every rank calls it at the same point: the step,
        a save, a re-layout."""
        if not self.runtime.host_units:  # the plan's, the same on every rank (a rank whose part of them is only
            return                       # padding holds no updater, and still agrees)
        if self.host is not None:
            self.host.join()
        error = comm.agree((self.host.error() if self.host is not None else "") or None)
        if error is not None:
            raise RuntimeError(error)

    def quiesce(self) -> None:
        """Nothing in flight: host updates finished (on every rank: ``check_host``) and every unit's P chunk current
        (before a re-layout or a checkpoint reads the state)."""
        self.check_host()
        self.runtime.settle()

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
        """Host memory the offloaded units' state holds on this rank (0 without offload). The host updates in flight
        are waited for only while an update has yet to make its optimizer state (the first): a later step's are not
        (the memory guard asks during training, where a wait would expose a whole host update)."""
        if self.host is None:
            return 0.0
        state = self.optimizer.state
        if not all(state.get(s.param) for s in self.slices if s.on_host):
            self.host.join()
        grads = self.runtime.host_grads
        return (self.host.nbytes() + (grads.nbytes() if grads is not None else 0)
                + self.runtime.host_param_bytes()) / 2**30

    def _grad_norm(self, inv_scale: float) -> torch.Tensor:
        """Global L2 norm of the true (unscaled, averaged) gradient, on the device; each element once."""
        rt = self.runtime
        host = rt.host_grads is not None  # then a second element: the ranks whose host gradient work failed
        sq = torch.zeros(2 if host else 1, dtype=torch.float32, device=rt.device)
        for g in rt.os_grads():  # accumulated in fp32 without an fp32 copy of the chunk
            sq[0] += torch.linalg.vector_norm(g, 2, dtype=torch.float32).square()
        if host:  # G on the host: its norm taken there as the gradients came down (docs/design.md §13)
            sq[0] += rt.host_grad_square_sum()
            sq[1] = 1.0 if rt.host_grad_error() else 0.0
        comm.all_reduce(rt.groups, "world", sq, tag="grad-norm")  # every OS chunk is held by world/s_os replicas
        if host and sq[1].item():  # a host failure on any rank raises on every rank, after the collective
            raise RuntimeError(rt.host_grad_error() or "lins: adding gradients on the host failed on another rank")
        return (sq[0] / rt.os_replicas).sqrt() * inv_scale

    @torch.no_grad()
    def step(self, closure=None):
        """No host synchronisation except for fp16, whose overflow decides on the host whether to step."""
        rt = self.runtime
        rt.finish_gradients()  # the last step's host updates included
        self.check_host()
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
        if rt.host_grads is not None:  # the host update reads the G accumulators on the host: every micro-batch's
            rt.host_grads.drain()      # gradient added first (the norm above drains too, but need not)
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
