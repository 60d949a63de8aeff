"""Plan-independent checkpoint content: parameter element ranges, no trace of units or chunks.

A checkpoint tag directory holds
    meta.json                 names, shapes, dtypes, param groups, plan and world that wrote it,
                              engine counters, the index of every shard file, every file's digest; written last
    meta.json.sha256          the SHA-256 of meta.json (``sha256sum -c`` reads it), checked before meta.json is
                              trusted
    shard-<rank>.safetensors   per writing rank: for each parameter range [a, b) of its OS chunk,
                              "<name>@<a>:<b>/master" (fp32) and "<name>@<a>:<b>/<state key>"
                              (element-wise optimizer state), plus "@scalars/<group>/<key>"
    frozen.safetensors        frozen parameters and persistent buffers (rank 0)
    extra.pt                  LR scheduler, loss scaler, client_state and DeepSpeed's own checkpoint keys
                              (ds_config, ds_version, buffer_names, param_shapes, ...) (rank 0)
    config.json               the Hugging Face model config, when there is one
A save goes to "<tag>.incomplete", marked by a "SAVING" file written first, and is renamed to "<tag>" once
every rank has written (the marker removed just before; an existing "<tag>" is first renamed "<tag>.old", removed
last); "latest" is rewritten last. meta.json records each file's SHA-256 (``digests``), checked when it is read. So
a killed save leaves, at every instant, one complete copy that a load finds: "<tag>", else a complete
"<tag>.incomplete" (the marker gone), else "<tag>.old".

meta.json is trusted only as far as its rules (``load.read_meta``): its own SHA-256 matches meta.json.sha256; every
file it names resolves inside the tag directory (``inside``: symlinks followed); every file a reader opens has its
digest listed. Format 1 (before meta.json.sha256, when a file could go unlisted) is refused like any format not this
one; ``python -m lins_ds.checkpoint.upgrade`` checks such a checkpoint and seals it as format 2, keeping its files.
"""

from __future__ import annotations

import os


class LinsCheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read as asked; the previous checkpoint and `latest` stay as they were."""


FORMAT = "lins_ds.checkpoint/2"
FORMAT_1 = "lins_ds.checkpoint/1"  # meta.json unsealed, files possibly unlisted: refused, upgraded by upgrade.py
META = "meta.json"
META_SEAL = "meta.json.sha256"  # "<sha256 of meta.json>  meta.json\n", as sha256sum writes it
LATEST = "latest"
INCOMPLETE = ".incomplete"
OLD = ".old"  # an existing tag while a re-save of it is put in place
SAVING = "SAVING"  # the marker of a save in progress, inside "<tag>.incomplete"
DIGESTS = "digests"  # meta.json: file name -> its digest (``formats.file_digest``)
DIGEST_SCHEME = "sha256-of-64MiB-block-sha256s"  # meta.json's "digest_scheme": how those were computed


def digests_of(meta: dict):
    """The file digests a checkpoint's meta.json records, where computed as this lins_ds computes them, else None."""
    return meta.get(DIGESTS) if meta.get("digest_scheme") == DIGEST_SCHEME else None


def inside(root: str, entry, where: str) -> str:
    """The real path of ``entry``, a file that ``root``'s meta.json names, or LinsCheckpointError naming the file, the
    entry and the rule: every file a checkpoint names must resolve (symlinks followed) inside its own directory."""
    if not isinstance(entry, str) or not entry or "\x00" in entry:
        raise LinsCheckpointError(f"{where}: {os.path.join(root, META)} names the file {entry!r}, which is not a file "
                                  "name; every file a checkpoint names must lie inside its directory")
    base = os.path.realpath(root)
    real = os.path.realpath(os.path.join(base, entry))
    if os.path.isabs(entry) or os.path.commonpath([base, real]) != base or real == base:
        raise LinsCheckpointError(f"{where}: {os.path.join(root, META)} names the file {entry!r}, which resolves "
                                  f"to {real}, outside the checkpoint directory {base}; every file a checkpoint names "
                                  "must lie inside its directory (no '..', absolute paths or symlinks leading out)")
    return real


def checked_tag(tag, where: str) -> str:
    """``tag`` as a directory name inside the checkpoint directory, or LinsCheckpointError naming ``where`` it came
    from: no separator, no "." or "..", not absolute, not empty (a tag, or a ``latest`` file, must never lead a save
    or a load outside the checkpoint directory)."""
    tag = str(tag)
    bad = (not tag or tag in (".", "..") or "/" in tag or "\\" in tag or (os.sep in tag) or "\x00" in tag
           or os.path.isabs(tag))
    if bad:
        raise LinsCheckpointError(f"{where}: tag {tag!r} is not a directory name inside the checkpoint directory (no "
                                  "path separators, '.' or '..'); checkpoints are read and written only there")
    return tag


def range_key(name: str, a: int, b: int, what: str) -> str:
    return f"{name}@{a}:{b}/{what}"


def overlaps(index: dict, name: str, a: int, b: int):
    """Shard files and stored ranges of parameter ``name`` that overlap [a, b): (file, sa, sb)."""
    for fname, ranges in index.items():
        for n, sa, sb in ranges:
            if n == name and sa < b and a < sb:
                yield fname, sa, sb
