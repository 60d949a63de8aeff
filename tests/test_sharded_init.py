"""lins_ds.init: models built or loaded so that no rank holds them whole, with the same values on every plan."""

import os
import resource

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import run

transformers = pytest.importorskip("transformers")
REPLICATED = {"p": [1, 1], "g": [1, 1], "os": [1, 1]}
P2 = {"p": [2, 1], "g": [2, 1], "os": [2, 1]}
P4 = {"p": [2, 2], "g": [2, 2], "os": [2, 2]}
RANGE = 0.1  # initializer_range: far from the kaiming default, so the model's own init is recognisable


def llama_config(**kw):
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=96, max_position_embeddings=64,
                                    initializer_range=RANGE, **kw)


def ds_config(plan, gpus_per_node=2):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 0}, "steps_per_print": 1000,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "lins": {"plan": plan, "gpus_per_node": gpus_per_node}}


def held_elements(module) -> int:
    """Parameter elements with storage on this rank (views into released unit buffers hold none)."""
    seen, total = set(), 0
    for p in module.parameters():
        st = p.untyped_storage()
        if p.is_meta or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes() // p.element_size()
    return total


def initial_state(plan, gpus_per_node):
    import deepspeed

    torch.manual_seed(11)
    cfg = ds_config(plan, gpus_per_node)
    with lins_ds.init(config=cfg):
        model = transformers.LlamaForCausalLM(llama_config())
    before = (sum(p.is_meta for p in model.parameters()), len(list(model.parameters())))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    shard_elements = sum(u.p_storage.numel() for u in engine.lins._units) if engine.lins.layout.p.size > 1 else None
    held = held_elements(engine.module) + sum(u.p_shard.numel() for u in engine.lins._units if u.p_shard is not None)
    max_unit = max(u.spec.padded for u in engine.lins._units)
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    engine.destroy()
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # a released one is empty (ZeRO-3's)
    return before, state, held, total, max_unit, shard_elements, engine.lins.layout.p.size


def test_initial_values_are_the_same_for_every_plan_and_world_size():
    results = [run(initial_state, 4, plan, 2, gpus_per_node=2)[0] for plan in (REPLICATED, P2, P4)]
    results.append(run(initial_state, 2, P2, 2, gpus_per_node=2)[0])
    reference = results[0][1]
    for (meta, count), state, held, total, max_unit, _, s_p in results:
        assert meta == count  # nothing materialised before deepspeed.initialize
        assert held <= total / s_p + max_unit  # after it: this rank's P chunk (plus at most one unit)
        assert set(state) == set(reference) and all(torch.equal(state[k], reference[k]) for k in reference)
    for name, t in reference.items():  # the model's own init: normal(0, initializer_range), norms at one
        if name.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif t.ndim == 2:
            assert abs(t.float().std().item() / RANGE - 1) < 0.2, (name, t.std().item())


def from_config_states(make, plans, modes):
    """Initial state dicts of a model built from its config: eagerly, and under lins_ds.init per plan and mode."""
    import deepspeed

    out = {}
    for plan in plans:
        for mode in modes:
            cfg = ds_config(plan)
            cfg["lins"]["init"] = "eager" if mode == "eager-built" else mode
            torch.manual_seed(11)
            if mode == "eager-built":
                model = make()
            else:
                with lins_ds.init(config=cfg):
                    model = make()
            drawn_after = torch.rand(4)  # what the program draws next: the same as after an eager build
            engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            out[(str(plan), mode)] = ({k: v.clone() for k, v in engine.module.state_dict().items()}, drawn_after)
            engine.destroy()
    return out


def tiny_gpt2_from_config():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96,
                                                                n_positions=32))


@pytest.mark.parametrize("make", [lambda: transformers.LlamaForCausalLM(llama_config()), tiny_gpt2_from_config],
                         ids=["llama", "gpt2"])
def test_a_model_built_sharded_starts_bit_identical_to_the_eager_build(make):
    """lins.init "eager" (the default): the values, and the generator's state after the build, are the eager
    build's, on every plan; "per_module" gives other (plan-independent) values."""
    out = run(from_config_states, 4, make, [REPLICATED, P4], ["eager-built", "eager", "per_module"],
              gpus_per_node=2)[0]
    eager, drawn = out[(str(REPLICATED), "eager-built")]
    for plan in (REPLICATED, P4):
        state, drawn_after = out[(str(plan), "eager")]
        assert set(state) == set(eager) and all(torch.equal(state[k], eager[k]) for k in eager), plan
        assert torch.equal(drawn_after, drawn)
        per_module = out[(str(plan), "per_module")][0]
        assert not all(torch.equal(per_module[k], eager[k]) for k in eager)
        assert all(torch.equal(per_module[k], out[(str(REPLICATED), "per_module")][0][k]) for k in eager)


# --- from_pretrained under the context: single file and sharded with an index ------------------------------
def loaded(path, plan, inside):
    import deepspeed

    from lins_ds.integrations import sharded_init

    reads = []
    real_read = sharded_init.LazySlice.read
    sharded_init.LazySlice.read = lambda self, a, b: (reads.append(b - a), real_read(self, a, b))[1]
    cfg = ds_config(plan)
    try:
        if inside:
            with lins_ds.init(config=cfg):
                model = transformers.AutoModelForCausalLM.from_pretrained(path)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(path)
        meta = all(p.is_meta for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    finally:
        sharded_init.LazySlice.read = real_read
    after_init_reads = sum(reads)
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    losses = []
    for step in range(3):
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(100 * step + torch.distributed.get_rank()))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return meta, after_init_reads, state, losses


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(llama_config())
    model.save_pretrained(tmp / "single")
    model.save_pretrained(tmp / "sharded", max_shard_size="20KB")
    assert (tmp / "sharded" / "model.safetensors.index.json").exists()
    return tmp, {k: v.clone() for k, v in model.state_dict().items()}, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("form", ["single", "sharded"])
def test_from_pretrained_reads_only_this_ranks_slices_and_trains_as_the_eager_model(saved, form):
    tmp, weights, total = saved
    lins = run(loaded, 4, str(tmp / form), P4, True, gpus_per_node=2)
    eager = run(loaded, 4, str(tmp / form), P4, False, gpus_per_node=2)
    for (meta, read, state, losses), (_, _, _, eager_losses) in zip(lins, eager):
        assert meta and 0 < read <= total / 2  # P sharded 4 ways: a quarter, plus whole rows at the edges
        assert all(torch.equal(state[k], weights[k]) for k in weights)
        assert losses == eager_losses  # each rank its own batches


def test_a_replicated_plan_reads_every_weight_once_per_rank(saved):
    tmp, weights, total = saved
    meta, read, state, _ = run(loaded, 2, str(tmp / "single"), REPLICATED, True, gpus_per_node=2)[0]
    assert meta and read == total and all(torch.equal(state[k], weights[k]) for k in weights)


# --- a model built on the meta device outside the context; the Trainer form; checkpoints ---------------------
def other_forms(path, ckpt):
    import deepspeed

    cfg = ds_config(P4)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(llama_config())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    inv_freq = engine.module.model.rotary_emb.inv_freq.clone()
    x = torch.randint(0, 96, (2, 8))
    finite = torch.isfinite(engine(input_ids=x, labels=x).loss).item()
    engine.save_checkpoint(ckpt)
    saved_state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    # TrainingArguments(deepspeed=<lins config>) alive: from_pretrained builds sharded by itself
    args = transformers.TrainingArguments(output_dir=os.path.dirname(ckpt), deepspeed=cfg, report_to=[],
                                          per_device_train_batch_size=2)
    eager = not any(p.is_meta for p in transformers.AutoModelForCausalLM.from_pretrained(path).parameters())
    del args  # a tiny model: whole on every rank, unless lins.sharded_load says otherwise
    args = transformers.TrainingArguments(output_dir=os.path.dirname(ckpt), report_to=[], per_device_train_batch_size=2,
                                          deepspeed={**cfg, "lins": {**cfg["lins"], "sharded_load": True}})
    trainer_meta = eager and all(p.is_meta for p in transformers.AutoModelForCausalLM.from_pretrained(path).parameters())
    del args
    with lins_ds.init(config=cfg):  # a layout-free Lins checkpoint loads into a model built this way
        model = transformers.LlamaForCausalLM(llama_config())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(P2))
    engine.load_checkpoint(ckpt)
    state = engine.module.state_dict()
    restored = all(torch.equal(state[k], saved_state[k]) for k in saved_state)
    engine.destroy()
    return inv_freq, finite, trainer_meta, restored


def test_meta_model_trainer_form_and_checkpoints(saved, tmp_path):
    tmp, _, _ = saved
    inv_freq, finite, trainer_meta, restored = run(other_forms, 4, str(tmp / "single"), str(tmp_path / "ckpt"),
                                                   gpus_per_node=2)[0]
    expected = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))  # head_dim 8, rope_theta 10000
    assert torch.allclose(inv_freq, expected) and finite
    assert trainer_meta and restored


# --- host memory while building ------------------------------------------------------------------------------
def build_rss(sharded: bool):
    """Peak RSS this rank adds while building a ~0.5 GB fp32 model and deepspeed.initialize with P in 4."""
    import deepspeed

    cfg = ds_config(P4)
    big = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=16000, max_position_embeddings=64)
    base = reset_peak_rss()
    torch.manual_seed(0)
    if sharded:
        with lins_ds.init(config=cfg):
            model = transformers.LlamaForCausalLM(big)
    else:
        model = transformers.LlamaForCausalLM(big)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    peak = peak_rss()
    size = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * 4
    largest = max(getattr(p, "ds_numel", p.numel()) for p in model.parameters()) * 4
    engine.destroy()
    return peak - base, size, largest


def peak_rss() -> int:
    """This process's peak resident set in bytes (Linux's VmHWM; else getrusage's maximum)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> int:
    """Start a new peak from here (a forked worker inherits its parent's); returns the current peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # Linux: the peak resident set becomes the current one
    except OSError:
        pass
    return peak_rss()


def test_host_memory_of_a_sharded_build_is_a_fraction_of_an_eager_one():
    eager = run(build_rss, 4, False, gpus_per_node=2)
    lins = run(build_rss, 4, True, gpus_per_node=2)
    assert 0.4e9 < eager[0][1] < 0.7e9
    for (grown, _, largest), (eager_grown, _, _) in zip(lins, eager):
        # this rank's quarter and what the build keeps besides, plus one parameter whole while the eager
        # initialisation is replayed (lins.init "eager"; "per_module" stays under 0.4 alone: 217 of 699 MB)
        assert grown < 0.4 * eager_grown + largest, (grown, eager_grown, largest)


# --- issue 58: a rank's from_pretrained decides alone; deepspeed.initialize makes the ranks agree ------------------
def one_rank_loads(path, out_dir, cfg):
    """A Lins TrainingArguments alive, rank 0 alone calls from_pretrained (an evaluation after training), then
    every rank meets at a collective."""
    args = transformers.TrainingArguments(output_dir=out_dir, deepspeed=cfg, report_to=[],  # noqa: F841
                                          per_device_train_batch_size=2)
    rank = torch.distributed.get_rank()
    state = None
    if rank == 0:
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        state = None if any(p.is_meta for p in model.parameters()) else model.state_dict()
    met = [None, None]
    torch.distributed.all_gather_object(met, ("met", rank))
    return state, met


def test_one_rank_alone_loads_while_a_lins_training_arguments_is_alive(saved, tmp_path):
    tmp, weights, _ = saved
    (state, met), (_, met1) = run(one_rank_loads, 2, str(tmp / "single"), str(tmp_path), ds_config(P2),
                                  gpus_per_node=2, timeout=120)
    assert met == met1 == [("met", 0), ("met", 1)]
    assert state is not None and all(torch.equal(state[k], weights[k]) for k in weights)  # loaded whole: it fits


def loads_then_trains(path, out_dir, how):
    """Every rank: from_pretrained with a Lins TrainingArguments alive, then deepspeed.initialize with a client
    optimizer built before (as the HF Trainer does) and three steps. ``how``: "eager" / "sharded" (every rank), "mixed" (rank 1
    finds its whole copy does not fit, as a rank measuring after another had loaded may), "mixed-resized" (the ranks
    with whole copies resize them). What initialize raised, else (deferred, state after initialize, losses)."""
    import deepspeed

    from lins_ds.integrations import sharded_init

    rank = torch.distributed.get_rank()
    cfg = ds_config(P2)
    del cfg["optimizer"]
    lins = {**cfg["lins"], "sharded_load": {"eager": False, "sharded": True}.get(how)}
    if how.startswith("mixed") and rank == 1:
        sharded_init.EAGER_SHARE = 0.0
    args = transformers.TrainingArguments(output_dir=out_dir, deepspeed={**cfg, "lins": lins},  # noqa: F841
                                          report_to=[], per_device_train_batch_size=2)
    torch.manual_seed(5)  # the missing keys' initialisation on ranks that load whole
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    deferred = any(p.is_meta for p in model.parameters())
    if how == "mixed-resized" and not deferred:
        model.resize_token_embeddings(100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    state = {k: v.clone() for k, v in engine.module.state_dict().items()}
    losses = []
    for step in range(3):
        x = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.destroy()
    return deferred, state, losses


@pytest.fixture(scope="module")
def headless(saved):
    """The tiny LLaMA's checkpoint without lm_head.weight: a key every load initialises."""
    from safetensors.torch import load_file, save_file

    tmp, _, _ = saved
    out = tmp / "headless"
    transformers.LlamaForCausalLM(llama_config()).config.save_pretrained(out)
    weights = load_file(tmp / "single" / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("form", ["single", "headless"])
def test_ranks_that_load_differently_start_alike_at_deepspeed_initialize(saved, headless, form, tmp_path):
    tmp, _, _ = saved
    path = str(headless if form == "headless" else tmp / form)
    mixed = run(loads_then_trains, 2, path, str(tmp_path), "mixed", gpus_per_node=2, timeout=240)
    assert [deferred for deferred, _, _ in mixed] == [False, True]
    # a checkpoint with every key: the values every load gives; one without lm_head: that of the ranks loading sharded
    reference = run(loads_then_trains, 2, path, str(tmp_path), "eager" if form == "single" else "sharded",
                    gpus_per_node=2, timeout=240)
    for (_, state, losses), (_, ref_state, ref_losses) in zip(mixed, reference):
        assert set(state) == set(ref_state) and all(torch.equal(state[k], ref_state[k]) for k in ref_state)
        assert losses == ref_losses


def test_ranks_whose_models_differ_fail_together_at_deepspeed_initialize(saved, tmp_path):
    tmp, _, _ = saved
    errors = run(loads_then_trains, 2, str(tmp / "single"), str(tmp_path), "mixed-resized", gpus_per_node=2,
                 timeout=240)
    for error in errors:
        assert isinstance(error, str) and "LinsConfigError" in error and "lins.sharded_load" in error, error


# --- a sharded load's state_dict is readable before deepspeed.initialize (TRL hashes it) --------------------------
def read_before_initialize(path, lora):
    import deepspeed
    from trl.trainer.utils import hash_module

    cfg = ds_config(P2)
    with lins_ds.init(config=cfg):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    meta = all(p.is_meta for p in model.parameters())
    before = {k: v.cpu() for k, v in model.state_dict().items()}  # each entry computed as it is read
    digest = hash_module(model)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-3), config=cfg)
    after = {k: v.clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return meta, before, after, digest


@pytest.mark.parametrize("form,lora", [("single", False), ("headless", False), ("headless", True)],
                         ids=["checkpoint", "missing-key", "missing-key-lora"])
def test_a_sharded_loads_state_dict_holds_the_values_initialize_gives(saved, headless, form, lora):
    pytest.importorskip("trl")
    from trl.trainer.utils import hash_module

    tmp, weights, _ = saved
    path = str(headless if form == "headless" else tmp / form)
    for meta, before, after, digest in run(read_before_initialize, 2, path, lora, gpus_per_node=2, timeout=240):
        assert meta and set(before) == set(after)
        assert all(torch.equal(before[k], after[k]) for k in after)
        if form == "single":
            assert digest == hash_module(transformers.AutoModelForCausalLM.from_pretrained(path))
