"""LinsEngine trains exactly like a single process on the global batch, under every valid plan."""

import pytest
import torch

import lins_ds  # noqa: F401  (routes deepspeed.initialize to LinsEngine)
from helpers import GAS, GPUS_PER_NODE, MB, MODELS, SEQ, STEPS, WORLD, batch, param_groups, reference, run
from lins_ds.plan import Topology, TrainingSpec, candidates
from lins_ds.plan.cost import schedule

transformers = pytest.importorskip("transformers")


def ds_config(plan, dtype="fp32"):
    cfg = {"train_micro_batch_size_per_gpu": MB, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "zero_optimization": {"stage": 0}, "steps_per_print": 1000,
           "lins": {"plan": plan, "gpus_per_node": GPUS_PER_NODE}}
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_plans(name, ref, plans):
    import deepspeed
    from lins_ds import comm

    rank = torch.distributed.get_rank()
    make_model, vocab = MODELS[name]
    results = []
    for plan in plans:
        model = make_model()
        engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(param_groups(model)),
                                                 config=ds_config(plan))
        errors, recorded = [], None
        for step in range(STEPS):
            with comm.recording() as rec:
                for micro in range(GAS):
                    x = batch(step, micro, rank, vocab)
                    engine.backward(engine(input_ids=x, labels=x).loss)
                    engine.step()
            recorded = recorded or rec.counts()
            state = engine.module.state_dict()
            errors.append(max((state[k].float() - v.float()).abs().max().item() for k, v in ref[step].items()))
        expected = {}
        train = TrainingSpec(SEQ, MB, GAS, "fp32")
        for c in schedule(engine.lins.topo, engine.lins.layout, engine.lins.unit_sizes(), train):
            key = (c.op, c.group, c.nbytes)
            expected[key] = expected.get(key, 0) + c.calls
        results.append((plan, errors, recorded, expected, type(engine).__name__, engine.get_global_grad_norm()))
        engine.destroy()
    return results


def as_config(layout):
    return {s: [f.intra, f.inter] for s, f in layout.factors().items()}


ALL_PLANS = [as_config(lay) for lay in candidates(Topology(WORLD // GPUS_PER_NODE, GPUS_PER_NODE))]


def check(results):
    for plan, errors, recorded, expected, engine_name, norm in results:
        assert engine_name == "LinsEngine"
        assert max(errors) <= 1e-5, (plan, errors)
        assert recorded == expected, (plan, recorded, expected)
        assert norm is not None and norm > 0


def trained(name, plans):
    """Every rank's results of ``plans`` on model ``name`` (the reference computed here, once, before the fork)."""
    return run(train_plans, WORLD, name, reference(name), plans, gpus_per_node=GPUS_PER_NODE)


def test_all_ten_plans_match_single_process_reference():
    assert len(ALL_PLANS) == 10
    for rank_results in trained("llama", ALL_PLANS):
        check(rank_results)


def test_tied_weights_and_odd_vocabulary():
    for rank_results in trained("llama-tied-97", [ALL_PLANS[0], ALL_PLANS[4], ALL_PLANS[-1]]):
        check(rank_results)


def test_frozen_parameters():
    for rank_results in trained("llama-frozen", [ALL_PLANS[0], ALL_PLANS[5], ALL_PLANS[-1]]):
        check(rank_results)
