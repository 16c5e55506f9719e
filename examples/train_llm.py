"""Train a small decoder-only LM with pyfused.parallelize on any dp x pp x tp mesh.

    torchrun --nproc-per-node 2 examples/train_llm.py --tp 2 --steps 50
    torchrun --nproc-per-node 4 examples/train_llm.py --dp 2 --pp 2 --model gpt2
    torchrun --nproc-per-node 2 examples/train_llm.py --tp 2 --ckpt-dir ckpt --save-every 20
    torchrun --nproc-per-node 2 examples/train_llm.py --tp 2 --ckpt-dir ckpt --resume --steps 100

The model is built from a small config with random weights (Llama or GPT-2 from transformers;
nothing is downloaded). Data: synthetic "counting" sequences (x_t = a + t*d mod V, a and d random per
sequence: learnable after two tokens, so the loss falls within a few dozen steps), or the bytes of a
local text file (``--data file.txt``, vocabulary 256). Batches are a pure function of (seed, step), so
a resumed run sees exactly the batches the uninterrupted run would have.

Runs on CUDA with NCCL when GPUs are visible (one per local rank), else on CPU with gloo. Rank 0 logs
the mesh, then loss (mean over dp ranks), tokens/s and step time every ``--log-every`` steps; with
``--metrics-file`` it also writes one JSON line per step.

Checkpoints: ``<ckpt-dir>/step_<N>/rank<R>.pt`` holds each rank's model shard, optimizer state and
step; ``<ckpt-dir>/latest`` names the newest complete one (written by rank 0 after every rank saved).
``--resume`` continues from ``latest`` (or ``--resume step_<N>``) on the same mesh; ``--export`` writes
the full model's state dict (``ParallelModel.full_state_dict()``), which loads into the original
transformers model -- or, with ``--init-from``, into a run on any other mesh.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dp", type=int, default=0, help="data-parallel size (default: world / (tp*pp))")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--no-sp", action="store_true", help="no sequence parallelism (TP only)")
    p.add_argument("--model", choices=("llama", "gpt2"), default="llama")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="Llama only (grouped-query attention)")
    p.add_argument("--ffn", type=int, default=176)
    p.add_argument("--vocab", type=int, default=128, help="synthetic data only (text uses 256)")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--microbatches", type=int, default=0, help="pipeline microbatches (default pp)")
    p.add_argument("--steps", type=int, default=50, help="train until this step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default="synthetic", help="'synthetic' or a text file (bytes)")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--metrics-file", default=None, help="rank 0 appends a JSON line per step")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--save-every", type=int, default=0, help="also save at the last step when set")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from <ckpt-dir>/latest, or from the named step_<N> folder")
    p.add_argument("--export", default=None, help="write the full state dict here at the end")
    p.add_argument("--init-from", default=None, help="start from a full state dict (any mesh)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a collective waits for a peer before every rank fails: a dead or "
                        "frozen rank stops the run after this long (default 5 minutes; torch's "
                        "is 30; see docs/FAULTS.md)")
    return p.parse_args(argv)


def setup(timeout_s: float = 300.0):
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # NCCL for the tensors, gloo for pyfused's per-call input checks (no GPU sync; see README).
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def build_model(args, vocab: int, device):
    import transformers as tf

    torch.manual_seed(args.seed)  # the same full model on every rank; parallelize shards it
    if args.model == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_embd=args.hidden, n_layer=args.layers, n_head=args.heads,
                            n_inner=args.ffn, n_positions=max(args.seq, 64), resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                             num_hidden_layers=args.layers, num_attention_heads=args.heads,
                             num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 64))
        model = tf.LlamaForCausalLM(cfg)
    return model.to(device)


class Batches:
    """Global batch of step ``s`` (a pure function of seed and step); each dp rank takes its rows."""

    def __init__(self, args, dp: int, dp_rank: int):
        self.args, self.dp, self.dp_rank = args, dp, dp_rank
        self.text = None
        if args.data != "synthetic":
            self.text = torch.frombuffer(bytearray(Path(args.data).read_bytes()), dtype=torch.uint8).long()
            if self.text.numel() <= args.seq + 1:
                raise SystemExit(f"{args.data}: needs more than {args.seq + 1} bytes")
        self.vocab = 256 if self.text is not None else args.vocab

    def __call__(self, step: int, device):
        a = self.args
        g = torch.Generator().manual_seed(a.seed * 1_000_003 + step)
        if self.text is None:
            start = torch.randint(0, self.vocab, (a.batch, 1), generator=g)
            stride = torch.randint(1, 8, (a.batch, 1), generator=g)
            ids = (start + stride * torch.arange(a.seq)) % self.vocab
        else:
            offs = torch.randint(0, self.text.numel() - a.seq, (a.batch,), generator=g)
            ids = torch.stack([self.text[o:o + a.seq] for o in offs.tolist()])
        rows = slice(self.dp_rank * a.batch // self.dp, (self.dp_rank + 1) * a.batch // self.dp)
        ids = ids[rows].to(device)
        return ids, ids.clone()  # causal LM: labels = inputs (the model shifts them)


def save_checkpoint(args, step, pm, opt, rank, mesh_sizes):
    folder = Path(args.ckpt_dir) / f"step_{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "mesh": mesh_sizes, "model": pm.module.state_dict(),
             "optim": opt.state_dict(), "rng": torch.get_rng_state()}
    tmp = folder / f"rank{rank:05d}.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(folder / f"rank{rank:05d}.pt")
    dist.barrier()  # every shard is on disk before ``latest`` names the step
    if rank == 0:
        latest = Path(args.ckpt_dir) / "latest.tmp"
        latest.write_text(folder.name)
        latest.replace(Path(args.ckpt_dir) / "latest")


def load_checkpoint(args, pm, opt, rank, mesh_sizes) -> int:
    name = args.resume
    if name == "latest":
        name = (Path(args.ckpt_dir) / "latest").read_text().strip()
    state = torch.load(Path(args.ckpt_dir) / name / f"rank{rank:05d}.pt", weights_only=False)
    if tuple(state["mesh"]) != tuple(mesh_sizes):
        raise SystemExit(f"checkpoint {name} was written on mesh (dp, pp, tp) = {tuple(state['mesh'])}, "
                         f"this run has {tuple(mesh_sizes)}: resume on the same mesh, or export a full "
                         f"state dict (--export) and start from it (--init-from)")
    pm.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def main(argv=None):
    args = parse_args(argv)
    device = setup(args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = args.dp or world // (args.tp * args.pp)
    if dp * args.tp * args.pp != world:
        raise SystemExit(f"dp x pp x tp = {dp} x {args.pp} x {args.tp} != world size {world}")
    from torch.distributed.device_mesh import init_device_mesh

    import pyfused

    mesh = init_device_mesh(device.type, (dp, args.pp, args.tp), mesh_dim_names=("dp", "pp", "tp"))
    dp_rank = mesh.get_local_rank("dp")
    batches = Batches(args, dp, dp_rank)
    if args.batch % dp:
        raise SystemExit(f"--batch {args.batch} must be divisible by dp={dp}")
    model = build_model(args, batches.vocab, device)
    n_params = sum(p.numel() for p in model.parameters())
    pp_options = {"n_microbatches": args.microbatches or args.pp} if args.pp > 1 else {}
    pm = pyfused.parallelize(model, mesh, sequence_parallel=not args.no_sp, **pp_options)
    if args.init_from:
        pm.load_full_state_dict(torch.load(args.init_from, map_location=device))
    opt = torch.optim.AdamW(pm.parameters(), lr=args.lr, weight_decay=0.0)
    mesh_sizes = (dp, args.pp, args.tp)
    step = load_checkpoint(args, pm, opt, rank, mesh_sizes) if args.resume else 0
    if rank == 0:
        print(f"mesh dp={dp} x pp={args.pp} x tp={args.tp} (world {world}, {dist.get_backend()} on "
              f"{device.type}), sequence_parallel={not args.no_sp and args.tp > 1}; {args.model} with "
              f"{n_params / 1e6:.2f}M parameters, batch {args.batch} x {args.seq}; "
              f"{'resumed at' if args.resume else 'starting at'} step {step}", flush=True)
    dp_group = mesh.get_group("dp")
    metrics = open(args.metrics_file, "a") if (args.metrics_file and rank == 0) else None
    pm.train()
    while step < args.steps:
        step += 1
        ids, labels = batches(step, device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        out = pm(input_ids=ids, labels=labels)
        pm.backward(out.loss)  # loss.backward(); with pp > 1 the call already ran the backward
        grad_norm = pm.clip_grad_norm_(args.clip) if args.clip > 0 else None  # the full model's norm
        opt.step()
        loss = out.loss.detach().float().clone()
        dist.all_reduce(loss, group=dp_group)  # also waits for this step on every dp rank
        loss = loss.item() / dp
        dt = time.perf_counter() - t0
        tokens_per_s = args.batch * args.seq / dt
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            norm = f" | grad norm {grad_norm.item():.3f}" if grad_norm is not None else ""
            print(f"step {step:5d} | loss {loss:.4f}{norm} | {tokens_per_s:9.0f} tokens/s | "
                  f"{dt * 1e3:7.1f} ms/step", flush=True)
        if metrics:
            metrics.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": tokens_per_s}) + "\n")
            metrics.flush()
        if args.ckpt_dir and args.save_every and (step % args.save_every == 0 or step == args.steps):
            save_checkpoint(args, step, pm, opt, rank, mesh_sizes)
    if args.export:
        full = pm.full_state_dict()  # a collective: every rank takes part
        if rank == 0:
            torch.save(full, args.export)
            print(f"wrote the full state dict ({len(full)} tensors) to {args.export}", flush=True)
    if metrics:
        metrics.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
