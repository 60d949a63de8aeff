"""Activation offload as a planned dimension (issue 60, docs/design.md §8; pure planner, no torch): the memory model
takes the offloaded layers' inputs off the GPU and counts them in host memory, the copies are priced by the host link,
the solver offloads the fewest layers that fit and none where the sequence fits without, and ``lins-ds plan`` walks the
same ladder (tilings first, then each again with activation offload)."""

import json
from dataclasses import replace

import pytest

from lins_ds.cli import main
from lins_ds.plan import MemorySpec, Topology, TrainingSpec, load_model
from lins_ds.plan.memory import GIB, UPLOADED_LAYERS, formula_activations, memory, offloaded_input_bytes
from lins_ds.plan.offload import HostSpec, OffloadSpec
from lins_ds.plan.sequence import activation_offload_seconds, rungs
from lins_ds.plan.solver import Plan, solve
from lins_ds.plan.topology import Factor, Layout, PlanError

ONE = Topology(1, 1)
RESIDENT_LAYOUT = Layout(Factor(1, 1), Factor(1, 1), Factor(1, 1))
HOST = HostSpec(400.0, h2d_gbs=50.0, d2h_gbs=50.0, source="given")
LLAMA8B = ["--model", "bench/models/hub-llama3-8b.json", "--nodes", "1", "--gpus-per-node", "1",
           "--gpu-memory-gb", "79.2", "--micro-batch-size", "1"]


def _model():
    return load_model("bench/models/hub-llama3-8b.json")


def _train(seq: int) -> TrainingSpec:
    return TrainingSpec(seq, 1, mlp_tiles=32, logits_tiles=64)


def _solve(seq: int, act, host=HOST, gpu_gb: float = 79.2):
    from lins_ds.plan import get_cluster
    from lins_ds.plan import cost

    model = _model()
    train = replace(_train(seq), activation_offload=act)
    table = get_cluster("a800-ib").table(cost.required_meshes(ONE, [RESIDENT_LAYOUT]))
    return solve(model, ONE, train, MemorySpec(gpu_gb, 2.0), table, offload=OffloadSpec("auto", host=host))


def test_the_offloaded_inputs_leave_the_gpu_and_take_host_memory():
    model, n = _model(), 32
    train = TrainingSpec(131072, 1)
    mem = MemorySpec(1000.0, 2.0)
    moved = offloaded_input_bytes(formula_activations(model, train), model, train)
    assert moved == 131072 * model.hidden * 2  # the residual stream: seq x hidden in bf16
    base = memory(model, train, mem, ONE, RESIDENT_LAYOUT, n)
    for a in (1, UPLOADED_LAYERS, 10, n):
        off = memory(model, train, mem, ONE, RESIDENT_LAYOUT, n, act_offload_units=a)
        away = max(0, a - UPLOADED_LAYERS) * moved / GIB  # those back on the device for the recompute stay
        assert off.terms["activations"] == pytest.approx(base.terms["activations"] - away)
        assert off.activation_host_gb == pytest.approx(a * moved / GIB)
        assert off.host_gb == pytest.approx(base.host_gb + a * moved / GIB)
    # more than the checkpointed units cannot be offloaded: only a checkpointed unit keeps just its inputs
    capped = memory(model, train, mem, ONE, RESIDENT_LAYOUT, 4, act_offload_units=10)
    assert capped.activation_host_gb == pytest.approx(4 * moved / GIB)


def test_the_copies_cost_only_what_compute_does_not_hide():
    gb = 1e9
    # 1 GB at 50 GB/s: 20 ms each way; a layer's backward of 100 ms hides the upload, a forward of 1 s the downloads
    assert activation_offload_seconds(gb, 10, HOST, 1.0, 3.2, 32, 1) == 0.0
    slow = replace(HOST, h2d_gbs=5.0, d2h_gbs=5.0)  # 200 ms each way
    up = 10 * (0.2 - 3.2 / 32)
    down = 10 * 0.2 - 1.0
    assert activation_offload_seconds(gb, 10, slow, 1.0, 3.2, 32, 2) == pytest.approx(2 * (up + down))


def test_the_ladder_offloads_none_where_the_sequence_fits_without(capsys):
    """The planner's ladder (``lins-ds plan``'s and the engine's): the rungs with activation offload come after every
    rung without it, so a sequence that fits without (here with the optimizer state of some units on the host) plans
    exactly as with ``--activation-offload off``."""
    def plan(*extra):
        assert main(["plan", *LLAMA8B, "--host-memory-gb", "200", "--seq-len", "8192", "--format", "json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    auto, off = plan(), plan("--activation-offload", "off")
    assert auto["activation_offload_units"] == 0 and "activation_offload_units" not in auto["plan_record"]
    assert auto["plan_record"] == off["plan_record"] and auto["offload_units"] > 0


def test_the_solver_offloads_the_fewest_layers_that_fit():
    with pytest.raises(PlanError):
        _solve(300_000, False)  # too long for the GPU without it
    long = _solve(300_000, True)
    a, k = long.plan.activation_offload_units, long.plan.activation_checkpointing_units
    assert UPLOADED_LAYERS < a <= k and long.best.memory.total_gb <= 79.2
    assert long.best.memory.activation_host_gb > 0 and long.best.memory.host_gb <= HOST.capacity_gb
    # the fewest: one layer fewer does not fit the GPU with the same placement and checkpointing (another placement,
    # e.g. G on the host, may fit with fewer: the solver priced it slower)
    best = long.best
    fewer = memory(_model(), replace(_train(300_000), activation_offload=a - 1), MemorySpec(79.2, 2.0), ONE,
                   best.layout, k, None, best.placement, a - 1)
    assert fewer.total_gb > 79.2
    # a fixed number is that many, of the layers the plan checkpoints
    fixed = _solve(8192, 5).plan
    assert fixed.activation_offload_units == min(5, fixed.activation_checkpointing_units) > 0
    # no host to hold them: nothing offloaded
    with pytest.raises(PlanError):
        _solve(300_000, True, host=replace(HOST, capacity_gb=1.0))


def test_the_plan_carries_it_through_json():
    plan = _solve(300_000, True).plan
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.activation_offload_units == plan.activation_offload_units > 0


def test_the_ladder_offers_it_after_every_tiling():
    from lins_ds.plan.sequence import LADDER

    assert rungs("auto", True) == rungs("auto", True, False) == [(*t, False) for t in LADDER]
    both = rungs("auto", True, "auto")
    half = len(both) // 2
    assert [r[2] for r in both] == [False] * half + [True] * half and both[:half] == rungs("auto", True)
    assert rungs(False, True, "auto") == [(1, 1, False), (1, 1, True)]
    assert rungs(False, True, 4) == [(1, 1, 4)]
    with pytest.raises(PlanError, match="activation_offload"):
        TrainingSpec(128, 1, activation_offload=-1)


def test_lins_ds_plan_reaches_longer_sequences_with_it_and_says_so(capsys):
    host = ["--host-memory-gb", "200"]

    def longest(*extra):
        assert main(["plan", *LLAMA8B, *host, "--seq-len", "8192", "--longest", "--format", "json", *extra]) == 0
        return json.loads(capsys.readouterr().out)["longest"]["seq_len"]

    without, with_it = longest("--activation-offload", "off"), longest()
    assert with_it > 1.5 * without, (without, with_it)
    assert main(["plan", *LLAMA8B, *host, "--seq-len", str(with_it)]) == 0
    table = capsys.readouterr().out
    assert "activation offload: the inputs of" in table and "checkpointed layer units held on the host" in table
    assert main(["plan", *LLAMA8B, *host, "--seq-len", str(with_it), "--activation-offload", "off"]) == 2
    capsys.readouterr()
