"""The profiler on 4 gloo processes as 2 nodes x 2: complete tables, cache hits, rejected caches."""

import json

import pytest

from helpers import launch, run, torchrun
from lins_ds.plan import Topology, candidates
from lins_ds.plan.cost import required_meshes

TOPO = Topology(2, 2)
MAX = 2**20


def profile_twice(cache_dir, tamper):
    import torch
    import torch.distributed as tdist

    from lins_ds.profiler import cache, obtain

    logs = []
    meshes = required_meshes(TOPO, candidates(TOPO))
    first = obtain(TOPO, meshes, torch.device("cpu"), max_bytes=MAX, cache_dir=cache_dir, log=logs.append)
    path = cache.cache_path(cache.launch_key(TOPO, torch.device("cpu")), cache_dir)
    tdist.barrier()
    if tdist.get_rank() == 0 and tamper:
        tamper(path)
    tdist.barrier()
    second = obtain(TOPO, meshes, torch.device("cpu"), max_bytes=MAX, cache_dir=cache_dir, log=logs.append)
    return first.to_json(), second.to_json(), logs, [str(m) for m in sorted(meshes)], path


def test_tables_are_complete_and_cached(tmp_path):
    res = run(profile_twice, 4, str(tmp_path), None, gpus_per_node=2)
    first, second, logs, meshes, path = res[0]
    assert all(r[0] == first for r in res)  # every rank holds rank 0's table
    got = {(m["op"], f"{m['intra']}x{m['inter']}") for m in first["measurements"]}
    ops = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
    assert got == {(op, mesh) for op in ops for mesh in meshes}
    for m in first["measurements"]:
        assert m["bytes"][0] <= 64 * 2**10 and m["bytes"][-1] >= MAX and len(m["spread"]) == len(m["bytes"])
    assert "measuring now" in logs[0] and logs[-1] == "lins profile: cache hit" and second == first
    assert "host_s_per_module" not in first["meta"]  # start-up profiling does not time the host: the engine's
    # own state would be in it (lins-ds profile and the example script measure it before any engine exists)


def _truncate(path):
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])


def _other_device(path):
    with open(path) as f:
        obj = json.load(f)
    obj["meta"]["device"] = "some other GPU"
    with open(path, "w") as f:
        json.dump(obj, f)


def test_corrupted_cache_is_rejected_and_remeasured(tmp_path):
    first, second, logs, _, path = run(profile_twice, 4, str(tmp_path), _truncate, gpus_per_node=2)[0]
    assert any("is unreadable" in msg for msg in logs) and "measuring now" in logs[-2]
    with open(path) as f:
        assert json.load(f)["format"] == "lins_ds.profile/1"  # rewritten whole


def test_mismatched_cache_is_rejected_and_remeasured(tmp_path):
    first, second, logs, _, _ = run(profile_twice, 4, str(tmp_path), _other_device, gpus_per_node=2)[0]
    assert any("measured for another launch" in msg and "some other GPU" in msg for msg in logs)
    assert second["meta"]["device"] == "cpu"


@pytest.mark.slow
def test_bench_profile_records_the_hosts_speed(tmp_path):
    """``lins-ds profile`` as the benchmark runs it (``torchrun -m bench profile``): the table's meta carries the
    slowest rank's host speed, which the simulator scales DeepSpeed's per-fetch cost by; the probe times a
    backward even under no_grad."""
    import torch

    from bench.host import seconds_per_module

    out = tmp_path / "profile.json"
    printed = launch(torchrun(2) + ["-m", "bench", "profile", "--quick", "--max-mb", "1", "--out", str(out)])
    table = json.loads(out.read_text())
    host_s = table["meta"]["host_s_per_module"]
    assert 0 < host_s < 0.1 and f"host: {1e6 * host_s:.1f} us per module pass" in printed
    assert table["meta"]["source"] == "measured:quick" and f"wrote {out}" in printed
    with torch.no_grad():
        assert 0 < seconds_per_module(torch.device("cpu")) < 0.1
