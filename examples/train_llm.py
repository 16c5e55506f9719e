"""Train a small decoder-only LM with pyfused.parallelize on any dp x pp x tp mesh.

    torchrun --nproc-per-node 2 examples/train_llm.py --tp 2 --steps 50
    torchrun --nproc-per-node 4 examples/train_llm.py --dp 2 --pp 2 --model gpt2
    torchrun --nproc-per-node 2 examples/train_llm.py --tp 2 --ckpt-dir ckpt --save-every 20
    torchrun --nproc-per-node 2 examples/train_llm.py --tp 2 --ckpt-dir ckpt --steps 100   # resumes
    torchrun --nproc-per-node 4 --max-restarts 3 examples/train_llm.py --dp 2 --tp 2 --ckpt-dir ckpt \
        --save-every 20 --steps 200                                          # elastic: survives a lost rank

The model is built from a small config with random weights (Llama or GPT-2 from transformers;
nothing is downloaded). Data: synthetic "counting" sequences (x_t = a + t*d mod V, a and d random per
sequence: learnable after two tokens, so the loss falls within a few dozen steps), or the bytes of a
local text file (``--data file.txt``, vocabulary 256). Batches are a pure function of (seed, step), so
a resumed run sees exactly the batches the uninterrupted run would have.

Runs on CUDA with NCCL when GPUs are visible (one per local rank), else on CPU with gloo. Rank 0 logs
the mesh, then loss (mean over dp ranks), tokens/s and step time every ``--log-every`` steps; with
``--metrics-file`` it also writes one JSON line per step.

Checkpoints (``--ckpt-dir``, ``--save-every``) are torch.distributed.checkpoint (DCP) directories,
``<ckpt-dir>/step_<N>/``, written by every rank in parallel (its own shards of the model and of the
optimizer state, keyed by the original model's names: pyfused/parallelize/checkpoint.py).
``checkpoint.save`` is atomic: ``step_<N>/`` appears, with its ``COMPLETE`` marker, only after every
rank's write returned, so a checkpoint that was being written when a rank died is never taken for a
complete one (``checkpoint.is_complete``). At start the script resumes from
the newest complete checkpoint (``--resume auto``, the default), on any mesh: DCP reshards. So under
``torchrun --max-restarts N`` a run whose rank dies is restarted by torchrun and goes on from its last
checkpoint; batches are a pure function of the step, so its losses are the uninterrupted run's.
``--export`` writes the full model's state dict (``ParallelModel.full_state_dict()``), which loads
into the original transformers model -- or, with ``--init-from``, into a run on any other mesh.

For tests, ``TRAIN_LLM_FAULT=RANK:STEP:WHERE[,...]`` makes that rank SIGKILL itself once (a file in
the checkpoint directory records that it did) at that step: ``train`` after the backward, ``save`` inside
DCP's write of that step's checkpoint, after its own shards are on disk.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
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
    p.add_argument("--resume", nargs="?", const="latest", default="auto",
                   help="'auto' (default): from the newest complete checkpoint in --ckpt-dir if any; "
                        "'latest': the same, but one must exist; 'none'; or a step_<N> folder")
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
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", **attempt_store(),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def attempt_store() -> dict:
    """Under torchrun, the rendezvous store seen through a prefix of this attempt's own.

    torchrun's agent keeps one TCPStore for every restart of the worker group (unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), so without a prefix a restarted group can read the dead
    group's addresses from it and fail to connect, or wait on keys that are already stale.
    TORCHELASTIC_RESTART_COUNT is the same on every worker of one agent (one node); on several
    nodes, set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for the agents instead."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
        return {}
    store, rank, world = next(dist.rendezvous("env://"))
    return {"store": dist.PrefixStore(f"train_llm/attempt_{attempt}", store), "rank": rank,
            "world_size": world}


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


def complete_checkpoints(ckpt_dir) -> list:
    """The step_<N> folders of ``ckpt_dir`` whose save finished on every rank, oldest first."""
    from pyfused.parallelize import checkpoint

    root = Path(ckpt_dir)
    found = [d for d in root.glob("step_*") if re.fullmatch(r"step_\d+", d.name)
             and checkpoint.is_complete(d)] if root.is_dir() else []
    return sorted(found, key=lambda d: int(d.name.split("_")[1]))


def checkpoint_to_resume(args, rank):
    """The checkpoint folder to resume from (rank 0 decides, every rank gets its answer), or None."""
    from pyfused.parallelize import checkpoint

    if args.resume not in ("auto", "latest", "none") and not args.ckpt_dir:
        raise SystemExit(f"--resume {args.resume} needs --ckpt-dir")
    choice = [None]
    if rank == 0 and args.resume != "none" and args.ckpt_dir:
        if args.resume in ("auto", "latest"):
            done = complete_checkpoints(args.ckpt_dir)
            choice[0] = str(done[-1]) if done else None
        else:
            folder = Path(args.ckpt_dir) / args.resume
            choice[0] = str(folder) if checkpoint.is_complete(folder) else f"!{folder}"
    dist.broadcast_object_list(choice, src=0)
    folder = choice[0]
    if folder is not None and folder.startswith("!"):
        raise SystemExit(f"{folder[1:]} is not a complete checkpoint (its save did not finish)")
    if folder is None and args.resume == "latest":
        raise SystemExit(f"--resume latest: no complete checkpoint in {args.ckpt_dir}")
    return folder


def save_checkpoint(args, step, pm, opt, rank, mesh_sizes):
    """``step_<N>/`` under --ckpt-dir; an earlier folder of that step (a run this one replaces) is
    replaced only once the new one is complete."""
    from pyfused.parallelize import checkpoint

    folder = Path(args.ckpt_dir) / f"step_{step:06d}"
    checkpoint.save(folder, pm, opt, extra={"step": step, "mesh": list(mesh_sizes)},
                    storage_writer=_writer(args, folder, step, rank))


def load_checkpoint(folder, pm, opt) -> int:
    from pyfused.parallelize import checkpoint

    extra = checkpoint.load(folder, pm, opt, extra={"step": 0, "mesh": []})
    return int(extra["step"])


# ---- fault injection for the tests (TRAIN_LLM_FAULT=RANK:STEP:WHERE[,...]) ---------------------------
def _fault(args, rank, step, where) -> bool:
    wanted = os.environ.get("TRAIN_LLM_FAULT", "").split(",")
    spec = f"{rank}:{step}:{where}"
    if spec not in wanted or not args.ckpt_dir:
        return False
    try:  # only once: the restarted run finds the record and goes on
        os.close(os.open(Path(args.ckpt_dir) / f"fault-{spec.replace(':', '-')}",
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _die(rank, step, where):
    print(f"rank {rank}: killing itself ({where}, step {step}) as TRAIN_LLM_FAULT asks", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _writer(args, folder, step, rank):
    from torch.distributed.checkpoint import FileSystemWriter

    class DyingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            done = super().write_data(plan, planner)
            done.wait()  # this rank's shards are on disk; DCP has not finished the checkpoint
            _die(rank, step, "save")
            return done

    return DyingWriter(folder) if _fault(args, rank, step, "save") else FileSystemWriter(folder)


def main(argv=None):
    args = parse_args(argv)
    device = setup(args.timeout)
    train(args, device)
    dist.destroy_process_group()


def train(args, device):
    """Build, resume and train on the default process group (every rank calls it)."""
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
    resume_from = checkpoint_to_resume(args, rank)
    step = load_checkpoint(resume_from, pm, opt) if resume_from else 0
    if rank == 0:
        print(f"mesh dp={dp} x pp={args.pp} x tp={args.tp} (world {world}, {dist.get_backend()} on "
              f"{device.type}), sequence_parallel={not args.no_sp and args.tp > 1}; {args.model} with "
              f"{n_params / 1e6:.2f}M parameters, batch {args.batch} x {args.seq}; "
              f"{'resumed at' if resume_from else 'starting at'} step {step}"
              f"{f' from {resume_from}' if resume_from else ''}", flush=True)
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
        if _fault(args, rank, step, "train"):
            _die(rank, step, "train")
        grad_norm = pm.clip_grad_norm_(args.clip) if args.clip > 0 else None  # the full model's norm
        opt.step()
        loss = out.loss.detach().float().clone()
        with pyfused.comm.failures_named("train_llm (loss all-reduce)", dp_group):
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


if __name__ == "__main__":
    main()
