"""A multi-process CPU run of accelerate (and so of the HF Trainer) with DeepSpeed counts one process.

Cause (accelerate 1.x, ``PartialState.__init__``): ``_prepare_backend(cpu=False)`` only recognises
accelerator backends, and treats CPU as distributed only when ``cpu=True``. On a machine without an
accelerator it therefore returns backend None; the DeepSpeed branch still initialises a gloo group of
every rank, but the "no backend" branch then sets ``num_processes = 1`` and ``process_index = 0`` on
every rank. Each rank then sees the whole dataset, the batch-size arithmetic uses world size 1 (the
Trainer fails DeepSpeed's batch check), and nothing is sharded.

Fix: in exactly that situation — no accelerator, ``cpu=False``, a launcher's LOCAL_RANK, DeepSpeed on —
report the gloo backend and MULTI_CPU, which is what DeepSpeed itself uses there. Every other case
goes to accelerate unchanged.
"""

from __future__ import annotations

import os

import torch


def _no_accelerator() -> bool:
    return not torch.cuda.is_available() and not (hasattr(torch, "xpu") and torch.xpu.is_available())


def install() -> None:
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "_lins_patched", False):
        return

    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        backend_out, dtype = original(self, cpu, sagemaker_dp, backend)
        if (backend_out is None and not cpu and not sagemaker_dp and _no_accelerator()
                and int(os.environ.get("LOCAL_RANK", -1)) != -1
                and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"):
            return "gloo", DistributedType.MULTI_CPU
        return backend_out, dtype

    _prepare_backend._lins_patched = True
    PartialState._prepare_backend = _prepare_backend
