"""Bad input to ``pyfused.parallelize`` fails with the same clear message on every rank, before any
collective beyond the one validation exchange, and leaves the model untouched (no layer was built)."""
import pytest
import torch
import torch.nn as nn

from tests.test_parallelize import BATCH, VOCAB, build

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers (the 'models' extra)")


def _unknown_arch(rank, world):
    import transformers as tf

    torch.manual_seed(0)
    return tf.OPTForCausalLM(tf.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                          ffn_dim=64, num_attention_heads=4, max_position_embeddings=32,
                                          word_embed_proj_dim=32))


def _llama_plan():
    from pyfused.parallelize import llama_plan

    return llama_plan("model.", has_lm_head=True)


class _DoubledEmbedding(nn.Embedding):
    """An nn.Embedding subclass whose forward adds something (as Gemma's scaled embedding does)."""

    def forward(self, ids):
        return super().forward(ids) * 2


class _ClampedLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x).clamp(-1, 1)


def _with_module(name, make):
    def builder(rank, world):
        model = build("llama")
        old = model.get_submodule(name)
        new = make(old)
        new.load_state_dict(old.state_dict())
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
        return model
    return builder


def _weights_differ(rank, world):
    """Rank 3 (the only rank that shares no mesh-dim group with rank 0 on a 2 x 2 mesh) holds
    different values of one tensor: as a checkpoint loaded on some ranks only."""
    model = build("llama")
    if rank == 3:
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
    return model


def _gpt_neox(rank, world):
    return build("gpt_neox")


def _auto_plan_with(family, styles):
    """Parallelize kwargs for every rank: ``family``'s auto plan with the ``styles`` entries replaced."""
    def kwargs(rank):
        from pyfused.parallelize import auto_plan

        return {"plan": {**auto_plan(build(family)), **styles}}
    return kwargs


def _gpt2_attention_replicated(rank):
    """GPT-2's attention replicated as a whole (its projections take that style too)."""
    from pyfused.parallelize import auto_plan

    plan = {k: v for k, v in auto_plan(build("gpt2")).items() if ".attn" not in k}
    return {"plan": {**plan, "transformer.h.*.attn": "replicate"}}


def _llama_norms_replicated_on_last_rank(rank):
    """A plan that is valid on every rank, but not the same on every rank (2 x 2 mesh)."""
    from pyfused.parallelize import auto_plan

    plan = auto_plan(build("llama"))
    if rank == 3:
        plan = {k: "replicate" if v == "sequence_parallel" else v for k, v in plan.items()}
    return {"plan": plan, "mesh": ((2, 2), ("dp", "tp"))}


CASES = {
    # case: (model builder, parallelize kwargs (and "mesh": shape, names) or a function of the
    # rank returning them, expected words in the message)
    "unknown_arch": (_unknown_arch, {}, "plan='auto' does not know OPTForCausalLM"),
    "heads": (lambda r, w: build("llama", num_attention_heads=6, num_key_value_heads=6), {},
              "num_attention_heads=6 is not divisible by the tensor-parallel size 4"),
    # 3 KV heads cannot be spread over 4 ranks (2 can: replicated, tests/test_parallelize.py)
    "kv_heads": (lambda r, w: build("llama", num_attention_heads=12, num_key_value_heads=3), {},
                 "num_key_value_heads=3 is not divisible by the tensor-parallel size 4"),
    "kv_colwise": (lambda r, w: build("llama", num_key_value_heads=2),
                   {"plan": {**_llama_plan(), "model.layers.*.self_attn.k_proj": "colwise"}},
                   "with k_proj / v_proj in style 'colwise_kv'"),
    "gpt2_heads": (lambda r, w: build("gpt2", n_head=2), {},
                   "num_attention_heads=2 is not divisible by the tensor-parallel size 4"),
    "differs": (lambda r, w: build("llama", intermediate_size=44 + 4 * (r == w - 1)), {},
                "these differ between ranks: the model (parameter and buffer names"),
    "plan_typo": (lambda r, w: build("llama"), {"plan": {"model.layer.*.mlp.up_proj": "colwise"}},
                  "matches no module"),
    "uncovered": (lambda r, w: build("llama"),
                  {"plan": {"model.layers.*.mlp.up_proj": "colwise",
                            "model.layers.*.mlp.down_proj": "rowwise"}},
                  "the plan does not cover parameter(s) model.embed_tokens.weight"),
    "bad_style": (lambda r, w: build("llama"), {"plan": {"lm_head": "columnwise"}},
                  "unknown style 'columnwise'"),
    # on a 2-D mesh the verdict travels along both dims: rank 3 shares no dim group with rank 0
    "differs_2d": (lambda r, w: build("gpt2", n_inner=52 + 4 * (r == 3)), {"mesh": ((2, 2), ("dp", "tp"))},
                   "these differ between ranks: the model (parameter and buffer names"),
    # the same sizes, but rank 3 calls the dims the other way round: its "tp" group is {1, 3} where
    # the others' are {0, 1} and {2, 3}; the ranks would wait in different collectives
    "mesh_dim_names_differ": (lambda r, w: build("llama"),
                              lambda r: {"mesh": ((2, 2), ("tp", "dp") if r == 3 else ("dp", "tp"))},
                              "these differ between ranks: the mesh (its dim names in order"),
    # a plan or an option that is valid on each rank but differs on one (on the 2 x 2 mesh rank 3
    # shares no dim group with rank 0: the verdict travels along both dims)
    "plan_differs_2d": (lambda r, w: build("llama"), _llama_norms_replicated_on_last_rank,
                     "these differ between ranks: the plan (module patterns and styles, in order)"),
    "options_differ_2d": (lambda r, w: build("llama"),
                          lambda r: {"mesh": ((2, 2), ("dp", "tp")),
                                     "overlap": "decomposed" if r == 3 else "auto"},
                          "these differ between ranks: the options (sequence_parallel, overlap"),
    # a forward-overriding subclass would lose its behaviour in the replacement (Gemma's scale is kept
    # by the embedding style: tests/test_parallelize_families.py)
    "embedding_subclass": (_with_module("model.embed_tokens", lambda m: _DoubledEmbedding(
        m.num_embeddings, m.embedding_dim, m.padding_idx)), {},
        "'model.embed_tokens' is a _DoubledEmbedding, a subclass of nn.Embedding whose forward differs"),
    "linear_subclass": (_with_module("model.layers.1.mlp.up_proj", lambda m: _ClampedLinear(
        m.in_features, m.out_features, bias=False)), {},
        "'model.layers.1.mlp.up_proj' is a _ClampedLinear, a subclass of nn.Linear whose forward differs"),
    # weights that differ between ranks: named on every rank, also across the dims of a 2-D mesh
    "weights_differ": (_weights_differ, {},
                       "weights differ between ranks (first differing tensor: "
                       "model.layers.1.mlp.up_proj.weight)"),
    "weights_differ_2d": (_weights_differ, {"mesh": ((2, 2), ("dp", "tp"))},
                          "weights differ between ranks (first differing tensor: "
                          "model.layers.1.mlp.up_proj.weight)"),
    # fused projections under a style that cuts through their layout (every family and style:
    # tests/test_parallelize_families.py); GPT-NeoX's query_key_value interleaves q, k, v per head
    "interleaved_qkv": (_gpt_neox, _auto_plan_with(
        "gpt_neox", {"gpt_neox.layers.*.attention.query_key_value": "colwise_qkv"}),
                        "'gpt_neox.layers.0.attention.query_key_value' is gpt_neox's fused per-head "
                        "interleaved [q0 k0 v0 | q1 k1 v1 ...] projection: style 'colwise_qkv'"),
    "fused_qkv_colwise": (lambda r, w: build("phi3"),
                          _auto_plan_with("phi3", {"model.layers.*.self_attn.qkv_proj": "colwise"}),
                          "'model.layers.0.self_attn.qkv_proj' is phi3's fused [q|k|v] projection: "
                          "style 'colwise' would cut through that layout; give it style 'colwise_qkv'"),
    # inside the sequence-parallel region a replicated module runs on the sequence shard: right for
    # a norm or an MLP (tests/test_parallelize.py), wrong for attention (it mixes positions)
    "attention_replicated_in_sp_region": (
        lambda r, w: build("gpt2"), _gpt2_attention_replicated,
        "transformer.h.0.attn (GPT2Attention) is in the sequence-parallel region under style "
        "'replicate' of 'transformer.h.0.attn'"),
    "pp_too_deep": (lambda r, w: build("gpt2", n_layer=1), {"mesh": ((4,), ("pp",))},
                    "pp=4 stages but the model has only 3 pipeline units"),
    # the options and the mesh, each checked before the agreement (parallelize/steps.py)
    "unnamed_mesh": (lambda r, w: build("llama"), {"mesh": ((4,), None)}, "mesh needs named dims"),
    "dp_value": (lambda r, w: build("llama"), {"dp": "zero"},
                 "dp must be 'ddp', 'fsdp' or 'hsdp', got 'zero'"),
    "pipeline_options_without_pp": (lambda r, w: build("llama"), {"n_microbatches": 2},
                                    "pipeline options ['n_microbatches'] given but the mesh has no pp "
                                    "dim > 1"),
    "unknown_pipeline_option": (lambda r, w: build("gpt2"), {"mesh": ((4,), ("pp",)), "microbatches": 2},
                                "unknown pipeline option(s) ['microbatches']"),
}


def _bad_parallelize(rank, world, case):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize import ParallelizeError

    builder, kwargs, _ = CASES[case]
    kwargs = kwargs(rank) if callable(kwargs) else dict(kwargs)
    shape, names = kwargs.pop("mesh", ((world,), ("tp",)))
    model = builder(rank, world)
    linears_before = sum(isinstance(m, nn.Linear) for m in model.modules())
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    try:
        pyfused.parallelize(model, mesh, **kwargs)
    except ParallelizeError as e:
        untouched = sum(isinstance(m, nn.Linear) for m in model.modules()) == linears_before
        return str(e), untouched
    return None, None


@pytest.mark.parametrize("case", list(CASES))
def test_bad_model_fails_on_every_rank(ranks, case):
    got = ranks.run(4, _bad_parallelize, case, timeout=120)
    msgs = [m for m, _ in got]
    assert msgs[0] is not None and len(set(msgs)) == 1, msgs
    assert CASES[case][2] in msgs[0], msgs[0]
    assert all(untouched for _, untouched in got), "a layer was built before the error"


def _bad_mesh_and_input(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused
    from pyfused.parallelize import ParallelizeError

    out = []
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("model",))
    try:
        pyfused.parallelize(build("llama"), mesh)
    except ParallelizeError as e:
        out.append(str(e))
    # a sequence TP does not divide, with sequence parallelism: a clear error before the forward
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = pyfused.parallelize(build("llama"), mesh, sequence_parallel=True)
    try:
        pm(input_ids=torch.zeros(BATCH, 10, dtype=torch.long))
    except ValueError as e:
        out.append(str(e))
    # token ids outside the vocabulary (a vocab-parallel embedding would otherwise read zeros)
    try:
        pm(input_ids=torch.full((BATCH, 12), VOCAB, dtype=torch.long))
    except IndexError as e:
        out.append(str(e))
    # outputs TP / SP cannot give in the original's layout
    for flag in ("output_attentions", "output_hidden_states"):
        try:
            pm(input_ids=torch.zeros(BATCH, 12, dtype=torch.long), **{flag: True})
        except ValueError as e:
            out.append(str(e))
    # the group is still usable: a correct call goes through on every rank
    pm(input_ids=torch.zeros(BATCH, 12, dtype=torch.long))
    return out


def test_bad_mesh_and_inputs(ranks):
    got = ranks.run(4, _bad_mesh_and_input, timeout=120)
    assert all(g == got[0] for g in got) and len(got[0]) == 5, got
    assert "mesh dims must be distinct names among" in got[0][0]
    assert "sequence length 10 is not divisible by the tensor-parallel size 4" in got[0][1]
    assert "token ids must lie in [0, 100)" in got[0][2]
    assert "output_attentions is not supported with tensor parallelism" in got[0][3]
    assert "output_hidden_states is not supported with sequence parallelism" in got[0][4]


def _weights_differ_on_purpose(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    pm = pyfused.parallelize(_weights_differ(rank, world), mesh, check_weights=False)
    return type(pm).__name__


def test_weights_check_can_be_skipped(ranks):
    assert ranks.run(4, _weights_differ_on_purpose, timeout=120) == ["ParallelModel"] * 4


def test_gemma_under_the_llama_plan():
    """A Llama plan a user writes for Gemma is what plan="auto" applies to it (so the families test
    covers it): its scaled embedding is a known one, whose scale the vocab-parallel embedding keeps."""
    from pyfused.parallelize import auto_plan, llama_plan
    from pyfused.parallelize.embedding import embedding_scale
    from pyfused.parallelize.plans import resolve

    model = build("gemma")
    assert auto_plan(model) == llama_plan("model.", has_lm_head=True)
    resolve(model, llama_plan("model.", has_lm_head=True))
    assert float(embedding_scale(model.model.embed_tokens)) == pytest.approx(64 ** 0.5)
