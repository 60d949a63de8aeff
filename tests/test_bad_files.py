"""Every broken file a user can hand us: one clear error naming the file, on every rank, exit status 2 from the
CLI, nothing the user saved changed. And checkpoints of other kinds are called what they are."""

import hashlib
import json
import os
import shutil

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import bad_config, ckpt_steps as steps, make_ckpt_engine as make_engine, run
from test_checkpoint import PLAN_A

transformers = pytest.importorskip("transformers")
NOT_UTF8 = b"\xff\xfe\x00binary \x80\x81 not text"
PLAN = ["plan", "--nodes", "1", "--gpus-per-node", "2", "--seq-len", "64", "--micro-batch-size", "1"]


def cli(capsys, *args):
    from lins_ds.cli import main

    code = main(list(args))
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line, no traceback
    return code, err


def test_plan_cli_names_a_profile_or_config_that_is_not_utf8_or_not_an_object(tmp_path, capsys):
    binary = tmp_path / "binary.json"
    binary.write_bytes(NOT_UTF8)
    code, err = cli(capsys, *PLAN, "--model", "llama-tiny", "--profile", str(binary))
    assert code == 2 and f"--profile {binary}" in err and "not UTF-8" in err
    code, err = cli(capsys, *PLAN, "--model", str(binary), "--gpu-memory-gb", "80")
    assert code == 2 and f"--model {binary}" in err and "not UTF-8" in err
    for value, kind in (([1, 2, 3], "list"), (None, "NoneType")):
        cfg = tmp_path / f"{kind}.json"
        cfg.write_text(json.dumps(value))
        code, err = cli(capsys, *PLAN, "--model", str(cfg), "--gpu-memory-gb", "80")
        assert code == 2 and str(cfg) in err and f"holds a {kind}" in err


def test_engine_names_lins_keys_for_bad_files_on_every_rank(tmp_path):
    binary = tmp_path / "profile.json"
    binary.write_bytes(NOT_UTF8)
    listy = tmp_path / "config.json"
    listy.write_text("[1, 2, 3]")
    solve = {"plan": "solve", "seq_len": 8}
    cases = [({**solve, "profile": str(binary)}, f"lins.profile {binary}: not a profile: the file is not UTF-8"),
             ({**solve, "profile": "synthetic", "model": str(listy)}, f"lins.model {listy}: a config.json holds"),
             ({**solve, "profile": "synthetic", "gpu_memory_gb": 1e-6, "reserved_gb": 0},
              "no plan fits in 1e-06 GiB per GPU (lins.gpu_memory_gb")]
    for lins, needle in cases:
        for msg in run(bad_config, 2, lins, {}, gpus_per_node=2):
            assert needle in msg, msg


# --- broken checkpoint files: every rank names the file ----------------------------------------------------
def broken_checkpoint_loads(ckpt):
    engine = make_engine(PLAN_A, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt)
    tag = os.path.join(ckpt, "global_step1")
    out = {}

    def attempt(name, damage):
        torch.distributed.barrier()
        if torch.distributed.get_rank() == 0:
            shutil.copytree(tag, tag + ".bak")
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
            os.replace(tag + ".bak", tag)
        torch.distributed.barrier()

    def truncate(fname):
        path = os.path.join(tag, fname)
        return lambda: open(path, "r+b").truncate(os.path.getsize(path) // 2)

    attempt("shard", truncate("shard-00000.safetensors"))
    attempt("missing-shard", lambda: os.remove(os.path.join(tag, "shard-00002.safetensors")))
    attempt("extra", truncate("extra.pt"))
    attempt("frozen", truncate("frozen.safetensors"))
    attempt("meta", lambda: open(os.path.join(tag, "meta.json"), "wb").write(NOT_UTF8))
    attempt("meta-and-seal", lambda: (open(os.path.join(tag, "meta.json"), "wb").write(NOT_UTF8),
                                      open(os.path.join(tag, "meta.json.sha256"), "w").write(
                                          hashlib.sha256(NOT_UTF8).hexdigest() + "  meta.json\n")))
    out["after"] = engine.load_checkpoint(ckpt)[0]  # restored: loads again
    engine.destroy()
    return out


def test_a_broken_checkpoint_file_is_named_on_every_rank(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run(broken_checkpoint_loads, 4, ckpt, gpus_per_node=2)
    for r in results:
        assert "shard-00000.safetensors is corrupted" in r["shard"], r["shard"]  # its digest, before reading
        assert "shard-00002.safetensors" in r["missing-shard"], r["missing-shard"]
        assert "extra.pt is corrupted" in r["extra"] and "central directory" not in r["extra"].split(":")[0]
        assert "frozen.safetensors is corrupted" in r["frozen"]
        assert "meta.json is corrupted or was changed after its save" in r["meta"]  # its seal, before it is parsed
        assert "meta.json is unreadable" in r["meta-and-seal"]
        assert all(v.startswith("LinsCheckpointError") for k, v in r.items() if k != "after")
        assert r["after"].endswith("global_step1")
    assert sorted(os.listdir(ckpt)) == ["global_step1", "latest", "zero_to_fp32.py"]


def test_consolidate_names_a_truncated_frozen_file_and_foreign_checkpoints(tmp_path, capsys):
    run(lambda c: (steps(e := make_engine(PLAN_A, 2), 0, 1), e.save_checkpoint(c), e.destroy()), 4,
        str(tmp_path / "ckpt"), gpus_per_node=2)
    frozen = tmp_path / "ckpt" / "global_step1" / "frozen.safetensors"
    frozen.write_bytes(frozen.read_bytes()[:20])
    code, err = cli(capsys, "consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert code == 2 and "frozen.safetensors is corrupted" in err  # its digest, before it is read
    (tmp_path / "ds" / "global_step3").mkdir(parents=True)
    for f in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (tmp_path / "ds" / "global_step3" / f).write_bytes(b"")
    code, err = cli(capsys, "consolidate", str(tmp_path / "ds" / "global_step3"), str(tmp_path / "out"))
    assert code == 2 and "is a DeepSpeed ZeRO-1/2 checkpoint" in err and "incomplete" not in err
    (tmp_path / "random" / "global_step1").mkdir(parents=True)
    (tmp_path / "random" / "global_step1" / "notes.txt").write_text("hello")
    code, err = cli(capsys, "consolidate", str(tmp_path / "random"), str(tmp_path / "out"), "--tag", "global_step1")
    assert code == 2 and "is not a checkpoint" in err and "notes.txt" in err and "incomplete" not in err


# --- a checkpoint whose pickles would run code ----------------------------------------------------------------
def write_marker(path):
    """What a malicious pickle would call on load; here it only leaves a file."""
    open(path, "w").write("ran")
    return "unpickled"


class Trap:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return write_marker, (self.path,)


def pickled_client_state(ckpt, marker):
    from helpers import ckpt_config

    import deepspeed

    engine = make_engine(PLAN_A, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt, client_state={"note": "kept", "trap": Trap(marker)})
    out = {}
    try:
        engine.load_checkpoint(ckpt)
        out["refused"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["refused"] = f"{type(e).__name__}: {e}"
    torch.distributed.barrier()
    out["marker_after_refusal"] = os.path.exists(marker)
    cfg = ckpt_config(PLAN_A, torch.distributed.get_world_size(), 2)
    cfg["lins"]["checkpoint_pickle"] = True
    trusting, *_ = deepspeed.initialize(model=engine.module, config=cfg)
    out["trusted"] = trusting.load_checkpoint(ckpt)[1]
    engine.destroy()
    trusting.destroy()
    return out


def test_a_checkpoint_that_would_run_code_is_refused_unless_trusted(tmp_path):
    ckpt, marker = str(tmp_path / "ckpt"), str(tmp_path / "marker")
    for r in run(pickled_client_state, 4, ckpt, marker, gpus_per_node=2):
        assert r["refused"].startswith("LinsCheckpointError: load_checkpoint: ") and \
            "holds test_bad_files.write_marker" in r["refused"] and '"checkpoint_pickle": true' in r["refused"], r
        assert not r["marker_after_refusal"]  # nothing ran
        trusted = {k: r["trusted"][k] for k in ("note", "trap")}
        assert trusted == {"note": "kept", "trap": "unpickled"}  # the opt-in reads it as torch.save wrote it
