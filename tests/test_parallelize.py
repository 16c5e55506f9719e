"""``pyfused.parallelize`` on real transformers models == the same model run in one process.

Every rank builds the same tiny random-weight model (same seed), keeps an untouched copy as the
single-process reference, parallelizes the other copy on a DeviceMesh and runs one training step of
both on the same batch: logits, loss and every parameter's gradient (gathered to the full tensor)
must match in fp32, and the gathered state dict must equal the original's exactly.

Sizes are odd-ish where the models allow: hidden 40/48, FFN 44/52, vocab 100, batch 3, sequence 12;
TP=4 needs head counts, FFN width, vocabulary and (with sequence parallelism) the sequence divisible
by 4. Grids are cut to what covers each code path once (each rank body loops over the variants
itself, so a pool and the transformers import are paid once per world size): the whole file must
stay within ~2 minutes on a 2-core CI box.
"""
import pytest
import torch

from tests.utils import assert_close

pytest.importorskip("transformers", reason="pyfused.parallelize tests need transformers (the 'models' extra)")

BATCH, SEQ, VOCAB = 3, 12, 100


def build(family: str, seed: int = 0, **overrides):
    """A tiny random-weight causal LM of ``family``, the same on every rank for the same seed."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = dict(vocab_size=VOCAB, n_embd=40, n_layer=2, n_head=4, n_inner=52, n_positions=32,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg.update(overrides)
        return tf.GPT2LMHeadModel(tf.GPT2Config(**cfg))
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=44, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32)
    common.update(overrides)
    if family == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    if family == "qwen2":  # q/k/v biases
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    if family == "mistral":
        return tf.MistralForCausalLM(tf.MistralConfig(**common))
    if family == "qwen3":  # per-head q/k RMSNorm over head_dim
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=common["hidden_size"] // 8))
    return build_family(tf, family, common, overrides)


def build_family(tf, family: str, common: dict, overrides: dict):
    """The families beyond the Llama core (tests/test_parallelize_families.py): hidden 64, 8 heads of 8
    (partial rotary needs an even rotary width), dropout off; seq 12 > a sliding window of 4."""
    cfg = dict(common, hidden_size=64, head_dim=8)
    cfg.update(overrides)
    window = dict(sliding_window=4)
    if family == "phi3":  # fused qkv_proj (q wider than k, v) and gate_up_proj
        return tf.Phi3ForCausalLM(tf.Phi3Config(**{k: v for k, v in cfg.items() if k != "head_dim"},
                                                pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                                resid_pdrop=0.0, embd_pdrop=0.0))
    if family == "gemma":  # scaled embedding, (1 + w) RMSNorm, tied head
        return tf.GemmaForCausalLM(tf.GemmaConfig(**cfg))
    if family == "gemma2":  # + attention and final logit soft-capping, alternating sliding windows
        return tf.Gemma2ForCausalLM(tf.Gemma2Config(**cfg, **window, query_pre_attn_scalar=8,
                                                    attn_logit_softcapping=5.0,
                                                    final_logit_softcapping=3.0))
    if family == "gemma3":  # + per-head q/k norms, a sliding and a full layer
        return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(
            **cfg, **window, query_pre_attn_scalar=8,
            layer_types=["sliding_attention", "full_attention"][:cfg["num_hidden_layers"]]))
    if family == "olmo2":  # q/k RMSNorm over the whole projection width
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**{k: v for k, v in cfg.items() if k != "head_dim"},
                                                  pad_token_id=0, eos_token_id=2))
    if family == "gpt_neox":  # per-head interleaved query_key_value, parallel residual, partial rotary
        cfg.pop("head_dim")
        cfg.pop("num_key_value_heads")
        return tf.GPTNeoXForCausalLM(tf.GPTNeoXConfig(**cfg, rotary_pct=0.5, hidden_dropout=0.0,
                                                      attention_dropout=0.0, pad_token_id=0,
                                                      bos_token_id=1, eos_token_id=2))
    if family == "stablelm":  # LayerNorm, partial rotary (a quarter of each head)
        cfg.pop("head_dim")
        return tf.StableLmForCausalLM(tf.StableLmConfig(**cfg, partial_rotary_factor=0.25,
                                                        pad_token_id=0))
    raise ValueError(family)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, labels


def reference_step(family, ids, labels, **overrides):
    ref = build(family, **overrides)
    out = ref(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    return ref, out, grads


def check_step(pm, ref, ref_out, ref_grads, ids, labels, tag, last_stage=True):
    """One training step of the parallel model ``pm`` against the reference's."""
    out = pm(input_ids=ids, labels=labels)
    if last_stage:
        assert_close(out.logits, ref_out.logits, name=f"logits {tag}")
        assert_close(out.loss, ref_out.loss, name=f"loss {tag}")
    pm.backward(out.loss)
    grads = pm.full_grad_dict()
    assert set(grads) == set(ref_grads), (tag, set(grads) ^ set(ref_grads))
    for name, g in grads.items():
        assert_close(g, ref_grads[name], name=f"grad {name} {tag}")


def _tp_matches(rank, world, family, variants, overrides=None):
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    overrides = overrides or {}
    ids, labels = batch()
    ref, ref_out, ref_grads = reference_step(family, ids, labels, **overrides)
    for sp, overlap in variants:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        pm = pyfused.parallelize(build(family, **overrides), mesh, sequence_parallel=sp, overlap=overlap)
        tag = f"{family} tp={world} sp={sp} overlap={overlap} rank {rank}"
        # the heads really were divided (the attention modules read no head count from the config)
        layer = pm.module.model.layers[0] if family != "gpt2" else pm.module.transformer.h[0]
        if family == "gpt2":
            assert layer.attn.split_size == 40 // world and layer.attn.num_heads == 4 // world, tag
            assert pm.module.lm_head.weight is pm.module.transformer.wte.weight, "tie lost " + tag
        assert layer.mlp.down_proj.weight.shape[1] == 44 // world if family != "gpt2" else True
        check_step(pm, ref, ref_out, ref_grads, ids, labels, tag)
        full = pm.full_state_dict()
        orig = ref.state_dict()
        assert list(full) == list(orig), tag
        for k in orig:
            assert torch.equal(full[k], orig[k]), f"state {k} {tag}"
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tensor_parallel_matches_single_process(ranks, family, world):
    # overlap="auto" picks the unfused ops at these sizes; the chunked (decomposed) schedules of the
    # layers' ops run once per world size and family, with sequence parallelism (all three ops)
    variants = [(False, "auto"), (True, "auto"), (True, "decomposed")]
    assert all(ranks.run(world, _tp_matches, family, variants, timeout=240))


@pytest.mark.parametrize("family", ["qwen2", "mistral", "qwen3"])
def test_llama_family_members(ranks, family):
    # one world size each: the Llama-family code path is covered above, these check the detection
    # and the q/k/v biases (qwen2) of the members
    # qwen3's per-head q/k norms get partial gradients on each rank with and without SP
    variants = [(False, "auto"), (True, "auto")] if family == "qwen3" else [(True, "auto")]
    assert all(ranks.run(2, _tp_matches, family, variants, timeout=240))


def _replicated_plans():
    """Llama's auto plan with parts of the blocks in style 'replicate': the block norms, and the
    whole MLP (one entry for the module and its three projections; an MoE block, which plan="auto"
    does not support yet, would be replicated the same way)."""
    from pyfused.parallelize import auto_plan

    plan = auto_plan(build("llama"))
    norms = {k: "replicate" if v == "sequence_parallel" else v for k, v in plan.items()}
    mlp = {**{k: v for k, v in plan.items() if ".mlp." not in k}, "model.layers.*.mlp": "replicate"}
    return {"norms": norms, "mlp": mlp}


def _replicate_in_region(rank, world, variants, overrides):
    """Replicated modules inside the blocks: with sequence parallelism they run on the sequence
    shard, and their parameters' gradients are summed over the TP group (as the 'sequence_parallel'
    norms' are): the full model's gradient on every rank, and the replicas stay equal after a step."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    ids, labels = batch()
    ref, ref_out, ref_grads = reference_step("llama", ids, labels, **overrides)
    plans = _replicated_plans()
    for which, sp in variants:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        pm = pyfused.parallelize(build("llama", **overrides), mesh, plan=plans[which], sequence_parallel=sp)
        tag = f"replicated {which} tp={world} sp={sp} rank {rank}"
        check_step(pm, ref, ref_out, ref_grads, ids, labels, tag)
        torch.optim.SGD(pm.parameters(), lr=0.1).step()
        name = f"model.layers.1.{'mlp.up_proj' if which == 'mlp' else 'input_layernorm'}.weight"
        param = pm.module.get_parameter(name).detach()
        every = [torch.empty_like(param) for _ in range(world)]
        torch.distributed.all_gather(every, param, group=mesh.get_group())
        assert all(torch.equal(e, every[0]) for e in every), f"replicas of {name} diverged {tag}"
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_replicate_inside_sequence_parallel_region(ranks, world):
    # TP=3 (no power of two): 6 heads / 3 KV heads, FFN 45, vocabulary padded; the control without
    # sequence parallelism once, at TP=2
    variants = [("norms", True), ("mlp", True)] + ([("mlp", False)] if world == 2 else [])
    shape = ({"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 45}
             if world == 3 else {})
    assert all(ranks.run(world, _replicate_in_region, variants, shape, timeout=300))


def _kv_replicated(rank, world):
    """8 query heads, 2 KV heads, TP=4: each KV head lives on 2 ranks (the two whose query heads use
    it); the model equals the single-process one, the KV projections' gradients are the sums over
    their replicas, and the gradient norm counts each replicated head once."""
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    assert _tp_matches(rank, world, "llama", [(False, "auto"), (True, "auto")],
                       {"num_key_value_heads": 2})
    ids, labels = batch()
    ref, _, _ = reference_step("llama", ids, labels, num_key_value_heads=2)
    pm = pyfused.parallelize(build("llama", num_key_value_heads=2),
                             init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    attn = pm.module.model.layers[0].self_attn
    assert attn.num_key_value_groups == 2 and attn.k_proj.weight.shape[0] == attn.head_dim, \
        (attn.num_key_value_groups, tuple(attn.k_proj.weight.shape))
    out = pm(input_ids=ids, labels=labels)
    pm.backward(out.loss)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
    assert_close(pm.clip_grad_norm_(1e9), want, name=f"grad norm rank {rank}")
    return True


def test_kv_heads_replicated_when_tp_exceeds_them(ranks):
    assert all(ranks.run(4, _kv_replicated, timeout=300))


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_vocabulary_padded_when_tp_does_not_divide_it(ranks, family):
    """Vocabulary 101 at TP=4 (GPT-2: tied head; Llama: its own head): padded to 104 rows, logits
    cut back to 101; outputs, gradients and the gathered state dict equal the unpadded model's."""
    assert all(ranks.run(4, _tp_matches, family, [(False, "auto"), (True, "auto")],
                         {"vocab_size": VOCAB + 1}, timeout=300))


def _report(rank, world):
    """The report names each module's style and what it became, and the op methods the first call
    ran: chosen by the ops under overlap="auto" (unfused at this tiny size, with the op's reason),
    as requested otherwise; recording them emits nothing to the user's handlers."""
    import contextlib
    import io
    import logging

    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logging.getLogger("pyfused").addHandler(handler)
    ids, labels = batch()
    results = {}
    for overlap in ("auto", "decomposed"):
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            pm = pyfused.parallelize(build("llama"), mesh, overlap=overlap, verbose=True)
            before = pm.report()
            pm(input_ids=ids, labels=labels).loss.backward()
        rows = {m.name: m for m in pm.report().modules}
        described = {n: (m.style, m.module, m.op, m.method, m.why) for n, m in rows.items()}
        results[overlap] = (str(before), described,
                            pm.report().methods(), printed.getvalue())
    logging.getLogger("pyfused").removeHandler(handler)
    results["debug records emitted"] = [r.getMessage() for r in seen if r.levelno < logging.WARNING]
    return results


def test_report_lists_styles_and_methods(ranks):
    got = ranks.run(2, _report, timeout=240)
    auto, dec = got[0]["auto"], got[0]["decomposed"]
    assert "not called yet" in auto[0]
    gate = auto[1]["model.layers.0.mlp.gate_proj"]
    assert gate[:4] == ("colwise", "SequenceParallelColumn", "all_gather_matmul", "unfused"), gate
    assert "below" in gate[4], gate  # the op's own reason: the GEMM is below the chunking size
    down = auto[1]["model.layers.1.mlp.down_proj"]
    assert down[:4] == ("rowwise", "SequenceParallelRow", "matmul_reduce_scatter", "unfused"), down
    assert auto[1]["model.layers.0.self_attn.q_proj"][1:3] == ("LocalInputColumn", None)
    assert auto[1]["model.embed_tokens"][1] == "VocabParallelEmbedding"
    assert auto[1]["model.layers.0.input_layernorm"][0] == "sequence_parallel"
    assert auto[2] == {"unfused": 8}  # per layer: gate, up (all_gather_matmul), o, down (reduce-scatter)
    assert dec[1]["model.layers.1.mlp.down_proj"][3:] == ("decomposed", "requested")
    # verbose: printed on global rank 0 only, before and after the first call
    assert got[0]["auto"][3].count("pyfused.parallelize: mesh") == 2 and got[1]["auto"][3] == ""
    assert got[0]["debug records emitted"] == [] and got[1]["debug records emitted"] == []
