"""DeepSpeed's universal checkpoint: reading it (and so any DeepSpeed ZeRO-1/2/3 checkpoint, through DeepSpeed's
own ``ds_to_universal`` conversion), and writing one from a Lins checkpoint (docs/design.md §9).

A universal checkpoint holds, per parameter name, whole fp32 tensors: ``zero/<name>/fp32.pt``,
``exp_avg.pt``, ``exp_avg_sq.pt`` (a ``{"param": tensor}`` dict, or a flat tensor when converted from
ZeRO-3) and ``step.pt``; ``zero/optimizer_state.pt`` has the param groups (and, from ZeRO-3, the step);
``*model_states.pt`` the engine counters, LR scheduler and ``client_state``. DeepSpeed ZeRO-1/2 read
``mp_rank_00_model_states.pt`` and ZeRO-3 ``zero_pp_rank_0_mp_rank_00_model_states.pt``: the writer
writes both, so every stage loads it with ``"checkpoint": {"load_universal": true}``.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
from typing import Optional

import torch

from .formats import LATEST_UNIVERSAL, LinsCheckpointError, load_deepspeed

ADAM_STATE = {"master": "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # Lins key -> file name
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def _load(path: str, trust: bool = False):
    try:
        return load_deepspeed(path, trust)
    except LinsCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read is a broken file, named
        raise LinsCheckpointError(f"load_checkpoint: {path} is unreadable (truncated or corrupted?): "
                                  f"{type(e).__name__}: {str(e)[:200]}") from None


@contextlib.contextmanager
def _deepspeed_reads(trust: bool):
    """While DeepSpeed's own code reads a checkpoint (ds_to_universal asks ``torch.load(weights_only=False)``), its
    reads go through ``load_deepspeed``: DeepSpeed's classes and data only, unless ``trust``."""
    real = torch.load

    def load(f, *args, weights_only=None, **kwargs):
        kwargs.pop("map_location", None)
        return load_deepspeed(f, trust, real_load=lambda p, **kw: real(p, *args, **{**kwargs, **kw}))

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def convert(deepspeed_dir: str, work_dir: str, trust: bool = False) -> str:
    """Convert a DeepSpeed ZeRO checkpoint to a universal one with DeepSpeed's own ``ds_to_universal``, into
    ``work_dir/universal`` (DeepSpeed also writes ``latest_universal`` into ``work_dir``, never beside the
    user's checkpoint). Returns the universal directory."""
    from deepspeed.checkpoint.ds_to_universal import main

    out = os.path.join(work_dir, "universal")
    args = argparse.Namespace(input_folder=deepspeed_dir, output_folder=out, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    try:
        with _deepspeed_reads(trust):
            main(args)
    except LinsCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - DeepSpeed's converter on a checkpoint it cannot read
        raise LinsCheckpointError(f"load_checkpoint: DeepSpeed's ds_to_universal could not convert {deepspeed_dir}: "
                                  f"{type(e).__name__}: {str(e)[:300]}") from None
    return out


class UniversalReader:
    """Element ranges of whole parameters, by name, from a universal checkpoint (one parameter cached)."""

    def __init__(self, path: str, trust: bool = False):
        """``trust`` (``lins.checkpoint_pickle``): read the files in full; else DeepSpeed's data only."""
        self.path, self.trust = path, trust
        states = [os.path.join(path, f) for f in MODEL_STATES if os.path.isfile(os.path.join(path, f))]
        states = states or sorted(glob.glob(os.path.join(path, "*model_states.pt")))
        if not states:
            raise LinsCheckpointError(f"load_checkpoint: {path} has no DeepSpeed *model_states.pt")
        self.model_states = _load(states[0], trust)
        self.optimizer = _load(os.path.join(path, "zero", "optimizer_state.pt"), trust)
        self._cache: tuple = (None, None)

    def _tensor(self, name: str, what: str) -> Optional[torch.Tensor]:
        key = (name, what)
        if self._cache[0] == key:
            return self._cache[1]
        f = os.path.join(self.path, "zero", name, f"{ADAM_STATE[what]}.pt")
        if not os.path.isfile(f):
            return None
        t = _load(f, self.trust)
        t = (t["param"] if isinstance(t, dict) else t).detach().float().reshape(-1)
        self._cache = (key, t)
        return t

    def has(self, name: str) -> bool:
        return os.path.isdir(os.path.join(self.path, "zero", name))

    def check(self, name: str, a: int, b: int, what: str) -> bool:
        """``fill`` will find [a, b) of ``name``'s ``what`` (read: a universal file holds the whole parameter)."""
        t = self._tensor(name, what)
        if t is None:
            return False
        if t.numel() < b:
            raise LinsCheckpointError(f"load_checkpoint: {self.path}: zero/{name}/{ADAM_STATE[what]}.pt holds "
                                      f"{t.numel()} elements, fewer than {b}")
        return True

    def fill(self, dest: torch.Tensor, name: str, a: int, b: int, what: str) -> bool:
        t = self._tensor(name, what)
        if t is None:
            if what == "master":
                raise LinsCheckpointError(f"load_checkpoint: {self.path} has no zero/{name}/fp32.pt")
            return False
        dest.copy_(t[a:b])
        return True

    def scalar(self, group: int, key: str):
        """The optimizer's step (DeepSpeed keeps one per group, the same for all its parameters)."""
        if key != "step":
            return None
        steps = glob.glob(os.path.join(self.path, "zero", "*", "step.pt"))
        if steps:
            return _load(steps[0], self.trust).detach().reshape(()).clone()
        state = (self.optimizer.get("optimizer_state_dict") or {}).get("state") or {}
        first = state.get(0) or next(iter(state.values()), {})
        return first["step"].detach().reshape(()).clone() if "step" in first else None

    @property
    def param_groups(self) -> list:
        groups = self.optimizer.get("param_groups") or (self.optimizer.get("optimizer_state_dict") or {}).get(
            "param_groups") or []
        return [{k: v for k, v in g.items() if k != "params"} for g in groups]

    def counters(self) -> dict:
        ms = self.model_states
        return {"global_steps": int(ms.get("global_steps", 0)), "skipped_steps": int(ms.get("skipped_steps", 0)),
                "global_samples": int(ms.get("global_samples", 0))}

    def buffers(self) -> dict:
        """Persistent buffers of the model, where the checkpoint kept them (DeepSpeed ZeRO-1/2)."""
        module = self.model_states.get("module") or {}
        names = self.model_states.get("buffer_names") or []
        return {n: module[n] for n in names if n in module and torch.is_tensor(module[n]) and module[n].numel()}


def write(tensors, steps: float, param_groups: list, counters: dict, lr_scheduler, client_state: dict,
          world_size: int, out_dir: str, tag: str) -> str:
    """Write a universal checkpoint: ``tensors`` yields (name, {"master", "exp_avg", "exp_avg_sq": whole fp32})
    one parameter at a time. Atomic: written to ``<tag>.incomplete`` and renamed; then ``latest_universal``."""
    import deepspeed

    final, tmp = os.path.join(out_dir, tag), os.path.join(out_dir, tag + ".incomplete")
    if os.path.exists(final):
        raise LinsCheckpointError(f"convert: {final} exists; it is not overwritten (choose another OUT or tag)")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "zero"))
    step = torch.tensor(float(steps), dtype=torch.float32)
    shapes = {}
    for name, state in tensors:
        shapes[name] = state["master"].shape
        pdir = os.path.join(tmp, "zero", name)
        os.makedirs(pdir)
        for what, fname in ADAM_STATE.items():
            if what in state:
                torch.save({"param": state[what].detach().float().contiguous(), "cat_dim": 0},
                           os.path.join(pdir, f"{fname}.pt"))
        torch.save(step.clone(), os.path.join(pdir, "step.pt"))  # ZeRO-1/2 need it
    groups = [dict(g, params=[i]) for i, g in enumerate(param_groups)]
    torch.save({"param_groups": groups, "ds_version": deepspeed.__version__,  # ZeRO-1/2 assert a version
                "optimizer_state_dict": {"state": {0: {"step": step.clone()}}, "param_groups": groups}},  # ZeRO-3
               os.path.join(tmp, "zero", "optimizer_state.pt"))
    states = {"module": None, "lr_scheduler": lr_scheduler, "dp_world_size": world_size, "mp_world_size": 1,
              "ds_version": deepspeed.__version__, "buffer_names": [], "shared_params": {},
              "param_shapes": [shapes], **counters, **client_state}
    for fname in MODEL_STATES:
        torch.save(states, os.path.join(tmp, fname))
    os.replace(tmp, final)
    with open(os.path.join(out_dir, LATEST_UNIVERSAL + ".tmp"), "w") as f:
        f.write(tag)
    os.replace(os.path.join(out_dir, LATEST_UNIVERSAL + ".tmp"), os.path.join(out_dir, LATEST_UNIVERSAL))
    return final
