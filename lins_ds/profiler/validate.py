"""Prediction vs measurement: time the collectives a plan really issues, on its real process groups,
and put each next to the cost model's prediction from a profile table."""

from __future__ import annotations

import statistics

from .. import comm
from ..plan import ProfileTable, Topology, TrainingSpec
from ..plan.cost import schedule
from .measure import time_op


def validate(table: ProfileTable, topo: Topology, layouts, units, train: TrainingSpec, device,
             warmup: int = 2, repeats: int = 5) -> dict:
    rows, seen = [], set()
    for layout in layouts:
        groups = comm.Groups(topo, layout)
        for c in schedule(topo, layout, units, train):
            key = (c.op, c.mesh, c.nbytes, c.group)
            if c.group == "world" or key in seen:
                continue
            seen.add(key)
            members = list(groups.members[c.group])
            measured, spread = time_op(c.op, c.nbytes, groups.pg(c.group), members, device, warmup, repeats)
            predicted = table.time(c.op, c.nbytes, c.mesh)
            rows.append({"layout": str(layout), "op": c.op, "group": c.group, "mesh": str(c.mesh),
                         "bytes": c.nbytes, "predicted_s": predicted, "measured_s": measured,
                         "relative_error": abs(predicted - measured) / measured, "spread": spread})
        comm.barrier()
        groups.destroy()
    errs = [r["relative_error"] for r in rows]
    return {"rows": rows, "median_relative_error": statistics.median(errs) if errs else None,
            "worst_relative_error": max(errs) if errs else None}
