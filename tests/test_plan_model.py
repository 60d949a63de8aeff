import pytest

from lins_ds.plan import BUILTIN_MODELS, PlanError
from lins_ds.plan.model import from_hf_config

transformers = pytest.importorskip("transformers")


def _count(model, prefix):
    return sum(p.numel() for n, p in model.named_parameters() if n.startswith(prefix))


@pytest.mark.parametrize("kv_heads,tied", [(4, False), (2, True)])
def test_llama_counts_match_transformers(kv_heads, tied):
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=3, vocab_size=101,
                                   num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    spec = from_hf_config(cfg.to_dict(), "tiny")
    assert spec.layer_params() == _count(model, "model.layers.0.")
    assert spec.total_params() == sum(p.numel() for p in model.parameters())


def test_gpt2_counts_match_transformers():
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=99, n_positions=128)
    model = transformers.GPT2LMHeadModel(cfg)
    spec = from_hf_config(cfg.to_dict(), "tiny-gpt2")
    assert spec.layer_params() == _count(model, "transformer.h.0.")
    assert spec.total_params() == sum(p.numel() for p in model.parameters())


def test_llama_7b_has_6_7b_params():
    assert 6.7e9 < BUILTIN_MODELS["llama-7b"].total_params() < 6.8e9
    assert 32.4e9 < BUILTIN_MODELS["llama-30b"].total_params() < 32.6e9


def test_unsupported_model_type_is_named():
    with pytest.raises(PlanError, match="model_type 'bert' is not modelled"):
        from_hf_config({"model_type": "bert"}, "x")


TINY = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
HF_TYPES = {
    "MixtralConfig": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen2MoeConfig": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                       "shared_expert_intermediate_size": 40},
    "Qwen3MoeConfig": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24, "head_dim": 16},
    "GemmaConfig": {"head_dim": 16},
    "Gemma2Config": {"head_dim": 16},
    "Phi3Config": {"pad_token_id": 0},
    "Qwen3Config": {"head_dim": 16},
    "Gemma3TextConfig": {"head_dim": 16},
    "MistralConfig": {"head_dim": 16},  # heads x head_dim wider than hidden, as Mistral-NeMo's is narrower
    "LlamaConfig": {"head_dim": 16},
}


@pytest.mark.parametrize("cls", list(HF_TYPES))
def test_modelled_hf_types_count_every_parameter_of_the_real_model(cls):
    """The planner's description of each Hugging Face type it reads holds exactly as many parameters per layer
    and in the root as transformers' own model of that config."""
    transformers = pytest.importorskip("transformers")
    import torch

    config = getattr(transformers, cls)(**TINY, **HF_TYPES[cls])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    spec = from_hf_config(config.to_dict(), cls)
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    total = sum(p.numel() for p in model.parameters())
    assert spec.unit_params()[1:] == layers, (spec.unit_params(), layers)
    assert spec.total_params() == total, (spec.total_params(), total)


def test_the_start_up_summary_names_linear_layers_of_a_misaligned_width():
    """cuBLAS runs a GEMM over a width not a multiple of 16 bytes on slower kernels (an H200 at 0.12-0.36 of the
    aligned rate, bench/results/simulate/shapes/call27-28): the engine's summary names such layers and how to pad."""
    import torch
    import transformers

    from lins_ds.integrations.launch import gemm_dtype
    from lins_ds.runtime.startup.planning import misaligned_note

    def gpt2(vocab):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=vocab))

    note = misaligned_note(gpt2(50257), torch.bfloat16)
    assert note.startswith("\nlins: note: lm_head (32 -> 50257): a width not a multiple of 8 "), note
    assert "pad_to_multiple_of=64" in note
    assert misaligned_note(gpt2(50264), torch.bfloat16) == ""  # 8-aligned: nothing to say
    assert misaligned_note(gpt2(50260), torch.float32) == ""  # 16 bytes of fp32 are 4 elements

    class Engine:  # DeepSpeed's torch_autocast: fp32 parameters, bf16 GEMMs
        def __init__(self, on):
            self.on = on

        def torch_autocast_enabled(self):
            return self.on

        def torch_autocast_dtype(self):
            return torch.bfloat16

    assert gemm_dtype(Engine(True), "fp32") == torch.bfloat16 and gemm_dtype(Engine(False), "fp32") == torch.float32
    assert gemm_dtype(object(), "fp16") == torch.float16  # a DeepSpeed without torch_autocast
    many = torch.nn.Sequential(*(torch.nn.Linear(8, 9 + i) for i in range(5)))
    assert "0 (8 -> 9), 1 (8 -> 10), 2 (8 -> 11) and 2 more:" in misaligned_note(many, torch.float16)
    # a rank-4 adapter beside a large layer costs nothing worth padding
    lora = torch.nn.Sequential(torch.nn.Linear(4096, 4), torch.nn.Linear(4, 4096), torch.nn.Linear(4096, 4096))
    assert misaligned_note(lora, torch.bfloat16) == ""
