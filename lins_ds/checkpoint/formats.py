"""What a checkpoint directory holds: a Lins checkpoint, a DeepSpeed ZeRO checkpoint, a DeepSpeed universal
checkpoint, an interrupted Lins save (recognised by its own marker), or nothing a checkpoint loader can use
(docs/design.md §9)."""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Optional

from deepspeed.utils import logger

from .layout_free import (DIGESTS, FORMAT, INCOMPLETE, LATEST, META, META_SEAL, OLD, SAVING,  # noqa: F401
                          LinsCheckpointError, checked_tag, inside)

LINS, DEEPSPEED, UNIVERSAL = "lins", "deepspeed", "deepspeed-universal"
LATEST_UNIVERSAL = "latest_universal"  # DeepSpeed's pointer to a universal checkpoint


def save_file(tensors: dict, path: str, metadata: Optional[dict] = None) -> None:
    """safetensors' save_file, leaving the file with the mode the umask gives any new file (safetensors writes
    0600: a checkpoint or consolidated model that only its writer could read)."""
    from safetensors.torch import save_file as _save

    _save(tensors, path, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


DIGEST_BLOCK = 1 << 26  # 64 MiB: each block hashed on its own, in parallel


def file_digest(path: str) -> str:
    """SHA-256 over the SHA-256 of each ``DIGEST_BLOCK`` of the file (its size first): the blocks are hashed by a pool
    of threads (hashlib lets go of the GIL on large buffers), so a checkpoint's shard is hashed at several times one
    core's 1-1.6 GB/s."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        def block(i: int) -> bytes:
            return hashlib.sha256(os.pread(fd, DIGEST_BLOCK, i * DIGEST_BLOCK)).digest()

        n = max(1, -(-size // DIGEST_BLOCK))
        with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1, n))) as pool:
            blocks = list(pool.map(block, range(n)))
    finally:
        os.close(fd)
    h = hashlib.sha256(size.to_bytes(8, "little"))
    for b in blocks:
        h.update(b)
    return h.hexdigest()


def verify_digest(path: str, digests: Optional[dict], what: str = "load_checkpoint",
                  entry: Optional[str] = None) -> None:
    """``path``'s bytes against the digest its save recorded in meta.json under ``entry`` (its name there; the file
    name when not given). LinsCheckpointError naming the file on a mismatch, and where meta.json lists no digest for
    it: every file a reader opens is checked."""
    entry = os.path.basename(path) if entry is None else entry
    if not digests or entry not in digests:
        raise LinsCheckpointError(f"{what}: {path} has no digest in meta.json (its {DIGESTS!r} do not list {entry!r}); "
                                  "every file a checkpoint's reader opens must be checked against the digest its save "
                                  "recorded, so it is not read")
    if file_digest(path) != digests[entry]:
        raise LinsCheckpointError(f"{what}: {path} is corrupted: its SHA-256 differs from the one its save recorded "
                                  "in meta.json (a changed byte, a partial copy?); load another checkpoint")


def seal_text(meta_bytes: bytes) -> str:
    """meta.json.sha256's content for meta.json's bytes: as ``sha256sum meta.json`` prints it."""
    import hashlib

    return f"{hashlib.sha256(meta_bytes).hexdigest()}  {META}\n"


def check_seal(path: str, meta_bytes: bytes, what: str = "load_checkpoint") -> bool:
    """meta.json's bytes (``meta_bytes``, read from tag directory ``path``) against meta.json.sha256: True when they
    match, False when there is no meta.json.sha256, LinsCheckpointError naming the file when they differ."""
    seal = os.path.join(path, META_SEAL)
    if not os.path.lexists(seal):
        return False
    inside(path, META_SEAL, what)
    try:
        with open(seal, encoding="utf-8") as f:
            recorded = f.read().split()
    except (OSError, UnicodeDecodeError) as e:
        raise LinsCheckpointError(f"{what}: {seal} is unreadable ({e})") from None
    if not recorded or recorded[0] != seal_text(meta_bytes).split()[0]:
        raise LinsCheckpointError(f"{what}: {os.path.join(path, META)} is corrupted or was changed after its save: its "
                                  f"SHA-256 differs from the one in {seal} (an edit, a changed byte, a partial copy?); "
                                  "load another checkpoint")
    return True


def write_meta(path: str, meta: dict) -> None:
    """meta.json and meta.json.sha256 into tag directory ``path``, each through a temporary file, on disk; the seal
    first, meta.json last (meta.json marks a whole directory)."""
    import json

    data = json.dumps(meta, indent=1).encode("utf-8")
    for name, content in ((META_SEAL, seal_text(data).encode("utf-8")), (META, data)):
        tmp = os.path.join(path, name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, name))


def deepspeed_globals() -> list:
    """The classes DeepSpeed's checkpoint files hold besides tensors and plain containers (found by
    ``torch.serialization.get_unsafe_globals_in_checkpoint`` on ZeRO-1/2/3 and universal checkpoints, fp32 and bf16),
    allowed to ``torch.load(weights_only=True)``: data, no code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed(path: str, trust: bool, real_load=None):
    """A DeepSpeed checkpoint file (model or optimizer states, a universal checkpoint's pieces): what DeepSpeed's own
    classes and plain data are, nothing else, unless ``trust`` (``lins.checkpoint_pickle``) reads it in full. A file
    that holds anything else is refused naming it and the opt-in: unpickling it could run code."""
    import pickle

    import torch

    load = real_load or torch.load
    if trust:
        return load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals(deepspeed_globals()):
            return load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))
        what = found.group(1) if found else "an object torch.load(weights_only=True) does not read"
        raise LinsCheckpointError(
            f"load_checkpoint: {path} holds {what}, which is not DeepSpeed's checkpoint data; reading it would run "
            "code the file chose. Set \"lins\": {\"checkpoint_pickle\": true} to load checkpoints you trust") from None


def load_pickle(path: str, trust: bool):
    """A ``torch.save`` file of a Lins checkpoint (``extra.pt``: LR scheduler, loss scaler, client_state). Read with
    ``weights_only=True`` (tensors, plain containers, numbers, strings, dtypes): unpickling anything else can run
    code. ``trust`` (``lins.checkpoint_pickle``) reads it as ``torch.save`` wrote it."""
    import pickle

    import torch

    if trust:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))
        what = found.group(1) if found else "an object torch.load(weights_only=True) does not read"
        raise LinsCheckpointError(
            f"load_checkpoint: {path} holds {what} (in client_state or the scheduler's state); reading it would run "
            "code the checkpoint chose. Set \"lins\": {\"checkpoint_pickle\": true} to load checkpoints you "
            "trust (lins-ds convert: --checkpoint-pickle), or save client_state as tensors, numbers, strings, "
            "lists and dicts") from None


@dataclass(frozen=True)
class Found:
    path: str
    kind: str  # LINS, DEEPSPEED or UNIVERSAL
    detail: str = ""  # e.g. "ZeRO-3"

    def describe(self) -> str:
        return {LINS: "a Lins checkpoint", DEEPSPEED: f"a DeepSpeed {self.detail} checkpoint",
                UNIVERSAL: "a DeepSpeed universal checkpoint"}[self.kind]


def identify(path: str) -> Optional[Found]:
    """What ``path`` (a tag directory) holds, or None."""
    if os.path.isfile(os.path.join(path, META)):
        return Found(path, LINS)
    states = glob.glob(os.path.join(path, "*model_states.pt"))
    if states and os.path.isdir(os.path.join(path, "zero")):
        return Found(path, UNIVERSAL)
    if states and glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_*_optim_states.pt")):
        zero3 = any(os.path.basename(s).startswith("zero_pp_rank_") for s in states)
        return Found(path, DEEPSPEED, "ZeRO-3" if zero3 else "ZeRO-1/2")
    return None


def _whole(path: str) -> bool:
    """A Lins tag directory with its meta.json and every file that lists (what a fallback copy must be)."""
    import json

    try:
        with open(os.path.join(path, META), encoding="utf-8") as f:
            meta = json.load(f)
        names = list(meta["index"]) + ["frozen.safetensors", "extra.pt"]
        names += [META_SEAL] if meta.get("format") == FORMAT else []
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    return all(os.path.isfile(os.path.join(path, n)) for n in names)


def _read_pointer(load_dir: str, name: str) -> Optional[str]:
    path = os.path.join(load_dir, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise LinsCheckpointError(f"load_checkpoint: {path} is unreadable ({e}); pass tag=...") from None
    if not tag:
        raise LinsCheckpointError(f"load_checkpoint: {path} is empty; pass tag=...")
    return tag


def locate(load_dir: str, tag=None) -> Optional[Found]:
    """The checkpoint to load, or None when ``load_dir`` names none (DeepSpeed returns (None, None)). A tag
    directory that holds no checkpoint is an error saying what it holds; an interrupted Lins save is an error
    saying so, recognised by its own marker."""
    if tag is None:
        pointer = LATEST if _read_pointer(load_dir, LATEST) is not None else LATEST_UNIVERSAL
        tag = _read_pointer(load_dir, pointer)
        if tag is None:  # DeepSpeed's answer (and its warning): nothing to resume from, e.g. a first run
            logger.warning(f"Unable to find latest file at {os.path.join(load_dir, LATEST)}, if trying to load latest "
                           "checkpoint please ensure this file exists or pass an explicit checkpoint tag when loading a "
                           "checkpoint.")
            return None
        tag = checked_tag(tag, f"load_checkpoint: {os.path.join(load_dir, pointer)}")
    else:
        tag = checked_tag(tag, "load_checkpoint")
    if not os.path.isdir(load_dir):
        raise LinsCheckpointError(f"load_checkpoint: {load_dir} is not a directory")
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        found = identify(path)
        if found is not None:
            return found
        listing = sorted(os.listdir(path))[:6]
        raise LinsCheckpointError(f"load_checkpoint: {path} is not a checkpoint: it holds neither Lins' {META} nor "
                                  f"DeepSpeed's model and optimizer states (it holds {listing})")
    for other, why in ((path + INCOMPLETE, "complete, but not yet renamed"), (path + OLD, "the previous copy")):
        if os.path.isdir(other) and not os.path.exists(os.path.join(other, SAVING)) and _whole(other):
            # a re-save of this tag was killed while putting the new copy in place: one of the two is whole
            logger.warning(f"load_checkpoint: {path} is missing (a save of it was interrupted); loading {other}, {why}")
            return identify(other)
    if os.path.isfile(os.path.join(path + INCOMPLETE, SAVING)):
        raise LinsCheckpointError(f"load_checkpoint: {path} is incomplete (a save was interrupted); "
                                  f"{path + INCOMPLETE} is still marked in progress; load an earlier tag")
    raise LinsCheckpointError(f"load_checkpoint: no checkpoint tag {tag!r} in {load_dir}")
