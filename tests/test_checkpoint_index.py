"""A checkpoint's meta.json is not trusted (issue 58): it is sealed by meta.json.sha256, every file it names must lie
inside the checkpoint directory, every file read must have its digest listed; format 1 is refused and upgraded by
command. DeepSpeed's own zero_to_fp32 module names the converter on a Lins checkpoint; client_state carries
DeepSpeed's keys."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import ckpt_config, ckpt_steps as steps, cpu_env, make_ckpt_engine as make_engine, run

transformers = pytest.importorskip("transformers")
PLAN = {"p": [1, 1], "g": [1, 1], "os": [2, 1]}  # two ranks, each writing its OS chunk: shard-00000, shard-00001
SHARD = "shard-00000.safetensors"


def _meta(tag):
    with open(os.path.join(tag, "meta.json")) as f:
        return json.load(f)


def _reseal(tag, meta):
    """meta.json rewritten with a matching seal (as ``sha256sum meta.json`` prints it): what the index says is then
    the test, not the seal."""
    import hashlib

    data = json.dumps(meta, indent=1).encode()
    with open(os.path.join(tag, "meta.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(tag, "meta.json.sha256"), "w") as f:
        f.write(f"{hashlib.sha256(data).hexdigest()}  meta.json\n")


def _flip_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))


def _renamed_entry(tag, new):
    """The index and digests name shard-00000 as ``new`` instead."""
    meta = _meta(tag)
    meta["index"] = {(new if k == SHARD else k): v for k, v in meta["index"].items()}
    meta["digests"] = {(new if k == SHARD else k): v for k, v in meta["digests"].items()}
    _reseal(tag, meta)


def _damages(tag, outside):
    """name -> what rank 0 does to the checkpoint before every rank loads it."""
    def dotdot():  # the index leads out of the directory to a good copy; the shard in the directory is gone
        os.makedirs(outside, exist_ok=True)
        shutil.copy(os.path.join(tag, SHARD), os.path.join(outside, SHARD))
        os.remove(os.path.join(tag, SHARD))
        _renamed_entry(tag, os.path.relpath(os.path.join(outside, SHARD), tag))

    def absolute():
        os.makedirs(outside, exist_ok=True)
        shutil.copy(os.path.join(tag, SHARD), os.path.join(outside, SHARD))
        os.remove(os.path.join(tag, SHARD))
        _renamed_entry(tag, os.path.abspath(os.path.join(outside, SHARD)))

    def symlink():  # the entry is a plain name, the file a link out of the directory
        os.makedirs(outside, exist_ok=True)
        os.replace(os.path.join(tag, SHARD), os.path.join(outside, SHARD))
        os.symlink(os.path.abspath(os.path.join(outside, SHARD)), os.path.join(tag, SHARD))

    def unlisted():  # a copy with a flipped byte, named by the index, its digest not listed
        shutil.copy(os.path.join(tag, SHARD), os.path.join(tag, "copy.safetensors"))
        _flip_byte(os.path.join(tag, "copy.safetensors"))
        meta = _meta(tag)
        meta["index"] = {("copy.safetensors" if k == SHARD else k): v for k, v in meta["index"].items()}
        _reseal(tag, meta)

    def unlisted_extra():
        meta = _meta(tag)
        meta["digests"].pop("extra.pt")
        _reseal(tag, meta)

    def edited_meta():  # an edit of meta.json that leaves it valid JSON: the seal no longer matches
        meta = _meta(tag)
        meta["global_steps"] = 1000
        with open(os.path.join(tag, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)

    def no_seal():
        os.remove(os.path.join(tag, "meta.json.sha256"))

    return {"dotdot": dotdot, "absolute": absolute, "symlink": symlink, "unlisted": unlisted,
            "unlisted-extra": unlisted_extra, "edited-meta": edited_meta, "no-seal": no_seal}


def untrusted_index_loads(ckpt, outside):
    engine = make_engine(PLAN, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt)
    steps(engine, 1, 2)  # the engine moves on: a load that went through would change it
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    before["steps"] = torch.tensor(engine.global_steps)
    tag = os.path.join(ckpt, "global_step1")
    out = {}
    for name, damage in _damages(tag, outside).items():
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.copytree(tag, tag + ".bak", symlinks=True)
            damage()
        torch.distributed.barrier()
        try:
            engine.load_checkpoint(ckpt)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.rmtree(tag)
            shutil.rmtree(outside, ignore_errors=True)
            os.replace(tag + ".bak", tag)
    after = {**engine.module.state_dict(), "steps": torch.tensor(engine.global_steps)}
    out["unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
    torch.distributed.barrier()
    out["after"] = engine.load_checkpoint(ckpt)[0]  # restored: loads again
    engine.destroy()
    return out


def test_an_index_naming_files_outside_unlisted_or_edited_is_refused_on_every_rank(tmp_path):
    ckpt, outside = str(tmp_path / "ckpt"), str(tmp_path / "elsewhere")
    for r in run(untrusted_index_loads, 2, ckpt, outside, gpus_per_node=2):
        assert all(v.startswith("LinsCheckpointError: load_checkpoint: ") for k, v in r.items()
                   if k not in ("unchanged", "after")), r
        rule = "every file a checkpoint names must lie inside its directory"
        assert f"names the file '../../elsewhere/{SHARD}'" in r["dotdot"] and rule in r["dotdot"], r["dotdot"]
        assert f"names the file '{os.path.join(outside, SHARD)}'" in r["absolute"] and rule in r["absolute"]
        assert f"names the file '{SHARD}', which resolves to {os.path.join(outside, SHARD)}" in r["symlink"] \
            and rule in r["symlink"], r["symlink"]
        for case, entry in (("unlisted", "copy.safetensors"), ("unlisted-extra", "extra.pt")):
            assert f"names '{entry}'" in r[case] and "without its digest" in r[case], r[case]
        assert "meta.json is corrupted or was changed after its save" in r["edited-meta"] \
            and "meta.json.sha256" in r["edited-meta"], r["edited-meta"]
        assert "meta.json.sha256 is missing" in r["no-seal"], r["no-seal"]
        assert r["unchanged"] and r["after"].endswith("global_step1")
    assert sorted(os.listdir(ckpt)) == ["global_step1", "latest", "zero_to_fp32.py"]  # nothing of the user's lost


def save_one(ckpt):
    engine = make_engine(PLAN, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt, client_state={"epoch": 3})
    engine.destroy()


def test_consolidate_and_convert_read_only_what_the_sealed_index_allows(tmp_path, capsys):
    from lins_ds.cli import main

    ckpt = str(tmp_path / "ckpt")
    run(save_one, 2, ckpt, gpus_per_node=2)
    tag = os.path.join(ckpt, "global_step1")
    assert open(os.path.join(tag, "meta.json.sha256")).read().endswith("  meta.json\n")  # sha256sum -c reads it
    assert subprocess.run(["sha256sum", "-c", "meta.json.sha256"], cwd=tag, capture_output=True).returncode == 0
    shutil.copytree(tag, tag + ".bak")
    os.makedirs(tmp_path / "elsewhere")
    shutil.move(os.path.join(tag, SHARD), tmp_path / "elsewhere" / SHARD)
    _renamed_entry(tag, f"../../elsewhere/{SHARD}")
    for cmd in (["consolidate", ckpt, str(tmp_path / "hf")], ["convert", ckpt, str(tmp_path / "uni")]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert f"names the file '../../elsewhere/{SHARD}'" in err and "outside the checkpoint directory" in err, err
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")
    shutil.rmtree(tag)
    os.replace(tag + ".bak", tag)
    with open(os.path.join(tag, "config.json"), "a") as f:
        f.write(" ")  # config.json is read by consolidate: checked too
    assert main(["consolidate", ckpt, str(tmp_path / "hf")]) == 2
    assert "config.json is corrupted" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "hf" / "model.safetensors")  # checked before anything is written


# --- format 1: refused like any other format, upgraded by command ---------------------------------------------------
def _as_format_1(tag):
    """What a lins_ds before issue 58 wrote: format 1, no seal, extra.pt unlisted, extra.pt without DeepSpeed's keys."""
    extra = torch.load(os.path.join(tag, "extra.pt"), weights_only=True)
    extra.pop("deepspeed")
    torch.save(extra, os.path.join(tag, "extra.pt"))
    meta = _meta(tag)
    meta["format"] = "lins_ds.checkpoint/1"
    meta["digests"].pop("extra.pt")
    os.remove(os.path.join(tag, "meta.json.sha256"))
    with open(os.path.join(tag, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)


def load_upgrade_load(ckpt):
    engine = make_engine(PLAN, 2)
    out = {}
    try:
        engine.load_checkpoint(ckpt)
        out["before"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["before"] = f"{type(e).__name__}: {e}"
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        import contextlib
        import io

        from lins_ds.checkpoint.upgrade import main

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            out["upgrade"] = (main([ckpt]), printed.getvalue())
    torch.distributed.barrier()
    path, client = engine.load_checkpoint(ckpt)
    out["after"] = (path, client["epoch"], engine.global_steps)
    engine.destroy()
    return out


def test_a_format_1_checkpoint_is_refused_naming_the_upgrade_which_keeps_every_file(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    run(save_one, 2, ckpt, gpus_per_node=2)
    tag = os.path.join(ckpt, "global_step1")
    _as_format_1(tag)
    files = {n: open(os.path.join(tag, n), "rb").read() for n in os.listdir(tag)}
    bad = str(tmp_path / "bad")
    shutil.copytree(ckpt, bad)
    _flip_byte(os.path.join(bad, "global_step1", "shard-00001.safetensors"))  # its digest is recorded: checked
    from lins_ds.checkpoint.upgrade import main

    assert main([bad]) == 2 and "shard-00001.safetensors is corrupted" in capsys.readouterr().err
    assert sorted(os.listdir(os.path.join(bad, "global_step1"))) == sorted(files)  # nothing written
    results = run(load_upgrade_load, 2, ckpt, gpus_per_node=2)
    for r in results:
        assert "was saved by an earlier lins_ds (format 'lins_ds.checkpoint/1'" in r["before"], r
        assert f"python -m lins_ds.checkpoint.upgrade {tag}" in r["before"], r
        assert r["after"][0].endswith("global_step1") and r["after"][1:] == (3, 1)
    code, printed = results[0]["upgrade"]
    assert code == 0 and printed.strip().endswith("digests recorded now, unchecked before: extra.pt"), printed
    assert open(os.path.join(tag, "meta.json.v1"), "rb").read() == files["meta.json"]  # the original, kept
    for name, content in files.items():
        if name != "meta.json":
            assert open(os.path.join(tag, name), "rb").read() == content, name
    assert main([ckpt]) == 0  # sealed now: checked, nothing rewritten


# --- DeepSpeed's zero_to_fp32 module on a Lins checkpoint ------------------------------------------------------------
def test_deepspeeds_zero_to_fp32_module_names_the_script_that_converts_a_lins_checkpoint(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    run(save_one, 2, ckpt, gpus_per_node=2)
    r = subprocess.run([sys.executable, "-m", "deepspeed.utils.zero_to_fp32", ckpt, out], env=cpu_env(),
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    command = f"python {ckpt}/zero_to_fp32.py {ckpt} {out}"
    assert f"{ckpt}/global_step1 is a Lins checkpoint" in r.stderr and "*_model_states.pt" in r.stderr, r.stderr
    assert command in r.stderr and f"lins-ds consolidate {ckpt} {out}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([sys.executable, *command.split()[1:]], env=cpu_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from lins_ds.checkpoint.consolidate import full_state_dict

    ours = torch.load(os.path.join(out, "pytorch_model.bin"), weights_only=True)
    ref = full_state_dict(os.path.join(ckpt, "global_step1"), torch.float32)
    assert sorted(ours) == sorted(ref) and all(torch.equal(ours[k], ref[k]) for k in ref)


# --- client_state: DeepSpeed's keys, with DeepSpeed's meaning --------------------------------------------------------
FLAGS = ({}, {"load_module_only": True}, {"load_optimizer_states": False, "load_lr_scheduler_states": False})


def client_states(ckpt, lins: bool):
    import deepspeed

    world = torch.distributed.get_world_size()
    cfg = ckpt_config(PLAN, world, 2)
    if not lins:
        del cfg["lins"]
        cfg["zero_optimization"] = {"stage": 1}
    engine, *_ = deepspeed.initialize(model=transformers.LlamaForCausalLM(
        transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)), config=cfg)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt, client_state={"note": "hello"})
    out = []
    for flags in FLAGS:
        _, client = engine.load_checkpoint(ckpt, **flags)
        out.append(client)
    engine.destroy()
    return out, cfg


def test_client_state_holds_deepspeeds_keys_as_zero1_returns_them(tmp_path):
    (ours, lins_cfg), = run(client_states, 2, str(tmp_path / "lins"), True, gpus_per_node=2)[:1]
    (theirs, ds_cfg), = run(client_states, 2, str(tmp_path / "ds"), False, gpus_per_node=2)[:1]
    for flags, a, b in zip(FLAGS, ours, theirs):
        assert sorted(a) == sorted(b), (flags, sorted(set(a) ^ set(b)))
        assert a["note"] == "hello"
        for key in ("global_samples", "ds_version", "buffer_names", "shared_params", "checkpoint_parallel_dimensions",
                    "frozen_param_shapes", "frozen_param_fragments", "param_shapes", "dp_world_size", "mp_world_size",
                    "global_steps", "skipped_steps", "optimizer", "data_sampler", "random_ltd"):
            assert a.get(key) == b.get(key), (flags, key, a.get(key), b.get(key))
        assert a["ds_config"] == lins_cfg and b["ds_config"] == ds_cfg
    assert "lr_scheduler" in ours[2] and ours[2]["lr_scheduler"]["last_batch_iteration"] == \
        theirs[2]["lr_scheduler"]["last_batch_iteration"]
