"""The host side of offload (docs/design.md §13): the offloaded units' master weights and moments in pinned host
memory, the host optimizer, and ``HostUpdater``, which runs their updates after ``step()`` returns.

One step, for the units whose OS is on the host (the plan's last ``offload_units``):

    step()       the global norm is taken on the GPU (every unit's gradient is still there); each host slice's
                 gradient and the clip coefficient go down on a copy stream (``download``); the GPU units update
                 as usual; the worker thread starts.
    worker       unit by unit in forward order: wait for the unit's gradient, scale it, step the host optimizer,
                 cast the master to the parameter dtype in a pinned buffer, copy it up on the copy stream.
    next use     the unit's forward (or anything that reads its parameters) waits for its own update only
                 (``Unit`` state UPDATING): the first units' forward runs while the last ones are updated.

On a CPU device the "host" is a separate tensor pool on the same memory and the copies are synchronous: the same
code paths run, which is what the CPU tests check.
"""

from __future__ import annotations

import collections
import copy
import queue
import sys
import threading
from contextlib import nullcontext
import time
import weakref
from typing import Optional

import torch

from ... import comm
from ...plan.offload import HostSpec
from ..errors import LinsConfigError

HOST_PIECE = 1 << 25  # elements per host master tensor (128 MiB in fp32): few enough calls that the worker rarely
# waits for the GIL, small enough that the first update starts soon and memory-bound temporaries stay small
SWITCH_INTERVAL_S = 5e-4  # while the worker runs: the training thread hands over the GIL within 0.5 ms, not 5
REGISTER_MIN_BYTES = 1 << 20  # host_empty: smaller pinned buffers come from torch's caching allocator
PREFER_DEEPSPEED = 1.25  # "auto" takes DeepSpeedCPUAdam only this much faster than torch's: it holds the GIL


def host_empty(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host memory for a copy to or from ``device``: page-locked where the device is a GPU.

    From ``REGISTER_MIN_BYTES`` on, the tensor is allocated pageable and registered with CUDA
    (``cudaHostRegister``, as torch.distributed.checkpoint's stager does) rather than taken from torch's pinned
    caching allocator, which rounds every block up to a power of two: a 113 M-parameter layer's bf16 gradient
    (226 MB) would hold 256 MiB, 4 GiB more host memory over a 2.9 B model's offloaded state. Unlike that
    allocator's blocks, nothing keeps registered memory alive for a copy in flight: when the storage dies (a
    re-layout drops its owner) the device is synchronized before it is unregistered and freed."""
    if device.type != "cuda":
        return torch.empty(n, dtype=dtype)
    if n * dtype.itemsize < REGISTER_MIN_BYTES:
        return torch.empty(n, dtype=dtype, pin_memory=True)
    t = torch.empty(n, dtype=dtype)
    storage = t.untyped_storage()
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(storage.data_ptr(), storage.nbytes(), 1)  # 1: portable
    if int(err):
        raise RuntimeError(f"lins.offload: page-locking {storage.nbytes() / 2**30:.2f} GiB of host memory failed "
                           f"({cudart.cudaGetErrorString(err)}); lower lins.host_memory_gb or raise the "
                           "locked-memory limit (ulimit -l)")
    finalizer = weakref.finalize(storage, _unregister, storage.data_ptr(), device)
    finalizer.atexit = False  # not after CUDA is gone
    return t


def _unregister(ptr: int, device: torch.device) -> None:
    """A registered buffer's storage died: no copy may still read or write it, then it is unregistered."""
    torch.cuda.synchronize(device)
    torch.cuda.cudart().cudaHostUnregister(ptr)


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


def square_sum(acc: torch.Tensor, scratch: torch.Tensor) -> float:
    """The squared L2 norm of ``acc``, summed in fp32 piece by piece through ``scratch`` (no fp32 copy of the whole
    chunk)."""
    total = 0.0
    for a in range(0, acc.numel(), HOST_PIECE):
        piece = acc[a:a + HOST_PIECE]
        if piece.dtype != torch.float32:
            piece = scratch[:piece.numel()].copy_(piece)
        total += float(torch.dot(piece, piece))
    return total


class HostGrads:
    """The G accumulators of the units whose gradients live on the host (the plan's ``offload_grads``), in pinned
    host memory, and the thread that adds each micro-batch's gradient into them (docs/design.md §13).

    ``push`` (the training thread, as a unit's reduction completes in a backward) sends the unit's reduced chunk
    down on a copy stream: straight into the accumulator where it is the window's first and of its dtype, else into
    the unit's down buffer, which the thread adds (or copies, converting) into the accumulator. On the backward that
    ends the window the thread then takes the accumulator's squared norm, so that the step finds the global
    gradient norm without another pass over host memory. Only layouts without a replica AllReduce place G here
    (``lins_ds.plan.offload.grads_may_leave``): the chunk that comes down is final for this micro-batch."""

    def __init__(self, units: list, accum_dtype: torch.dtype, device: torch.device):
        self.device, self.accum_dtype = device, accum_dtype
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.acc = {u: host_empty(u.g_numel, accum_dtype, device).zero_() for u in units}
        self._down: dict = {}  # unit -> the buffer a micro-batch's gradient lands in before the thread adds it
        self._free = {u: threading.Event() for u in units}  # the thread is done with the unit's down buffer
        for ev in self._free.values():
            ev.set()
        self._count = dict.fromkeys(units, 0)  # micro-batches pushed in this window
        self._sq: dict = {}  # unit -> the window's squared norm, once the backward that ends it pushed the unit
        self._scratch = torch.empty(min(HOST_PIECE, max((a.numel() for a in self.acc.values()), default=0)),
                                    dtype=torch.float32)
        self._queue: "queue.Queue" = queue.Queue()
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="lins-host-grads", daemon=True)
        self._thread.start()
        self.ends_window = True
        self.waited_s = 0.0  # how long the training thread has blocked on the host's gradient work, in total

    def units(self) -> list:
        return list(self.acc)

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.acc.values()) + sum(t.nbytes for t in self._down.values())

    def push(self, unit, src: torch.Tensor) -> None:
        """``src``, this micro-batch's reduced gradient of ``unit`` (its G chunk, on the device), towards the unit's
        host accumulator. ``src`` may be freed by the caller at once (its memory is kept for the copy)."""
        first = self._count[unit] == 0
        if first:  # the last step's host update of this unit reads the accumulator: done with it first
            unit.wait_host_update()
        direct = first and src.dtype == self.accum_dtype
        if direct:
            dst = self.acc[unit]
        else:
            self._wait(self._free[unit].wait)
            if unit not in self._down:
                self._down[unit] = host_empty(src.numel(), src.dtype, self.device)
            dst = self._down[unit]
            self._free[unit].clear()
        cs = self.copy_stream
        if cs is not None:
            cs.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(cs):
                dst.copy_(src, non_blocking=True)
                src.record_stream(cs)
                ev = torch.cuda.Event()
                ev.record(cs)
        else:
            dst.copy_(src)
            ev = None
        self._count[unit] += 1
        op = None if direct else ("copy" if first else "add")
        self._queue.put((unit, ev, op, self.ends_window))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # close()
                self._queue.task_done()
                return
            unit, _, op, _ = item
            try:
                if self._error is None:
                    self._add(*item)
            except BaseException as e:  # noqa: BLE001 - re-raised on the training thread by square_sum()
                self._error = e
            finally:
                if op is not None:  # it read the down buffer: the next push may write it
                    self._free[unit].set()
                self._queue.task_done()

    def _add(self, unit, ev, op: Optional[str], last: bool) -> None:
        """One pushed gradient into ``unit``'s accumulator (``op``: "copy", "add", or None where it came down
        straight into it), once its copy (``ev``) is done; on the window's last backward, the accumulator's norm."""
        if ev is not None:
            ev.synchronize()
        acc = self.acc[unit]
        with torch.no_grad():
            if op == "copy":
                acc.copy_(self._down[unit])
            elif op == "add":
                acc.add_(self._down[unit])
        if last:
            self._sq[unit] = square_sum(acc, self._scratch)
        else:
            self._sq.pop(unit, None)

    def square_sum(self) -> float:
        """At the step: every push of the window added up, and the squared norm of every host accumulator (a
        unit no backward of the window reached holds zeros). NaN if the thread failed (``error()`` says why: the
        caller raises on every rank after the norm's collective)."""
        self._wait(self._queue.join)
        if self._error is not None:
            return float("nan")
        total = 0.0
        for unit, acc in self.acc.items():
            if self._count[unit] == 0:
                unit.wait_host_update()
                acc.zero_()
                self._sq[unit] = 0.0
            elif unit not in self._sq:  # the window ended without a backward that said so (no_sync, then step)
                self._sq[unit] = square_sum(acc, self._scratch)
            total += self._sq[unit]
        return total

    def drain(self) -> None:
        """Every gradient pushed so far added into its accumulator: from here until the next backward pushes, the
        accumulators are final (what a host update reads). The step calls it before any host update starts."""
        self._wait(self._queue.join)

    def drained(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def forget_norms(self) -> None:
        """An accumulator was written from outside (``safe_set_full_grad``): its norm is taken again at the step."""
        self._sq = {u: v for u, v in self._sq.items() if self._count[u] == 0}

    def _wait(self, block) -> None:
        t0 = time.perf_counter()
        block()
        self.waited_s += time.perf_counter() - t0

    def reset(self) -> None:
        """After the step: the next window starts (the accumulators keep their values for the host update)."""
        self._queue.join()
        self._count = dict.fromkeys(self.acc, 0)
        self._sq.clear()

    def error(self) -> str:
        """Why the thread failed ('' when it did not)."""
        return "" if self._error is None else f"lins: adding gradients on the host failed: {self._error!r}"

    def close(self) -> None:
        """The thread ends (idempotent); the buffers go with this object (a re-layout, or another placement, builds
        new ones)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._queue.join()


class HostParams:
    """The P chunks of the units whose parameters live on the host (the plan's ``offload_params``; only where s_p =
    s_os, so that the host optimizer writes the P chunk itself and no P-sync follows): pinned, and before each use
    uploaded on a stream of their own — then all-gathered over the P group where s_p > 1 — into the unit's full
    buffer (docs/design.md §13). The host optimizer writes a unit's P chunk only after the step's events, which
    follow every use of its last upload."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def empty(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(n, dtype, self.device)

    def upload(self, chunk: torch.Tensor, dst: Optional[torch.Tensor], then=None) -> "_Uploaded":
        """Launch the copy of the host ``chunk`` up, on this stream: into ``dst`` (the unit's full buffer, allocated
        by the caller), or into a device buffer of its own that ``then(src)`` (the unit's AllGather, where s_p > 1)
        reads on the same stream; a handle whose ``wait()`` orders the current stream after both. The collective
        is the caller's (``Unit``): this class only copies."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the full buffer's memory is free there
        with torch.cuda.stream(self.stream):
            work = None
            if dst is not None:
                dst.copy_(chunk, non_blocking=True)
            else:
                src = torch.empty(chunk.numel(), dtype=chunk.dtype, device=self.device)
                src.copy_(chunk, non_blocking=True)
                work = then(src)
            done = torch.cuda.Event()
            done.record(self.stream)
        return _Uploaded(done, work, self.device)


class _Uploaded:
    """An upload (and its gather) in flight: ``wait()`` orders the current stream after both."""

    def __init__(self, done, work, device):
        self.done, self.work, self.device = done, work, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.done)
        if self.work is not None:
            self.work.wait()


class HostSlice:
    """One offloaded piece of an ``OSRange``: its pinned gradient (down at the step; where the unit's G lives on the
    host, a view into its accumulator), its parameter-dtype copy (up)."""

    def __init__(self, master, device: torch.device):
        self.master = master  # a MasterSlice whose param lives on the host
        n, dtype = master.param.numel(), master.range.unit.dtype
        unit = master.range.unit
        self.on_host = unit.host_grads is not None
        self.grad = master.range.grads() if self.on_host else host_empty(n, unit.accum_dtype, device)
        # the parameter-dtype copy that goes up: none for fp32 parameters (the master goes up) or for a unit whose P
        # is on the host (the master is cast straight into it)
        self.up = None if dtype == torch.float32 or unit.host_params is not None else host_empty(n, dtype, device)


class HostTicket:
    """One unit's host update of one step, what the unit holds while UPDATING (not the updater): the worker marks it
    done, with the event of the upload it launched; the unit's next use waits on it. Written by the worker only
    before ``done`` is set, read by the training thread only after."""

    def __init__(self, updater: "HostUpdater", unit_name: str):
        self._updater, self.unit_name = updater, unit_name
        self._done = threading.Event()
        self._upload = None  # the CUDA event of the upload (None on a CPU device)

    def finish(self, upload) -> None:
        """The worker: this unit's update is written and its upload (``upload``, an event or None) launched."""
        self._upload = upload
        self._done.set()

    def abandon(self) -> None:
        """The worker failed: whoever waits stops waiting (the error is raised on every rank at the step)."""
        self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def wait_done(self, timeout: float) -> bool:
        """Block up to ``timeout`` s for the worker; whether it is done with this unit."""
        return self._done.wait(timeout)

    def wait(self) -> None:
        """Block until the update is on the device, ordered before the current stream's next work (a failed update
        returns at once: every rank raises it at the next step boundary, ``HostUpdater.error``)."""
        self._updater.wait_for(self)
        if self._upload is not None and not self._updater.failed():
            torch.cuda.current_stream(self._updater.device).wait_event(self._upload)
            self._upload = None


class HostUpdater:
    """Runs the offloaded units' updates on a worker thread, in forward order; each unit's next use waits for its
    own (``Unit.begin_host_update`` with the unit's ``HostTicket``)."""

    def __init__(self, host_optimizer: HostOptimizer, slices_by_unit: list, device: torch.device):
        self.opt, self.device = host_optimizer, device
        self.by_unit = [(unit, [HostSlice(m, device) for m in masters]) for unit, masters in slices_by_unit]
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.coef = host_empty(1, torch.float32, device)
        # the fp32 gradient of the piece being updated: one buffer, reused (a fresh 128 MiB per piece costs its
        # page faults every time)
        self._scratch = torch.empty(max((s.grad.numel() for _, ss in self.by_unit for s in ss), default=0),
                                    dtype=torch.float32)
        self._thread: Optional[threading.Thread] = None
        self._tickets: list = []  # this step's, one per unit, in forward order
        self._error: Optional[BaseException] = None
        self.last_update_s = 0.0  # the worker's wall time in the last step (host updates and copies)
        self.last_spent_s: dict = {}  # ... of it waiting for the gradients, updating, launching the uploads
        self.waited_s = 0.0  # how long the main thread has blocked on host updates, in total (exposed host work)

    def units(self) -> list:
        return [u for u, _ in self.by_unit]

    def nbytes(self) -> int:
        """Host bytes of the offloaded state: masters, their optimizer state, the gradient and parameter copies."""
        n = 0
        for _, slices in self.by_unit:
            for s in slices:
                m = s.master.param
                n += m.nbytes + (0 if s.on_host else s.grad.nbytes) + (s.up.nbytes if s.up is not None else 0)
                n += sum(v.nbytes for v in self.opt.opt.state.get(m, {}).values() if torch.is_tensor(v) and v.dim())
        return n

    def download(self, coef: torch.Tensor) -> list:
        """Launch every host slice's gradient and the clip coefficient down; one event per unit (None on CPU)."""
        events = []
        cs = self.copy_stream
        if cs is not None:
            cs.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(cs) if cs is not None else nullcontext():
            self.coef.copy_(coef.reshape(1), non_blocking=cs is not None)
            coef_ready = None
            if cs is not None:
                coef.record_stream(cs)
                coef_ready = torch.cuda.Event()
                coef_ready.record(cs)
            for unit, slices in self.by_unit:
                if unit.host_grads is not None:  # its gradient is on the host already: final once drained
                    if not unit.host_grads.drained():
                        raise RuntimeError(f"lins: the host update of unit {unit.name} would read its gradient "
                                           "before the host has added every micro-batch's (HostGrads.drain() first)")
                    events.append(coef_ready)
                    continue
                for s in slices:
                    s.grad.copy_(s.master.range.grads(), non_blocking=cs is not None)
                if cs is not None:
                    unit.g_acc.record_stream(cs)  # freed after the step; reused only once the copy is done
                    ev = torch.cuda.Event()
                    ev.record(cs)
                    events.append(ev)
                else:
                    events.append(None)
        return events

    def start(self, events: list) -> None:
        """Begin the host updates (after ``download``); each unit enters UPDATING until the worker finishes it."""
        self._tickets = [HostTicket(self, u.name) for u, _ in self.by_unit]
        self._error = None
        hyper = self.opt.hyperparameters()
        for (unit, _), ticket in zip(self.by_unit, self._tickets):
            unit.begin_host_update(ticket)
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, args=(events, hyper), name="lins-host-update", daemon=True)
        self._thread.start()

    def _run(self, events: list, hyper: list) -> None:
        t0 = time.perf_counter()
        spent = dict.fromkeys(("download", "update", "upload"), 0.0)  # the worker's time by what it waited on
        try:
            ctx = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
            with ctx, torch.no_grad():
                for (unit, slices), ev, ticket in zip(self.by_unit, events, self._tickets):
                    t = time.perf_counter()
                    if ev is not None:
                        ev.synchronize()
                    coef = float(self.coef[0])
                    t, spent["download"] = time.perf_counter(), spent["download"] + time.perf_counter() - t
                    for s in slices:
                        self._update(s, coef, hyper)
                    t, spent["update"] = time.perf_counter(), spent["update"] + time.perf_counter() - t
                    ticket.finish(self._upload(slices))
                    spent["upload"] += time.perf_counter() - t
        except BaseException as e:  # noqa: BLE001 - raised on every rank at the next step boundary (error())
            self._error = e
            for ticket in self._tickets:
                ticket.abandon()
        self.last_update_s, self.last_spent_s = time.perf_counter() - t0, spent
        sys.setswitchinterval(self._interval)

    def _update(self, s: HostSlice, coef: float, hyper: list) -> None:
        update_piece(self.opt, s.master.param, s.grad, s.up, self._scratch, coef, hyper)

    def _upload(self, slices: list):
        """Launch the updated slices' copy up; the event that marks it done (None on a CPU device: synchronous)."""
        cs = self.copy_stream
        with torch.cuda.stream(cs) if cs is not None else nullcontext():
            for s in slices:
                s.master.range.params().copy_(s.up if s.up is not None else s.master.param.data,
                                              non_blocking=cs is not None)
            if cs is None:
                return None
            done = torch.cuda.Event()
            done.record(cs)
            return done

    def wait_for(self, ticket: HostTicket) -> None:
        """Block until the worker is done with ``ticket`` (counted as exposed host time); a worker that died outside
        its own handler is an error, as a failed update is."""
        if ticket.ready():
            return
        t0 = time.perf_counter()
        while not ticket.wait_done(1.0):
            if self._thread is None or not self._thread.is_alive():
                if not ticket.ready():
                    self._error = self._error or RuntimeError(f"the host update thread ended before updating unit "
                                                              f"{ticket.unit_name}")
                    break
        self.waited_s += time.perf_counter() - t0

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def failed(self) -> bool:
        return self._error is not None

    def clear_error(self) -> None:
        """A checkpoint load replaces what the failed update left: training may go on."""
        self._error = None

    def error(self) -> str:
        """Why the last host update failed on this rank ('' if it did not): its units kept their old values, and the
        caller makes every rank raise it (``LinsOptimizer.check_host``)."""
        if self._error is None:
            return ""
        return f"lins: the host optimizer's update failed on rank {comm.rank()}: {type(self._error).__name__}: " \
               f"{self._error}"


def measure(basic, kind: str, device: torch.device, capacity_gb: float, elems: int = 1 << 24,
            grad_dtypes: tuple = (torch.bfloat16, torch.bfloat16)) -> tuple:
    """(HostSpec, host optimizer kind): this host's offload speeds, timed here: the host optimizer's update of ``elems`` fp32 elements (a unit's
    piece) and pinned copies of a bf16 tensor of that size each way. ``kind`` "auto" tries torch's fused Adam and
    DeepSpeedCPUAdam, and keeps DeepSpeedCPUAdam only if ``PREFER_DEEPSPEED`` times faster: its update holds the
    GIL, which stalls the training thread's kernel launches while the forward overlaps it."""
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
    return HostSpec(capacity_gb, best[0], h2d, d2h, best[1], f"measured on {device.type}",
                    *_time_accumulate(device, elems, *grad_dtypes)), best[2]


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
