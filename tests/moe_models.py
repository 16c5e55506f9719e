"""Tiny random-weight MoE causal LMs of every family the MoE tests use, the same on every rank for
one seed (hidden 32, 2 layers, 4 experts of width 24 -- 8 where a test divides them over 4 ranks --
top-2, vocab 101), and the batches they run on."""
from __future__ import annotations

import torch

VOCAB = 101
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def build(family: str, seed: int = 0, experts: int = 4):
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    routed = dict(num_experts_per_tok=2)
    if family == "mixtral":
        cfg = tf.MixtralConfig(**common, **routed, intermediate_size=24, num_local_experts=experts)
    elif family == "qwen2_moe":  # a shared expert with its own sigmoid gate beside the routed ones
        cfg = tf.Qwen2MoeConfig(**common, **routed, intermediate_size=40, moe_intermediate_size=24,
                                shared_expert_intermediate_size=28, num_experts=experts,
                                decoder_sparse_step=1, mlp_only_layers=[])
    elif family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**common, **routed, intermediate_size=40, moe_intermediate_size=24,
                                num_experts=experts, decoder_sparse_step=1, mlp_only_layers=[],
                                head_dim=8)
    elif family == "olmoe":
        cfg = tf.OlmoeConfig(**common, **routed, intermediate_size=24, num_experts=experts)
    elif family == "deepseek_v3":  # a dense first layer, shared experts, grouped routing, MLA
        cfg = tf.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, **routed,
                                  intermediate_size=40, moe_intermediate_size=24,
                                  n_routed_experts=experts, n_shared_experts=1,
                                  first_k_dense_replace=1, n_group=2, topk_group=1,
                                  kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                  qk_nope_head_dim=8, v_head_dim=8)
    elif family == "gpt_oss":  # expert biases, interleaved [gate|up], clamped SwiGLU, sinks
        # gate_up outputs here are ~0.15 in size: a limit of 0.15 clamps a good share of them
        cfg = tf.GptOssConfig(**common, **routed, intermediate_size=24, num_local_experts=experts,
                              head_dim=8, sliding_window=4, swiglu_limit=0.15)
    else:
        raise ValueError(family)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    if family == "deepseek_v3":  # random router biases, so the grouped routing has work to do
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.copy_(torch.randn(buf.shape) * 0.1)
    if family == "gpt_oss":  # random expert biases (initialized to zero), so that they count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("gate_up_proj_bias", "down_proj_bias")):
                    p.copy_(torch.randn(p.shape) * 0.1)
    return model


def batch(seed: int, rows: int = 2, seq: int = 9):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, VOCAB, (rows, seq), generator=g),
            torch.randint(0, VOCAB, (rows, seq), generator=g))


def experts_modules(model):
    """{name: module} of the model's experts modules (3-D gate_up_proj)."""
    return {n: m for n, m in model.named_modules()
            if getattr(getattr(m, "gate_up_proj", None), "dim", lambda: 0)() == 3}
