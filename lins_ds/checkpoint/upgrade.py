"""``python -m lins_ds.checkpoint.upgrade CKPT [--tag TAG]``: a Lins checkpoint of format 1 checked and sealed as
format 2, which this lins_ds loads (docs/checkpoints.md).

Format 1's meta.json had no seal and could leave a file it names without a digest; this lins_ds refuses it, as it
refuses any format but its own. The upgrade keeps every file: it refuses a file named outside the tag directory or
one whose recorded digest differs (as a load would), records the digest of each file read that had none (those are
taken as they are now, and listed), writes the original meta.json to ``meta.json.v1`` and a format-2 meta.json
with its seal, ``meta.json.sha256``. Run again after an interruption, it starts from ``meta.json.v1``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from .formats import LinsCheckpointError, file_digest, verify_digest, write_meta
from .layout_free import DIGEST_SCHEME, DIGESTS, FORMAT, FORMAT_1, META, inside

ORIGINAL = META + ".v1"


def upgrade(path: str) -> list:
    """Seal tag directory ``path`` (format 1) as format 2; the files whose digests were recorded now (none had one).
    A format-2 checkpoint is only checked (nothing written; its error, if it has one)."""
    from .load import check_meta, read_meta

    what = "upgrade"
    try:
        read_meta(path, what)
        return []  # format 2, sealed, every file it names inside and listed
    except LinsCheckpointError:
        pass
    source = os.path.join(path, ORIGINAL if os.path.isfile(os.path.join(path, ORIGINAL)) else META)
    try:
        inside(path, os.path.basename(source), what)
        with open(source, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise LinsCheckpointError(f"{what}: {source} is unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise LinsCheckpointError(f"{what}: {source} is not a lins_ds checkpoint's meta.json")
    if meta.get("format") == FORMAT:
        read_meta(path, what)  # its error
    if meta.get("format") != FORMAT_1:
        raise LinsCheckpointError(f"{what}: {path} is not a lins_ds checkpoint of format {FORMAT_1!r} (format "
                                  f"{meta.get('format')!r})")
    recorded = meta.get(DIGESTS) if meta.get("digest_scheme") == DIGEST_SCHEME else None
    recorded = dict(recorded) if isinstance(recorded, dict) else {}
    meta.update({"format": FORMAT, DIGESTS: recorded, "digest_scheme": DIGEST_SCHEME})
    read = list(meta.get("index") or {}) + ["frozen.safetensors", "extra.pt"]
    read += ["config.json"] if os.path.lexists(os.path.join(path, "config.json")) else []
    added = []
    for entry in read + list(recorded):
        inside(path, entry, what)
    for entry in read:
        if not os.path.isfile(os.path.join(path, entry)):
            raise LinsCheckpointError(f"{what}: {os.path.join(path, entry)} is missing")
        if entry in recorded:
            verify_digest(os.path.join(path, entry), recorded, what, entry)
        else:
            recorded[entry] = file_digest(os.path.join(path, entry))
            added.append(entry)
    check_meta(path, meta, what)
    if not os.path.isfile(os.path.join(path, ORIGINAL)):
        shutil.copy2(os.path.join(path, META), os.path.join(path, ORIGINAL))
    write_meta(path, meta)
    read_meta(path, what)
    return added


def main(argv=None) -> int:
    from .consolidate import checkpoint_path

    p = argparse.ArgumentParser(prog="python -m lins_ds.checkpoint.upgrade",
                                description="Check a Lins checkpoint of format 1 and seal it as format 2 (keeps "
                                            "every file; the original meta.json is kept as meta.json.v1).")
    p.add_argument("checkpoint", help="a tag directory, or the save directory (its latest, or --tag)")
    p.add_argument("--tag", default=None)
    args = p.parse_args(argv)
    try:
        path = checkpoint_path(args.checkpoint, args.tag)
        added = upgrade(path)
    except LinsCheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    note = (f"; digests recorded now, unchecked before: {', '.join(added)}" if added else "")
    print(f"{path}: {FORMAT}{note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
