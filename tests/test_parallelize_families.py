"""The families ``plan="auto"`` knows beyond the Llama core and GPT-2 == the single-process model:
Phi-3 (fused qkv_proj and gate_up_proj), Gemma / Gemma2 / Gemma3 text (scaled embedding, (1 + w)
RMSNorm, soft-capping, sliding windows, per-head q/k norms), OLMo 2 (q/k norms over the whole
projection), GPT-NeoX (per-head interleaved query_key_value, parallel residual, partial rotary) and
StableLM (LayerNorm, partial rotary), at TP=2 and TP=4 with and without sequence parallelism, and
at PP=2 x TP=2: logits, loss, every gradient and the gathered state dict (helpers of
test_parallelize.py and test_parallelize_mesh.py). The fused projections (Phi-3's, GPT-NeoX's,
GPT-2's) under every style a user plan can give them: exact, or refused naming the projection.

Cost: one rank body per mesh loops over all families (a pool and the transformers import paid
once), 2 layers of width 64; the decomposed overlap schedule and DP are not repeated here (their
code paths do not depend on the family: tests/test_parallelize*.py cover them on Llama and GPT-2).
"""
import pytest

from tests.test_parallelize import batch, build, check_step, reference_step

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers (the 'models' extra)")

FAMILIES = ["phi3", "gemma", "gemma2", "gemma3", "olmo2", "gpt_neox", "stablelm"]


def _families_match(rank, world, families, variants):
    """``families``: names, or (name, config overrides, SP variants) for an extra case."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    ids, labels = batch()
    for case in families:
        family, overrides, sps = case if isinstance(case, tuple) else (case, {}, variants)
        ref, ref_out, ref_grads = reference_step(family, ids, labels, **overrides)
        for sp in sps:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
            pm = pyfused.parallelize(build(family, **overrides), mesh, sequence_parallel=sp)
            tag = f"{family} {overrides} tp={world} sp={sp} rank {rank}"
            check_step(pm, ref, ref_out, ref_grads, ids, labels, tag)
            full, orig = pm.full_state_dict(), ref.state_dict()
            assert list(full) == list(orig), tag
            for k in orig:
                assert torch.equal(full[k], orig[k]), f"state {k} {tag}"
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_families_tensor_parallel(ranks, world):
    # at TP=4 also OLMo 2 with 2 KV heads: k_norm's weight shards and its sum of squares then span
    # KV heads replicated on 2 ranks each (counted once); one SP variant, the norm is the same code
    extra = [("olmo2", {"num_key_value_heads": 2}, [True])] if world == 4 else []
    assert all(ranks.run(world, _families_match, FAMILIES + extra, [False, True], timeout=600))


def test_fused_and_sharded_norms_at_tp3(ranks):
    # TP=3 (no power of two): Phi-3's unequal fused q|k|v sections and OLMo 2's sharded q/k norms,
    # 6 heads / 3 KV heads of 8, FFN 45, vocabulary 100 padded to 102; with SP (seq 12)
    shape = {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 45}
    assert all(ranks.run(3, _families_match, [("phi3", shape, [True]), ("olmo2", shape, [True])], [],
                         timeout=300))


def _families_pipelined(rank, world, families):
    from tests.test_parallelize_mesh import _mesh_matches

    # a cut after both blocks for some (embedding and blocks | head), the profiled cut for others
    for i, family in enumerate(families):
        options = {"n_microbatches": 2, **({"split_points": [3]} if i % 2 else {})}
        assert _mesh_matches(rank, world, family, (2, 2), ("pp", "tp"), True, options)
    return True


def test_families_pipeline_x_tensor_parallel(ranks):
    assert all(ranks.run(4, _families_pipelined, FAMILIES, timeout=600))


# the fused projections of the families plan="auto" knows, by plan pattern
FUSED = {"phi3": ["model.layers.*.self_attn.qkv_proj", "model.layers.*.mlp.gate_up_proj"],
         "gpt_neox": ["gpt_neox.layers.*.attention.query_key_value"],
         "gpt2": ["transformer.h.*.attn.c_attn"]}
ONE_MODULE_STYLES = ["colwise", "colwise_qkv", "colwise_gate_up", "colwise_kv", "rowwise",
                     "colwise_gather_output", "replicate"]


def _fused_styles(rank, world):
    """Each fused projection under each style a linear module can take, in a user plan that is
    otherwise the auto plan: exact (logits, loss, every gradient) or refused by name on every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize import ParallelizeError, auto_plan

    ids, labels = batch()
    exact, refused = [], []
    for family, patterns in FUSED.items():
        ref, ref_out, ref_grads = reference_step(family, ids, labels)
        for pattern in patterns:
            for style in ONE_MODULE_STYLES:
                plan = {**auto_plan(ref), pattern: style}
                mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
                model = build(family)
                try:
                    pm = pyfused.parallelize(model, mesh, plan=plan)
                except ParallelizeError as e:
                    named = pattern.replace("*", "0")
                    assert f"{named!r} is {family}'s fused" in str(e), (pattern, style, str(e))
                    refused.append((pattern, style))
                    continue
                check_step(pm, ref, ref_out, ref_grads, ids, labels, f"{pattern} {style} rank {rank}")
                exact.append((pattern, style))
    return exact, refused


def test_fused_projection_styles_exact_or_refused(ranks):
    # TP=2 with sequence parallelism, whose code paths are the more varied; the refusal does not
    # depend on it, and the styles that run are the auto plans' (also run without SP above)
    got = ranks.run(2, _fused_styles, timeout=600)
    assert got[0] == got[1]
    exact, refused = got[0]
    assert exact == [("model.layers.*.self_attn.qkv_proj", "colwise_qkv"),
                     ("model.layers.*.mlp.gate_up_proj", "colwise_gate_up"),
                     ("gpt_neox.layers.*.attention.query_key_value", "colwise"),
                     ("transformer.h.*.attn.c_attn", "colwise_qkv")], exact
    assert len(refused) == 4 * (len(ONE_MODULE_STYLES) - 1)
