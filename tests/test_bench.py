"""The benchmark (``python -m bench``) end to end on CPU: shipped configs side by side, JSON and PNG out."""

import json
import os
import sys

import pytest

from helpers import launch


@pytest.mark.slow
def test_bench_runs_baselines_and_lins_plans_side_by_side(tmp_path):
    launch([sys.executable, "-m", "bench", "run", "--nproc", "2", "--model", "tiny", "--seq-len", "32", "--steps",
            "3", "--warmup-steps", "1", "--loss-steps", "3", "--topologies", "host", "--modes",
            "zero1,lins,lins_as_zero2", "--no-no-comm-limit", "--out", str(tmp_path)])
    with open(tmp_path / "bench.json") as f:
        table = json.load(f)["table"]["host"]
    rows = {row["mode"]: row for row in table["rows"]}
    assert set(rows) == {"zero1", "lins", "lins_as_zero2"} and table["best_deepspeed"] == "zero1"
    assert rows["lins_as_zero2"]["plan"]["g"] == {"intra": 2, "inter": 1}  # "all" on one host of 2
    assert all(row["tokens_per_gpu_s"] > 0 and row["vs_best_deepspeed"] > 0 for row in rows.values())
    assert all(0 < row["host_s_per_module"] < 0.1 for row in rows.values())  # the host measured in every run
    assert (tmp_path / "throughput.png").stat().st_size > 0


@pytest.mark.slow
def test_memory_bench_writes_predicted_and_measured_rows(tmp_path):
    launch([sys.executable, "-m", "bench", "memory", "--nproc", "2", "--model", "tiny", "--seq-len", "32",
            "--micro-batch-size", "2", "--grad-accum", "2", "--steps", "2", "--runs",
            "zero1,lins-zero1-layout,lins-partial-ckpt", "--out", str(tmp_path)])
    with open(tmp_path / "tiny.json") as f:
        rows = {row["run"]: row for row in json.load(f)["rows"]}
    assert set(rows) == {"zero1", "lins-zero1-layout", "lins-partial-ckpt"}
    lins = rows["lins-zero1-layout"]
    assert lins["plan"] == "P=1x1 G=1x1 OS=2x1" and lins["activation_checkpointing"] == "0 of 4"
    assert lins["predicted_peak_gib"] > 0 and lins["memory_profile"] == "formula"  # measured on GPUs only
    assert rows["lins-partial-ckpt"]["budget_gib"] > 0 and rows["zero1"]["predicted_peak_gib"] is None
    assert (tmp_path / "tiny.png").stat().st_size > 0


def test_a_failed_run_is_named_by_its_exception_else_by_the_rank_that_aborted():
    from bench.run import failure

    launcher = ("torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n=====\n"
                "  exitcode  : -6 (pid: 27767)  (SIGABRT)\n=====")
    aborted = "step    3  loss 6.2648\nterminate called without an active exception\n" + launcher
    assert failure(aborted) == "terminate called without an active exception"
    raised = "[rank0]: Traceback (most recent call last):\n[rank0]: ValueError: lins.plan: bad\n"
    peer = "terminate called after throwing an instance of 'gloo::IoException'\n  what():  Connection closed by peer\n"
    assert failure(raised + peer + launcher) == "ValueError: lins.plan: bad"  # the cause, not the peer's abort
    assert failure("just a line\n") == "just a line"


def test_the_moved_commands_say_where_they_went(capsys):
    from lins_ds.cli import main

    assert main(["bench", "--model", "1b"]) == 2
    assert "python -m bench run" in capsys.readouterr().err


def test_ds_set_writes_a_dotted_key_of_the_deepspeed_config():
    from bench.train import ds_config_for, parse_args

    args = parse_args(["--deepspeed_config", "ds_configs/zero3_offload_ratio.json",
                       "--ds-set", "zero_optimization.offload_optimizer.ratio=0.55",
                       "--ds-set", "zero_optimization.sub_group_size=100000000", "--ds-set", "steps_per_print=1"])
    cfg = ds_config_for(args)
    zero = cfg["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True, "ratio": 0.55}
    assert zero["sub_group_size"] == 100000000 and zero["stage"] == 3 and cfg["steps_per_print"] == 1
    for bad in ("steps_per_print", "steps_per_print=", "zero_optimization.offload_optimizer.device=cpu"):
        with pytest.raises(SystemExit):
            parse_args(["--deepspeed_config", "ds_configs/zero3_offload_ratio.json", "--ds-set", bad])
    with pytest.raises(SystemExit, match="not a section"):
        ds_config_for(parse_args(["--deepspeed_config", "ds_configs/zero3_offload_ratio.json",
                                  "--ds-set", "bf16.enabled.x=1"]))


def test_the_overlap_probe_says_what_share_of_a_side_kernel_the_step_pays(capsys):
    """``python -m bench overlap`` (one GPU): 0 where the side kernel hides behind the step, 1 where the two run one
    after the other; on a machine without a GPU it says it needs one instead of timing nothing."""
    from bench.__main__ import main
    from bench.overlap import paid_share

    assert paid_share(0.1, 0.04, 0.1) == 0.0 and paid_share(0.1, 0.04, 0.14) == pytest.approx(1.0)
    assert paid_share(0.1, 0.04, 0.12) == pytest.approx(0.5)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            main(["overlap", "--model", "tiny"])


@pytest.mark.gpu
def test_the_overlap_probe_times_each_stand_in_beside_the_backward(tmp_path):
    """On a GPU: every stand-in gets a row with its own time, the step's alone and with it, and the share paid."""
    import torch

    from bench.__main__ import main

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "overlap.json"
    assert main(["overlap", "--model", "tiny", "--seq-len", "512", "--repeats", "3", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert rows[-1]["side"] == "Tensor.copy_" and all(r["side_s"] > 0 and r["step_s"] > 0 for r in rows)
    assert all(-0.5 < r["paid_share"] < 2.0 for r in rows)


def test_the_host_probe_prices_each_host_bound_run_at_the_host_it_ran_on(capsys):
    """``python -m bench host-probe`` (call17: steps the host sets, never fitted): every run predicted at that
    machine's host speed, and one checkpointed layer's extra host time measured next to the simulator's; a
    calibration without the shape model's host terms is refused by name."""
    import os

    from bench.__main__ import main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    probe = os.path.join(root, "bench/results/simulate/shapes/call17")
    shape = os.path.join(root, "bench/results/simulate/calibrated_shape/profile_1host.json")
    assert main(["host-probe", probe, "--profile", shape]) == 0
    out = capsys.readouterr().out
    assert "1.53x the calibration's" in out and out.count(" ckpt 24 lins ") == 2  # seq 128 and seq 2048
    line = [x for x in out.splitlines() if x.strip().startswith("shape-h1536-l24 s128 mb1 lins:")][0]
    assert "measured step +4.46 (forward +1.08, backward +3.44), predicted step +4.71" in line
    per_model = os.path.join(root, "bench/results/simulate/calibrated/profile_1host.json")
    assert main(["host-probe", probe, "--profile", per_model]) != 0
    assert f"{per_model}: no shape-model terms with a measured host" in capsys.readouterr().err


def test_a_config_of_another_family_is_built_as_its_own_hugging_face_class(tmp_path):
    """``bench/train.py --model config.json``: a LLaMA config as ``LlamaForCausalLM`` with the planner's shapes (as
    the shape grid was built), any other model type as its own class (the families of ``gpu_compute_shapes.sh`` GRID=16);
    a GPT-2 asked for a sequence beyond the positions it learns is refused before anything is built."""
    from bench.train import build_model

    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 500,
                                "n_positions": 128}))
    model = build_model(str(gpt2), 64)
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.vocab_size == 500
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(SystemExit, match="--seq-len 256: .* learns 128 positions"):
        build_model(str(gpt2), 256)
    tiny = tmp_path / "qwen3.json"  # the families' full sizes are GPU work: a tiny Qwen3 stands in
    tiny.write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
                                "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "head_dim": 32, "vocab_size": 256}))
    model = build_model(str(tiny), 64)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.model.layers[0].self_attn.q_norm is not None
    llama = tmp_path / "llama.json"
    llama.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 96,
                                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
                                 "vocab_size": 256}))
    assert type(build_model(str(llama), 64)).__name__ == "LlamaForCausalLM"


def test_the_long_context_plot_reads_each_mode_s_runs_and_out_of_memory_ends(tmp_path):
    """``bench.long_context_plot``: a run per mode and length from its JSON, a run that ran out of memory from its log,
    other names (a rerun kept beside) left out, and Lins over ALST only where both trained."""
    from bench import long_context_plot

    def summary(name, step, tokens):
        (tmp_path / f"{name}.json").write_text(json.dumps({"median_step_s": step, "tokens_per_gpu_s": tokens,
                                                           "peak_memory_gb": 9.0, "losses": [12.1, 12.0]}))

    summary("lins_65536", 4.0, 16000.0)
    summary("alst_65536", 5.0, 12800.0)
    summary("tiled_131072", 15.0, 8700.0)  # gpu_long_context.sh's name for Lins from the config alone
    summary("alst_torch_init_131072", 20.0, 6000.0)  # not a mode's name: left out
    summary("plain_16384", 0.6, 28000.0)
    (tmp_path / "plain_32768.log").write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    (tmp_path / "alst_262144.log").write_text("killed by the time limit\n")  # ended early, not out of memory
    long_context_plot.main([str(tmp_path)])
    out = json.loads((tmp_path / "tokens_per_s.json").read_text())
    assert out["lins_over_alst"] == {"65536": 1.25}
    assert set(out["runs"]["alst"]) == {"65536"} and out["runs"]["plain"]["32768"] == {"result": "out of memory"}
    assert set(out["runs"]["lins"]) == {"65536", "131072"}
    assert (tmp_path / "tokens_per_s.png").stat().st_size > 0


def test_reprice_host_rebuilds_the_start_ups_price_of_a_run(tmp_path, capsys, monkeypatch):
    """``bench.reprice_host`` prices a GPU run's exposed host time as the solver does (``solver.evaluate`` on the
    run's plan, model, batch, compute rate and host speeds; the committed runs' logs were priced before the copies
    ran on lanes of their own, so the logged figure is not today's) and again at the rate its host worker ran."""
    import shutil

    from bench import reprice_host

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)  # the runs name their model by its path in the repository
    src = os.path.join(root, "bench", "results", "offload", "rate_h100", "l3")
    for name in ("l3_lins_fp_clip1", "l3_lins_40_clip0"):
        for ext in (".json", ".log"):
            shutil.copy(os.path.join(src, name + ext), tmp_path)
    from lins_ds.plan import ComputeSpec, MemorySpec, Topology, TrainingSpec, candidates, cost
    from lins_ds.plan import get_cluster, load_model
    from lins_ds.plan.offload import HostSpec, OffloadSpec, Placement
    from lins_ds.plan.solver import evaluate

    reprice_host.main([str(tmp_path), "l3_lins_fp_clip1", "l3_lins_40_clip0"])
    rows = json.load(open(tmp_path / "reprice_host.json"))
    assert [r["in_backward"] for r in rows] == [False, True]
    one = Topology(1, 1)
    (layout,) = candidates(one)
    table = get_cluster("h200-emulated").table(cost.required_meshes(one, [layout]))
    for r in rows:
        run = json.load(open(tmp_path / f"{r['run']}.json"))
        log = open(tmp_path / f"{r['run']}.log").read()
        tflops, peak = map(float, reprice_host.COMPUTE.search(log).groups())
        rate, h2d, d2h, acc, norm = (float(x) if x else 1e9 for x in reprice_host.OFFLOAD.search(log).groups())
        plan, p = run["plan"], run["plan"]["placement"]
        train = TrainingSpec(run["seq_len"], 2, 2, host_update_in_backward=r["in_backward"])
        host = HostSpec(1e6, rate * 1e9, h2d, d2h, accumulate_elems_per_s=acc * 1e9, norm_elems_per_s=norm * 1e9)
        ev = evaluate(one, layout, plan["activation_checkpointing_units"], load_model(run["model"]), train,
                      MemorySpec(80), table, ComputeSpec(peak, tflops / peak),
                      placement=Placement.of(p["units"], p["os"], p["g"], p["p"]),
                      offload=OffloadSpec("auto", host=host))
        assert r["at_start_up_s"] == pytest.approx(ev.offload_s, rel=1e-9, abs=1e-12), r
        assert r["worker_rate"] > 0 and r["at_worker_s"] >= 0
    assert "| l3_lins_fp_clip1 | after the step |" in capsys.readouterr().out
