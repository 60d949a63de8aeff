"""The blocked host update's loop over a piece (``HostOptimizer._fused_blocks``, docs/design.md §13), run as one
TorchScript call where TorchScript compiles it.

Each cache-sized block takes about four torch ops (the gradient made fp32, its scaling, the fused Adam kernel, the cast
up), and each op called from Python takes the GIL back when it returns. Beside a training thread that runs Python
(the backward's hooks, the checkpointed layers' recompute) every one of those hand-overs waits: on one H100 host the
same unit's update took 58-87 ms inside the last backward and 22-41 ms after it (bench/results/offload/rate_h100/,
the workers' timelines). A scripted function runs its whole loop in TorchScript's interpreter without the GIL. The
loop is one function either way: compiled, or run as the Python it is where TorchScript cannot (a tensor learning
rate, a torch without it); the ops, and so the bits, are the same.
"""

from __future__ import annotations

import threading
import warnings
from typing import List, Optional

import torch

__all__ = ["fused_blocks", "scripted"]


def _loop(p: torch.Tensor, g_in: torch.Tensor, m: torch.Tensor, v: torch.Tensor, vmax: List[torch.Tensor],
          up: Optional[torch.Tensor], scratch: torch.Tensor, steps: List[torch.Tensor], coef: float, block: int,
          decoupled: bool, lr: float, beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool,
          maximize: bool) -> None:
    """torch's fused Adam (``decoupled``: AdamW) over flat ``p`` with moments ``m``, ``v`` (and ``vmax[0]`` with
    amsgrad), ``block`` elements at a time: the block's gradient ``g_in`` as fp32 in ``scratch``, times ``coef`` (no
    pass where it is 1), the kernel on the block's views, the block's ``p`` cast into ``up`` (None: no copy)."""
    n = p.numel()
    a = 0
    while a < n:
        b = min(n, a + block)
        g = scratch[:b - a]
        g.copy_(g_in[a:b])
        if coef != 1.0:
            g.mul_(coef)
        vm: List[torch.Tensor] = []
        if len(vmax) > 0:
            vm = [vmax[0][a:b]]
        ps = [p[a:b]]  # read again below: TorchScript keeps a call whose mutated lists nothing reads (checked)
        if decoupled:
            torch._fused_adamw_(ps, [g], [m[a:b]], [v[a:b]], vm, steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)
        else:
            torch._fused_adam_(ps, [g], [m[a:b]], [v[a:b]], vm, steps, lr=lr, beta1=beta1, beta2=beta2,
                               weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize)
        if up is not None:
            up[a:b].copy_(ps[0])
        a = b


_compiled: list = []  # [the scripted loop, or None where it cannot be used], once per process
_lock = threading.Lock()


def scripted():
    """``_loop`` compiled by TorchScript (once; its deprecation warning is not the user's to read), or None where
    this torch cannot script it or the compiled loop does not give the Python loop's bits (``_same_bits``: a
    compiler that drops or reorders an in-place call must not change an update)."""
    with _lock:
        if not _compiled:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    loop = torch.jit.script(_loop)
                _compiled.append(loop if _same_bits(loop) else None)
            except Exception:  # noqa: BLE001 - no TorchScript here: the same loop runs as Python
                _compiled.append(None)
        return _compiled[0]


def _same_bits(loop) -> bool:
    """Whether ``loop`` updates as ``_loop`` does, bit for bit: Adam and AdamW, amsgrad, with and without the copy
    up, over several blocks and a partial one."""
    n, block = 2500, 1024
    for decoupled, amsgrad, with_up in ((True, False, True), (False, True, False)):
        out = []
        for fn in (_loop, loop):
            gen = torch.Generator().manual_seed(0)
            p, m, v, vmax = (torch.randn(n, generator=gen) for _ in range(4))
            v, vmax = v.abs(), vmax.abs()
            grad = torch.randn(n, generator=gen).to(torch.bfloat16)
            up = torch.empty(n, dtype=torch.bfloat16) if with_up else None
            with _plain():  # as ``fused_blocks`` runs it
                fn(p, grad, m, v, [vmax] if amsgrad else [], up, torch.empty(block), [torch.ones(())], 0.5, block,
                   decoupled, 1e-2, 0.9, 0.999, 0.01, 1e-8, amsgrad, False)
            out.append([p, m, v, vmax] + ([up] if with_up else []))
        if not all(torch.equal(a, b) for a, b in zip(*out)):
            return False
    return True


def fused_blocks(p, g_in, m, v, vmax: Optional[torch.Tensor], up: Optional[torch.Tensor], scratch, steps: list,
                 coef: float, block: int, decoupled: bool, lr, beta1: float, beta2: float, weight_decay: float,
                 eps: float, amsgrad: bool, maximize: bool) -> None:
    """``_loop``, scripted where it can be (a float learning rate: the kernel's tensor-LR overload stays in Python)."""
    loop = scripted() if not torch.is_tensor(lr) else None
    with _plain():
        (loop or _loop)(p, g_in, m, v, [vmax] if vmax is not None else [], up, scratch, steps, float(coef),
                        int(block), bool(decoupled), lr if torch.is_tensor(lr) else float(lr), float(beta1),
                        float(beta2), float(weight_decay), float(eps), bool(amsgrad), bool(maximize))


def _plain():
    """This thread's TorchScript calls run their graph as compiled, without the profiling executor's optimisation
    (thread-local): it specialises a graph to the shapes it saw and compiles again when they change, and every piece
    and block here has its own length; the loop's ops are whole kernels, which no graph optimisation speeds up."""
    return torch.jit.optimized_execution(False)
