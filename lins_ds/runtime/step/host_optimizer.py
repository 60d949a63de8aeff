"""The host optimizer of offloaded units (docs/design.md §13): the engine optimizer's hyperparameters with a CPU
implementation of its update, and the start-up measurement of this host's offload speeds (``measure``)."""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
import threading
import time
from typing import Optional

import torch

from ...plan.offload import HostSpec
from ..errors import LinsConfigError
from .host_memory import HOST_PIECE, SWITCH_INTERVAL_S, host_empty, square_sum

PREFER_DEEPSPEED = 1.25  # "auto" takes DeepSpeedCPUAdam only this much faster than torch's: it holds the GIL


def adam_mode(basic) -> Optional[bool]:
    """True: AdamW (decoupled weight decay); False: Adam (L2); None: not an Adam."""
    import torch.optim as O

    if isinstance(basic, O.AdamW):
        return True
    if isinstance(basic, O.Adam):
        return bool(basic.defaults.get("decoupled_weight_decay", False))
    mode = getattr(basic, "adam_w_mode", None)  # DeepSpeed's FusedAdam and DeepSpeedCPUAdam
    return bool(mode) if mode is not None else None


def _deepspeed_cpu_adam():
    """DeepSpeedCPUAdam's class when its op builds on this machine, else None."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
        return DeepSpeedCPUAdam
    except Exception:  # noqa: BLE001 - no compiler, no ninja, an unsupported CPU: torch's optimizer is used
        return None


def _unsupported(basic, kind: str) -> str:
    """What the host optimizer ``kind`` would silently change in ``basic``'s update ('' when nothing)."""
    for g in basic.param_groups:
        if g.get("bias_correction", True) is False:
            return "bias_correction=False (torch's and DeepSpeed's CPU Adam always correct)"
        if kind == "deepspeed" and (g.get("amsgrad") or g.get("maximize")):
            return "amsgrad or maximize, which DeepSpeedCPUAdam ignores"
    return ""


_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "momentum", "dampening", "nesterov", "alpha",
          "maximize", "lr_decay", "initial_accumulator_value", "rho", "centered", "decoupled_weight_decay")


class HostOptimizer:
    """The offloaded slices' optimizer: the engine optimizer's hyperparameters (taken from its param groups as each
    step's host updates start, so LR schedulers act on both), its own CPU implementation, the engine optimizer's
    state dict (so checkpoints see one optimizer)."""

    def __init__(self, basic, masters_by_group: list, kind: str, device: torch.device):
        self.basic, self.kind = basic, kind
        why = _unsupported(basic, kind)
        if why:
            raise LinsConfigError(f"lins.host_optimizer: {kind!r} cannot update {type(basic).__name__} on the host: {why}")
        groups = [{"params": ps, **{k: v for k, v in g.items() if k != "params"}}
                  for g, ps in zip(basic.param_groups, masters_by_group)]
        mode = adam_mode(basic)
        ds_cls = _deepspeed_cpu_adam() if kind == "deepspeed" and mode is not None else None
        if kind == "deepspeed" and ds_cls is None:
            raise LinsConfigError("lins.host_optimizer: \"deepspeed\" needs an Adam optimizer and DeepSpeedCPUAdam's "
                                  "op built on this machine (deepspeed.ops.op_builder.CPUAdamBuilder); use \"torch\"")
        if ds_cls is not None:
            self.opt = ds_cls([{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay")}
                               for g in groups], adamw_mode=mode)
            self.name = f"DeepSpeedCPUAdam ({'AdamW' if mode else 'Adam'})"
        elif mode is not None:
            cls = torch.optim.AdamW if mode else torch.optim.Adam
            self.opt = cls([{k: v for k, v in g.items() if k in ("params", "lr", "betas", "eps", "weight_decay",
                                                                   "amsgrad")} for g in groups], fused=True)
            self.name = f"torch {cls.__name__} (fused, CPU)"
        else:  # another element-wise torch optimizer: its own class, stepped on CPU tensors
            self.opt = copy.copy(basic)
            self.opt.param_groups = groups
            self.name = f"{type(basic).__name__} (CPU)"
        self.opt.state = basic.state  # one state dict: checkpoints and load_checkpoint see every slice
        self._int_step = ds_cls is not None

    def hyperparameters(self) -> list:
        """The engine optimizer's hyperparameters now, per group: taken on the training thread when the step's host
        updates start (the LR scheduler steps right after ``step()`` returns, while they still run)."""
        return [{k: theirs[k] for k in _HYPER if k in theirs and k in mine}
                for mine, theirs in zip(self.opt.param_groups, self.basic.param_groups)]

    def step(self, masters: list, hyper: list) -> None:
        """One update of ``masters`` (their ``.grad`` set) with ``hyper`` (``hyperparameters()``)."""
        for mine, values in zip(self.opt.param_groups, hyper):
            mine.update(values)
        for p in masters:  # a checkpoint may have been written by the other kind of optimizer
            st = self.opt.state.get(p)
            if st and "step" in st:
                if self._int_step and torch.is_tensor(st["step"]):
                    st["step"] = int(st["step"].item())
                elif not self._int_step and (not torch.is_tensor(st["step"]) or st["step"].dtype != torch.float32):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
        if isinstance(self.opt, torch.optim.Optimizer) and type(self.opt) is type(self.basic):
            type(self.basic).step(self.opt)  # the class's step: a scheduler may have wrapped the instance's own
        else:
            self.opt.step()


def update_piece(opt: HostOptimizer, master: torch.Tensor, grad: torch.Tensor, up: Optional[torch.Tensor],
                 scratch: torch.Tensor, coef: float, hyper: list) -> None:
    """One host piece's update: its gradient (as it came down) to fp32 in ``scratch``, scaled by ``coef`` (the
    loss-scale, averaging and clipping factor), the optimizer step, the master cast into ``up`` for the upload."""
    g = scratch[:grad.numel()]
    g.copy_(grad)
    g.mul_(coef)
    master.grad = g.view_as(master)
    opt.step([master], hyper)
    master.grad = None
    if up is not None:
        up.copy_(master.data)


def measure(basic, kind: str, device: torch.device, capacity_gb: float, elems: int = 1 << 24,
            grad_dtypes: tuple = (torch.bfloat16, torch.bfloat16)) -> tuple:
    """(HostSpec, host optimizer kind): this host's offload speeds, timed here: the host optimizer's update of
    ``elems`` fp32 elements (a unit's piece) and pinned copies of a bf16 tensor of that size each way. ``kind``
    "auto" tries torch's fused Adam and DeepSpeedCPUAdam, and keeps DeepSpeedCPUAdam only if ``PREFER_DEEPSPEED``
    times faster: its update holds the GIL, which stalls the training thread's kernel launches while the forward
    overlaps it. That choice is timed on an idle host; the speeds the planner prices a step with (the update, the
    gradient sums and norms) are then timed as a step runs them: beside the training thread (``beside_training``)."""
    kinds = ["torch", "deepspeed"] if kind == "auto" and adam_mode(basic) is not None else [kind if kind != "auto" else "torch"]
    best = None
    for k in kinds:
        try:
            rate, name = _time_update(basic, k, device, elems)
        except Exception as e:  # noqa: BLE001 - an optimizer that cannot step on the CPU (a CUDA-only kernel)
            if kind != "auto":
                raise LinsConfigError(f"lins.host_optimizer: {k!r} cannot update {type(basic).__name__} on this "
                                      f"host ({type(e).__name__}: {e})") from None
            continue
        if best is None or rate > best[0] * (PREFER_DEEPSPEED if k == "deepspeed" else 1.0):
            best = (rate, name, k)
    if best is None:
        raise LinsConfigError(f"lins.offload: no host optimizer can update {type(basic).__name__} on this host "
                              "(torch's CPU Adam needs an Adam; another optimizer must step on CPU tensors)")
    h2d, d2h = _time_copies(device, elems)
    with beside_training(device):
        rate = _time_update(basic, best[2], device, elems)[0]
        accumulate = _time_accumulate(device, elems, *grad_dtypes)
    source = (f"measured on {device.type} beside a training-like thread; the update alone {best[0] / 1e9:.2f} G "
              "elements/s")
    return HostSpec(capacity_gb, rate, h2d, d2h, best[1], source, *accumulate), best[2]


STAND_IN = "lins-training-stand-in"  # the stand-in thread's name


@contextlib.contextmanager
def beside_training(device: torch.device):
    """The calling thread's host work timed as a step runs it: beside the training thread (here a stand-in that
    launches small kernels on ``device`` in a loop, a little Python between them and a synchronize every 64, as a
    forward's hooks and modules do; on a CPU device the same on a tiny CPU tensor), with the GIL switch interval
    ``HostUpdater`` sets. On an idle host the update ran faster than in training: 2.40-3.09 G elements/s timed at
    start-up, 2.1-2.3 in the host worker of the same jobs (bench/results/offload/again_h100/, Qwen2.5-3B widths on one
    H100's host), and the exposed host time was predicted 0.21-0.75 s a step where those jobs waited 0.37-1.12 s (mean
    of steps 3-8); beside such a loop the same update ran 2.32 G elements/s against 3.17 alone
    (bench/results/host_update_branch/). Yields the count of kernels launched so far (one-element list); a stand-in
    that fails raises here."""
    stop, started, launched, failed = threading.Event(), threading.Event(), [0], []

    def loop():
        try:
            x = torch.zeros(1024, device=device)
            started.set()
            while not stop.is_set():
                for _ in range(64):
                    k = 0
                    for i in range(20):  # the Python a hook or a module's forward runs between launches
                        k += i
                    x.add_(1.0)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                launched[0] += 64
        except BaseException as e:  # noqa: BLE001 - raised in the caller's thread (``_stand_in_failed``)
            failed.append(e)
        finally:
            started.set()

    thread = threading.Thread(target=loop, name=STAND_IN, daemon=True)
    interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(min(interval, SWITCH_INTERVAL_S))
        thread.start()
        started.wait()  # set by the loop whatever happens to it
        _stand_in_failed(failed, device)
        yield launched
    finally:
        stop.set()
        if thread.ident is not None:  # started
            thread.join()
        sys.setswitchinterval(interval)
    _stand_in_failed(failed, device)  # it failed while the block ran: what was timed was not beside it


def _stand_in_failed(failed: list, device: torch.device) -> None:
    if failed:
        raise RuntimeError(f"lins: the training stand-in could not run on {device} "
                           f"({type(failed[0]).__name__}: {failed[0]})") from failed[0]


def _time_update(basic, kind: str, device: torch.device, elems: int) -> tuple:
    p = torch.nn.Parameter(torch.zeros(elems, dtype=torch.float32))
    probe = copy.copy(basic)
    probe.param_groups = [{**{k: v for k, v in basic.param_groups[0].items() if k != "params"}, "params": []}]
    probe.state = collections.defaultdict(dict)
    opt = HostOptimizer(probe, [[p]], kind, device)
    grad, up = host_empty(elems, torch.bfloat16, device).fill_(1e-3), host_empty(elems, torch.bfloat16, device)
    scratch, hyper = torch.empty(elems, dtype=torch.float32), opt.hyperparameters()
    return _per_second(lambda: update_piece(opt, p, grad, up, scratch, 1.0, hyper), elems), opt.name


def _per_second(work, elems: int, reps: int = 3) -> float:
    """Elements per second of ``work`` over ``elems`` elements: one untimed call (state allocation, page faults),
    then ``reps`` timed."""
    work()
    t0 = time.perf_counter()
    for _ in range(reps):
        work()
    return reps * elems / (time.perf_counter() - t0)


def _time_accumulate(device: torch.device, elems: int, accum: torch.dtype, reduce: torch.dtype) -> tuple:
    """Elements per second of ``HostGrads``' work for a unit whose gradients live on the host: the sum of a
    micro-batch's gradient (``reduce`` dtype, pinned) into its G accumulator (``accum``), and the norm pass."""
    down = host_empty(elems, reduce, device).fill_(1e-3)
    acc = host_empty(elems, accum, device).zero_()
    scratch = torch.empty(min(elems, HOST_PIECE), dtype=torch.float32)
    return _per_second(lambda: acc.add_(down), elems), _per_second(lambda: square_sum(acc, scratch), elems)


def _time_copies(device: torch.device, elems: int) -> tuple:
    if device.type != "cuda":
        return 25.0, 25.0  # no copy on a CPU device: a nominal figure (offload never helps there)
    host = host_empty(elems, torch.bfloat16, device)
    dev = torch.empty(elems, dtype=torch.bfloat16, device=device)
    out = []
    for dst, src in ((dev, host), (host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out.append(3 * elems * 2 / (time.perf_counter() - t0) / 1e9)
    return tuple(out)
