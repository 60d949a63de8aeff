"""Memory truth at another length (issue 61): eager attention keeps seq x seq tensors, so a profile measured at one
length and re-sized for another must grow those as the square of the length. On CPU the probe counts saved tensors
exactly, so a re-sized profile is held to a direct measurement at the new length."""

import pytest
import torch

from lins_ds.plan import Layout, MemorySpec, Topology, TrainingSpec, Factor
from lins_ds.plan.memory import FIELDS, ActivationProfile, fitted, formula_activations, memory
from lins_ds.plan.model import from_hf_config

transformers = pytest.importorskip("transformers")

GEMMA2 = dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=4096, max_position_embeddings=512,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=512)
LLAMA = dict(model_type="llama", hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=512, max_position_embeddings=512)


def build(cfg: dict, attn: str):
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def probe(model, seq: int, fit: bool = True):
    from lins_ds.runtime.memory import memory_probe

    run = memory_probe.probe if fit else memory_probe._probe_once
    return run(model, list(model.model.layers), 2, seq, model.config.vocab_size, torch.device("cpu"))


def close(a: ActivationProfile, b: ActivationProfile, rel: float) -> list:
    return [k for k in FIELDS if abs(getattr(a, k) - getattr(b, k)) > rel * getattr(b, k)]


@pytest.mark.parametrize("cfg,attn", [(GEMMA2, "eager"), (LLAMA, "eager"), (LLAMA, "sdpa")],
                         ids=["gemma2-eager", "llama-eager", "llama-sdpa"])
def test_a_profile_resized_to_4x_and_8x_its_length_equals_a_measurement_there(cfg, attn):
    model = build(cfg, attn)
    base = probe(model, 64)
    for seq in (256, 512):
        direct = probe(model, seq, fit=False)
        resized = base.scaled(2 * seq, seq)
        assert not close(resized, direct, 0.02), (seq, resized, direct)
    linear = ActivationProfile(base.source, base.tokens, *(getattr(base, k) for k in FIELDS))  # the old stretch
    if attn == "eager":
        assert base.quadratic[0] > 0.1 * base.layer_saved  # a sixth to a quarter of a layer at 64 tokens
        assert close(linear.scaled(1024), direct, 0.2)  # a linear stretch misses them by far
    else:
        assert base.quadratic == (0.0,) * 4


def test_fit_splits_linear_and_quadratic_terms_exactly():
    def at(seq):  # a L + b L^2 per sequence, micro-batch 2
        return ActivationProfile("t", 2 * seq, *(2 * (a * seq + b * seq * seq) for a, b in
                                                 ((10, 3), (4, 0), (7, 1), (100, 0.5))), seq_len=seq)
    prof = fitted(at(1024), at(512))
    assert prof.quadratic == pytest.approx((2 * 3 * 1024**2, 0.0, 2 * 1 * 1024**2, 2 * 0.5 * 1024**2))
    for seq in (300, 4096, 8192):
        got, want = prof.scaled(2 * seq, seq), at(seq)
        assert [getattr(got, k) for k in FIELDS] == pytest.approx([getattr(want, k) for k in FIELDS], rel=1e-9), seq
    with pytest.raises(ValueError, match="not one micro-batch at two lengths"):
        fitted(at(512), at(1024))


def test_profile_json_round_trips_and_reads_old_caches():
    prof = ActivationProfile("m", 128, 1.0, 2.0, 3.0, 4.0, seq_len=64, quadratic=(0.5, 0.0, 0.25, 1.0))
    assert ActivationProfile.from_json(prof.to_json()) == prof
    old = {"source": "m", "tokens": 128, "layer_saved": 1.0, "layer_saved_ckpt": 2.0, "layer_transient": 3.0,
           "head_peak": 4.0}
    assert ActivationProfile.from_json(old).scaled(256).layer_saved == 2.0  # no length known: linear, as before


def test_the_formula_knows_eager_attention_and_soft_capping():
    gemma = from_hf_config(GEMMA2, "gemma2")  # transformers runs gemma2 eagerly only
    assert gemma.attention == "eager" and gemma.attn_softcap and gemma.attention_masks == 2
    llama = from_hf_config(LLAMA, "llama")
    assert llama.attention == "sdpa" and llama.eager_score_bytes(2) == 0
    assert from_hf_config({**LLAMA, "_attn_implementation": "eager"}, "l").eager_score_bytes(2) == 4 * (4 + 2)
    assert gemma.eager_score_bytes(2) == 4 * (4 + 2 + 2)
    short, long = (formula_activations(gemma, TrainingSpec(seq, 1, param_dtype="bf16")) for seq in (2048, 8192))
    assert long.layer_saved / short.layer_saved > 4 * 1.5  # well past linear: the scores dominate at 8k
    resized = short.scaled(8192, 8192)
    assert [getattr(resized, k) for k in FIELDS] == pytest.approx([getattr(long, k) for k in FIELDS])


def test_the_formula_matches_the_probes_eager_scores_on_cpu():
    """What eager attention keeps per layer, modelled, against what autograd saved (fp32 on CPU)."""
    model = build(GEMMA2, "eager")
    measured = probe(model, 128)
    spec = from_hf_config({**GEMMA2, "_attn_implementation": "eager"}, "g")
    modelled = formula_activations(spec, TrainingSpec(128, 2, param_dtype="fp32"))
    assert modelled.quadratic[0] == pytest.approx(measured.quadratic[0], rel=0.15)


def test_a_resize_plans_for_the_quadratic_growth():
    """The plan's predicted activation memory at 4x the length, from a profile taken at the start-up length."""
    spec = from_hf_config(GEMMA2, "gemma2")
    topo, layout = Topology(1, 1), Layout(Factor(1, 1), Factor(1, 1), Factor(1, 1))
    start = formula_activations(spec, TrainingSpec(2048, 1, param_dtype="bf16"))
    mem = MemorySpec(1000.0)
    at = {seq: memory(spec, TrainingSpec(seq, 1, param_dtype="bf16"), mem, topo, layout, 0, start).terms["activations"]
          for seq in (2048, 8192)}
    direct = memory(spec, TrainingSpec(8192, 1, param_dtype="bf16"), mem, topo, layout, 0, None).terms["activations"]
    assert at[8192] == pytest.approx(direct) and at[8192] > 6 * at[2048]
