"""The limit an engine should reach on one GPU: a plain PyTorch training loop with no engine at all
(``python -m bench.train --plain ...``), driven by the same script, batches and DeepSpeed config as every mode.

What a careful user writes by hand for bf16 training with fp32 master weights: bf16 parameters on the device; after
each backward their gradients added into fp32 gradient buffers (one multi-tensor kernel); at the window's last
micro-batch the global norm clipped to ``gradient_clipping``, torch's fused AdamW on the fp32 masters, the masters
copied back into the bf16 parameters. The loss of each micro-batch is divided by the accumulation, as DeepSpeed does.
One process only: the loop has no data parallelism (that is DDP's job, not this baseline's).
"""

from __future__ import annotations

import torch


class PlainLoop:
    """The subset of DeepSpeed's engine that ``bench.train`` drives: call, ``backward``, ``step`` (every micro-batch;
    the update at the window's boundary), the batch sizes, ``module``, ``device``, ``destroy``."""

    def __init__(self, model: torch.nn.Module, ds_config: dict, device: torch.device):
        self.module, self.device = model, device
        self._micro = int(ds_config.get("train_micro_batch_size_per_gpu", 1))
        self._gas = int(ds_config.get("gradient_accumulation_steps", 1))
        self.clip = float(ds_config.get("gradient_clipping", 0.0))
        bf16 = (ds_config.get("bf16") or {}).get("enabled", False)
        model.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [p.detach().float() for p in self.params] if bf16 else self.params
        self.grads = [torch.zeros_like(m) for m in self.masters]
        for m, g in zip(self.masters, self.grads):
            m.grad = g
        opt = ds_config.get("optimizer") or {"type": "AdamW", "params": {}}
        if opt.get("type", "").lower() not in ("adamw", "adam"):
            raise SystemExit(f"--plain: optimizer.type {opt.get('type')!r}: the plain loop runs AdamW or Adam only")
        hp = {k: v for k, v in opt.get("params", {}).items() if k in ("lr", "betas", "eps", "weight_decay")}
        cls = torch.optim.AdamW if opt["type"].lower() == "adamw" else torch.optim.Adam
        self.optimizer = cls(self.masters, fused=device.type == "cuda", **hp)
        self._count = 0

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self._gas).backward()
        if self.masters is not self.params:
            torch._foreach_add_(self.grads, [p.grad for p in self.params])
            for p in self.params:
                p.grad = None

    def step(self) -> None:
        self._count += 1
        if self._count % self._gas:
            return
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.masters, self.clip, foreach=True)
        self.optimizer.step()
        if self.masters is not self.params:
            torch._foreach_copy_([p.data for p in self.params], self.masters)
        torch._foreach_zero_(self.grads)

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._micro

    def gradient_accumulation_steps(self) -> int:
        return self._gas

    def destroy(self) -> None:
        pass
