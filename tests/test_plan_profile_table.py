import json
import math

import pytest

from lins_ds.plan import Factor, PlanError, ProfileTable, get_cluster
from lins_ds.plan.profile_table import Series


def test_interpolation_is_monotone_and_exact_at_points():
    s = Series((1024, 4096, 16384), (1e-5, 3e-5, 2e-5))  # a noisy dip is flattened
    assert s.time(1024) == 1e-5 and s.time(4096) == 3e-5 and s.time(16384) == 3e-5
    xs = [2 ** (10 + k / 8) for k in range(0, 40)]
    ts = [s.time(x) for x in xs]
    assert all(a <= b + 1e-18 for a, b in zip(ts, ts[1:]))


def test_outside_the_measured_range():
    s = Series((1024, 2048), (1e-5, 1.5e-5))
    assert s.time(10) == 1e-5  # latency floor
    assert math.isclose(s.time(4096), 3e-5)  # last bandwidth


def test_round_trip_and_rejects():
    t = get_cluster("a800-ib").table([Factor(8, 1), Factor(8, 2)])
    t2 = ProfileTable.from_json(json.loads(json.dumps(t.to_json())))
    assert t2.time("all_gather", 123456, Factor(8, 2)) == t.time("all_gather", 123456, Factor(8, 2))
    with pytest.raises(PlanError, match="not a lins_ds profile"):
        ProfileTable.from_json({"format": "other"})
    bad = t.to_json()
    bad["measurements"][0]["time_s"][0] = -1
    with pytest.raises(PlanError, match="positive"):
        ProfileTable.from_json(bad)
    with pytest.raises(PlanError, match="no measurement of all_reduce on mesh 4x1"):
        t.time("all_reduce", 10, Factor(4, 1))
    assert t.time("all_reduce", 10, Factor(1, 1)) == 0.0


def test_synthetic_inter_node_is_slower_than_intra():
    c = get_cluster("h200-emulated")
    t = c.table([Factor(2, 1), Factor(1, 2)])
    assert t.time("all_reduce", 2**29, Factor(1, 2)) > 10 * t.time("all_reduce", 2**29, Factor(2, 1))
