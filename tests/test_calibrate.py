"""The simulator's fitted terms (bench/calibrate.py, python -m bench simulate --fit / --validate / --calibration): pure
Python on synthetic bench results whose steps come from known terms."""

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from bench.__main__ import main
from lins_ds.plan import Factor, Layout, PlanError, Topology, candidates, get_cluster
from lins_ds.plan.cost import required_meshes
from bench import calibrate as C
from bench.simulate import Overheads

TRUE = Overheads({"zero0": {"comm_factor": 1.2, "update_factor": 3.0},
                  "zero1": {"comm_factor": 1.1, "update_factor": 3.0},
                  "zero2": {"comm_factor": 1.4, "update_factor": 3.0},
                  "zero3": {"comm_factor": 0.9, "update_factor": 3.0, "per_fetch_s": 7e-4, "per_fetch_byte_s": 5e-12},
                  "mics": {"comm_factor": 0.8, "update_factor": 3.0, "per_fetch_s": 7e-4, "per_fetch_byte_s": 5e-12},
                  "lins": {"comm_factor": 1.15, "update_factor": 3.0}},
                 {"llama-1b": 0.3, "llama-7b": 0.45}, "synthetic")
CLUSTER = get_cluster("h200-emulated")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOPOLOGIES = {"host": Topology(1, 2), "emulated": Topology(2, 1)}


def _tables():
    return {name: CLUSTER.table(required_meshes(topo, candidates(topo))) for name, topo in TOPOLOGIES.items()}


def _bench(path, model, steps=None, host=None, truth=TRUE, grad_accum=2):
    """A lins-ds bench result for ``model``, its runs on a host measured at ``host`` s per module (None: not
    measured); steps from ``truth`` unless given."""
    rows = {}
    for name, topo in TOPOLOGIES.items():
        for mode in ("zero0", "zero1", "zero2", "zero3", "mics", "lins"):
            lay = Layout(Factor(1, 1), Factor(1, 1), Factor(topo.gpus_per_node, topo.nodes))
            rows.setdefault(name, []).append({"mode": mode, "model": model, "world_size": 2, "seq_len": 2048,
                                              "gpus_per_node": topo.gpus_per_node, "median_step_s": 1.0,
                                              "samples_per_gpu_per_step": 2 * grad_accum, "peak_memory_gb": 20.0,
                                              "plan": lay.to_json() if mode == "lins" else None,
                                              "host_s_per_module": host})
    nocomm = {"mode": "nocomm", "model": model, "seq_len": 2048, "median_step_s": 1.0, "peak_memory_gb": 20.0}
    bench = {"command": "lins-ds bench", "micro_batch_size": 2, "grad_accum": grad_accum, "no_comm_limit": nocomm,
             "table": {t: {"rows": r} for t, r in rows.items()}}
    path.write_text(json.dumps(bench))
    runs = C.load_runs(str(path))
    steps = steps or [C.predict(r, _tables(), CLUSTER.compute(), truth)[0] for r in runs]
    for r, s in zip([x for t in rows.values() for x in t] + [nocomm], steps):
        r["median_step_s"] = s
    path.write_text(json.dumps(bench))
    return str(path)


@pytest.fixture
def benches(tmp_path):
    return [_bench(tmp_path / "b1.json", "1b"), _bench(tmp_path / "b7.json", "7b")]


def test_nnls_keeps_coefficients_non_negative():
    rng = np.random.default_rng(0)
    a = rng.random((30, 5)) * np.array([1, 1000, 1, 1e-3, 1])  # columns of very different scale
    x = np.array([2.0, 0.0, 0.5, 300.0, 1.0])
    assert C.nnls(a, a @ x) == pytest.approx(x, rel=1e-6, abs=1e-9)
    b = a @ np.array([1.0, -0.01, 1.0, 0.0, 1.0])  # the unconstrained answer has a negative coefficient
    got = C.nnls(a, b)
    assert got.min() >= 0 and got[1] == 0
    assert np.linalg.norm(a @ got - b) <= np.linalg.norm(a @ np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0, None) - b)


def test_fit_recovers_the_terms_that_made_the_runs(benches):
    runs = [r for b in benches for r in C.load_runs(b)]
    assert {r.system for r in runs} == {"zero0", "zero1", "zero2", "zero3", "mics", "lins"}
    assert [r for r in runs if r.mode == "nocomm"][0].over_nocomm_s is None
    got = C.fit(runs, _tables(), CLUSTER.compute())
    for model, eff in TRUE.compute.items():
        assert got.compute[model] == pytest.approx(eff, rel=1e-3)
    for system in TRUE.systems:
        for term, value in TRUE.terms(system).items():
            assert got.terms(system)[term] == pytest.approx(value, rel=1e-3, abs=1e-9), (system, term)
    rows = C.validate(runs, _tables(), CLUSTER.compute(), got, leave_one_out=True)
    assert max(abs(r["error_pct"]) for r in rows) < 0.1
    assert {r["run"] for r in rows if r["terms"]["fetch_bound"]} == {  # on the fast link the fetches set the pace
        "llama-1b host zero3", "llama-1b host mics", "llama-1b emulated mics", "llama-7b host zero3",
        "llama-7b host mics"}
    # exact data: a mode left out is still predicted by the others, but for the one link-bound MiCS run, the
    # only run that determines MiCS's link factor
    loo = {r["run"]: abs(r["loo_error_pct"]) for r in rows}
    assert loo.pop("llama-7b emulated mics") > 5
    assert max(loo.values()) < 1
    lins = [r for r in rows if r["system"] == "lins"][0]
    assert lins["predicted_peak_gb"] > 0 and lins["plan"] == "P=1x1 G=1x1 OS=2x1"


def test_what_overlapped_communication_still_costs_is_told_from_what_is_exposed(tmp_path):
    """Lins overlaps its boundary AllReduce and P-sync with compute (``cost.exposed_seconds``); the step may still
    pay part of that time (the overlapped kernels slow each other). Its runs on a fast link (nothing exposed) and
    on a slow one (part exposed) tell that share from the factor on the exposed part. DeepSpeed's ZeRO-1 runs with
    ``overlap_comm`` (ds_configs/zero1.json): its boundary reduction is told apart the same way."""
    systems = dict(TRUE.systems, lins=dict(TRUE.systems["lins"], overlap_factor=0.8),
                   zero1=dict(TRUE.systems["zero1"], overlap_factor=0.4))
    truth = Overheads(systems, TRUE.compute, "synthetic")
    runs = [r for m in ("1b", "7b") for r in C.load_runs(_bench(tmp_path / f"b{m}.json", m, truth=truth))]
    lins = [C.predict(r, _tables(), CLUSTER.compute(), truth)[1] for r in runs if r.system == "lins"]
    assert all(t.overlapped_s > 0 for t in lins) and any(t.exposed_s > 0 for t in lins)
    got = C.fit(runs, _tables(), CLUSTER.compute())
    assert got.terms("lins")["overlap_factor"] == pytest.approx(0.8, rel=1e-3)
    assert got.terms("lins")["comm_factor"] == pytest.approx(1.15, rel=1e-3)
    assert got.terms("zero1")["overlap_factor"] == pytest.approx(0.4, rel=1e-3)
    assert got.terms("zero1")["comm_factor"] == pytest.approx(1.1, rel=1e-3)
    assert got.terms("zero0")["overlap_factor"] == 0.0  # ZeRO-0 reduces after the backward: all exposed
    # hiding it cannot cost a step more than leaving it exposed: a fit that would price it higher holds it at 1
    systems = dict(TRUE.systems, lins=dict(TRUE.systems["lins"], overlap_factor=1.3))
    truth = Overheads(systems, TRUE.compute, "synthetic")
    runs = [r for m in ("1b", "7b") for r in C.load_runs(_bench(tmp_path / f"c{m}.json", m, truth=truth))]
    assert C.fit(runs, _tables(), CLUSTER.compute()).terms("lins")["overlap_factor"] == 1.0


def test_a_table_with_timed_layers_holds_the_compute_factor_it_measured(tmp_path):
    """A compute table whose layers were timed (``python -m bench profile --compute``) measured the shape model's factor
    itself: the fit holds it and fits the per-system terms on top, Lins' optimizer step and DeepSpeed's (fp32 master
    weights, every gradient copied into them) each with its own update factor."""
    from bench.compute_model import ComputeTable, in_training_factor

    table = ComputeTable.load(os.path.join(ROOT, "bench/results/simulate/shapes/call20/layers/compute.json"))
    f = in_training_factor(table)
    systems = {s: dict(t, per_step_s=0.01) for s, t in TRUE.systems.items()}
    systems["lins"]["update_factor"] = 2.5
    truth = Overheads(systems, {"shape": 1.0 / f}, "synthetic", compute_table=table.to_json())
    runs = [r for m in ("1b", "7b", "13b") for r in C.load_runs(_bench(tmp_path / f"b{m}.json", m, truth=truth))]
    compute = replace(CLUSTER.compute(), table=table, achievable_mfu=1.0)
    got = C.fit(runs, _tables(), compute)
    assert got.compute["shape"] == pytest.approx(1.0 / f, rel=1e-9)
    assert got.terms("lins")["update_factor"] == pytest.approx(2.5, rel=1e-3)
    assert got.terms("zero1")["update_factor"] == got.terms("zero3")["update_factor"] == pytest.approx(3.0, rel=1e-3)
    # runs of Lins alone: DeepSpeed's systems take Lins' update factor, not the byte model's 1
    only = C.fit([r for r in runs if r.system == "lins"], _tables(), compute)
    assert only.terms("zero1")["update_factor"] == only.terms("lins")["update_factor"] == pytest.approx(2.5, rel=1e-3)
    # the same runs taken 10 % slower: the measured factor stays, the other terms take what it does not price
    slower = [replace(r, step_s=1.1 * r.step_s) for r in runs]
    assert C.fit(slower, _tables(), compute).compute["shape"] == pytest.approx(1.0 / f, rel=1e-9)


def test_a_noisy_run_shows_in_its_error_and_leave_one_out(tmp_path):
    tables, compute = _tables(), CLUSTER.compute()
    path = _bench(tmp_path / "b1.json", "1b")
    bench = json.loads(open(path).read())
    bench["table"]["emulated"]["rows"][1]["median_step_s"] *= 1.5  # emulated ZeRO-1 measured 50 % slow
    open(path, "w").write(json.dumps(bench))
    runs = C.load_runs(path) + C.load_runs(_bench(tmp_path / "b7.json", "7b"))
    rows = C.validate(runs, tables, compute, C.fit(runs, tables, compute), leave_one_out=True)
    noisy = [r for r in rows if r["run"] == "llama-1b emulated zero1"][0]
    assert noisy["error_pct"] < -5 and noisy["loo_error_pct"] < noisy["error_pct"]


def test_repeated_runs_are_held_to_their_median(tmp_path):
    """The same mode measured in three leases: one row with its median and range."""
    first = _bench(tmp_path / "a.json", "1b")
    exact = [r.step_s for r in C.load_runs(first)]
    repeats = [_bench(tmp_path / f"{n}.json", "1b", steps=[f * s for s in exact]) for n, f in (("b", 1.5), ("c", 1.1))]
    runs = [r for b in (first, *repeats) for r in C.load_runs(b)]
    modes = {m["mode"]: m for m in C.per_mode(C.validate(runs, _tables(), CLUSTER.compute(), TRUE))}
    assert len(modes) == 13 and "llama-1b emulated lins P=1x1 G=1x1 OS=1x2" in modes
    zero1 = modes["llama-1b host zero1"]
    assert zero1["runs"] == 3 and zero1["measured_median_s"] == pytest.approx(1.1 * zero1["measured_min_s"])
    assert zero1["measured_max_s"] == pytest.approx(1.5 * zero1["measured_min_s"])
    assert zero1["error_pct"] == pytest.approx(100 * (1 / 1.1 - 1))
    assert "predicted within 10 % of the median: 13 of 13 modes" in C.per_mode_text(list(modes.values()))


def test_shared_terms_reach_systems_without_runs_and_a_mode_left_out_may_be_undetermined(tmp_path):
    runs = [r for r in C.load_runs(_bench(tmp_path / "b1.json", "1b")) if r.system != "mics"]
    runs.append([r for r in C.load_runs(_bench(tmp_path / "b7.json", "7b")) if r.label == "llama-7b host zero1"][0])
    got = C.fit(runs, _tables(), CLUSTER.compute())
    # shared: fitted from the ZeRO-3 runs, so MiCS has them too (one model size: the fetch cost as a whole; its
    # split between per fetch and per byte needs two sizes)
    assert got.terms("mics")["update_factor"] == pytest.approx(TRUE.terms("mics")["update_factor"], rel=1e-3)
    zero3 = [r for r in runs if r.label == "llama-1b host zero3"][0]
    terms = C.terms_of(zero3, _tables(), CLUSTER.compute().at(0.3))[0]
    assert terms.waits(got.terms("mics"))[1] == pytest.approx(terms.waits(TRUE.terms("mics"))[1], rel=1e-3)
    assert "comm_factor" not in got.systems["mics"] and got.terms("zeropp")["per_fetch_s"] > 0
    rows = C.validate(runs, _tables(), CLUSTER.compute(), got, leave_one_out=True)
    only_7b = [r for r in rows if r["run"] == "llama-7b host zero1"][0]
    assert only_7b["loo_predicted_step_s"] is None  # without it nothing determines 7B's efficiency
    assert abs(only_7b["error_pct"]) < 0.1


def test_fetch_cost_follows_each_runs_measured_host(tmp_path):
    """The same runs on hosts measured 1x, 1.5x and 0.8x the reference's time per module: the fit finds the
    reference host and the per-fetch cost there; a ZeRO-3 run on a slow host is predicted slower, the others not."""
    truth = Overheads(TRUE.systems, TRUE.compute, "synthetic", host_s_per_module=50e-6)
    benches = [_bench(tmp_path / f"{model}_{n}.json", model, host=host, truth=truth)
               for model in ("1b", "7b") for n, host in enumerate((50e-6, 75e-6, 40e-6))]
    runs = [r for b in benches for r in C.load_runs(b)]
    tables, compute = _tables(), CLUSTER.compute()
    got = C.fit(runs, tables, compute)
    assert got.host_s_per_module == pytest.approx(50e-6)  # the median measured host
    assert got.terms("zero3")["per_fetch_s"] == pytest.approx(7e-4, rel=1e-3)
    rows = C.validate(runs, tables, compute, got)
    assert max(abs(r["error_pct"]) for r in rows) < 0.1
    step = {(r["run"], r["host_s_per_module"]): r["predicted_step_s"] for r in rows}
    slower = step[("llama-1b host zero3", 75e-6)] - step[("llama-1b host zero3", 50e-6)]
    fetches = [r for r in rows if r["run"] == "llama-1b host zero3"][0]["terms"]["fetches"]
    assert slower == pytest.approx(0.5 * 7e-4 * fetches, rel=1e-3)  # the hooks' part, not the bytes'
    assert got.terms("zero3")["per_fetch_byte_s"] == pytest.approx(5e-12, rel=1e-3)
    assert step[("llama-1b host zero1", 75e-6)] == step[("llama-1b host zero1", 50e-6)]
    # the same runs with their hosts unrecorded: one fetch cost cannot hold them
    blind = [replace(r, host_s=None) for r in runs]
    blind_rows = C.validate(blind, tables, compute, C.fit(blind, tables, compute))
    assert max(abs(r["error_pct"]) for r in blind_rows if r["system"] == "zero3") > 10
    # and the simulator prices a profile's host the same way
    stored = Overheads.from_json(json.loads(json.dumps(got.to_json())))
    assert stored.host_scale(75e-6) == pytest.approx(1.5) and stored.host_scale(None) == 1.0


def test_bench_result_errors_name_the_file(tmp_path):
    bad = tmp_path / "bench.json"
    bad.write_text(json.dumps({"table": {"host": {"rows": [{"mode": "zero1"}]}}}))
    with pytest.raises(PlanError, match="bench.json: not a python -m bench run result"):
        C.load_runs(str(bad))
    bench = json.loads(open(_bench(tmp_path / "b.json", "1b")).read())
    bench["grad_accum"] = 4  # rows say 4 samples per GPU per step: 2 x 4 does not match
    bad.write_text(json.dumps(bench))
    with pytest.raises(PlanError, match="samples per GPU per step, not micro-batch 2 x grad-accum 4"):
        C.load_runs(str(bad))


def _profiles(tmp_path):
    out = {}
    for name, table in _tables().items():
        out[name] = tmp_path / f"profile_{name}.json"
        out[name].write_text(json.dumps(table.to_json()))
    return out


def _fails(capsys, args, message):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_fit_validate_and_calibration(tmp_path, benches, capsys):
    prof = _profiles(tmp_path)
    out = tmp_path / "calibrated.json"
    fit_args = ["simulate", "--fit", *benches, "--profile", str(prof["host"]), "--emulated-profile",
                str(prof["emulated"])]
    _fails(capsys, fit_args, "--out: required with --fit")
    assert main([*fit_args, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "predicted: 26 of 26 runs within 10 %" in text
    assert "leave-one-out (the mode's runs left out): 25 of 26" in text  # the link-bound MiCS run, as above
    assert "predicted within 10 % of the median: 26 of 26 modes" in text
    stored = json.loads(out.read_text())["meta"]["simulator"]
    assert stored["overheads"]["compute_efficiency"]["llama-7b"] == pytest.approx(0.45, rel=1e-3)
    assert len(stored["fit"]) == 26

    assert main(["simulate", "--validate", benches[0], "--profile", str(out), "--emulated-profile",
                 str(prof["emulated"]), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)["runs"]
    assert len(rows) == 13 and max(abs(r["error_pct"]) for r in rows) < 0.1
    _fails(capsys, ["simulate", "--validate", benches[0], "--profile", str(out)],
           "llama-1b emulated zero0: no profile for the emulated topology (--profile / --emulated-profile)")
    _fails(capsys, ["simulate", "--validate", benches[0], "--profile", str(prof["host"])],
           f"--profile {prof['host']}: holds no fitted terms")

    paper = ["simulate", "--model", "llama-7b", "--nodes", "16", "--cluster", "a800-ib", "--gpus-per-node", "8",
             "--seq-len", "4096", "--micro-batch-size", "1", "--global-batch-tokens", "4194304", "--format", "json"]
    assert main(paper) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*paper, "--calibration", str(out)]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert "per-system terms fitted to GPU runs" in fitted["calibration"]
    assert fitted["systems"]["zero1"]["step_s"] > plain["systems"]["zero1"]["step_s"]  # update x3, link x1.1
    _fails(capsys, [*paper, "--calibration", str(prof["host"])], f"--calibration {prof['host']}: holds no fitted terms")

    # the fitted terms with the host's own table: the fit's compute model (h200-emulated), not a800-ib's
    host = ["simulate", "--profile", str(out), "--nodes", "1", "--gpus-per-node", "2", "--model", "llama-1b",
            "--seq-len", "2048", "--micro-batch-size", "2", "--global-batch-tokens", "16384", "--gpu-memory-gb", "139",
            "--systems", "zero1", "--format", "json"]
    assert main(host) == 0
    sim = json.loads(capsys.readouterr().out)["systems"]["zero1"]["step_s"]
    measured = [r for r in stored["fit"] if r["run"] == "llama-1b host zero1"][0]["measured_step_s"]
    assert sim == pytest.approx(measured, rel=1e-3)
    _fails(capsys, [*host, "--cluster", "a800-ib"], "--cluster a800-ib: the fitted efficiency of llama-1b")
    _fails(capsys, ["simulate", "--model", "llama-7b"], "--gpus-per-node: required to simulate")


def test_one_gpu_runs_pay_the_hooks_only_and_are_labelled_apart(tmp_path):
    """A bench on one GPU (``lins-ds bench --nproc 1``): its ZeRO-3 run is priced with the hooks of every fetch
    and none of the bytes (one rank gathers nothing) and keeps a label apart from the two-GPU host runs."""
    rows = [{"mode": m, "model": "1b", "world_size": 1, "gpus_per_node": 1, "seq_len": 2048, "median_step_s": 1.0,
             "samples_per_gpu_per_step": 4, "host_s_per_module": 60e-6} for m in ("zero0", "zero3")]
    path = tmp_path / "one_gpu.json"
    path.write_text(json.dumps({"command": "lins-ds bench --nproc 1", "micro_batch_size": 2, "grad_accum": 2,
                                "table": {"host": {"rows": rows}}}))
    zero0, zero3 = C.load_runs(str(path))
    assert (zero0.label, zero3.label) == ("llama-1b 1-GPU zero0", "llama-1b 1-GPU zero3")
    truth = Overheads(TRUE.systems, TRUE.compute, "synthetic", host_s_per_module=40e-6)
    (s0, *_), (s3, t3, *_) = (C.predict(r, _tables(), CLUSTER.compute(), truth) for r in (zero0, zero3))
    assert t3.fetch_bytes == 0 and t3.exposed_s == 0
    assert s3 - s0 == pytest.approx(7e-4 * t3.fetches * 1.5)  # the hooks at a host 1.5x the reference's


def test_a_tuned_jobs_measured_candidates_are_calibration_data():
    """``"plan": "tune"`` appends every measured candidate to tune-runs.jsonl beside the profiles; --fit reads it:
    Lins with the candidate's layout and checkpointing depth (offloaded candidates left out: no offload term)."""
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "bench/results/tune/final/cache/tune-runs.jsonl")
    runs = C.load_runs(path)
    assert [(r.system, r.ckpt_units, r.step_s) for r in runs] == [("lins", 18, pytest.approx(0.945, abs=5e-4)),
                                                                    ("lins", 21, pytest.approx(0.974, abs=5e-4)),
                                                                    ("lins", 24, pytest.approx(0.997, abs=5e-4))]
    assert all(r.spec.hidden == 3072 and r.spec.num_layers == 24 and r.nodes * r.gpus_per_node == 1 for r in runs)
    tables = {"host": CLUSTER.table(required_meshes(Topology(1, 1), candidates(Topology(1, 1))))}
    compute = [C.terms_of(r, tables, CLUSTER.compute())[0].compute_s for r in runs]
    assert compute[0] < compute[1] < compute[2]  # deeper checkpointing, more recompute
    assert len({r.key for r in runs}) == 3


def test_a_file_that_is_no_tune_runs_is_named(tmp_path):
    bad = tmp_path / "tune-runs.jsonl"
    bad.write_text('{"plan": {}}\n')
    with pytest.raises(PlanError, match="tune-runs.jsonl: not a tune-runs.jsonl"):
        C.load_runs(str(bad))


def test_a_deepspeed_run_is_priced_with_the_layers_it_recomputed(tmp_path):
    """A ZeRO-1 run of the grid checkpoints with Hugging Face's flag, which its result records
    (``hf_checkpointing``); an older result takes its Lins run's count, found in any folder read with it (the
    first grid's h5120 s2048 ZeRO-1 run is in call1, its Lins run in call2)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shapes = os.path.join(root, "bench/results/simulate/shapes")
    runs = C.load_all([os.path.join(shapes, "call1"), os.path.join(shapes, "call2")])
    s9 = [r for r in runs if r.model == "shape-h5120-l8" and r.seq_len == 2048]
    assert {(r.system, r.ckpt_units) for r in s9} == {("zero1", 8), ("lins", 8)}
    model = os.path.join(root, "bench/models/shape-h1024-l16.json")
    for flag, units in ((True, 16), (False, 0)):
        (tmp_path / "x_zero1.json").write_text(json.dumps({
            "model": model, "seq_len": 1024, "samples_per_gpu_per_step": 1, "median_step_s": 0.1, "plan": None,
            "hf_checkpointing": flag}))
        assert [r.ckpt_units for r in C.load_all([str(tmp_path)])] == [units]


def test_the_shape_model_fits_one_factor_for_every_model_and_prices_a_model_it_never_saw():
    """--fit --compute-table: compute from each model's shape with the device's measured table, one factor and a
    host cost per layer pass per system, fitted on the one-H200 shape grid; a 2.9B model of another depth, sequence
    and batch (a tuned job's runs) is then predicted without any run of it."""
    import os
    from dataclasses import replace as with_

    from bench.compute_model import ComputeTable

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shapes = os.path.join(root, "bench/results/simulate/shapes")
    runs = C.load_all([os.path.join(shapes, "call1"), os.path.join(shapes, "call2")])
    assert len(runs) == 20 and {r.system for r in runs} == {"zero1", "lins"}
    assert {r.ckpt_units for r in runs if r.model == "shape-h2560-l8"} == {8}  # ZeRO-1 checkpointed as Lins did
    tables = {"host": CLUSTER.table(required_meshes(Topology(1, 1), candidates(Topology(1, 1))))}
    table = ComputeTable.load(os.path.join(shapes, "call1/compute_h200.json"))
    compute = with_(CLUSTER.compute(), table=table, achievable_mfu=1.0)
    ov = C.fit(runs, tables, compute)
    assert ov.shape_model and set(ov.compute) == {"shape"} and ov.terms("lins")["per_layer_s"] > 0
    ov = C.Overheads.from_json(json.loads(json.dumps(ov.to_json())))  # stored with the profile, read back
    unseen = C.load_runs(os.path.join(root, "bench/results/tune/final/cache/tune-runs.jsonl"))
    errors = [C.predict(r, tables, CLUSTER.compute(), ov)[0] / r.step_s - 1 for r in unseen]
    assert all(abs(e) < 0.25 for e in errors), errors


def test_what_a_checkpointed_layer_costs_the_host_is_told_from_a_plain_pass():
    """A checkpointed layer's forward and recompute each cost the host more than a plain pass (the checkpoint's
    hooks; bench/results/simulate/shapes/call17 measured it): the grid's host-bound shapes, with and without
    checkpointing, tell that cost from each system's per-pass one, and the wide shapes from the compute factor."""
    from bench.compute_model import ComputeTable

    shapes = os.path.join(ROOT, "bench/results/simulate/shapes")
    runs = C.load_all([os.path.join(shapes, f"call{i}") for i in (1, 2, 3, 4)])
    assert {r.ckpt_units > 0 for r in runs} == {True, False} and {r.system for r in runs} == {"zero1", "lins"}
    table = ComputeTable.load(os.path.join(shapes, "call1/compute_h200.json"))
    systems = {"zero1": {"update_factor": 3.0, "per_layer_s": 1.2e-3, "per_step_s": 0.01},
               "lins": {"update_factor": 3.0, "per_layer_s": 1.5e-3, "per_step_s": 0.01}}
    for t in systems.values():
        t["per_ckpt_pass_s"] = 0.8e-3
    # hosts of two speeds: the host's costs scale with each run's own (the median, 250 us, is the fit's)
    runs = [replace(r, host_s=2e-4 if i % 2 else 3e-4) for i, r in enumerate(runs)]
    truth = Overheads(systems, {"shape": 0.9}, "synthetic", host_s_per_module=2.5e-4, compute_table=table.to_json())
    tables = {"host": _tables()["host"]}
    runs = [replace(r, step_s=C.predict(r, tables, CLUSTER.compute(), truth)[0]) for r in runs]
    got = C.fit(runs, tables, replace(CLUSTER.compute(), table=table, achievable_mfu=1.0))
    assert got.compute["shape"] == pytest.approx(0.9, rel=1e-3)
    assert got.terms("zero1")["per_ckpt_pass_s"] == got.terms("lins")["per_ckpt_pass_s"] == pytest.approx(0.8e-3, rel=1e-3)
    assert got.terms("lins")["per_layer_s"] == pytest.approx(1.5e-3, rel=1e-3)
    assert "checkpointed layer: its forward and its recompute each cost the host 0.800 ms more" in C.terms_text(got)
    assert "checkpointed layer: no host cost of its own (not fitted" in C.terms_text(replace(got, systems={}))


def test_a_host_cost_per_layer_once_a_step_is_told_from_one_per_micro_batch(tmp_path):
    """With the shape model each system also has a host cost per layer once a step (DeepSpeed's stage 1 reduces
    gradients parameter by parameter in the last micro-batch only), paid inside that micro-batch's backward: a layer
    whose backward kernels outlast it hides it (the 7B's and 13B's here), a small one (the 1B's) waits for it. Runs
    at gas 1 and gas 2 tell it from the cost per layer pass, which every micro-batch pays; the depths tell it from
    the update and the fixed cost."""
    import os

    from bench.compute_model import ComputeTable

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    table = ComputeTable.load(os.path.join(root, "bench/results/simulate/shapes/call1/compute_h200.json"))
    systems = {s: dict(t, per_step_s=0.01) for s, t in TRUE.systems.items() if s != "mics"}
    systems["zero1"]["per_layer_step_s"] = 5e-3
    truth = Overheads(systems, {"shape": 0.85}, "synthetic", host_s_per_module=None, compute_table=table.to_json())
    benches = [_bench(tmp_path / f"b{m}_{g}.json", m, truth=truth, grad_accum=g) for m in ("1b", "7b", "13b")
               for g in (1, 2)]
    runs = [r for b in benches for r in C.load_runs(b) if r.system != "mics"]
    compute = replace(CLUSTER.compute(), table=table, achievable_mfu=1.0)
    got = C.fit(runs, _tables(), compute)
    assert got.compute["shape"] == pytest.approx(0.85, rel=1e-3)
    assert got.terms("zero1")["per_layer_step_s"] == pytest.approx(5e-3, rel=1e-3)
    assert got.terms("zero2")["per_layer_step_s"] == pytest.approx(0.0, abs=1e-7)
    assert got.terms("lins")["per_step_s"] == pytest.approx(0.01, rel=1e-3)
    one = [r for r in runs if r.system == "zero1" and r.grad_accum == 1 and r.topology == "host"][0]
    two = [r for r in runs if r.system == "zero1" and r.grad_accum == 2 and r.topology == "host"][0]
    terms1, terms2 = (C.predict(r, _tables(), CLUSTER.compute(), got)[1] for r in (one, two))
    assert terms1.model_layers == terms2.model_layers and terms2.layers == 2 * terms1.layers
    seven = [r for r in runs if r.system == "zero1" and "7b" in r.model and r.topology == "host"][0]
    hidden = C.predict(seven, _tables(), CLUSTER.compute(), got)[1]
    zero1 = got.terms("zero1")
    assert terms2.host_passes(zero1["per_layer_s"], 0.0, zero1["per_layer_step_s"])[3] == terms2.model_layers
    assert hidden.host_passes(zero1["per_layer_s"], 0.0, zero1["per_layer_step_s"])[3] == 0
