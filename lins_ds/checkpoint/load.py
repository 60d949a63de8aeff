"""Load a checkpoint into any plan and world size (docs/design.md §9): a Lins checkpoint, or a DeepSpeed ZeRO
stage 1/2/3 checkpoint (converted by DeepSpeed's own ``ds_to_universal``), or a DeepSpeed universal one.

Each rank reads the parameter ranges of its own OS chunks — fp32 master weights and element-wise optimizer
state — then the P-sync AllGather rebuilds P. Every read is agreed on: each rank reports its outcome and all
of them raise the first error any rank saw, naming the file, before any of them goes on to a collective.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .. import comm
from ..runtime.step.unit import param_shape
from .formats import DEEPSPEED, LINS, Found, LinsCheckpointError, check_seal, load_pickle, locate, verify_digest
from .layout_free import (DIGEST_SCHEME, DIGESTS, FORMAT, FORMAT_1, META, META_SEAL, digests_of, inside, overlaps,
                          range_key)
from .trainee import Counters, Trainee
from .universal import UniversalReader, convert

ADAM_FAMILY = {"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam"}  # what a DeepSpeed universal checkpoint's state fits


def agreed(fn):
    """``fn()`` on every rank; if it raised on any rank, every rank raises that rank's error (checkpoint
    reads fail together, before any collective; the message names the file). Any exception counts: one left to
    propagate on one rank would leave the others waiting in this agreement."""
    try:
        result, error = fn(), None
    except (LinsCheckpointError, OSError) as e:
        result, error = None, str(e)
    except Exception as e:  # noqa: BLE001 - agreed, then raised on every rank
        result, error = None, f"load_checkpoint: {type(e).__name__}: {e}"
    error = comm.agree(error)
    if error is not None:
        raise LinsCheckpointError(error)
    return result


# --- the two kinds of source --------------------------------------------------------------------------------
class ShardReader:
    """Element ranges of a Lins checkpoint's shard files, each checked against its recorded SHA-256 when first
    opened (``digests``: meta.json's, read from ``path`` when not given) and read only inside ``path``."""

    def __init__(self, path: str, index: dict, digests: dict = None, what: str = "load_checkpoint"):
        if digests is None:  # every file read is checked: the digests of the checkpoint's own meta.json
            digests = digests_of(read_meta(path, what))
        self.path, self.index, self._files, self.digests, self.what = path, index, {}, digests, what

    def _open(self, fname: str):
        if fname not in self._files:
            real = inside(self.path, fname, self.what)
            verify_digest(os.path.join(self.path, fname), self.digests, self.what, entry=fname)
            try:
                self._files[fname] = safe_open(real, framework="pt")
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
            except Exception as e:  # noqa: BLE001 - any read failure is a broken file
                raise LinsCheckpointError(f"load_checkpoint: {self.path}/{fname} is unreadable: {e}") from None
            dest[lo - a:hi - a].copy_(piece)
            covered += hi - lo
        if covered != b - a:
            raise LinsCheckpointError(f"load_checkpoint: {self.path} holds {covered} of the {b - a} elements "
                                      f"[{a}, {b}) of {name}")
        return True

    def check(self, name: str, a: int, b: int, what: str) -> bool:
        """What ``fill`` needs is there (its files whole by their digests, every element of [a, b) stored), read no
        further; False if the checkpoint lacks ``what``."""
        covered = 0
        for fname, sa, sb in overlaps(self.index, name, a, b):
            f = self._open(fname)
            key = range_key(name, sa, sb, what)
            if key not in f.keys():
                return False
            if f.get_slice(key).get_shape() != [sb - sa]:
                raise LinsCheckpointError(f"load_checkpoint: {self.path}/{fname}: {key} holds "
                                          f"{f.get_slice(key).get_shape()} elements, its index says {sb - sa}")
            covered += min(b, sb) - max(a, sa)
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


class LinsCheckpoint:
    def __init__(self, path: str):
        self.path, self.meta = path, read_meta(path)
        self.reader = ShardReader(path, self.meta["index"], digests_of(self.meta))
        self.elementwise, self.scalars = self.meta["elementwise_state"], self.meta["scalar_state"]
        self.param_groups = self.meta["param_groups"]

    def check(self, trainee: Trainee, strict: bool, with_state: bool) -> None:
        check_model(self.meta, trainee.module, strict)
        theirs, ours = self.meta["optimizer"], type(trainee.optimizer.optimizer).__name__
        if with_state and theirs != ours:
            raise LinsCheckpointError(f"load_checkpoint: optimizer state is {theirs}'s, this engine uses {ours}; "
                                      "pass load_optimizer_states=False")

    def rest(self, trust_pickle: bool = False) -> dict:
        """Frozen parameters and buffers, LR scheduler, loss scaler, counters, and the checkpoint's state as DeepSpeed
        keeps it (its own keys, client_state's over them) for ``client_state``."""
        digests = digests_of(self.meta)
        frozen = _read(lambda p: (verify_digest(p, digests, entry="frozen.safetensors"), load_file(p))[1],
                       os.path.join(self.path, "frozen.safetensors"))
        extra = _read(lambda p: (verify_digest(p, digests, entry="extra.pt"), load_pickle(p, trust_pickle))[1],
                      os.path.join(self.path, "extra.pt"))
        counters = {k: self.meta[k] for k in ("global_steps", "global_samples", "skipped_steps")}
        state = {"module": None, "optimizer": None, **(extra.get("deepspeed") or {}),
                 "lr_scheduler": extra["lr_scheduler"], **counters, **(extra["client_state"] or {})}
        return {"tensors": frozen, "lr_scheduler": extra["lr_scheduler"], "loss_scaler": extra["loss_scaler"],
                "state": state, "counters": counters}


class UniversalCheckpoint:
    """A DeepSpeed universal checkpoint (or a ZeRO one converted to it), read by parameter name."""

    elementwise, scalars = ["exp_avg", "exp_avg_sq"], ["step"]

    def __init__(self, path: str, origin: str, trust: bool = False):
        self.path, self.origin = path, origin
        self.reader = UniversalReader(path, trust)
        self.param_groups = self.reader.param_groups

    def check(self, trainee: Trainee, strict: bool, with_state: bool) -> None:
        shapes = {}
        for group in self.reader.model_states.get("param_shapes") or []:
            shapes.update({n: list(s) for n, s in group.items()})
        ours = {n: p for n, p in trainee.module.named_parameters() if p.requires_grad}
        missing = sorted(n for n in ours if not self.reader.has(n))
        wrong = [f"{n}: checkpoint {shapes[n]} vs model {list(param_shape(p))}" for n, p in ours.items()
                 if n in shapes and shapes[n] != list(param_shape(p))]
        if wrong:
            raise LinsCheckpointError(f"load_checkpoint: {self.origin} is from another model; shapes differ: "
                                      + "; ".join(wrong[:5]))
        if missing:
            raise LinsCheckpointError(f"load_checkpoint: {self.origin} lacks parameters {missing[:5]}")
        name = type(trainee.optimizer.optimizer).__name__
        if with_state and name not in ADAM_FAMILY:
            raise LinsCheckpointError(f"load_checkpoint: {self.origin} holds Adam's state (exp_avg, exp_avg_sq); "
                                      f"this engine uses {name}; pass load_optimizer_states=False")

    def rest(self, trust_pickle: bool = False) -> dict:
        """DeepSpeed's own files: its data (``checkpoint_pickle``: everything, as DeepSpeed reads them)."""
        ms = self.reader.model_states
        return {"tensors": self.reader.buffers(), "lr_scheduler": ms.get("lr_scheduler"), "loss_scaler": None,
                "state": dict(ms), "counters": self.reader.counters()}


def _read(read, path: str):
    try:
        return read(path)
    except LinsCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to read is a broken file, named
        raise LinsCheckpointError(f"load_checkpoint: {path} is unreadable (truncated or corrupted?): "
                                  f"{type(e).__name__}: {str(e)[:200]}") from None


META_FIELDS = {"params": dict, "index": dict, "param_groups": list, "elementwise_state": list, "scalar_state": list,
               "optimizer": str, "global_steps": int, "global_samples": int, "skipped_steps": int}


def read_meta(path: str, what: str = "load_checkpoint") -> dict:
    """A Lins tag directory's meta.json, trusted only once it has passed, in this order: its SHA-256 matches
    meta.json.sha256 (checked before it is parsed); its format is this lins_ds' (format 1 is refused with the command
    that upgrades it); its fields have their types; every file it names resolves inside ``path``; every file a
    reader opens (each shard it indexes, frozen.safetensors, extra.pt) has its digest listed (config.json, read by
    consolidate only, is checked there). Else LinsCheckpointError naming the file, the entry and the rule."""
    meta_path = os.path.join(path, META)
    try:
        inside(path, META, what)
        with open(meta_path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise LinsCheckpointError(f"{what}: {meta_path} is unreadable ({e})") from None
    sealed = check_seal(path, data, what)
    try:
        meta = json.loads(data.decode("utf-8"))
    except ValueError as e:
        raise LinsCheckpointError(f"{what}: {meta_path} is unreadable ({e})") from None
    version = meta.get("format") if isinstance(meta, dict) else None
    if version == FORMAT_1:
        raise LinsCheckpointError(
            f"{what}: {path} was saved by an earlier lins_ds (format {FORMAT_1!r}: meta.json unsealed, files it "
            f"names not all checked); this lins_ds reads {FORMAT!r}. Check and seal it, keeping every file: "
            f"python -m lins_ds.checkpoint.upgrade {path}")
    if version != FORMAT:
        raise LinsCheckpointError(f"{what}: {path} is not a lins_ds checkpoint (format {version!r}, expected "
                                  f"{FORMAT!r})")
    if not sealed:
        raise LinsCheckpointError(f"{what}: {os.path.join(path, META_SEAL)} is missing: the save writes meta.json's "
                                  "SHA-256 there and meta.json is not trusted without it (a copy that left it out?)")
    return check_meta(path, meta, what)


def check_meta(path: str, meta: dict, what: str = "load_checkpoint") -> dict:
    """``meta`` (tag directory ``path``'s meta.json, parsed) well-formed, its files inside ``path`` and all of those
    read covered by its digests; see ``read_meta``."""
    meta_path = os.path.join(path, META)
    for key, kind in META_FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise LinsCheckpointError(f"{what}: {meta_path} is malformed: {key!r} is "
                                      f"{type(meta.get(key)).__name__}, expected {kind.__name__}")
    bad = [n for n, v in meta["params"].items()
           if not (isinstance(v, dict) and isinstance(v.get("shape"), list) and isinstance(v.get("trainable"), bool))]
    if bad or not isinstance(meta.get(DIGESTS), dict):
        raise LinsCheckpointError(f"{what}: {meta_path} is malformed: "
                                  + (f"params entry {bad[0]!r}" if bad else f"{DIGESTS!r} is not an object"))
    if meta.get("digest_scheme") != DIGEST_SCHEME:
        raise LinsCheckpointError(f"{what}: {meta_path} records digests of scheme {meta.get('digest_scheme')!r}; this "
                                  f"lins_ds checks {DIGEST_SCHEME!r}, and reads no file unchecked")
    for entry in list(meta["index"]) + list(meta[DIGESTS]):
        inside(path, entry, what)
    for entry in list(meta["index"]) + ["frozen.safetensors", "extra.pt"]:  # what every reader opens
        inside(path, entry, what)
        if entry not in meta[DIGESTS]:
            raise LinsCheckpointError(
                f"{what}: {meta_path} names {entry!r} ({os.path.join(path, entry)}) without its digest in "
                f"{DIGESTS!r}; every file a checkpoint's reader opens must be checked against the digest its save "
                "recorded, so the checkpoint is not read")
    return meta


def check_model(meta: dict, module: torch.nn.Module, strict: bool) -> None:
    ours = {n: list(param_shape(p)) for n, p in module.named_parameters()}
    theirs = {n: v["shape"] for n, v in meta["params"].items()}
    wrong = [f"{n}: checkpoint {theirs[n]} vs model {s}" for n, s in ours.items() if n in theirs and theirs[n] != s]
    if wrong:
        raise LinsCheckpointError("load_checkpoint: checkpoint is from another model; shapes differ: "
                                  + "; ".join(wrong[:5]))
    missing, unexpected = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if strict and (missing or unexpected):
        raise LinsCheckpointError(f"load_checkpoint: parameters missing from the checkpoint {missing[:5]}, "
                                  f"unexpected in it {unexpected[:5]} (load_module_strict=True)")


@contextlib.contextmanager
def opened(found: Found, trust: bool = False):
    """The checkpoint to read. A DeepSpeed ZeRO checkpoint is converted by DeepSpeed's ds_to_universal on rank 0
    into a work directory beside it (removed afterwards; the user's files are only read). DeepSpeed's files are read
    as DeepSpeed's data only, unless ``trust`` (``lins.checkpoint_pickle``)."""
    if found.kind == LINS:
        yield agreed(lambda: LinsCheckpoint(found.path))
        return
    if found.kind != DEEPSPEED:
        yield agreed(lambda: UniversalCheckpoint(found.path, found.path, trust))
        return
    work = os.path.join(os.path.dirname(os.path.abspath(found.path)),
                        f".lins-convert-{os.path.basename(found.path)}")
    try:
        def convert_on_rank0():
            if comm.rank() == 0:
                shutil.rmtree(work, ignore_errors=True)
                convert(found.path, work, trust)
        agreed(convert_on_rank0)
        yield agreed(lambda: UniversalCheckpoint(os.path.join(work, "universal"), found.path, trust))
    finally:
        comm.barrier()
        if comm.rank() == 0:
            shutil.rmtree(work, ignore_errors=True)


def _check_optimizer(trainee: Trainee, ckpt, with_state: bool) -> None:
    """Everything this rank's slices will read is in the checkpoint (its files whole, every range and key there):
    checked before anything is written, without a second copy of the state in memory."""
    reader = ckpt.reader
    for sl in trainee.runtime.master_slices():
        for name, (a, b), _ in sl.range.by_parameter():
            if not reader.check(name, a, b, "master"):
                raise LinsCheckpointError(f"load_checkpoint: {ckpt.path} lacks the master weights of {name}")
            for k in ckpt.elementwise if with_state else ():
                if not reader.check(name, a, b, k):
                    raise LinsCheckpointError(f"load_checkpoint: {ckpt.path} lacks {k} of {name}; pass "
                                              "load_optimizer_states=False")


def _fill_optimizer(trainee: Trainee, ckpt, with_state: bool) -> None:
    """This rank's master slices (and their optimizer state) from the checkpoint, in place (all of it checked)."""
    opt, reader = trainee.optimizer, ckpt.reader
    for gi, group in enumerate(opt.param_groups):
        for sl in [s for s in trainee.runtime.master_slices() if any(s.param is p for p in group["params"])]:
            state = {k: torch.zeros_like(sl.param.data) for k in ckpt.elementwise} if with_state else {}
            for name, (a, b), (s, e) in sl.range.by_parameter():
                reader.fill(sl.param.data[s:e], name, a, b, "master")
                for k, t in state.items():
                    reader.fill(t[s:e], name, a, b, k)
            for k in ckpt.scalars if with_state else ():
                v = reader.scalar(gi, k)
                if v is not None:
                    state[k] = v  # scalar state (Adam's step) lives on the CPU unless the optimizer is capturable
            if with_state:
                opt.state[sl.param] = state
            sl.write_back()


def _check_rest(trainee: Trainee, ckpt, rest: dict, with_state: bool, load_lr_scheduler_states: bool,
                load_module_only: bool):
    """What the apply step would refuse, refused now (before any rank changes anything). The LR scheduler takes the
    saved state on trial and is put back as it was."""
    if with_state and ckpt.param_groups and ckpt.kind_strict:
        _restore_group_hyperparameters([dict(g) for g in trainee.optimizer.param_groups], ckpt.param_groups, True)
    sched, saved = trainee.lr_scheduler, rest["lr_scheduler"]
    if load_module_only or not load_lr_scheduler_states or sched is None or saved is None:
        return
    before = copy.deepcopy(sched.state_dict())
    try:
        sched.load_state_dict(copy.deepcopy(saved))
    except Exception as e:  # noqa: BLE001 - a state this scheduler cannot take: named, and nothing changed
        raise LinsCheckpointError(f"load_checkpoint: {ckpt.path}: the LR scheduler's saved state does not fit "
                                  f"{type(sched).__name__} ({type(e).__name__}: {e}); pass "
                                  "load_lr_scheduler_states=False") from None
    finally:
        sched.load_state_dict(before)


@torch.no_grad()
def load(trainee: Trainee, load_dir: str, tag=None, load_module_strict: bool = True, load_optimizer_states: bool = True,
         load_lr_scheduler_states: bool = True, load_module_only: bool = False, trust_pickle: bool = False):
    """All or nothing: every rank checks everything it will read (each file against its digest, every range and key
    of its slices) and reads the rest (frozen tensors, scheduler, loss scaler, counters, client_state) before any rank
    changes ``trainee``; an error on any rank is every rank's, raised with each trainee exactly as it was. Host updates
    still running are joined first (their outcome does not matter: the checkpoint replaces what they write).
    Returns ``(path, client_state, counters)``: the saved ``Counters`` for the caller to set (None where nothing was
    found, or with ``load_module_only``); ``(None, None, None)`` where nothing was found."""
    found = agreed(lambda: locate(load_dir, tag))
    if found is None:
        return None, None, None
    with_state = load_optimizer_states and not load_module_only
    opt, runtime = trainee.optimizer, trainee.runtime
    runtime.join_host(replacing=True)  # the checkpoint replaces what updates begun in a last backward wrote
    with opened(found, trust_pickle) as ckpt:
        ckpt.kind_strict = found.kind == LINS
        agreed(lambda: ckpt.check(trainee, load_module_strict, with_state))

        def check():
            rest = ckpt.rest(trust_pickle)
            _check_rest(trainee, ckpt, rest, with_state, load_lr_scheduler_states, load_module_only)
            _check_optimizer(trainee, ckpt, with_state)
            return rest

        rest = agreed(check)
        runtime.wait()  # an in-flight P-sync must not overwrite what we load
        runtime.forget_host_failure()  # what a failed host update left, the checkpoint replaces
        agreed(lambda: _fill_optimizer(trainee, ckpt, with_state))  # checked: a failure here is the disk's
    if with_state and ckpt.param_groups:
        _restore_group_hyperparameters(opt.param_groups, ckpt.param_groups, found.kind == LINS)
    runtime.sync_parameters()
    _copy_into(trainee.module, rest["tensors"])
    counters = None
    if not load_module_only:
        sched = trainee.lr_scheduler
        if load_lr_scheduler_states and sched is not None and rest["lr_scheduler"] is not None:
            sched.load_state_dict(rest["lr_scheduler"])
        if opt.loss_scaler is not None and rest["loss_scaler"]:
            vars(opt.loss_scaler).update(rest["loss_scaler"])
        counters = Counters(**rest["counters"])
    return found.path, returned_client_state(rest["state"], load_optimizer_states, load_lr_scheduler_states,
                                             load_module_only), counters


def returned_client_state(state: dict, load_optimizer_states: bool, load_lr_scheduler_states: bool,
                          load_module_only: bool) -> dict:
    """What DeepSpeed's ``load_checkpoint`` returns as ``client_state`` from a checkpoint's ``state`` (its
    ``_load_checkpoint``, ZeRO-1): everything but what the load itself restored (the module, and the counters,
    world sizes, sparse-module names (0.19.6), data sampler and random-LTD unless ``load_module_only``; the LR scheduler and the optimizer where
    loaded)."""
    restored = ["module"] if load_module_only else ["module", "sparse_tensor_module_names", "skipped_steps",
                                                    "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                                                    "random_ltd"]
    restored += ["lr_scheduler"] if load_lr_scheduler_states else []
    restored += ["optimizer"] if load_optimizer_states else []
    return {k: v for k, v in state.items() if k not in restored}


def _restore_group_hyperparameters(groups: list, saved: list, strict: bool = True) -> None:
    """lr, betas, weight decay ... as saved (schedulers set the lr only on their next step). DeepSpeed's ZeRO-3
    saves one group per sub-group: when the counts differ there, the engine's own hyperparameters stay."""
    if len(groups) != len(saved):
        if not strict:
            return
        raise LinsCheckpointError(f"load_checkpoint: the checkpoint has {len(saved)} optimizer param groups, "
                                  f"this optimizer {len(groups)}; pass load_optimizer_states=False")
    for group, values in zip(groups, saved):
        for k, v in values.items():
            if k in group and not torch.is_tensor(group[k]):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v


def _copy_into(module: torch.nn.Module, tensors: dict) -> None:
    """Frozen parameters and buffers by name."""
    own = dict(module.named_parameters())
    own.update({n: b for n, b in module.named_buffers()})
    for name, t in tensors.items():
        if name in own and own[name].shape == t.shape:
            own[name].data.copy_(t)
