"""The host optimizer of offloaded units (docs/design.md §13): the engine optimizer's hyperparameters with a CPU
implementation of its update, and the start-up measurement of this host's offload speeds (``measure``).

The update is memory-bound (``lins_ds.plan.host_update`` counts its bytes per element), so it is written to move as
few bytes as the numerics allow: torch's fused Adam/AdamW kernel is element-wise, so a piece is updated in blocks
that stay in the last-level cache (``block_elems``) — the gradient made fp32 and scaled, the kernel on the block's
views, the master cast for the upload — and nothing but the state and the two copies crosses memory (28 bytes per
bf16 element, where four passes over the whole piece moved 48). The results are the same bits. Each pass over a block
is a parallel region, so on many threads a block is larger than the cache's share (``PER_THREAD_BLOCK``): there the
fork and join cost more than the bytes a block that spills moves again."""

from __future__ import annotations

import collections
import contextlib
import copy
import statistics
import sys
import threading
import time
from typing import Optional

import torch

from ... import comm
from ...plan.host_update import BLOCKS, PIECE, achieved_fraction, bytes_per_element
from ...plan.offload import HostSpec
from ...profiler import host_bandwidth, host_rate
from ..errors import LinsConfigError
from .host_blocks import fused_blocks, scripted
from .host_memory import HOST_PIECE, SWITCH_INTERVAL_S, host_empty, host_threads, intra_op_threads, square_sum

PREFER_DEEPSPEED = 1.25  # "auto" takes DeepSpeedCPUAdam only this much faster than torch's: it holds the GIL
# A block starts at a multiple of every vector width and of the fused kernel's task unit (16 fp32 elements, a cache
# line): each element takes the same code path (vector body or scalar tail) as in one call over the whole piece.
BLOCK_ALIGN = 1024
# Last-level cache per element of a block: the ~28 bytes it holds there between the passes over it (bf16 gradient and
# parameter copy, fp32 gradient, master and moments) take under a quarter of the cache, since a shared cache (other
# processes and tenants, a non-inclusive cache's other victims) holds less than its size says. On a 2-core slice of a
# 300 MiB Emerald Rapids cache, blocks of 1-2 M elements ran 18 % faster than the staged update, 4.9 M no faster.
BLOCK_CACHE_BYTES = 128
# At least this many elements per block: at most 32 blocks, 128 calls, per HOST_PIECE. Each call is a parallel region
# (~15 us on 16 threads, more where the threads outnumber the free cores) and a GIL hand-over.
MIN_BLOCK = 1 << 20
# At least this many elements of a block per intra-op thread: each pass over a block is one parallel region, and a
# thread's share must outweigh its fork and join. On a 16-core GPU host (105 MiB L3) the update on 15 threads ran
# 3.20 G elements/s in blocks of 8 M elements against 2.60 in the 1 M its cache share gave (70 k per thread), alone
# (bench/results/offload/blocks_h100/second_call/host_update.txt); on one thread 1-2 M had run best.
PER_THREAD_BLOCK = 1 << 19
# ``measure`` times an update that scales: the coefficient (1 / ranks, times the clip factor) is rarely exactly 1, the
# one value whose pass is skipped
TIMED_COEF = 0.5
# Each start-up timing repeats its work for at least this long and keeps the median call (``_per_second``)
TIMED_S = 0.5


def block_elems(llc_bytes: int, sharers: int = 1, threads: int = 1) -> int:
    """Elements per block of a piece's update: what fits the share of the last-level cache (``llc_bytes``) one of
    the ``sharers`` ranks updating at once may use, and at least ``PER_THREAD_BLOCK`` for each of the ``threads``
    each of its passes splits it among; from ``MIN_BLOCK`` to ``HOST_PIECE``, a multiple of ``BLOCK_ALIGN``."""
    n = max(llc_bytes // (BLOCK_CACHE_BYTES * max(1, sharers)), PER_THREAD_BLOCK * max(1, threads))
    return max(MIN_BLOCK, min(HOST_PIECE, n)) // BLOCK_ALIGN * BLOCK_ALIGN


def _fused_kernels() -> bool:
    """Whether this torch has the fused Adam/AdamW kernels the blocked update calls."""
    return hasattr(torch, "_fused_adam_") and hasattr(torch, "_fused_adamw_")


def _scalar(x):
    """A hyperparameter as the fused kernel takes it (torch's ``_to_scalar``: a one-element tensor's value)."""
    return x.item() if torch.is_tensor(x) and x.numel() == 1 else x


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
    state dict (so checkpoints see one optimizer). ``path``: how a piece is updated (``plan.host_update``): BLOCKS
    with torch's fused Adam/AdamW, else PIECE (the optimizer's own step over the whole piece). ``threads``: the
    intra-op threads the update runs on (``host_memory.host_threads``), applied by whoever runs it
    (``HostUpdater``'s worker, ``measure``) with ``host_memory.intra_op_threads``."""

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
        self.path = BLOCKS if ds_cls is None and mode is not None and _fused_kernels() else PIECE
        if self.path == BLOCKS:
            scripted()  # compiled here, on the thread that builds the engine, not first in the host worker
        self.threads = host_threads(comm.local_world_size())
        self.block = block_elems(host_bandwidth.last_level_cache_bytes(), comm.local_world_size(), self.threads)
        self._group_of = {p: g for g in self.opt.param_groups for p in g["params"]}

    def hyperparameters(self) -> list:
        """The engine optimizer's hyperparameters now, per group: taken on the training thread when the step's host
        updates start (the LR scheduler steps right after ``step()`` returns, while they still run)."""
        return [{k: theirs[k] for k in _HYPER if k in theirs and k in mine}
                for mine, theirs in zip(self.opt.param_groups, self.basic.param_groups)]

    def step(self, masters: list, hyper: list) -> None:
        """One update of ``masters`` (their ``.grad`` set) with ``hyper`` (``hyperparameters()``)."""
        self._take(hyper)
        self._own_steps(masters)
        if isinstance(self.opt, torch.optim.Optimizer) and type(self.opt) is type(self.basic):
            type(self.basic).step(self.opt)  # the class's step: a scheduler may have wrapped the instance's own
        else:
            self.opt.step()

    def update(self, master: torch.Tensor, grad: torch.Tensor, up: Optional[torch.Tensor], scratch: torch.Tensor,
               coef: float, hyper: list) -> None:
        """One host piece's update (``update_piece``) along ``path``."""
        if self.path == BLOCKS:
            self._take(hyper)
            self._own_steps([master])
            with torch.no_grad():
                self._fused_blocks(master, grad, up, scratch, coef)
            return
        g = scratch[:grad.numel()]
        flat = grad.reshape(-1)
        for a in range(0, g.numel(), self.block):  # each block's scaling reads and writes cache, not memory
            _scaled(g[a:a + self.block], flat[a:a + self.block], coef)
        master.grad = g.view_as(master)
        self.step([master], hyper)
        master.grad = None
        if up is not None:
            up.copy_(master.data)

    def _take(self, hyper: list) -> None:
        for mine, values in zip(self.opt.param_groups, hyper):
            mine.update(values)

    def _own_steps(self, masters: list) -> None:
        """Step counts as this kind keeps them: a checkpoint may have been written by the other kind of optimizer."""
        for p in masters:
            st = self.opt.state.get(p)
            if st and "step" in st:
                if self._int_step and torch.is_tensor(st["step"]):
                    st["step"] = int(st["step"].item())
                elif not self._int_step and (not torch.is_tensor(st["step"]) or st["step"].dtype != torch.float32):
                    st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)

    def _fused_state(self, master: torch.Tensor, group: dict) -> dict:
        """``master``'s state as torch's fused Adam keeps it (made as its ``_init_group`` makes it at the first step),
        its step counted once for the whole piece, before the kernel reads it (as ``_fused_adam`` does)."""
        state = self.opt.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                state[name] = torch.zeros_like(master, memory_format=torch.preserve_format)
        state["step"].add_(1)
        return state

    def _fused_blocks(self, master: torch.Tensor, grad: torch.Tensor, up: Optional[torch.Tensor],
                      scratch: torch.Tensor, coef: float) -> None:
        """torch's fused Adam/AdamW kernel on ``master``, one cache-sized block at a time: the block's gradient made
        fp32 and scaled in ``scratch``, the kernel on the block's views of master and moments, the block's master
        cast into ``up``. The kernel is element-wise and every block starts at a multiple of ``BLOCK_ALIGN``, so this
        is the class's step over the whole piece, bit for bit, without the fp32 gradient and the master crossing
        memory again between the passes."""
        group = self._group_of[master]
        state = self._fused_state(master, group)
        # a group's own mode first, as torch's Adam.step reads it (AdamW's groups carry True unless set otherwise)
        decoupled = group.get("decoupled_weight_decay", isinstance(self.opt, torch.optim.AdamW))
        beta1, beta2 = group["betas"]
        lr = group["lr"]  # a tensor LR on another device goes where the kernel runs, as torch's _fused_adam moves it
        lr = lr.to("cpu") if torch.is_tensor(lr) and lr.device.type != "cpu" else lr
        vmax = state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
        fused_blocks(master.detach().view(-1), grad.reshape(-1), state["exp_avg"].view(-1),
                     state["exp_avg_sq"].view(-1), vmax, up, scratch, [state["step"]], coef, self.block, decoupled,
                     lr, _scalar(beta1), _scalar(beta2), group["weight_decay"], group["eps"], group["amsgrad"],
                     group.get("maximize", False))


def _scaled(dst: torch.Tensor, src: torch.Tensor, coef: float) -> torch.Tensor:
    """``src`` as fp32 in ``dst``, times ``coef`` (no pass where it is 1: x * 1.0 is x, bit for bit)."""
    dst.copy_(src)
    if coef != 1.0:
        dst.mul_(coef)
    return dst


def update_piece(opt: HostOptimizer, master: torch.Tensor, grad: torch.Tensor, up: Optional[torch.Tensor],
                 scratch: torch.Tensor, coef: float, hyper: list) -> None:
    """One host piece's update: its gradient (as it came down) to fp32 in ``scratch``, scaled by ``coef`` (the
    loss-scale, averaging and clipping factor), the optimizer step, the master cast into ``up`` for the upload (None:
    the master goes up itself). ``scratch`` holds at least the piece's elements (the PIECE path stages all of them;
    BLOCKS uses one block of it)."""
    opt.update(master, grad, up, scratch, coef, hyper)


def measure(basic, kind: str, device: torch.device, capacity_gb: float, elems: Optional[int] = None,
            grad_dtypes: tuple = (torch.bfloat16, torch.bfloat16), cache_dir: Optional[str] = None) -> tuple:
    """(HostSpec, host optimizer kind): this host's offload speeds, timed here: the host optimizer's update of
    ``elems`` fp32 elements (a unit's piece; by default ``update_elems()``, more than the last-level cache holds)
    and pinned copies of a bf16 tensor of that size each way. ``kind`` "auto" tries torch's fused Adam and
    DeepSpeedCPUAdam, and keeps DeepSpeedCPUAdam only if ``PREFER_DEEPSPEED`` times faster: its update holds the
    GIL, which stalls the training thread's kernel launches while the forward overlaps it. The host's memory
    bandwidth (``profiler.host_bandwidth``, cached in ``cache_dir``) is measured beside it, and the HostSpec's
    ``source`` says how close to it the update comes for the bytes its path moves. That choice is timed on an idle
    host; the speeds the planner prices a step with (the update, the gradient sums and norms) are then timed as a step
    runs them: beside the training thread (``beside_training``), on the threads the host updater gives them. Where
    runs on this host kept their workers' rates in training (``profiler.host_rate``: one after the step, one of
    updates inside the last backward), the update is priced at those instead."""
    elems = elems or update_elems()
    kinds = ["torch", "deepspeed"] if kind == "auto" and adam_mode(basic) is not None else [kind if kind != "auto" else "torch"]
    best = None
    for k in kinds:
        try:
            rate, name, path, threads = _time_update(basic, k, device, elems, grad_dtypes[0])
        except Exception as e:  # noqa: BLE001 - an optimizer that cannot step on the CPU (a CUDA-only kernel)
            if kind != "auto":
                raise LinsConfigError(f"lins.host_optimizer: {k!r} cannot update {type(basic).__name__} on this "
                                      f"host ({type(e).__name__}: {e})") from None
            continue
        if best is None or rate > best[0] * (PREFER_DEEPSPEED if k == "deepspeed" else 1.0):
            best = (rate, name, k, path, threads)
    if best is None:
        raise LinsConfigError(f"lins.offload: no host optimizer can update {type(basic).__name__} on this host "
                              "(torch's CPU Adam needs an Adam; another optimizer must step on CPU tensors)")
    h2d, d2h = _time_copies(device, elems)
    with intra_op_threads(best[4]):  # the threads the update and the gradient sums run on
        bandwidth = host_bandwidth.obtain(cache_dir, comm.local_world_size())
        with beside_training(device):
            rate = _time_update(basic, best[2], device, elems, grad_dtypes[0])[0]
            accumulate = _time_accumulate(device, elems, *grad_dtypes)
    source = (f"measured on {device.type} beside a training-like thread; the update alone {best[0] / 1e9:.2f} G "
              f"elements/s, {bandwidth_note(best[0], best[3], bandwidth, grad_dtypes[0].itemsize)}")
    kept = {mode: host_rate.load(cache_dir, host_rate.key(device.type, comm.local_world_size(), best[1], best[4],
                                                          str(grad_dtypes[0]), mode)) for mode in (False, True)}
    words = [f"{r / 1e9:.2f} G elements/s {'inside the last backward' if mode else 'after the step'} ({path})"
             for mode, (r, path) in kept.items() if r is not None]
    if words:  # what the last runs' workers on this host ran in training, not the stand-in's timing
        source = f"the update as the last runs on this host ran it in training: {'; '.join(words)}; " \
                 f"{rate / 1e9:.2f} at start-up, " + source
    return HostSpec(capacity_gb, kept[False][0] or rate, h2d, d2h, best[1], source, *accumulate,
                    in_backward_update_elems_per_s=kept[True][0]), best[2]


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


def update_elems() -> int:
    """Elements ``measure`` updates: a piece whose bytes are ``LLC_MULTIPLE`` times the last-level cache (so the
    update is timed against memory, as a whole unit's is), at least 16 M."""
    llc = host_bandwidth.last_level_cache_bytes()
    n = max(1 << 24, host_bandwidth.LLC_MULTIPLE * llc // bytes_per_element(BLOCKS))
    return n // BLOCK_ALIGN * BLOCK_ALIGN


def bandwidth_note(elems_per_s: float, path: str, bandwidth: "host_bandwidth.HostBandwidth", grad_bytes: int) -> str:
    """The start-up summary's words on the host update against the host's memory bandwidth (for bf16 parameters)."""
    per = bytes_per_element(path, grad_bytes)
    share = achieved_fraction(elems_per_s, bandwidth.copy_gbs, path, grad_bytes)
    return (f"update {elems_per_s * per / 1e9:.1f} GB/s for its {per} bytes per element ({path}), {100 * share:.0f} % "
            f"of the host's {bandwidth.copy_gbs:.1f} GB/s copy bandwidth (triad {bandwidth.triad_gbs:.1f}; "
            f"{bandwidth.threads} threads; {bandwidth.origin})")


def _time_update(basic, kind: str, device: torch.device, elems: int, grad_dtype: torch.dtype) -> tuple:
    """(elements per second, optimizer name, path, threads) of one piece's update with a gradient of ``grad_dtype``
    (the G accumulator's, as the update reads it) and a bf16 copy up, scaled by ``TIMED_COEF``, on the intra-op
    threads the host updater gives it (``HostOptimizer.threads``)."""
    p = torch.nn.Parameter(torch.zeros(elems, dtype=torch.float32))
    probe = copy.copy(basic)
    probe.param_groups = [{**{k: v for k, v in basic.param_groups[0].items() if k != "params"}, "params": []}]
    probe.state = collections.defaultdict(dict)
    opt = HostOptimizer(probe, [[p]], kind, device)
    grad, up = host_empty(elems, grad_dtype, device).fill_(1e-3), host_empty(elems, torch.bfloat16, device)
    scratch, hyper = torch.empty(elems, dtype=torch.float32), opt.hyperparameters()
    with intra_op_threads(opt.threads):
        rate = _per_second(lambda: update_piece(opt, p, grad, up, scratch, TIMED_COEF, hyper), elems)
    return rate, opt.name, opt.path, opt.threads


def _per_second(work, elems: int, reps: int = 3, at_least_s: Optional[float] = None) -> float:
    """Elements per second of ``work`` over ``elems`` elements: one untimed call (state allocation, page faults),
    then at least ``reps`` timed calls, and more until ``at_least_s`` (``TIMED_S``) has passed; the median call. A
    piece takes ~20 ms on a GPU host, and three of them (the mean) gave start-up rates of 1.9-2.9 G elements/s in
    three launches on one machine, where the host worker of those jobs ran 1.6-2.3 (bench/results/offload/
    blocks_h100/): one slow or fast call no longer sets the price."""
    at_least_s = TIMED_S if at_least_s is None else at_least_s
    work()
    times, start = [], time.perf_counter()
    while len(times) < reps or time.perf_counter() - start < at_least_s:
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return elems / statistics.median(times)


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
