"""TRL's trainers with a Lins config, 2 CPU processes launched as a user would (``examples/trl_train.py``), held to
DeepSpeed ZeRO-1 step by step. DPO and KTO build a reference model without an optimizer (a forward-only Lins engine);
GRPO with beta > 0 does too, and generates completions that end at different lengths on each rank, which under a plan
that partitions the parameters must keep the ranks in step."""

import json
import os

import pytest

from helpers import ROOT, launch, torchrun

pytest.importorskip("trl")
pytestmark = pytest.mark.slow
EXAMPLE = os.path.join(ROOT, "examples", "trl_train.py")
COMMON = ("--max_steps", "4", "--per_device_train_batch_size", "2", "--seed", "7", "--learning_rate", "1e-3")
GRPO = ("--num_generations", "2", "--max_completion_length", "8", "--beta", "0.1", "--eos_bias", "2")
SHARDED = {"p": ["all", 1], "g": ["all", 1], "os": ["all", 1]}


def trl_run(trainer, config, out, *extra):
    """The example under torchrun with ``lins_ds.run`` (accelerate's CPU DeepSpeed fix reaches ZeRO configs only where
    lins_ds is imported): what rank 0 wrote."""
    cmd = torchrun(2) + ["-m", "lins_ds.run", EXAMPLE, "--trainer", trainer, "--deepspeed", config, "--output_dir",
                         str(out), *COMMON, *extra]
    launch(cmd)
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


def ds_config(name, tmp_path, plan=None):
    path = os.path.join(ROOT, "ds_configs", name)
    if plan is None:
        return path
    with open(path) as f:
        cfg = json.load(f)
    cfg["lins"]["plan"] = plan
    out = tmp_path / "lins_sharded.json"
    out.write_text(json.dumps(cfg))
    return str(out)


def config_with(tmp_path, name, base, **changes):
    """``base`` (a file of ds_configs) with top-level keys replaced and ``lins`` keys set: a file under tmp_path."""
    with open(os.path.join(ROOT, "ds_configs", base)) as f:
        cfg = json.load(f)
    lins = changes.pop("lins", None)
    cfg.update(changes)
    if lins:
        cfg["lins"].update(lins)
    out = tmp_path / name
    out.write_text(json.dumps(cfg))
    return str(out)


def column(run, key):
    return [h[key] for h in run["log"]]


@pytest.mark.parametrize("trainer", ["dpo", "kto"])
def test_preference_trainers_with_a_reference_model_equal_zero1(trainer, tmp_path):
    lins = trl_run(trainer, ds_config("hf_lins.json", tmp_path), tmp_path / "lins")
    zero1 = trl_run(trainer, ds_config("hf_zero1.json", tmp_path), tmp_path / "zero1")
    assert (lins["engine"], lins["ref_engine"]) == ("LinsEngine", "LinsEngine")
    assert len(column(lins, "loss")) == 4
    for key in ("loss", "grad_norm"):
        assert max(abs(a - b) for a, b in zip(column(lins, key), column(zero1, key))) <= 1e-5, key


def test_grpo_with_a_reference_model_and_uneven_completions_equals_zero1(tmp_path):
    zero1 = trl_run("grpo", ds_config("hf_zero1.json", tmp_path), tmp_path / "zero1", *GRPO)
    lengths = list(zip(column(zero1, "completions/min_length"), column(zero1, "completions/max_length")))
    assert any(lo < hi for lo, hi in lengths), lengths  # completions end at different lengths
    assert any(kl > 0 for kl in column(zero1, "kl"))  # the reference model is used
    for plan in (None, SHARDED):
        lins = trl_run("grpo", ds_config("hf_lins.json", tmp_path, plan), tmp_path / f"lins{plan is None}", *GRPO)
        assert (lins["engine"], lins["ref_engine"]) == ("LinsEngine", "LinsEngine")
        for key in ("loss", "kl", "reward", "completions/mean_length"):
            assert max(abs(a - b) for a, b in zip(column(lins, key), column(zero1, key))) <= 1e-5, (plan, key)


def test_dpo_precomputing_reference_log_probs_on_a_sharded_load_equals_zero3(tmp_path):
    """TRL hashes the policy (its state_dict) and runs it in a forward-only engine before training: on a sharded load
    (lins.sharded_load: true, nothing read before deepspeed.initialize) the state_dict's entries are computed as TRL
    reads them. Held to ZeRO-3, whose from_pretrained partitions the model (zero.Init) as a sharded load defers it."""
    precompute = ("--precompute_ref_log_probs", "True")
    zero3 = trl_run("dpo", config_with(tmp_path, "zero3.json", "hf_zero1.json", zero_optimization={"stage": 3}),
                    tmp_path / "zero3", *precompute)
    lins = trl_run("dpo", config_with(tmp_path, "sharded.json", "hf_lins.json", lins={"sharded_load": True}),
                   tmp_path / "lins", *precompute)
    assert (lins["engine"], lins["ref_engine"], zero3["ref_engine"]) == ("LinsEngine", "NoneType", "NoneType")
    assert len(column(lins, "loss")) == 4 and any(m != 0 for m in column(zero3, "rewards/margins"))
    for key in ("loss", "grad_norm", "rewards/chosen", "rewards/margins"):
        assert max(abs(a - b) for a, b in zip(column(lins, key), column(zero3, key))) <= 1e-5, key
