"""Nothing lost, nothing run (issue 48): corrupted checkpoints are refused, a failed load changes nothing, a re-save
killed at any instant leaves a loadable copy, no checkpoint path runs code, caches are validated, and every failure on
one rank reaches every rank. Each test is one way a demanding user breaks things (gloo ranks, the tiny LLaMA, fp32)."""

import json
import os
import shutil
import time
import warnings

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import ckpt_steps as steps, make_ckpt_engine as make_engine, run
from lins_ds import comm
from lins_ds.checkpoint.formats import file_digest, write_meta
from lins_ds.checkpoint.layout_free import FORMAT

SHARDED = {"p": [2, 1], "g": [2, 1], "os": [2, 1]}
REPLICATED = {"p": [1, 1], "g": [1, 1], "os": [1, 1]}
ZERO1_LIKE = {"p": [1, 1], "g": [1, 1], "os": [2, 1]}


def _err(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the tests read every rank's message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _flip_byte(path: str, at: float = 0.6) -> None:
    """One byte inside the tensor data (well past the safetensors header) changed."""
    with open(path, "r+b") as f:
        f.seek(int(os.path.getsize(path) * at))
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))


# --- 1. a changed byte is refused -------------------------------------------------------------------------------------
def flipped(ckpt):
    engine = make_engine(SHARDED, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        _flip_byte(os.path.join(ckpt, "global_step1", "shard-00001.safetensors"))
    torch.distributed.barrier()
    msg = _err(lambda: engine.load_checkpoint(ckpt))
    engine.destroy()
    return msg


def test_a_flipped_byte_is_refused_on_load_and_in_consolidate(tmp_path):
    from lins_ds.cli import main

    ckpt = str(tmp_path / "ckpt")
    for msg in run(flipped, 2, ckpt, gpus_per_node=2):
        assert "shard-00001.safetensors is corrupted" in msg and "SHA-256" in msg, msg
    assert main(["consolidate", ckpt, str(tmp_path / "out")]) == 2
    assert not os.path.exists(tmp_path / "out" / "model.safetensors")


# --- 2. a failed load changes nothing -----------------------------------------------------------------------------------
def _state(engine) -> dict:
    """Everything a load writes, by value: masters and optimizer state per slice, the module's parameters, the LR
    scheduler, the counters."""
    opt = engine.optimizer
    out = {f"master/{i}": s.param.detach().clone() for i, s in enumerate(engine.lins.master_slices())}
    for i, s in enumerate(engine.lins.master_slices()):
        for k, v in opt.state.get(s.param, {}).items():
            out[f"state/{i}/{k}"] = v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v))
    out.update({f"module/{k}": v.clone() for k, v in engine.module.state_dict().items()})
    out["scheduler"] = torch.tensor([float(x) for x in engine.lr_scheduler.get_last_lr()] + [engine.lr_scheduler.last_batch_iteration])
    out["counters"] = torch.tensor([engine.global_steps, engine.global_samples, engine.skipped_steps])
    return out


def failed_load(ckpt, damage):
    engine = make_engine(SHARDED, 2)
    steps(engine, 0, 1)
    engine.save_checkpoint(ckpt)
    steps(engine, 1, 2)  # the engine moves on: a load would change every number
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        tag = os.path.join(ckpt, "global_step1")
        {"shard": lambda: _flip_byte(os.path.join(tag, "shard-00001.safetensors")),
         "extra": lambda: open(os.path.join(tag, "extra.pt"), "r+b").truncate(100),
         "meta": lambda: write_meta(tag, {"format": FORMAT, "params": []}),
         "scheduler": lambda: _rewrite_extra(tag, {"lr_scheduler": {"not": "this scheduler's"}, "loss_scaler": None,
                                                   "client_state": {}}),
         }[damage]()
    torch.distributed.barrier()
    before = _state(engine)
    msg = _err(lambda: engine.load_checkpoint(ckpt))
    after = _state(engine)
    same = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    losses = [steps(engine, 3, 1)[0][1]]  # and it trains on
    engine.destroy()
    return msg, same, losses


def _rewrite_extra(tag: str, extra: dict) -> None:
    """extra.pt replaced, its digest dropped (as a save before digests would have it): the content is the test."""
    torch.save(extra, os.path.join(tag, "extra.pt"))
    meta = json.load(open(os.path.join(tag, "meta.json")))
    meta["digests"]["extra.pt"] = file_digest(os.path.join(tag, "extra.pt"))  # recorded, sealed: the content is the test
    write_meta(tag, meta)


@pytest.mark.parametrize("damage,named", [("shard", "shard-00001.safetensors is corrupted"),
                                          ("extra", "extra.pt is"), ("meta", "meta.json is malformed"),
                                          ("scheduler", "the LR scheduler's saved state does not fit")])
def test_a_failed_load_leaves_every_rank_exactly_as_it_was(tmp_path, damage, named):
    for msg, same, _ in run(failed_load, 2, str(tmp_path / "ckpt"), damage, gpus_per_node=2):
        assert named in msg, msg
        assert same, f"{damage}: the engine changed"


# --- 3. a re-save of the same tag killed at any instant -------------------------------------------------------------------
class Killed(BaseException):
    """The process dies here (not an error the save could catch)."""


def resave_killed_at(tmp, point):
    """Save tag "ck" at step 1, train on, save "ck" again with the kill at the ``point``-th file-system change of
    its publication; then a fresh engine loads ``ck``. (killed?, loaded values equal the first or the second)."""
    from lins_ds.checkpoint import save as save_module

    engine = make_engine(REPLICATED, 1)
    steps(engine, 0, 1)
    engine.save_checkpoint(tmp, tag="ck")
    first = {k: v.clone() for k, v in engine.module.state_dict().items()}
    steps(engine, 1, 1)
    second = {k: v.clone() for k, v in engine.module.state_dict().items()}
    calls, real = [0], (save_module.os.replace, save_module.os.remove, save_module.shutil.rmtree)

    def counted(fn):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == point:
                raise Killed()
            return fn(*args, **kwargs)
        return wrapper

    publish = save_module._publish
    save_module._publish = lambda *a: (setattr(save_module.os, "replace", counted(real[0])),
                                       setattr(save_module.os, "remove", counted(real[1])),
                                       setattr(save_module.shutil, "rmtree", counted(real[2])), publish(*a))[-1]
    killed = False
    try:
        engine.save_checkpoint(tmp, tag="ck")
    except Killed:
        killed = True
    finally:
        save_module._publish = publish
        save_module.os.replace, save_module.os.remove, save_module.shutil.rmtree = real
    engine.destroy()
    fresh = make_engine(REPLICATED, 1)
    path, _ = fresh.load_checkpoint(tmp)
    got = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    fresh.destroy()
    equal = lambda a: all(torch.equal(got[k], a[k]) for k in a)  # noqa: E731
    return killed, path, equal(first) or equal(second)


def test_a_resave_killed_at_every_instant_leaves_a_copy_load_finds(tmp_path):
    point = 1
    while True:
        killed, path, whole = run(resave_killed_at, 1, str(tmp_path / f"k{point}"), point)[0]
        assert whole, (point, path)
        if not killed:
            break
        point += 1
    assert point > 4  # the marker, the old copy aside, the new one in place, the old removed, `latest`


def second_kill(tmp):
    """A re-save killed after setting the old copy aside (``ck.old`` and a finished ``ck.incomplete``, no ``ck``), then
    the next save of ``ck`` killed while it clears that ``ck.incomplete`` away: a whole copy is still found."""
    from lins_ds.checkpoint import save as save_module

    engine = make_engine(REPLICATED, 1)
    steps(engine, 0, 1)
    engine.save_checkpoint(tmp, tag="ck")
    shutil.copytree(os.path.join(tmp, "ck"), os.path.join(tmp, "ck.incomplete"))
    os.replace(os.path.join(tmp, "ck"), os.path.join(tmp, "ck.old"))
    real = save_module.shutil.rmtree

    def killed_midway(path, *args, **kwargs):  # one file removed, then the process dies
        os.remove(os.path.join(path, "shard-00000.safetensors"))
        raise Killed()

    save_module.shutil.rmtree = killed_midway
    try:
        engine.save_checkpoint(tmp, tag="ck")
    except Killed:
        pass
    finally:
        save_module.shutil.rmtree = real
    engine.destroy()
    fresh = make_engine(REPLICATED, 1)
    path, _ = fresh.load_checkpoint(tmp)
    fresh.destroy()
    return path


def test_two_interrupted_saves_still_leave_a_copy_load_finds(tmp_path):
    assert run(second_kill, 1, str(tmp_path))[0].endswith("ck.old")


# --- 4. no code runs from a crafted checkpoint -------------------------------------------------------------------------------
class Payload:
    """Unpickling it writes the marker file: what a malicious checkpoint would run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted(root: str, marker: str, names: list) -> dict:
    """Directories shaped like every checkpoint a loader reads, each with the payload where it would unpickle."""
    evil = Payload(marker)
    out = {}
    lins = os.path.join(root, "lins")  # a Lins checkpoint with the payload in extra.pt
    out["extra.pt"] = (lins, None)
    universal = os.path.join(root, "universal", "t")
    os.makedirs(os.path.join(universal, "zero"))
    torch.save({"x": evil}, os.path.join(universal, "mp_rank_00_model_states.pt"))
    out["model states (universal-shaped)"] = (os.path.dirname(universal), "t")
    zero = os.path.join(root, "zero", "t")
    os.makedirs(zero)
    torch.save({"x": evil}, os.path.join(zero, "mp_rank_00_model_states.pt"))
    torch.save({"x": evil}, os.path.join(zero, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    torch.save({"x": evil}, os.path.join(zero, "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    out["ZeRO-shaped"] = (os.path.dirname(zero), "t")
    piece = os.path.join(root, "piece", "t")
    shutil.copytree(universal, piece)
    os.remove(os.path.join(piece, "mp_rank_00_model_states.pt"))
    torch.save({"module": None, "param_shapes": [], "global_steps": 1}, os.path.join(piece, "mp_rank_00_model_states.pt"))
    torch.save({"optimizer_state_dict": {}, "param_groups": []}, os.path.join(piece, "zero", "optimizer_state.pt"))
    for name in names:  # every parameter's fp32.pt holds the payload: the first one read would run it
        os.makedirs(os.path.join(piece, "zero", name))
        torch.save(evil, os.path.join(piece, "zero", name, "fp32.pt"))
    out["universal piece"] = (os.path.dirname(piece), "t")
    steer = os.path.join(root, "steer")
    os.makedirs(steer)
    with open(os.path.join(steer, "latest"), "w") as f:
        f.write("../zero/t")
    out["latest pointing outside"] = (steer, None)
    return out


def crafted_loads(root, marker):
    engine = make_engine(SHARDED, 2)
    steps(engine, 0, 1)
    cases = None
    if torch.distributed.get_rank() == 0:
        cases = _crafted(root, marker, [n for n, p in engine.module.named_parameters() if p.requires_grad])
    torch.distributed.barrier()
    engine.save_checkpoint(os.path.join(root, "lins"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        torch.save({"lr_scheduler": None, "loss_scaler": None, "client_state": {"x": Payload(marker)}},
                   os.path.join(root, "lins", "global_step1", "extra.pt"))
        meta_path = os.path.join(root, "lins", "global_step1", "meta.json")
        meta = json.load(open(meta_path))
        meta["digests"]["extra.pt"] = file_digest(os.path.join(root, "lins", "global_step1", "extra.pt"))
        write_meta(os.path.dirname(meta_path), meta)  # recorded and sealed: the file itself is the test
    torch.distributed.barrier()
    cases = comm.broadcast_object(cases)
    out = {name: _err(lambda d=d, t=t: engine.load_checkpoint(d, tag=t)) for name, (d, t) in cases.items()}
    engine.destroy()
    return out, os.path.exists(marker)


def test_no_checkpoint_path_runs_code_with_the_default_config(tmp_path):
    marker = str(tmp_path / "MARKER")
    for out, ran in run(crafted_loads, 2, str(tmp_path / "crafted"), marker, gpus_per_node=2):
        assert not ran, out
        for name, msg in out.items():
            assert msg != "no error", name
        assert "checkpoint_pickle" in out["extra.pt"] and "checkpoint_pickle" in out["ZeRO-shaped"], out
        assert "not a directory name inside the checkpoint directory" in out["latest pointing outside"]
    assert not os.path.exists(marker)


# --- 5. caches are data ---------------------------------------------------------------------------------------------------
def unwritable_cache(cache):
    import deepspeed
    from helpers import config, tiny_llama

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(
        {"plan": "solve", "profile": "measure", "profile_cache": cache},
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}))
    x = torch.randint(0, 96, (2, 8))
    engine.backward(engine(input_ids=x, labels=x).loss)
    engine.step()
    engine.destroy()
    return "trained"


def test_an_unwritable_cache_directory_trains_with_a_warning(tmp_path, capfd):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert run(unwritable_cache, 2, str(blocker / "cache"), gpus_per_node=2) == ["trained", "trained"]
    assert "not cached" in capfd.readouterr().out


def tune_decisions(tmp, edit):
    """Tune once (the decision cached), damage the decision as ``edit`` says, launch the same job again."""
    from test_tune import CANDIDATES, _engine, _steps, slow_all_reduce_profile, tune_config

    from lins_ds.runtime.switch import tune

    if torch.distributed.get_rank() == 0:
        slow_all_reduce_profile(f"{tmp}/profile.json")
    torch.distributed.barrier()
    engine = _engine(tune_config(tmp))
    _steps(engine, 0, CANDIDATES * 2 + 1)
    engine.destroy()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        path = next(os.path.join(f"{tmp}/cache", n) for n in os.listdir(f"{tmp}/cache")
                    if n.startswith("tune-") and n.endswith(".json"))
        obj = json.load(open(path))
        if edit == "edited":
            obj["plan"]["activation_checkpointing_units"] = 1
        elif edit == "other topology":
            # 2 nodes of 4 (this job is 2 of 2): any mesh the tuner picked still divides it, so what is refused is the
            # topology, whichever plan won (1 node refused an inter factor of 2 first when that plan won)
            obj["plan"]["nodes"], obj["plan"]["gpus_per_node"] = 2, 4
            obj["seal"] = tune._seal(obj["key"], obj["plan"])
        elif edit == "impossible offload":
            obj["plan"]["offload_units"], obj["plan"]["offload_params"] = 3, True
            obj["seal"] = tune._seal(obj["key"], obj["plan"])
        json.dump(obj, open(path, "w"))
    torch.distributed.barrier()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine = _engine(tune_config(tmp))
    trials = engine.lins_tuner is not None
    _steps(engine, 0, 1)
    engine.destroy()
    return trials, [str(w.message) for w in said if "lins tune" in str(w.message)]


@pytest.mark.parametrize("edit,why", [("edited", "was edited since it was written"),
                                      ("other topology", "gpus_per_node=4"),
                                      ("impossible offload", "offload does not allow")])
def test_a_damaged_tune_decision_is_named_and_tuned_again(tmp_path, edit, why):
    results = run(tune_decisions, 4, str(tmp_path), edit, gpus_per_node=2)
    assert [trials for trials, _ in results] == [True] * 4  # tuned again
    said = results[0][1]  # rank 0 reads the decision, and says why it is not used
    assert len(said) == 1 and "the cached decision" in said[0] and ".json is not used" in said[0] and why in said[0], said


def version_in_keys():
    from lins_ds.plan import Topology
    from lins_ds.profiler.cache import launch_key

    return launch_key(Topology(1, 1), torch.device("cpu"))["lins_ds"]


def test_caches_are_keyed_by_the_lins_ds_version():
    """The profile's key, which the tune decision's includes: another lins_ds measures and tunes anew."""
    assert run(version_in_keys, 1) == [lins_ds.__version__]


# --- 6. every failure reaches every rank ------------------------------------------------------------------------------------
def host_worker_fails(failing_rank):
    """Offload on a CPU device: the host optimizer of one rank fails in the second step."""
    import deepspeed
    from helpers import config, tiny_llama

    from lins_ds.runtime.step import offload

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(
        {"plan": REPLICATED, "offload": {"os": "cpu"}},
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}))
    if torch.distributed.get_rank() == failing_rank:
        real = offload.HostUpdater._update
        calls = [0]

        def update(self, *args):
            calls[0] += 1
            if calls[0] == 2:
                raise MemoryError("test: the host ran out of memory")
            return real(self, *args)
        offload.HostUpdater._update = update
    t0, msg = time.monotonic(), "no error"
    try:
        for step in range(4):
            x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(step))
            for _ in range(2):
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
    except RuntimeError as e:
        msg = str(e)
    took = time.monotonic() - t0
    engine.destroy()
    return msg, took


@pytest.mark.parametrize("world", [2, 4])
def test_a_host_worker_failing_on_one_rank_ends_every_rank_with_its_message(world):
    for msg, took in run(host_worker_fails, world, world - 1, gpus_per_node=2, timeout=120):
        assert f"failed on rank {world - 1}" in msg and "the host ran out of memory" in msg, msg
        assert took < 10, took


def different_accumulation():
    import deepspeed
    from helpers import config, tiny_llama

    model = tiny_llama()
    gas = 2 if torch.distributed.get_rank() == 0 else 4
    return _err(lambda: deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(
        {"plan": ZERO1_LIKE}, gradient_accumulation_steps=gas,
        optimizer={"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}})))


def test_different_accumulation_per_rank_fails_at_start_up_naming_it():
    for msg in run(different_accumulation, 2, gpus_per_node=2, timeout=120):
        assert "gradient_accumulation_steps: the ranks differ (2 on ranks [0]; 4 on ranks [1])" in msg, msg


# --- 7. paths, files and messages ------------------------------------------------------------------------------------------
def traversal(tmp):
    engine = make_engine(REPLICATED, 2)
    steps(engine, 0, 1)
    out = {tag: _err(lambda t=tag: engine.save_checkpoint(os.path.join(tmp, "ck"), tag=t))
           for tag in ("../escaped", os.path.join(tmp, "absolute"), "a/b", "..")}
    out["load"] = _err(lambda: engine.load_checkpoint(os.path.join(tmp, "ck"), tag="../escaped"))
    engine.destroy()
    return out


def test_tags_that_leave_the_checkpoint_directory_are_refused(tmp_path):
    for out in run(traversal, 2, str(tmp_path), gpus_per_node=2):
        for tag, msg in out.items():
            assert "is not a directory name inside the checkpoint directory" in msg, (tag, msg)
    assert not os.path.exists(tmp_path / "escaped") and not os.path.exists(tmp_path / "absolute")


def test_the_fixed_plan_host_memory_error_shows_small_numbers():
    from lins_ds.plan.solver import _gib

    assert _gib(0.0012) == "0.0012" and _gib(12.345) == "12.35"
