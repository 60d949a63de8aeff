"""LinsEngine features a DeepSpeed user relies on, each checked against DeepSpeed itself or a reference."""

import sys

import pytest
import torch

import lins_ds  # noqa: F401
from helpers import (GPUS_PER_NODE, MODELS, WORLD, allow_fp16_on_this_cpu, bad_config, batch, config, max_err,
                     param_groups, reference, run, state, tiny_llama, train)
from lins_ds.runtime.step.unit import ParamState
from test_engine_parity import ALL_PLANS

transformers = pytest.importorskip("transformers")
P_SHARDED = {"p": [2, 1], "g": [2, 2], "os": [2, 2]}
ALL_SHARDED = {"p": [2, 2], "g": [2, 2], "os": [2, 2]}
REPLICATED = {"p": [1, 1], "g": [1, 1], "os": [1, 1]}


# --- bf16 -------------------------------------------------------------------------------------
def bf16_errors(ref, plans, accum=None):
    import deepspeed

    errs = {}
    bf16 = dict(bf16={"enabled": True}, **({"data_types": {"grad_accum_dtype": accum}} if accum else {}))
    runs = [("zero1", config(zero_optimization={"stage": 1}, **bf16))]
    runs += [(str(p), config({"plan": p}, **bf16)) for p in plans]
    for name, cfg in runs:
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)), config=cfg)
        states = train(engine, after_step=state)
        errs[name] = max(max_err(s, r) for s, r in zip(states, ref))
        engine.destroy()
    return errs


def test_bf16_every_plan_within_zero1_bf16_tolerance():
    errs = run(bf16_errors, WORLD, reference("llama"), ALL_PLANS, gpus_per_node=GPUS_PER_NODE)[0]
    zero1 = errs.pop("zero1")
    assert zero1 > 0
    for plan, err in errs.items():
        assert err <= 1.5 * zero1, (plan, err, zero1)


def test_bf16_with_fp32_gradient_accumulation_within_zero1_tolerance():
    """data_types.grad_accum_dtype fp32: DeepSpeed's BF16_Optimizer for ZeRO-1, fp32 g_acc for Lins."""
    errs = run(bf16_errors, WORLD, reference("llama"), [P_SHARDED, ALL_SHARDED, REPLICATED], "fp32",
               gpus_per_node=GPUS_PER_NODE)[0]
    zero1 = errs.pop("zero1")
    assert zero1 > 0
    for plan, err in errs.items():
        assert err <= 1.5 * zero1, (plan, err, zero1)


# --- fp16 dynamic loss scaling ---------------------------------------------------------------------
def fp16_run(plan):
    import deepspeed

    allow_fp16_on_this_cpu()
    results = {}
    # DeepSpeed's ZeRO-1 is the comparison: its optimizer scales the loss through the same engine path.
    for name, cfg in (("ds", config(zero_optimization={"stage": 1}, fp16={"enabled": True, "initial_scale_power": 20})),
                      ("lins", config({"plan": plan}, fp16={"enabled": True, "initial_scale_power": 20}))):
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)), config=cfg)
        before = state(engine)
        scales, changed = [], []
        for _ in range(8):
            train(engine, steps=1)
            now = state(engine)
            changed.append(max_err(now, before) > 0)
            before = now
            scales.append(engine._get_optimizer_loss_scale())
        results[name] = (engine.skipped_steps, scales, changed, engine.global_steps)
        engine.destroy()
    return results


@pytest.mark.parametrize("plan", [REPLICATED, ALL_SHARDED], ids=["replicated", "sharded"])
def test_fp16_overflow_skips_step_like_deepspeed(plan):
    res = run(fp16_run, WORLD, plan, gpus_per_node=GPUS_PER_NODE)[0]
    skipped, scales, changed, steps = res["lins"]
    assert skipped > 0 and steps == 8
    assert res["lins"][:3] == res["ds"][:3], res  # the same steps overflow, the same scales, as in ZeRO-1 fp16
    assert not changed[0] and changed[-1]  # a skipped step leaves the parameters alone; later steps apply


# --- optimizer and scheduler from the config; client scheduler ------------------------------------------
def schedulers(plan):
    import deepspeed

    out = {}
    sched = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 3}}
    optim = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1, "torch_adam": True}}
    for name, lins in (("ds", None), ("lins", {"plan": plan})):
        engine, _, _, lr_sched = deepspeed.initialize(model=tiny_llama(), config=config(lins, optimizer=optim,
                                                                                        scheduler=sched))
        lrs = train(engine, after_step=lambda e: e.get_lr()[0])
        out[name] = (lrs, state(engine), type(lr_sched).__name__)
        engine.destroy()
    model = tiny_llama()
    opt = torch.optim.AdamW(param_groups(model))
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    engine, _, _, lr_sched = deepspeed.initialize(model=model, optimizer=opt, lr_scheduler=lam,
                                                  config=config({"plan": plan}))
    out["client"] = (train(engine, after_step=lambda e: [g["lr"] for g in e.optimizer.param_groups]),)
    engine.destroy()
    return out


def test_config_optimizer_and_schedulers():
    out = run(schedulers, WORLD, ALL_SHARDED, gpus_per_node=GPUS_PER_NODE)[0]
    assert out["lins"][0] == out["ds"][0] and out["lins"][0][0] < out["lins"][0][-1]
    assert out["lins"][2] == out["ds"][2] == "WarmupLR"
    assert max_err(out["lins"][1], out["ds"][1]) <= 1e-5
    lrs = out["client"][0]
    assert [round(x, 8) for x in lrs[1]] == [round(1e-3 / 3, 8), round(2e-3 / 3, 8)]


# --- gradient checkpointing, GPT-2, eval/no_grad ------------------------------------------------------
HF_MODELS = ("llama-ckpt", "llama-ckpt-nonreentrant", "gpt2-ckpt")


def hf_models(refs, plans):
    import deepspeed

    out = []
    for label in HF_MODELS:
        make, ref = MODELS[label][0], refs[label]
        for plan in plans:
            model = make()
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                              config=config({"plan": plan}))
            states = train(engine, after_step=state)
            err = max(max_err(s, r) for s, r in zip(states, ref))
            # eval and no_grad forwards see the full, current parameters
            x = batch(99, 0, 0, 96)
            engine.eval()
            with torch.no_grad():
                logits = engine(input_ids=x).logits
            ref_model = make()
            ref_model.load_state_dict(states[-1])
            ref_model.eval()
            with torch.no_grad():
                ref_logits = ref_model(input_ids=x).logits
            engine.train()
            train(engine, steps=1)  # training goes on after an eval forward
            out.append((label, str(plan), err, (logits - ref_logits).abs().max().item()))
            engine.destroy()
    return out


def test_hf_models_with_gradient_checkpointing_and_eval():
    refs = {label: reference(label) for label in HF_MODELS}
    for label, plan, err, eval_err in run(hf_models, WORLD, refs, [P_SHARDED, ALL_SHARDED], gpus_per_node=GPUS_PER_NODE)[0]:
        assert err <= 1e-5, (label, plan, err)
        assert eval_err <= 1e-5, (label, plan, eval_err)


def every_other_layer_run():
    import deepspeed

    model = tiny_llama(layers=4)
    model.activation_checkpointing_enable(every_n_layers=2,
                                          activation_checkpointing_kwargs={"use_reentrant": False, "preserve_rng_state": False})
    own = model.model.layers[0]._gradient_checkpointing_func
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config({"plan": "solve", "profile": "synthetic", "seq_len": 8}))
    train(engine, steps=2)
    flags = [layer.gradient_checkpointing for layer in model.model.layers]
    funcs = [layer._gradient_checkpointing_func is own for layer in model.model.layers if layer.gradient_checkpointing]
    k = engine.lins.plan.activation_checkpointing_units
    engine.destroy()
    return flags, k, funcs


def test_a_model_checkpointing_every_other_layer_keeps_those_layers_under_a_solved_plan():
    """transformers' ``activation_checkpointing_enable(every_n_layers=2)`` checkpoints layers 0 and 2 of 4: the
    solver takes that count as the model's, and the engine keeps those layers (it used to count the leading run,
    one, and turn layer 2's checkpointing off). They keep the model's checkpoint function too, built from its
    ``activation_checkpointing_kwargs`` (and ``offload=True``, which the engine used to replace with its own)."""
    import inspect

    import transformers

    enable = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", lambda: None)
    if "every_n_layers" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers has no every_n_layers")
    flags, k, funcs = run(every_other_layer_run, WORLD, gpus_per_node=GPUS_PER_NODE)[0]
    assert k == 2 and flags == [True, False, True, False], (k, flags)
    assert funcs == [True, True], funcs


def test_the_model_s_checkpoint_function_outlives_a_plan_that_turns_its_layers_off():
    """``recompute.apply`` across plans (a relayout to another k): after a plan with k = 0, a later k = 2 still runs
    the function the model was given; after ``activation_checkpointing_disable`` (which leaves the bare
    ``checkpoint``), the engine's non-reentrant one."""
    import functools
    import inspect

    from lins_ds.runtime.step import recompute

    enable = getattr(transformers.PreTrainedModel, "activation_checkpointing_enable", None)
    if enable is None or "activation_checkpointing_kwargs" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers has no activation_checkpointing_enable")
    model = tiny_llama(layers=4)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False,
                                                                          "preserve_rng_state": False})
    own = model.model.layers[0]._gradient_checkpointing_func
    units = [[layer] for layer in model.model.layers]
    recompute.apply(units, 0)
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)
    recompute.apply(units, 2)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, True, False, False]
    assert all(layer._gradient_checkpointing_func is own for layer in model.model.layers[:2])
    with recompute.disabled(model.model.layers[0]):  # the memory probe's way round: the same function after
        assert not model.model.layers[0].gradient_checkpointing
    assert model.model.layers[0].gradient_checkpointing and model.model.layers[0]._gradient_checkpointing_func is own
    model.activation_checkpointing_disable()
    recompute.apply(units, 1)
    func = model.model.layers[0]._gradient_checkpointing_func
    assert isinstance(func, functools.partial) and func.keywords == {"use_reentrant": False}, func


@pytest.mark.gpu
def test_a_model_s_activation_offload_still_frees_gpu_memory_under_a_solved_plan(monkeypatch):
    """On a GPU: transformers' ``activation_checkpointing_enable(offload=True)`` holds what its checkpointed layers
    save in pinned host memory. Under a solved Lins plan the step's peak falls by as much as without DeepSpeed (the
    engine used to put its own checkpoint function in the layers, and the offload was lost, silently)."""
    import gc

    import deepspeed

    from helpers import free_port

    import inspect

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if "offload" not in inspect.signature(getattr(transformers.PreTrainedModel, "activation_checkpointing_enable",
                                                  lambda: None)).parameters:
        pytest.skip("this transformers cannot offload checkpointed activations")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    deepspeed.init_distributed("nccl")
    x = torch.randint(0, 1024, (4, 2048), device="cuda")

    def peak(offload: bool, lins: bool) -> int:
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
            vocab_size=1024, max_position_embeddings=2048))
        model.activation_checkpointing_enable(offload=offload)
        if lins:
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config={
                "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                "zero_optimization": {"stage": 0}, "lins": {"plan": "solve", "profile": "synthetic", "seq_len": 2048}})
            assert engine.lins.plan.activation_checkpointing_units == 8  # the model's own count, kept

            def step():
                engine.backward(engine(input_ids=x, labels=x).loss)
                engine.step()
        else:
            model.cuda()
            opt = torch.optim.AdamW(model.parameters())

            def step():
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        got = torch.cuda.max_memory_allocated()
        if lins:
            engine.destroy()
        return got

    def fresh_peak(offload: bool, lins: bool) -> int:
        got = peak(offload, lins)
        gc.collect()
        torch.cuda.empty_cache()
        return got

    try:
        plain = fresh_peak(False, False) - fresh_peak(True, False)
        lins = fresh_peak(False, True) - fresh_peak(True, True)
    finally:
        deepspeed.comm.destroy_process_group()
    print(f"step peak freed by the offload: {plain / 2**20:.0f} MiB without DeepSpeed, {lins / 2**20:.0f} MiB under Lins")
    assert plain > 16 * 2**20, plain  # at least one layer's saved input (4 x 2048 x 512 fp32: 16 MiB) off the peak
    assert lins > 0.8 * plain, (lins, plain)


# --- solve at start-up ---------------------------------------------------------------------------
def solve_run():
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config({"plan": "solve", "gpu_memory_gb": 0.0004, "reserved_gb": 0, "seq_len": 8, "profile": "synthetic",
                                                     "activation_checkpointing": False}))
    losses = []
    for step in range(6):
        x = batch(0, 0, torch.distributed.get_rank(), 96)  # the same batch: loss must fall
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    layout = engine.lins.plan.layout
    engine.destroy()
    return str(layout), engine.lins.plan.digest(), losses


def test_solve_gives_every_rank_the_same_plan_and_trains():
    res = run(solve_run, WORLD, gpus_per_node=GPUS_PER_NODE)
    assert len({r[1] for r in res}) == 1
    assert res[0][0] != "P=1x1 G=1x1 OS=1x1"  # the budget forced some sharding
    assert all(r[2][-1] < r[2][0] for r in res)


# --- bad input: clear errors on every rank, before any group exists ---------------------------------------
@pytest.mark.parametrize("lins,stage,needle", [
    ({"plan": {"p": [3, 1], "g": [2, 1], "os": [2, 1]}}, 0, "lins.plan.p: intra factor 3 does not divide gpus_per_node 2"),
    ({"plan": {"p": [1, 1], "g": [1, 2], "os": [2, 2]}}, 0, "crosses nodes without filling one"),
    ({"plan": {"p": [2, 1], "g": [1, 1], "os": [2, 1]}}, 0, "must divide lins.plan.g"),
    ({"plan": "solve", "bucket": 3}, 0, "lins.bucket: unknown key"),
    ({"plan": "solve", "gpu_memory_gb": "auto"}, 0, "lins.gpu_memory_gb: \"auto\" is not accepted"),
    ({"plan": "solve"}, 2, "zero_optimization.stage: 2 with lins enabled"),
    ({"plan": "solve", "gpus_per_node": 3}, 0, "lins.gpus_per_node: 3 does not divide the world size 4"),
], ids=["divide", "fill-node", "nesting", "unknown-key", "auto", "zero-stage", "node-size"])
def test_bad_config_is_named_with_its_key_value_and_rule(lins, stage, needle):
    """The rules LinsEngine checks before any process group of its own exists (in-process: they need only the
    launch's world size and GPUs per node)."""
    from lins_ds.integrations.engine import validate
    from lins_ds.plan import PlanError

    with pytest.raises(PlanError) as e:
        validate(config(lins), stage, WORLD, GPUS_PER_NODE)
    assert needle in str(e.value)


def test_bad_config_fails_on_every_rank_before_any_lins_group():
    for msg in run(bad_config, WORLD, {"plan": {"p": [3, 1], "g": [2, 1], "os": [2, 1]}}, {},
                   gpus_per_node=GPUS_PER_NODE):
        assert msg.endswith("Error: lins.plan.p: intra factor 3 does not divide gpus_per_node 2"), msg


class SignMomentum(torch.optim.Optimizer):
    """A user's own element-wise optimizer (not one Lins knows by class)."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    m = self.state[p].setdefault("m", torch.zeros_like(p))
                    p.sub_(group["lr"] * m.mul_(0.9).add_(p.grad).sign())


class Lamb(torch.optim.Optimizer):
    """Per-tensor trust ratio: not element-wise. Named like nothing Lins knows; one named "AdamW" would fail too."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    update = p.grad / (p.grad.norm() + 1e-8)
                    p.sub_(group["lr"] * (p.norm() / (update.norm() + 1e-8)) * update)


class AdamW(Lamb):
    """A non-element-wise class that borrows a known name."""


def optimizer_verdicts():
    import deepspeed

    out = {}
    for label, make, lins in (("sign-momentum", SignMomentum, {}), ("lamb", Lamb, {}),
                              ("named-adamw", AdamW, {}), ("lbfgs", torch.optim.LBFGS, {}),
                              ("lamb-declared", Lamb, {"elementwise_optimizer": True})):
        model = tiny_llama()
        try:
            engine, *_ = deepspeed.initialize(model=model, optimizer=make(model.parameters()),
                                              config=config({"plan": REPLICATED, **lins}))
            train(engine, steps=1)
            engine.destroy()
            out[label] = "accepted"
        except Exception as e:  # noqa: BLE001
            out[label] = str(e)
    return out


def test_element_wise_is_what_an_optimizer_does_not_what_it_is_called():
    for verdicts in run(optimizer_verdicts, 2, gpus_per_node=2):
        assert verdicts["sign-momentum"] == "accepted" and verdicts["lamb-declared"] == "accepted", verdicts
        for label in ("lamb", "named-adamw", "lbfgs"):
            assert "is not element-wise" in verdicts[label] and '"elementwise_optimizer": true' in verdicts[label], \
                verdicts[label]


def test_import_hook_survives_availability_probes():
    import subprocess

    code = ("import importlib.util, lins_ds, sys; importlib.util.find_spec('deepspeed'); "
            "assert 'deepspeed' not in sys.modules; import deepspeed; "
            "from lins_ds.integrations.deepspeed_patch import initialize; assert deepspeed.initialize is initialize")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def destroy_mid_training():
    import deepspeed

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                      config=config({"plan": P_SHARDED, "overlap_param_sync": True},
                                                    optimizer={"type": "AdamW",
                                                               "params": {"lr": 1e-3, "torch_adam": True}}))
    train(engine, steps=1)  # ends with the P-sync AllGathers in flight
    in_flight = sum(u.param_state is ParamState.SYNCING for u in engine.lins._units)
    engine.destroy()
    engine.destroy()  # idempotent, as DeepSpeed's __del__ calls it again
    waited = not any(u.param_state is ParamState.SYNCING for u in engine.lins._units)
    try:
        train(engine, steps=1)
    except RuntimeError as e:
        return in_flight, waited, str(e)
    return in_flight, waited, "trained after destroy"


def test_destroy_waits_for_in_flight_collectives_and_refuses_further_use():
    for in_flight, waited, msg in run(destroy_mid_training, WORLD, gpus_per_node=GPUS_PER_NODE):
        assert in_flight > 0 and waited
        assert "engine.destroy() was called" in msg


# --- lins.overlap_param_sync = false; lins.unit_modules ----------------------------------------------
def variant_runs(ref, lins_extra: dict, plans):
    import deepspeed

    out = []
    for plan in plans:
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                          config=config({"plan": plan, **lins_extra}))
        syncing = []
        states = train(engine, after_step=lambda e: (syncing.append(any(u.param_state is ParamState.SYNCING for u in e.lins._units)),
                                                     state(e))[1])
        out.append((str(plan), max(max_err(s, r) for s, r in zip(states, ref)), syncing,
                    [u.name for u in engine.lins._units]))
        engine.destroy()
    return out


def test_without_param_sync_overlap_the_step_waits_and_matches_the_reference():
    for plan, err, syncing, _ in run(variant_runs, WORLD, reference("llama"), {"overlap_param_sync": False},
                                     [P_SHARDED, ALL_SHARDED, {"p": [1, 1], "g": [2, 1], "os": [2, 2]}],
                                     gpus_per_node=GPUS_PER_NODE)[0]:
        assert err <= 1e-5, (plan, err)
        assert not any(syncing), plan  # every P-sync finished inside step(): nothing left in flight


def test_unit_modules_choose_the_units_and_train_exactly():
    res = run(variant_runs, WORLD, reference("llama"), {"unit_modules": ["LlamaMLP", "LlamaAttention"]},
              [P_SHARDED, ALL_SHARDED], gpus_per_node=GPUS_PER_NODE)[0]
    for plan, err, _, names in res:
        assert err <= 1e-5, (plan, err)
        assert names == ["root", "model.layers.0.self_attn", "model.layers.0.mlp", "model.layers.1.self_attn",
                         "model.layers.1.mlp"], names  # the norms stay in the root unit


def test_unit_modules_naming_no_class_of_the_model_fails_clearly():
    for msg in run(bad_config, WORLD, {"plan": P_SHARDED, "unit_modules": ["NoSuchBlock"]}, {},
                   gpus_per_node=GPUS_PER_NODE):
        assert "lins.unit_modules: no module of class ['NoSuchBlock'] in the model" in msg, msg


# --- the unit state machine ----------------------------------------------------------------------------
def wrong_transitions():
    """Transitions asked of units in states they do not start from are refused, naming unit and states."""
    import deepspeed

    from lins_ds.runtime.step.unit import GradState, UnitStateError

    model = tiny_llama()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                      config=config({"plan": ALL_SHARDED}))
    unit = engine.lins._units[1]
    refused = []
    for transition in (unit.finish_reduce, unit.finish_replica_reduce):
        try:
            transition()
        except UnitStateError as e:
            refused.append(str(e))
    train(engine, steps=1)  # the machine still drives a normal step
    states = {u.grad_state for u in engine.lins._units}
    engine.destroy()
    return refused, states == {GradState.ACCUMULATING}


def test_a_transition_from_the_wrong_state_is_refused():
    refused, clean = run(wrong_transitions, WORLD, gpus_per_node=GPUS_PER_NODE)[0]
    assert refused == ["lins: unit model.layers.0: finish_reduce from accumulating, expected reducing",
                       "lins: unit model.layers.0: finish_replica_reduce from accumulating, expected replica-reducing"]
    assert clean


# --- any Hugging Face model: modelled types and others ----------------------------------------------------------
def tiny_hf(kind: str):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64)
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    else:  # gpt_neox: not a type the planner reads; an odd vocabulary, which the start-up summary names
        cfg = transformers.GPTNeoXConfig(**dict(common, vocab_size=99), rotary_pct=0.5)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def against_zero1(make, fixed: dict) -> dict:
    """ZeRO-1, a solved plan and the fixed plan ``fixed`` (a lins block) on ``make()``'s model: label -> (the states
    after each step, what start-up printed)."""
    import contextlib
    import io

    import deepspeed

    out = {}
    for label, cfg in (("zero1", config(zero_optimization={"stage": 1})),
                       ("solve", config({"plan": "solve", "profile": "synthetic", "seq_len": 8})),
                       ("fixed", config(fixed))):
        model = make()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                              config=cfg)
        out[label] = (train(engine, after_step=state), printed.getvalue())
        engine.destroy()
    return out


def any_model_runs(kind):
    return against_zero1(lambda: tiny_hf(kind), {"plan": ALL_SHARDED})


@pytest.mark.parametrize("kind", ["mixtral", "gpt_neox"])
def test_any_hf_model_trains_under_solve_and_fixed_plans_like_zero1(kind):
    out = run(any_model_runs, WORLD, kind, gpus_per_node=GPUS_PER_NODE)[0]
    zero1 = out.pop("zero1")[0]
    for label, (states, printed) in out.items():
        assert max(max_err(s, r) for s, r in zip(states, zero1)) <= 1e-5, label
        assert "predicted" in printed, printed  # memory predicted for every plan
        if kind == "gpt_neox":
            assert "model_type 'gpt_neox' is not modelled" in printed and "counted on the model" in printed, printed
            assert "lins: note: lm_head (32 -> 99): a width not a multiple of 4 " in printed, printed  # fp32
        else:
            assert "lins: note:" not in printed, printed


class PlainLM(torch.nn.Module):
    """A language model written by hand: no ``config`` for the planner to read, a loss returned inside an object
    of the kind ``wrap`` makes (``SimpleNamespace``: neither pytree nor DeepSpeed look into it)."""

    def __init__(self, wrap):
        super().__init__()
        torch.manual_seed(0)
        self.wrap = wrap
        self.embed = torch.nn.Embedding(96, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(),
                                                              torch.nn.Linear(48, 32)) for _ in range(3))
        self.head = torch.nn.Linear(32, 96)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return self.wrap(loss=loss, logits=logits)


def plain_model_runs(wrap_name):
    import collections
    import types

    wrap = {"namedtuple": collections.namedtuple("Out", "loss logits"), "namespace": types.SimpleNamespace}[wrap_name]
    return against_zero1(lambda: PlainLM(wrap), {"plan": ALL_SHARDED, "seq_len": 8})


@pytest.mark.parametrize("wrap", ["namedtuple", "namespace"])
def test_a_model_without_config_returning_its_loss_in_any_object_trains_like_zero1(wrap):
    """No ``config``: the planner counts the model's parameters and takes one attention head (it used to refuse:
    "heads 0"). A loss inside a ``SimpleNamespace``: DeepSpeed hooks none of the output, so Lins hooks the tensors
    inside it (without that, G-sharded plans ended 1e-2 off and P-sharded ones failed in the backward)."""
    out = run(plain_model_runs, WORLD, wrap, gpus_per_node=GPUS_PER_NODE)[0]
    zero1 = out.pop("zero1")[0]
    for label, (states, printed) in out.items():
        assert max(max_err(s, r) for s, r in zip(states, zero1)) <= 1e-5, (label, printed)
        assert "predicted" in printed and "counted on the model" in printed, printed
