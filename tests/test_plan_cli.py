import json
import subprocess
import sys

import pytest

from lins_ds.cli import main

PAPER = ["--objective", "comm", "--grad-accum-dtype", "fp32", "--cluster", "a800-ib", "--nodes", "128", "--gpus-per-node", "8",
         "--gpu-memory-gb", "80", "--seq-len", "4096", "--micro-batch-size", "1", "--grad-accum", "1"]


def test_json_output_has_the_contract_keys(capsys):
    assert main(["plan", "--model", "llama-7b", *PAPER, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["plan"] == {"p": {"intra": 1, "inter": 1}, "g": {"intra": 1, "inter": 1},
                           "os": {"intra": 4, "inter": 1}}  # Table III's but for OS (docs/planner.md says why)
    for key in ("memory_gb_per_gpu", "predicted_comm_s_per_step", "candidates_considered", "feasible"):
        assert key in out
    assert 0 < out["memory_gb_per_gpu"] <= 80 and out["feasible"] <= out["candidates_considered"]


def test_table_output_explains_the_choice(capsys):
    assert main(["plan", "--model", "llama-13b", *PAPER]) == 0
    out = capsys.readouterr().out
    for text in ("P (parameters)", "memory per GPU", "headroom", "runner-up", "solved in"):
        assert text in out


def test_infeasible_exits_2_naming_smallest_plan(capsys):
    code = main(["plan", "--model", "llama-30b", "--nodes", "1", "--gpus-per-node", "2", "--gpu-memory-gb", "40",
                 "--seq-len", "4096", "--micro-batch-size", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "smallest" in err and "P=2x1 G=2x1 OS=2x1" in err and "GiB more" in err


@pytest.mark.parametrize("args,needle", [
    (["--model", "llama-99b"], "not a built-in model"),
    (["--model", "llama-7b", "--gpu-memory-gb", "-3"], "--gpu-memory-gb"),
    (["--model", "llama-7b", "--nodes", "0"], "nodes: 0 is not a positive integer"),
    (["--model", "llama-7b", "--cluster", "tpu"], "unknown cluster"),
    (["--model", "llama-7b", "--seq-len", "x"], "invalid int value"),
])
def test_bad_arguments_one_line_exit_2(args, needle):
    base = {"--nodes": "2", "--gpus-per-node": "4", "--gpu-memory-gb": "80", "--seq-len": "2048",
            "--micro-batch-size": "1"}
    for k, v in zip(args[::2], args[1::2]):
        base[k] = v
    argv = [sys.executable, "-m", "lins_ds.cli", "plan"] + [x for kv in base.items() for x in kv]
    if "--model" not in base:
        argv += ["--model", "llama-7b"]
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr


def test_plan_does_not_import_torch():
    code = ("import sys, lins_ds.plan, lins_ds.cli; from lins_ds.cli import main; "
            "main(['plan','--model','llama-7b','--nodes','2','--gpus-per-node','8','--seq-len','1024',"
            "'--micro-batch-size','1','--format','json']); "
            "assert 'torch' not in sys.modules, 'lins_ds.plan imported torch'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_hf_config_json_model(tmp_path, capsys):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
           "vocab_size": 100, "num_attention_heads": 4, "num_key_value_heads": 2}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(path), "--nodes", "2", "--gpus-per-node", "2", "--gpu-memory-gb", "8",
                 "--seq-len", "128", "--micro-batch-size", "1", "--cluster", "h200-emulated", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["params"] > 0


def test_plan_offloads_with_host_memory_and_refuses_without(capsys):
    one_gpu = ["--model", "llama-7b", "--nodes", "1", "--gpus-per-node", "1", "--seq-len", "2048",
               "--micro-batch-size", "1", "--gpu-memory-gb", "80", "--format", "json"]
    assert main(["plan", *one_gpu]) == 2  # GPU-resident: no plan fits
    capsys.readouterr()
    assert main(["plan", *one_gpu, "--host-memory-gb", "200"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["offload_units"] < out["num_units"] and out["host_memory_gb"] > 0
    assert out["memory_gb_per_gpu"] <= 80
    assert main(["plan", *one_gpu, "--host-memory-gb", "200", "--offload", "off"]) == 2
    capsys.readouterr()
    assert main(["plan", *one_gpu, "--host-memory-gb", "5"]) == 2
    assert "host memory" in capsys.readouterr().err


ONE_GPU_1B = ["--model", "llama-1b", "--nodes", "1", "--gpus-per-node", "1", "--seq-len", "4096",
              "--micro-batch-size", "2", "--grad-accum", "2", "--format", "json"]


def test_plan_offloads_only_where_no_gpu_resident_plan_fits_as_the_engine_does(capsys):
    """lins.offload "auto"'s one policy (lins_ds.plan.context.without_offload_first): at 24 GiB a GPU-resident plan
    fits (10 of 16 layers checkpointed), and host memory does not change it; `lins-ds plan` used to offload 4 units
    there, a plan the engine would never run. At 20 GiB none fits: then it offloads."""
    plans = {}
    for gb in ("24", "20"):
        for host in ([], ["--host-memory-gb", "1000"]):
            code = main(["plan", *ONE_GPU_1B, "--gpu-memory-gb", gb, "--tiling", "off", *host])
            out = capsys.readouterr().out
            plans[gb, bool(host)] = json.loads(out) if code == 0 else None
    assert plans["24", True]["offload_units"] == 0
    for key in ("plan", "activation_checkpointing_units", "memory_gb_per_gpu", "objective_s_per_step"):
        assert plans["24", True][key] == plans["24", False][key], key
    assert plans["20", False] is None and plans["20", True]["offload_units"] > 0


def engine_solution(profile, extra):
    import deepspeed
    import torch
    from helpers import config, param_groups, tiny_llama

    from lins_ds.plan import report

    model = tiny_llama()
    lins = {"plan": "solve", "profile": profile, "seq_len": 64, "memory_profile": "formula", **extra}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config(lins))
    out = report.to_json(engine._lins_solve.solution)
    engine.destroy()
    return out


@pytest.mark.parametrize("cluster", [None, "a800-ib"])
def test_plan_from_a_profile_predicts_what_the_engine_predicts(tmp_path, capsys, cluster):
    """The same model, batch, profile and memory: `lins-ds plan --profile` and the engine's lins.profile give the
    same plan and the same predictions (compute from lins.cluster, the reserve by the profile's device). The CLI
    used to price recompute with compute of its own (312 TFLOPS at 50 %), the engine with h200-emulated's."""
    from helpers import GPUS_PER_NODE, run, tiny_llama

    from lins_ds.plan import Topology, candidates, cost, get_cluster

    topo = Topology(2, GPUS_PER_NODE)
    table = get_cluster("h200-emulated").table(cost.required_meshes(topo, candidates(topo)))
    obj = table.to_json()
    obj["meta"]["device"] = "cpu"
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(obj))
    tiny_llama().config.to_json_file(tmp_path / "config.json")
    extra = {"gpu_memory_gb": 0.004, "activation_checkpointing": True, **({"cluster": cluster} if cluster else {})}
    want = run(engine_solution, 2 * GPUS_PER_NODE, str(profile), extra, gpus_per_node=GPUS_PER_NODE)[0]
    args = ["plan", "--model", str(tmp_path / "config.json"), "--nodes", "2", "--gpus-per-node", str(GPUS_PER_NODE),
            "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum", "2", "--dtype", "fp32",
            "--gpu-memory-gb", "0.004", "--activation-checkpointing", "--profile", str(profile), "--format", "json"]
    assert main(args + (["--cluster", cluster] if cluster else [])) == 0
    got = json.loads(capsys.readouterr().out)
    assert want["predicted_recompute_s_per_step"] > 0
    for key in ("plan", "activation_checkpointing_units", "memory_gb_per_gpu", "memory_breakdown_gb",
                "predicted_recompute_s_per_step", "predicted_optimizer_s_per_step", "objective_s_per_step"):
        assert got[key] == want[key], (key, got[key], want[key])


def test_the_compute_table_profiler_moved_to_bench_and_lins_ds_says_where():
    with pytest.raises(SystemExit, match="python -m bench profile --compute"):
        main(["profile", "--compute"])


ONE_GPU = ["--model", "llama-1b", "--nodes", "1", "--gpus-per-node", "1", "--gpu-memory-gb", "24",
           "--micro-batch-size", "1"]


def test_longest_is_the_longest_length_that_plans_and_names_what_binds(capsys):
    """``--longest``: the length it reports gets a plan, 128 more does not, and beyond it the tensor it names first is
    the largest of those that grow with the sequence (here, the seq x vocab logits and loss)."""
    untiled = [*ONE_GPU, "--tiling", "off"]
    assert main(["plan", *untiled, "--seq-len", "2048", "--longest", "--format", "json"]) == 0
    longest = json.loads(capsys.readouterr().out)["longest"]
    n = longest["seq_len"]
    assert n % 128 == 0 and n > 2048 and not longest["capped"] and longest["short_gb"] > 0
    assert main(["plan", *untiled, "--seq-len", str(n)]) == 0
    assert main(["plan", *untiled, "--seq-len", str(n + 128)]) == 2
    names = [name for name, _ in longest["binding"]]
    sizes = [gb for _, gb in longest["binding"][:-1]]  # the growing tensors, then the state that does not grow
    assert sizes == sorted(sizes, reverse=True) and names[0] == "logits and loss (seq x vocab)", longest
    assert names[-1].startswith("state and buffers") and longest["binding"][-1][1] > 0
    capsys.readouterr()
    # a length that does not fit still says how long one can be
    assert main(["plan", *untiled, "--seq-len", str(4 * n), "--longest"]) == 2
    assert f"longest sequence: {n} tokens per sequence fit" in capsys.readouterr().err
    # tiling (lins.tiling "auto") takes the logits out of the way: longer, and the layers' activations bind
    assert main(["plan", *ONE_GPU, "--seq-len", "2048", "--longest", "--format", "json"]) == 0
    tiled = json.loads(capsys.readouterr().out)["longest"]
    assert tiled["seq_len"] > 2 * n and tiled["binding"][0][0] == "layer activations kept for backward", tiled


def test_longest_search_finds_the_edge_from_either_side():
    from lins_ds.plan.longest import ALIGN, search

    for edge in (ALIGN, 5 * ALIGN, 1000 * ALIGN):
        for start in (ALIGN, 3 * ALIGN, 4000 * ALIGN):
            assert search(lambda n: n <= edge, start) == (edge, False)
    assert search(lambda n: False, 1024) == (0, False)


def test_tiling_comes_only_where_nothing_fits_without_it_and_after_offload(capsys):
    """lins.tiling "auto" (plan.sequence.LADDER, walked after the offload ladder): at 24 GiB nothing is tiled; at 20
    GiB without a host the logits are tiled, with a host the optimizer state goes there first; "off" refuses."""
    def plan(*extra):
        code = main(["plan", *ONE_GPU_1B, *extra])
        out = capsys.readouterr().out
        return json.loads(out) if code == 0 else None

    fits = plan("--gpu-memory-gb", "24")
    assert (fits["mlp_tiles"], fits["logits_tiles"], fits["offload_units"]) == (1, 1, 0)
    tiled = plan("--gpu-memory-gb", "20")
    assert tiled["logits_tiles"] > 1 and tiled["offload_units"] == 0
    assert tiled["plan_record"]["logits_tiles"] == tiled["logits_tiles"]
    assert tiled["memory_gb_per_gpu"] <= 20
    offloaded = plan("--gpu-memory-gb", "20", "--host-memory-gb", "1000")
    assert offloaded["offload_units"] > 0 and offloaded["logits_tiles"] == 1
    assert plan("--gpu-memory-gb", "20", "--tiling", "off") is None
    fixed = plan("--gpu-memory-gb", "24", "--tiling", "2,4")
    assert (fixed["mlp_tiles"], fixed["logits_tiles"]) == (2, 4)
    assert fixed["memory_gb_per_gpu"] < fits["memory_gb_per_gpu"]


def test_short_host_memory_names_the_least_any_plan_that_fits_the_gpu_needs(capsys):
    """Where the host is what is short, the error names the least host memory of the plans that fit the GPU, over
    every placement of the offloaded units' G and P (it named the fastest placement's: Qwen2.5-14B widths with the
    logits tiled said 118.95 GiB at 112, where OS, G and P of 25 units need 115.36): given that much, a plan fits."""
    args = ["plan", "--model", "bench/models/hub-qwen2.5-14b.json", "--nodes", "1", "--gpus-per-node", "1",
            "--gpu-memory-gb", "139", "--cluster", "h200-emulated", "--seq-len", "4096", "--micro-batch-size", "1",
            "--grad-accum", "16", "--host-update-gelems", "2.5", "--host-copy-gbs", "90", "--tiling", "1,8"]
    assert main([*args, "--host-memory-gb", "112"]) == 2
    err = capsys.readouterr().err
    named = float(err.split(" GiB of host memory")[0].rsplit("needs ", 1)[1])
    assert "the least host memory" in err and named < 118, err
    assert main([*args, "--host-memory-gb", str(named + 0.01), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["host_memory_gb"] == pytest.approx(named, abs=0.01)
