"""Save a Lins checkpoint: every rank of the first OS replica writes its own OS chunk, nothing else is
gathered; the directory becomes visible only when complete (see layout_free for the format)."""

from __future__ import annotations

import json
import os
import shutil

import torch

from .. import comm
from ..runtime.step.unit import param_shape
from .zero_to_fp32 import write_script
from .formats import LinsCheckpointError, file_digest, save_file, write_meta
from .layout_free import DIGEST_SCHEME, DIGESTS, FORMAT, INCOMPLETE, LATEST, OLD, SAVING, checked_tag, range_key
from .trainee import Trainee

__all__ = ["LinsCheckpointError", "save"]


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def shard_tensors(opt, slices: list) -> tuple:
    """({key: tensor}, [(name, a, b)], {elementwise state keys}, {scalar state keys}) of this rank's master
    ``slices`` (``LinsRuntime.master_slices``) and their state in ``opt``."""
    tensors, index, ew_keys, scalar_keys = {}, [], set(), set()
    group_of = {id(p): gi for gi, g in enumerate(opt.param_groups) for p in g["params"]}
    for sl in slices:
        state = opt.state.get(sl.param, {})
        for name, (a, b), (s, e) in sl.range.by_parameter():
            index.append((name, a, b))
            tensors[range_key(name, a, b, "master")] = _cpu(sl.param.data[s:e].float())
            for k, v in state.items():
                if torch.is_tensor(v) and v.shape == sl.param.shape:
                    tensors[range_key(name, a, b, k)] = _cpu(v[s:e])
                    ew_keys.add(k)
        for k, v in state.items():
            if not (torch.is_tensor(v) and v.shape == sl.param.shape):
                # a step count is saved as torch keeps it (float32): DeepSpeedCPUAdam's int would reach a torch
                # Adam on load as int64, which its foreach and fused paths reject
                t = torch.as_tensor(float(v) if k == "step" else v, dtype=torch.float32 if k == "step" else None)
                tensors[f"@scalars/{group_of[id(sl.param)]}/{k}"] = _cpu(t)
                scalar_keys.add(k)
    return tensors, index, ew_keys, scalar_keys


def frozen_and_buffers(module: torch.nn.Module, exclude_frozen: bool = False) -> dict:
    """Frozen parameters (unless ``exclude_frozen``: DeepSpeed's ``exclude_frozen_parameters``, a LoRA checkpoint
    without its base) and persistent buffers, by name."""
    out = {} if exclude_frozen else {n: _cpu(p) for n, p in module.named_parameters() if not p.requires_grad}
    for mod_name, mod in module.named_modules():
        for b_name, buf in mod._buffers.items():
            if buf is not None and b_name not in mod._non_persistent_buffers_set:
                out[f"{mod_name}.{b_name}" if mod_name else b_name] = _cpu(buf)
    return out


def _buffer_names(module: torch.nn.Module) -> list:
    """Persistent buffers' names, as DeepSpeed's ``_get_buffer_names`` lists them."""
    return [f"{mod_name}.{b_name}" if mod_name else b_name for mod_name, mod in module.named_modules()
            for b_name, buf in mod._buffers.items()
            if buf is not None and b_name not in mod._non_persistent_buffers_set]


def _aliases(module: torch.nn.Module) -> dict:
    """Every parameter name (tied ones included) -> the name its tensor is first known by."""
    first = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


def _meta(trainee: Trainee, index: dict, ew_keys, scalar_keys) -> dict:
    opt, module, counters = trainee.optimizer, trainee.module, trainee.counters
    group_of = trainee.runtime.param_groups_by_name()
    return {
        "format": FORMAT,
        "params": {n: {"shape": list(param_shape(p)), "dtype": str(p.dtype).split(".")[-1], "trainable": p.requires_grad,
                       "group": group_of.get(n)} for n, p in module.named_parameters()},
        "aliases": _aliases(module),
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
        "optimizer": type(opt.optimizer).__name__,
        "elementwise_state": sorted(ew_keys), "scalar_state": sorted(scalar_keys),
        "plan": trainee.runtime.plan.to_json(), "world_size": trainee.runtime.topo.world_size,
        "global_steps": counters.global_steps, "global_samples": counters.global_samples,
        "skipped_steps": counters.skipped_steps, "index": index,
    }


def deepspeed_keys(trainee: Trainee) -> dict:
    """The keys DeepSpeed's ``_save_checkpoint`` puts in a ZeRO-1 checkpoint's state besides the module, the optimizer
    and the counters, with their meaning there (``load_checkpoint`` returns them in ``client_state``): the persistent
    buffers' names, each optimizer param group's {name: shape} of its trainable parameters, tied parameters {name not
    stored: name holding the data}, the data-parallel and model-parallel world sizes, the pipeline and tensor degrees,
    the DeepSpeed config and version. What ZeRO-1 leaves None (frozen parameter shapes and fragments, a data sampler,
    random-LTD) is None here too. ds_config is kept as JSON holds it (torch.load(weights_only=True) reads it back)."""
    from collections import OrderedDict

    import deepspeed
    from deepspeed.checkpoint import constants
    from deepspeed.utils.bwc import bwc_pipeline_parallel_world_size, bwc_tensor_model_parallel_world_size

    module, group_of = trainee.module, trainee.runtime.param_groups_by_name()
    shapes = [OrderedDict((n, torch.Size(param_shape(p))) for n, p in module.named_parameters()
                          if p.requires_grad and group_of.get(n) == gi)
              for gi in range(len(trainee.optimizer.param_groups))]
    mpu = trainee.mpu
    keys = {"buffer_names": _buffer_names(module),
            "param_shapes": shapes, "frozen_param_shapes": None, "frozen_param_fragments": None,
            "shared_params": {a: n for a, n in _aliases(module).items() if a != n},
            "data_sampler": None, "random_ltd": None,
            "dp_world_size": int(trainee.seq_dp_world_size or trainee.runtime.topo.world_size),
            "mp_world_size": int(trainee.mp_world_size or 1),
            "ds_config": _json_safe(trainee.ds_config), "ds_version": deepspeed.__version__}
    if trainee.sparse_tensor_module_names is not None:  # DeepSpeed 0.19.6 saves it (0.19.8 no longer does)
        keys["sparse_tensor_module_names"] = set(trainee.sparse_tensor_module_names)
    if hasattr(constants, "CHECKPOINT_PARALLEL_DIMS"):  # where this DeepSpeed saves the degrees
        keys[constants.CHECKPOINT_PARALLEL_DIMS] = {
            constants.CHECKPOINT_PP_DEGREE: bwc_pipeline_parallel_world_size(mpu),
            constants.CHECKPOINT_TP_DEGREE: bwc_tensor_model_parallel_world_size(mpu)}
    return keys


def _json_safe(obj):
    return json.loads(json.dumps(obj, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o)))


def _agree_on_tag(trainee: Trainee, tag) -> str:
    tag = str(tag if tag is not None else f"global_step{trainee.counters.global_steps}")
    tags = comm.all_gather_object(tag)
    if len(set(tags)) != 1:
        raise LinsCheckpointError(f"save_checkpoint: tag differs across ranks ({sorted(set(tags))}); pass one tag")
    return checked_tag(tag, "save_checkpoint")  # every rank has the same tag: the same verdict


def _write_shard(trainee: Trainee, tmp: str):
    """This rank's OS chunk, if it is a writer: (file name, index, element-wise keys, scalar keys)."""
    if not trainee.runtime.is_checkpoint_writer:
        return None
    tensors, index, ew, sc = shard_tensors(trainee.optimizer, trainee.runtime.master_slices())
    fname = f"shard-{comm.rank():05d}.safetensors"
    save_file(tensors, os.path.join(tmp, fname), metadata={"format": "pt"})
    return fname, index, sorted(ew), sorted(sc), file_digest(os.path.join(tmp, fname))


def _write_rank0_files(trainee: Trainee, tmp: str, entries: list, client_state, exclude_frozen: bool = False) -> None:
    """Frozen parameters and buffers, extra.pt, config.json, and meta.json (with meta.json.sha256) last (it marks a
    whole directory)."""
    entries = [e for e in entries if e is not None]
    index = {fname: idx for fname, idx, _, _, _ in entries}
    digests = {fname: digest for fname, _, _, _, digest in entries}
    ew = {k for e in entries for k in e[2]}
    sc = {k for e in entries for k in e[3]}
    save_file(frozen_and_buffers(trainee.module, exclude_frozen), os.path.join(tmp, "frozen.safetensors"),
              metadata={"format": "pt"})
    scaler, sched = trainee.optimizer.loss_scaler, trainee.lr_scheduler
    torch.save({"lr_scheduler": sched.state_dict() if sched is not None else None,
                "loss_scaler": dict(vars(scaler)) if scaler is not None else None,
                "deepspeed": deepspeed_keys(trainee), "client_state": client_state or {}},
               os.path.join(tmp, "extra.pt"))
    hf = getattr(trainee.module, "config", None)
    if hf is not None and hasattr(hf, "to_json_string"):
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(hf.to_json_string())
    for fname in ("frozen.safetensors", "extra.pt", "config.json"):
        if os.path.exists(os.path.join(tmp, fname)):
            digests[fname] = file_digest(os.path.join(tmp, fname))
    write_meta(tmp, _json_safe({**_meta(trainee, index, ew, sc), "frozen_excluded": exclude_frozen, DIGESTS: digests,
                                "digest_scheme": DIGEST_SCHEME}))  # and meta.json.sha256, its seal


def _publish(save_dir: str, tag: str, tmp: str, save_latest: bool) -> None:
    """Drop the in-progress marker, rename the complete directory into place, then rewrite ``latest``. Killed at any
    instant, one complete copy is left where ``formats.locate`` looks: ``tag``, else the complete ``tag.incomplete``,
    else ``tag.old`` (a copy left by an earlier interrupted re-save is removed only once the new one is in place)."""
    os.remove(os.path.join(tmp, SAVING))
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, tag + OLD)
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _sync_dir(save_dir)  # the new copy's name on disk before the old copy goes
    shutil.rmtree(old, ignore_errors=True)
    write_script(save_dir)  # DeepSpeed's zero_to_fp32.py, for a Lins checkpoint
    if save_latest:
        with open(os.path.join(save_dir, LATEST + ".tmp"), "w") as f:
            f.write(tag)
        os.replace(os.path.join(save_dir, LATEST + ".tmp"), os.path.join(save_dir, LATEST))


def save(trainee: Trainee, save_dir: str, tag=None, client_state=None, save_latest: bool = True,
         exclude_frozen: bool = False) -> bool:
    """``trainee`` (built by ``integrations/checkpointing.py``) saved under ``save_dir/tag``; every rank calls it."""
    tag = _agree_on_tag(trainee, tag)
    trainee.runtime.check_host()  # host updates done on every rank (or every rank raises the failing one's error)
    trainee.runtime.wait()  # fp32 masters alias the P storage an in-flight P-sync writes
    tmp = os.path.join(save_dir, tag + INCOMPLETE)
    _agreed(lambda: _start(save_dir, tmp, tag) if comm.rank() == 0 else None)
    entries = comm.all_gather_object(_agreed(lambda: _write_shard(trainee, tmp)))
    _agreed(lambda: _write_rank0_files(trainee, tmp, entries, client_state, exclude_frozen) if comm.rank() == 0
            else None)
    _agreed(lambda: _publish(save_dir, tag, tmp, save_latest) if comm.rank() == 0 else None)
    return True


def _start(save_dir: str, tmp: str, tag: str) -> None:
    """A fresh ``<tag>.incomplete`` with the in-progress marker first (a killed save is recognised by it). What an
    earlier killed save left there is renamed away first, atomically, then removed: a removal killed half-way never
    leaves a ``<tag>.incomplete`` that looks finished."""
    os.makedirs(save_dir, exist_ok=True)
    if os.path.exists(tmp):
        trash = f"{tmp}.trash-{os.getpid()}"
        os.replace(tmp, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.makedirs(tmp)
    with open(os.path.join(tmp, SAVING), "w") as f:
        f.write(f"a Lins save of tag {tag} in progress; complete saves are renamed to {tag}\n")


def _sync_dir(path: str) -> None:
    """The directory's entries (renames) on disk, where the file system lets a directory be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _agreed(fn):
    """Every rank's outcome of a write step, combined: all raise the first error (disk full, permissions, any
    other exception one rank met alone)."""
    try:
        result, error = fn(), None
    except (OSError, LinsCheckpointError) as e:
        result, error = None, f"save_checkpoint: {e}"
    except Exception as e:  # noqa: BLE001 - any failure: agreed, or the other ranks would wait here for ever
        result, error = None, f"save_checkpoint: {type(e).__name__}: {e}"
    error = comm.agree(error)
    if error is not None:
        raise LinsCheckpointError(error + " (the previous checkpoint and `latest` are untouched)")
    return result
