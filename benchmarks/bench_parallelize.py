"""One training step of a transformers model parallelized by ``pyfused.parallelize`` against the
same model parallelized by torch's own ``parallelize_module`` (DTensor), on the same TP mesh (every
rank of the suite's group), in the same run. Three families, each with its own torch rows:
Llama, Phi-3 (fused qkv_proj / gate_up_proj) and Gemma2 (scaled embedding, soft-capping,
sliding-window layers; untied LM head, which torch's plan cannot share with a vocab-parallel
embedding).

Variants (rows), each pyfused row timed against the torch row of the same parallelism:
  * ``torch-tp``: ColwiseParallel q/k/v/gate/up, RowwiseParallel o/down, vocab-parallel embedding
    (RowwiseParallel, replicated output) and LM head (ColwiseParallel, replicated logits) -- the
    plan transformers' own ``tp_plan`` and torchtitan use without sequence parallelism. Phi-3's fused
    projections are ColwiseParallel too, their rows permuted beforehand so that each rank's
    contiguous shard is its [q|k|v] heads / its [gate|up] share, and the attention modules' head
    counts (which Phi-3 reads from its config) divided -- what a user of torch's API has to do by
    hand for the same model.
  * ``torch-tp+sp``: the same plus torch's sequence parallelism as torchtitan plans it: the
    embedding's output, every norm (``SequenceParallel``) and the o/down projections' outputs are
    sequence shards (``Shard(1)`` of the batch-first activations), the attention and MLP modules
    gather their input (``PrepareModuleInput`` to ``Replicate``), and the LM head gathers the final
    norm's output. The residual stream stays a DTensor (``use_local_output=False``), so the model's
    own forward reads the global sequence length from it.
  * ``pyfused-tp``: ``parallelize(model, mesh, sequence_parallel=False)``, against torch-tp;
  * ``pyfused-tp+sp``: ``parallelize(model, mesh)`` (norms on sequence shards, all_gather_matmul /
    matmul_reduce_scatter), against torch-tp+sp.
All four start from the same full model; their losses are checked against each other before
anything is timed, and the four are timed round-robin (``harness.time_interleaved``, the
interleaved form of ``time_fn``), so a shared machine's drifting load hits them alike. A step is
``zero_grad``, forward with labels (full logits + loss), backward and an AdamW step.
``tokens_per_s`` = batch x sequence / step time; ``tflops`` counts 6 x (GEMM parameters) per token
plus causal attention (6 x 2 x s x h per token and layer, the full square), per rank.

Sizes: a small model on CPU (the default run takes a few seconds on 2 gloo ranks), a 4-layer
2048-wide one on GPU; ``--quick`` shrinks both. pyfused validates every op's inputs across ranks by
default (one tiny all-gather per call; the ``validate`` column) -- ``--no-validate`` measures without.
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Dict, List

import torch

from pyfused.bench.gemm_collective import agree_close
from pyfused.bench.harness import interleaved_samples, metadata, op_row, speedup, vs_peer

MULTI_RANK = True


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    batch: int
    seq: int

    def label(self, family: str) -> str:
        return (f"{family} h={self.hidden} L={self.layers} heads={self.heads}/{self.kv_heads} "
                f"ffn={self.ffn} V={self.vocab} b={self.batch} s={self.seq}")


SIZES = {  # (device type, quick) -> size; every dim divisible by up to 8 TP ranks
    ("cpu", False): Size(128, 2, 8, 8, 344, 512, 4, 64),
    ("cpu", True): Size(64, 2, 8, 8, 176, 256, 2, 32),
    ("cuda", False): Size(2048, 4, 16, 8, 5632, 32000, 2, 1024),
    ("cuda", True): Size(1024, 2, 16, 8, 2816, 32000, 2, 512),
}


FAMILIES = ("llama", "phi3", "gemma2")
# Rounds outside --quick (at least --iters): a step of the CPU size (25-90 ms, many small
# collectives) takes anywhere between 0.6x and 1.5x its median on a 2-core box, and the paired
# ratios' median moved by up to 16% between runs of 30 rounds; its error falls as one over the
# root of the count.
ROUNDS = 120
# row -> the torch row it is timed against
PEERS = {"pyfused-tp": "torch-tp", "pyfused-tp+sp": "torch-tp+sp"}


def build(size: Size, ctx, family: str = "llama"):
    import transformers as tf

    state = torch.random.get_rng_state()
    torch.manual_seed(1234)
    common = dict(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.ffn,
                  num_hidden_layers=size.layers, num_attention_heads=size.heads,
                  num_key_value_heads=size.kv_heads, max_position_embeddings=size.seq)
    if family == "phi3":
        model = tf.Phi3ForCausalLM(tf.Phi3Config(**common, pad_token_id=0, bos_token_id=1,
                                                 eos_token_id=2, resid_pdrop=0.0, embd_pdrop=0.0))
    elif family == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(
            **common, head_dim=size.hidden // size.heads, query_pre_attn_scalar=size.hidden // size.heads,
            sliding_window=size.seq // 2, tie_word_embeddings=False))
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    model = model.to(ctx.device, ctx.dtype)
    torch.random.set_rng_state(state)
    return model


def _rank_major(weight: torch.Tensor, sections, world: int) -> torch.Tensor:
    """Rows of a fused projection reordered so that contiguous shard r is rank r's part of every
    section ([q_r|k_r|v_r] or [gate_r|up_r]): what ColwiseParallel's even split then gives rank r."""
    parts = [p.chunk(world) for p in weight.split(list(sections))]
    return torch.cat([parts[i][r] for r in range(world) for i in range(len(parts))])


def _prepare_phi3_for_torch_tp(model, world: int) -> None:
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    with torch.no_grad():
        for layer in model.model.layers:
            qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
            qkv.weight.copy_(_rank_major(qkv.weight, (q, kv, kv), world))
            gate_up.weight.copy_(_rank_major(gate_up.weight, (cfg.intermediate_size,) * 2, world))
            layer.self_attn.num_key_value_heads //= world
    cfg.num_attention_heads //= world  # read at forward time by Phi3Attention (this copy's config)
    cfg.num_key_value_heads //= world


NORMS = {"llama": ("input_layernorm", "post_attention_layernorm"),
         "phi3": ("input_layernorm", "post_attention_layernorm"),
         "gemma2": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")}


def torch_tp(model, mesh, family: str = "llama", sequence_parallel: bool = False):
    """``model`` parallelized by torch's ``parallelize_module``: the torch-tp plan, or with
    ``sequence_parallel`` the torch-tp+sp one (the module docstring describes both)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence_parallel:
        seq = Shard(1)  # batch-first activations: dim 1 is the sequence
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq,
                                                      use_local_output=False),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
                "model.layers.*.self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": seq},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "model.layers.*.mlp": PrepareModuleInput(input_layouts=(seq,),
                                                         desired_input_layouts=(Replicate(),))}
        plan.update({f"model.layers.*.{norm}": SequenceParallel() for norm in NORMS[family]})
        row = RowwiseParallel(output_layouts=seq, use_local_output=False)
    else:
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        row = RowwiseParallel()
    if family == "phi3":
        _prepare_phi3_for_torch_tp(model, mesh.size())
        plan["model.layers.*.self_attn.qkv_proj"] = ColwiseParallel()
        plan["model.layers.*.mlp.gate_up_proj"] = ColwiseParallel()
    else:
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"model.layers.*.self_attn.{name}"] = ColwiseParallel()
        plan["model.layers.*.mlp.gate_proj"] = ColwiseParallel()
        plan["model.layers.*.mlp.up_proj"] = ColwiseParallel()
    plan["model.layers.*.self_attn.o_proj"] = row
    plan["model.layers.*.mlp.down_proj"] = row
    return parallelize_module(model, mesh, plan)


def flop_per_rank(size: Size, world: int) -> float:
    h, f, L, s = size.hidden, size.ffn, size.layers, size.seq
    head_dim = h // size.heads
    gemm_params = L * (2 * h * h + 2 * h * size.kv_heads * head_dim + 3 * h * f) + h * size.vocab
    tokens = size.batch * s
    return (6 * gemm_params * tokens + 6 * 2 * s * h * L * tokens) / world


def training_step(model, opt, ids):
    def step():
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        return out.loss
    return step


def run(ctx) -> List[Dict]:
    return [row for family in FAMILIES for row in run_family(ctx, family)]


def run_family(ctx, family: str) -> List[Dict]:
    from torch.distributed.device_mesh import DeviceMesh

    import pyfused

    size = SIZES[(ctx.device.type if ctx.device.type == "cuda" else "cpu", ctx.quick)]
    label = size.label(family)
    mesh = DeviceMesh.from_group(ctx.group, ctx.device.type, mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, size.vocab, (size.batch, size.seq), generator=g).to(ctx.device)
    full = build(size, ctx, family)
    makers = {
        "torch-tp": lambda m: torch_tp(m, mesh, family),
        "torch-tp+sp": lambda m: torch_tp(m, mesh, family, sequence_parallel=True),
        "pyfused-tp": lambda m: pyfused.parallelize(m, mesh, sequence_parallel=False),
        "pyfused-tp+sp": lambda m: pyfused.parallelize(m, mesh, sequence_parallel=True),
    }
    steps, ref_loss = {}, None
    for name, make in makers.items():
        model = make(copy.deepcopy(full))
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss.detach().float().reshape(1)
        if ref_loss is None:
            ref_loss = loss
        agree_close(loss, ref_loss, f"parallelize[{name}] loss vs torch-tp at {label}", ctx)
        steps[name] = training_step(model, opt, ids)
    # round-robin: load drifting on a shared machine hits every variant alike
    rounds = ctx.iters if ctx.quick else max(ROUNDS, ctx.iters)
    samples = interleaved_samples(steps, ctx, iters=rounds)
    times = {name: statistics.median(t) for name, t in samples.items()}
    rows = []
    flop = flop_per_rank(size, ctx.world)
    for name, ms in times.items():
        rows.append(op_row(
            ctx, shape=label, dtype=ctx.dtype, method=name, transport=ctx.transport, ms=ms,
            flop=flop, t_baseline=times[PEERS.get(name, name)],  # ``speedup``: vs its own peer
            note=f"{size.batch * size.seq / (ms * 1e-3):.0f} tokens/s",
            tokens_per_s=size.batch * size.seq / (ms * 1e-3),
            speedup_vs_torch_tp=speedup(times["torch-tp"], ms),
            **vs_peer(PEERS.get(name, name), name, samples), tp=ctx.world, family=family,
            sequence_parallel=name.endswith("+sp"), rounds=rounds, **metadata(ctx)))
    return rows
