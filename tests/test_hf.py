"""HF Trainer and accelerate with a Lins config, 2 CPU processes launched as a user would."""

import json
import os
import sys

import pytest

from helpers import ROOT, free_port, launch, torchrun

EXAMPLE = os.path.join(ROOT, "examples", "hf_trainer.py")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow
COMMON = ("--per_device_train_batch_size", "4", "--max_steps", "6")


def trainer(config, out, *extra, launcher=None):
    """examples/hf_trainer.py (which never names lins_ds) under torchrun (or ``launcher``): what it wrote to
    ``losses.json``."""
    cmd = (launcher or torchrun(2)) + [EXAMPLE, "--output_dir", str(out), "--logging_steps", "1", "--report_to",
                                       "none", "--learning_rate", "1e-3", "--seed", "7", *extra]
    if config:
        cmd += ["--deepspeed", os.path.join(ROOT, "ds_configs", config)]  # an absolute path stays what it is
    output = launch(cmd)
    with open(os.path.join(out, "losses.json")) as f:
        return {**json.load(f), "_output": output}


def sharded_load(tmp_path) -> str:
    """hf_lins.json with ``"sharded_load": true``: the tiny model would load whole on every rank by default."""
    with open(os.path.join(ROOT, "ds_configs", "hf_lins.json")) as f:
        cfg = json.load(f)
    cfg["lins"]["sharded_load"] = True
    path = tmp_path / "hf_lins_sharded.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def losses(run):
    return [h["loss"] for h in run["log"]]


@pytest.fixture(scope="module")
def lins_run(tmp_path_factory):
    """Six Lins steps of 4 x 1 samples per rank, checkpointed at step 3: shared by the tests below."""
    out = tmp_path_factory.mktemp("hf") / "lins"
    return out, trainer("hf_lins.json", out, *COMMON, "--save_steps", "3")


def test_trainer_lins_matches_zero1_and_saves_loadable_weights(lins_run, tmp_path):
    out, lins = lins_run
    # DeepSpeed's ZeRO under accelerate on CPU counts one process unless the program imports lins_ds, whose fix of
    # that accelerate bug reaches beyond Lins configs only then (integrations/accelerate_patch.py)
    zero1 = trainer("hf_zero1.json", tmp_path / "zero1", *COMMON, "--save_strategy", "no",
                    launcher=torchrun(2) + ["-m", "lins_ds.run"])
    assert (lins["engine"], zero1["engine"]) == ("LinsEngine", "DeepSpeedEngine")
    assert lins["world_size"] == 2  # each rank its own data shard: accelerate counted both processes
    assert max(abs(a - b) for a, b in zip(losses(lins), losses(zero1))) <= 1e-5
    assert all(h["grad_norm"] > 0 for h in lins["log"]) and lins["log"][-1]["learning_rate"] < 1e-3
    a = transformers.AutoModelForCausalLM.from_pretrained(out)
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "zero1")
    sa, sb = a.state_dict(), b.state_dict()
    assert max((sa[k] - sb[k]).abs().max().item() for k in sb) <= 1e-5


def test_gradient_accumulation_equals_the_larger_batch(lins_run, tmp_path):
    four_by_one = trainer("hf_lins.json", tmp_path / "a", "--max_steps", "6", "--save_strategy", "no",
                          "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4")
    assert max(abs(a - b) for a, b in zip(losses(four_by_one), losses(lins_run[1]))) <= 1e-5


def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(lins_run, tmp_path):
    out, full = lins_run
    assert os.path.isdir(out / "checkpoint-3" / "global_step3")
    resumed = trainer("hf_lins.json", tmp_path / "resumed", *COMMON, "--save_strategy", "no",
                      "--resume_from_checkpoint", str(out / "checkpoint-3"))
    after = [h for h in resumed["log"] if h["step"] > 3]  # steps 1-3 come back from trainer_state.json
    assert [h["step"] for h in after] == [4, 5, 6]
    assert max(abs(a["loss"] - b) for a, b in zip(after, losses(full)[3:])) <= 1e-5


def test_a_model_built_from_config_trains_step_by_step_as_zero1_does(tmp_path):
    """run_clm.py's way: from_config while a Lins TrainingArguments is alive builds sharded, with the eager build's
    initial values (lins.init "eager"), so its losses are ZeRO-1's from the first step."""
    args = ("--max_steps", "4", "--per_device_train_batch_size", "4", "--save_strategy", "no", "--from_config", "true")
    lins = trainer(sharded_load(tmp_path), tmp_path / "lins", *args)
    zero1 = trainer("hf_zero1.json", tmp_path / "zero1", *args, launcher=torchrun(2) + ["-m", "lins_ds.run"])
    assert lins["engine"] == "LinsEngine"
    assert max(abs(a - b) for a, b in zip(losses(lins), losses(zero1))) <= 1e-5, (losses(lins), losses(zero1))


def test_accelerate_launch_with_a_lins_deepspeed_config_file(tmp_path):
    cfg = tmp_path / "accelerate.yaml"
    cfg.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                   f"deepspeed_config:\n  deepspeed_config_file: {ROOT}/ds_configs/hf_lins.json\n"
                   "num_machines: 1\nnum_processes: 2\nmachine_rank: 0\nuse_cpu: false\n"
                   f"main_process_port: {free_port()}\n")
    run = trainer(None, tmp_path / "acc", "--max_steps", "3", "--per_device_train_batch_size", "4",
                  "--save_strategy", "no",
                  launcher=[sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(cfg)])
    assert run["engine"] == "LinsEngine" and run["world_size"] == 2


SCRIPT = '''
import deepspeed, torch
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
       "lins": {"plan": {"p": [1, 1], "g": [1, 1], "os": ["all", 1]}}}
engine, *_ = deepspeed.initialize(model=model, config=cfg)
loss = engine(torch.randn(1, 8)).sum()
engine.backward(loss)
engine.step()
print(f"ENGINE-{torch.distributed.get_rank()}:{type(engine).__name__}:{engine.global_steps}", flush=True)
'''


def test_lins_ds_run_activates_lins_for_scripts_that_do_not_import_it(tmp_path):
    script = tmp_path / "plain_script.py"
    script.write_text(SCRIPT)
    out = launch(torchrun(2) + ["-m", "lins_ds.run", str(script)])
    assert "ENGINE-0:LinsEngine:1" in out and "ENGINE-1:LinsEngine:1" in out


def test_lora_under_the_trainer_on_a_sharded_build_is_lora_on_an_eager_one(tmp_path):
    """PEFT's LoRA added by the script after the model is built sharded (from_config under a Lins TrainingArguments)
    trains, step by step and to the saved adapter, as LoRA on the eagerly built model."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    args = ("--max_steps", "5", "--per_device_train_batch_size", "4", "--save_strategy", "no", "--lora_r", "4")
    sharded = trainer(sharded_load(tmp_path), tmp_path / "sharded", *args, "--from_config", "true")
    eager = trainer("hf_lins.json", tmp_path / "eager", *args)
    assert sharded["engine"] == eager["engine"] == "LinsEngine"
    assert max(abs(a - b) for a, b in zip(losses(sharded), losses(eager))) <= 1e-6, (losses(sharded), losses(eager))
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("sharded", "eager"))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max(float((a[k].float() - b[k].float()).abs().max()) for k in a) <= 1e-6


def offload_config(tmp_path, ahead) -> str:
    """hf_lins.json with every unit's OS and G on the host and ``lins.host_update_in_backward`` ``ahead`` (an "auto"
    written inside the lins block is Lins' own, not one accelerate fills)."""
    with open(os.path.join(ROOT, "ds_configs", "hf_lins.json")) as f:
        cfg = json.load(f)
    cfg["lins"].update(offload={"os": "cpu", "g": "cpu"}, host_update_in_backward=ahead)
    path = tmp_path / f"hf_lins_offload_{ahead}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_the_trainer_without_clipping_updates_inside_the_backward_as_after_the_step(tmp_path):
    """``--max_grad_norm 0`` fills gradient_clipping 0: the Trainer's step (accelerate's backward, then the engine's
    step) takes the host updates begun inside the last backward, and trains as with them after the step."""
    args = ("--max_steps", "4", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
            "--save_strategy", "no", "--max_grad_norm", "0")
    runs = {ahead: trainer(offload_config(tmp_path, ahead), tmp_path / str(ahead), *args) for ahead in ("auto", False)}
    said = "host update starts inside the window's last backward"
    assert said in runs["auto"]["_output"] and said not in runs[False]["_output"], runs["auto"]["_output"][-3000:]
    assert runs["auto"]["engine"] == runs[False]["engine"] == "LinsEngine"
    assert losses(runs["auto"]) == losses(runs[False]) and len(losses(runs["auto"])) == 4
    assert [h["grad_norm"] for h in runs["auto"]["log"]] == [h["grad_norm"] for h in runs[False]["log"]]
