"""The one map between dtype names ("fp32", "bf16", "fp16": the planner's, ``lins_ds.plan.spec.DTYPES``)
and torch dtypes, with the spellings DeepSpeed and Hugging Face configs use."""

from __future__ import annotations

import torch

from .plan.spec import DTYPES

TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ALIASES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
HF_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # config.json's "torch_dtype"
assert set(TORCH) == set(DTYPES)


def canonical(name: str) -> str:
    """"fp32" / "bf16" / "fp16" for any accepted spelling ("torch.bfloat16", "half", ...); ValueError else."""
    key = str(name).lower().split(".")[-1]
    key = ALIASES.get(key, key)
    if key not in TORCH:
        raise ValueError(f"{name!r} is not one of {', '.join(DTYPES)}")
    return key


def torch_dtype(name: str) -> torch.dtype:
    return TORCH[canonical(name)]


def name_of(dtype: torch.dtype) -> str:
    return {v: k for k, v in TORCH.items()}[dtype]
