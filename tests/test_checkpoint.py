"""Checkpoints: resume on another plan or world size exactly, atomic saves, consolidation to HF weights."""

import json
import os

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import batch, ckpt_config as config, make_ckpt_engine as make_engine, ckpt_steps as steps, max_err, run

transformers = pytest.importorskip("transformers")
K = 2  # steps before and after the checkpoint
PLAN_A = {"p": [1, 1], "g": [2, 1], "os": [2, 2]}
PLAN_B = {"p": [2, 2], "g": [2, 2], "os": [2, 2]}
PLAN_2RANKS = {"p": [1, 1], "g": [1, 1], "os": [2, 1]}


def uninterrupted(plan):
    engine = make_engine(plan, 2)
    out = steps(engine, 0, 2 * K)[K:]
    engine.destroy()
    return out


def first_half(ckpt, plan):
    engine = make_engine(plan, 2)
    steps(engine, 0, K)
    engine.save_checkpoint(ckpt, client_state={"note": "hello", "k": K})
    engine.destroy()
    return sorted(os.listdir(ckpt))


def second_half(ckpt, plan, gpus_per_node):
    engine = make_engine(plan, gpus_per_node)
    path, client = engine.load_checkpoint(ckpt)
    counters = (engine.global_steps, engine.get_lr()[0])
    out = steps(engine, K, K)
    engine.destroy()
    return path, client, counters, out


def save_and_resume_on_four_ranks(ckpt):
    """The uninterrupted run, the first half saved, and its resumes on two plans: one set of 4 ranks."""
    ref = uninterrupted(PLAN_A)
    listing = first_half(ckpt, PLAN_A)
    return ref, listing, [second_half(ckpt, plan, 2) for plan in (PLAN_A, PLAN_B)]


def test_resume_on_other_plans_and_world_sizes_continues_the_same_trajectory(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    ref, listing, resumed = run(save_and_resume_on_four_ranks, 4, ckpt, gpus_per_node=2)[0]
    assert listing == ["global_step2", "latest", "zero_to_fp32.py"]  # DeepSpeed's converter, as DeepSpeed writes it
    resumed.append(run(second_half, 2, ckpt, PLAN_2RANKS, 2, gpus_per_node=2)[0])
    for (path, client, (gsteps, lr), out), plan in zip(resumed, ("A", "B", "2 ranks")):
        assert path.endswith("global_step2") and gsteps == K
        assert {k: client[k] for k in ("note", "k")} == {"note": "hello", "k": K}  # with DeepSpeed's keys
        assert client["global_samples"] == 16 * K and client["ds_config"]["lins"]["plan"] == PLAN_A
        for (state, lr_now), (ref_state, ref_lr) in zip(out, ref):
            assert max_err(state, ref_state) <= 1e-6, plan
            assert lr_now == pytest.approx(ref_lr)


def killed_during_save(ckpt):
    import lins_ds.checkpoint.save as S

    engine = make_engine(PLAN_A, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt, tag="good")
    steps(engine, 1, 1)
    real = S.save_file

    def dying_save_file(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        if torch.distributed.get_rank() == 0:
            os._exit(9)  # the job dies in the middle of writing "bad"

    S.save_file = dying_save_file
    engine.save_checkpoint(ckpt, tag="bad")


def load_tag(ckpt, tag):
    engine = make_engine(PLAN_B, 2)
    try:
        path, _ = engine.load_checkpoint(ckpt, tag=tag)
        return path, engine.global_steps
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", None
    finally:
        engine.destroy()


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        run(killed_during_save, 4, ckpt, gpus_per_node=2)
    assert sorted(os.listdir(ckpt)) == ["bad.incomplete", "good", "latest", "zero_to_fp32.py"]
    assert open(os.path.join(ckpt, "latest")).read() == "good"
    path, gsteps = run(load_tag, 4, ckpt, None, gpus_per_node=2)[0]
    assert path.endswith("good") and gsteps == 1
    msg, _ = run(load_tag, 4, ckpt, "bad", gpus_per_node=2)[0]
    assert "incomplete (a save was interrupted)" in msg


def save_then_consolidate(ckpt, out):
    from lins_ds.checkpoint.consolidate import consolidate

    engine = make_engine(PLAN_B, 2)
    steps(engine, 0, 2)
    engine.save_checkpoint(ckpt)
    engine.save_16bit_model(out + "-16bit")
    x = batch(7, 0, 0, 96)
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=x).logits
    engine.destroy()
    if torch.distributed.get_rank() == 0:
        consolidate(ckpt, out)
    return logits


def test_consolidated_weights_load_in_transformers_with_the_same_logits(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    logits = run(save_then_consolidate, 4, ckpt, out, gpus_per_node=2)[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        ref = model(input_ids=batch(7, 0, 0, 96)).logits
    assert (ref - logits).abs().max().item() <= 1e-5
    sd = torch.load(os.path.join(out + "-16bit", "pytorch_model.bin"))
    assert set(model.state_dict()) <= set(sd) | {"lm_head.weight"}
    # the tag directory itself works as CKPT_DIR, with or without --tag naming it
    from lins_ds.cli import main
    from safetensors.torch import load_file

    tag_dir = os.path.join(ckpt, "global_step2")
    for extra, dest in (([], tmp_path / "hf2"), (["--tag", "global_step2"], tmp_path / "hf3")):
        assert main(["consolidate", tag_dir, str(dest), *extra]) == 0
        a, b = load_file(os.path.join(out, "model.safetensors")), load_file(str(dest / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_consolidate_cli_errors(tmp_path, capsys):
    from lins_ds.cli import main

    assert main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "nothing is not a directory" in capsys.readouterr().err


def bad_loads(ckpt, other):
    import deepspeed

    engine = make_engine(PLAN_A, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt)
    results = {}
    results["missing-tag"] = load_err(engine, ckpt, "global_step99")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96)
    other_engine, *_ = deepspeed.initialize(model=transformers.LlamaForCausalLM(cfg),
                                            config=config(PLAN_A, torch.distributed.get_world_size(), 2))
    results["other-model"] = load_err(other_engine, ckpt, None)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        shard = os.path.join(ckpt, "global_step1", "shard-00000.safetensors")
        with open(shard, "r+b") as f:
            f.truncate(os.path.getsize(shard) // 2)
    torch.distributed.barrier()
    results["truncated"] = load_err(engine, ckpt, None)
    return results


def load_err(engine, ckpt, tag):
    try:
        engine.load_checkpoint(ckpt, tag=tag)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def test_bad_checkpoints_fail_clearly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    res = run(bad_loads, 4, ckpt, None, gpus_per_node=2)
    for r in res:
        assert "no checkpoint tag 'global_step99'" in r["missing-tag"]
        assert "from another model" in r["other-model"]
    assert all("shard-00000.safetensors is corrupted" in r["truncated"] for r in res)  # every rank names it
    meta = json.load(open(os.path.join(ckpt, "global_step1", "meta.json")))
    assert meta["global_steps"] == 1  # nothing overwritten
