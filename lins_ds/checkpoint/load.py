"""Load a Lins checkpoint into any plan and world size: each rank reads the parameter ranges of its
own OS chunks from whichever shard files hold them, then the P-sync AllGather rebuilds P."""

from __future__ import annotations

import json
import os

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .layout_free import FORMAT, INCOMPLETE, LATEST, META, overlaps, range_key
from .save import LinsCheckpointError


def resolve(load_dir: str, tag=None):
    """The checkpoint directory to load, None when there is nothing (DeepSpeed returns (None, None))."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            return None
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(load_dir, str(tag))
    if not os.path.isfile(os.path.join(path, META)):
        if os.path.isdir(path + INCOMPLETE) or os.path.isdir(path):
            raise LinsCheckpointError(f"load_checkpoint: {path} is incomplete (a save was interrupted); "
                                      "load an earlier tag")
        raise LinsCheckpointError(f"load_checkpoint: no checkpoint tag {tag!r} in {load_dir}")
    return path


def read_meta(path: str) -> dict:
    try:
        with open(os.path.join(path, META)) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise LinsCheckpointError(f"load_checkpoint: {path}/{META} is unreadable ({e})") from None
    if meta.get("format") != FORMAT:
        raise LinsCheckpointError(f"load_checkpoint: {path} is not a lins_ds checkpoint "
                                  f"(format {meta.get('format')!r}, expected {FORMAT!r})")
    return meta


def check_model(meta: dict, module: torch.nn.Module, strict: bool) -> None:
    ours = {n: list(p.shape) for n, p in module.named_parameters()}
    theirs = {n: v["shape"] for n, v in meta["params"].items()}
    wrong = [f"{n}: checkpoint {theirs[n]} vs model {s}" for n, s in ours.items() if n in theirs and theirs[n] != s]
    if wrong:
        raise LinsCheckpointError("load_checkpoint: checkpoint is from another model; shapes differ: "
                                  + "; ".join(wrong[:5]))
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if strict and (missing or unexpected):
        raise LinsCheckpointError(f"load_checkpoint: parameters missing from the checkpoint {missing[:5]}, "
                                  f"unexpected in it {unexpected[:5]} (load_module_strict=True)")


class ShardReader:
    def __init__(self, path: str, index: dict):
        self.path, self.index, self._files = path, index, {}

    def _open(self, fname: str):
        if fname not in self._files:
            try:
                self._files[fname] = safe_open(os.path.join(self.path, fname), framework="pt")
            except (SafetensorError, OSError) as e:
                raise LinsCheckpointError(f"load_checkpoint: {self.path}/{fname} is unreadable "
                                          f"(truncated or corrupted?): {e}") from None
        return self._files[fname]

    def fill(self, dest: torch.Tensor, name: str, a: int, b: int, what: str) -> bool:
        """Copy elements [a, b) of ``name``/``what`` into ``dest``; False if the checkpoint lacks ``what``."""
        covered = 0
        for fname, sa, sb in overlaps(self.index, name, a, b):
            f = self._open(fname)
            key = range_key(name, sa, sb, what)
            if key not in f.keys():
                return False
            lo, hi = max(a, sa), min(b, sb)
            try:
                piece = f.get_slice(key)[lo - sa:hi - sa]
            except (SafetensorError, Exception) as e:  # noqa: BLE001 - any read failure is a broken file
                raise LinsCheckpointError(f"load_checkpoint: {self.path}/{fname} is unreadable: {e}") from None
            dest[lo - a:hi - a].copy_(piece)
            covered += hi - lo
        if covered != b - a:
            raise LinsCheckpointError(f"load_checkpoint: {self.path} holds {covered} of the {b - a} elements "
                                      f"[{a}, {b}) of {name}")
        return True

    def scalar(self, group: int, key: str):
        for fname in self.index:
            f = self._open(fname)
            if f"@scalars/{group}/{key}" in f.keys():
                return f.get_tensor(f"@scalars/{group}/{key}").clone()  # own memory: optimizers add in place
        return None


@torch.no_grad()
def load(engine, load_dir: str, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False):
    path = resolve(load_dir, tag)
    if path is None:
        return None, None
    meta = read_meta(path)
    check_model(meta, engine.module, load_module_strict)
    opt, reader = engine.optimizer, ShardReader(path, meta["index"])
    engine.lins.wait()  # an in-flight P-sync must not overwrite what we load
    with_state = load_optimizer_states and not load_module_only
    if with_state and meta["optimizer"] != type(opt.optimizer).__name__:
        raise LinsCheckpointError(f"load_checkpoint: optimizer state is {meta['optimizer']}'s, this engine uses "
                                  f"{type(opt.optimizer).__name__}; pass load_optimizer_states=False")
    for gi, group in enumerate(opt.param_groups):
        for sl in [s for s in opt.slices if any(s.param is p for p in group["params"])]:
            state = {k: torch.zeros_like(sl.param.data) for k in meta["elementwise_state"]} if with_state else {}
            for slot, (a, b), (s, e) in sl.unit.pieces(sl.lo, sl.hi):
                reader.fill(sl.param.data[s:e], slot.name, a, b, "master")
                for k, t in state.items():
                    reader.fill(t[s:e], slot.name, a, b, k)
            for k in meta["scalar_state"] if with_state else ():
                v = reader.scalar(gi, k)
                if v is not None:
                    state[k] = v  # scalar state (Adam's step) lives on the CPU unless the optimizer is capturable
            if with_state:
                opt.state[sl.param] = state
            sl.write_back()
    if with_state:
        _restore_group_hyperparameters(opt.param_groups, meta["param_groups"])
    engine.lins.sync_parameters()
    _load_frozen(engine.module, path)
    extra = torch.load(os.path.join(path, "extra.pt"), weights_only=False)
    if not load_module_only:
        if load_lr_scheduler_states and engine.lr_scheduler is not None and extra["lr_scheduler"] is not None:
            engine.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        if opt.loss_scaler is not None and extra["loss_scaler"]:
            vars(opt.loss_scaler).update(extra["loss_scaler"])
        engine.global_steps, engine.global_samples = meta["global_steps"], meta["global_samples"]
        engine.skipped_steps = meta["skipped_steps"]
    return path, extra["client_state"]


def _restore_group_hyperparameters(groups: list, saved: list) -> None:
    """lr, betas, weight decay ... as saved (schedulers set the lr only on their next step)."""
    if len(groups) != len(saved):
        raise LinsCheckpointError(f"load_checkpoint: the checkpoint has {len(saved)} optimizer param groups, "
                                  f"this optimizer {len(groups)}; pass load_optimizer_states=False")
    for group, values in zip(groups, saved):
        for k, v in values.items():
            if k in group and not torch.is_tensor(group[k]):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _load_frozen(module: torch.nn.Module, path: str) -> None:
    try:
        tensors = load_file(os.path.join(path, "frozen.safetensors"))
    except (SafetensorError, OSError) as e:
        raise LinsCheckpointError(f"load_checkpoint: {path}/frozen.safetensors is unreadable: {e}") from None
    own = dict(module.named_parameters())
    own.update({n: b for n, b in module.named_buffers()})
    for name, t in tensors.items():
        if name in own:
            own[name].data.copy_(t)
