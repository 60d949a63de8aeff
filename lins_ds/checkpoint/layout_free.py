"""Plan-independent checkpoint content: parameter element ranges, no trace of units or chunks.

A checkpoint tag directory holds
    meta.json                 names, shapes, dtypes, param groups, plan and world that wrote it,
                              engine counters, the index of every shard file; written last
    shard-<rank>.safetensors   per writing rank: for each parameter range [a, b) of its OS chunk,
                              "<name>@<a>:<b>/master" (fp32) and "<name>@<a>:<b>/<state key>"
                              (element-wise optimizer state), plus "@scalars/<group>/<key>"
    frozen.safetensors        frozen parameters and persistent buffers (rank 0)
    extra.pt                  LR scheduler, loss scaler, client_state (rank 0)
    config.json               the Hugging Face model config, when there is one
A save goes to "<tag>.incomplete", marked by a "SAVING" file written first, and is renamed to "<tag>" once
every rank has written (the marker removed just before); "latest" is rewritten last. So a killed save leaves
the previous checkpoint and "latest" intact, and is recognised by its marker.
"""

from __future__ import annotations

FORMAT = "lins_ds.checkpoint/1"
META = "meta.json"
LATEST = "latest"
INCOMPLETE = ".incomplete"
SAVING = "SAVING"  # the marker of a save in progress, inside "<tag>.incomplete"


def range_key(name: str, a: int, b: int, what: str) -> str:
    return f"{name}@{a}:{b}/{what}"


def overlaps(index: dict, name: str, a: int, b: int):
    """Shard files and stored ranges of parameter ``name`` that overlap [a, b): (file, sa, sb)."""
    for fname, ranges in index.items():
        for n, sa, sb in ranges:
            if n == name and sa < b and a < sb:
                yield fname, sa, sb
