"""Models, data and rank bodies shared by the DDP tests (no tests of its own).

Every rank builds its model from ``seed + rank`` (different on purpose: DDP must broadcast rank 0's
parameters and buffers) and draws its batch of step ``s`` from ``(seed, s, rank)``, so any rank can
also build every other rank's batch and train the single-process full-batch reference.

Models and batches live on ``tests.utils.device_of_ranks()``: the CPU with gloo ranks, the GPU when the
pool runs NCCL (``PYFUSED_TEST_BACKEND=nccl``), so the same tests check the CUDA path (comm stream,
Triton bucket kernel) on a machine with a GPU. TF32 is turned off there: the references are fp32.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence

from tests.utils import assert_close, test_device as device_of_ranks

VOCAB, T_MAX = 23, 7


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(13, 37), nn.Linear(37, 29), nn.Linear(29, 5)

    def forward(self, x):
        return self.fc3(torch.tanh(self.fc2(F.gelu(self.fc1(x)))))


class BackwardsMLP(MLP):
    """MLP with its layers registered last-used first: reverse registration order (the initial
    buckets) is then the opposite of the order backward produces gradients -- the case the bucket
    rebuild from the observed order is for."""

    def __init__(self):
        nn.Module.__init__(self)
        self.fc3, self.fc2, self.fc1 = nn.Linear(29, 5), nn.Linear(37, 29), nn.Linear(13, 37)


class CNN(nn.Module):
    def __init__(self, norm="batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, padding=1)
        self.norm = nn.BatchNorm2d(6) if norm == "batch" else nn.GroupNorm(2, 6)
        self.conv2 = nn.Conv2d(6, 5, 3, stride=2)
        self.head = nn.Linear(5, 4)

    def forward(self, x):
        h = F.relu(self.conv2(F.relu(self.norm(self.conv1(x)))))
        return self.head(h.mean(dim=(2, 3)))


class Recurrent(nn.Module):
    """Embedding -> LSTM/GRU over packed variable-length sequences -> classifier on the last state."""

    def __init__(self, cell="lstm"):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(8, 11, num_layers=2, batch_first=True)
        self.head = nn.Linear(11, 3)

    def forward(self, tokens, lengths):
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True,
                                      enforce_sorted=False)
        _, h = self.rnn(packed)
        h = h[0] if isinstance(h, tuple) else h
        return self.head(h[-1])


class Branchy(nn.Module):
    """``a`` always used; ``b`` only when asked; ``never`` never (unused-parameter tests)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.never = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.out = nn.Linear(6, 2)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.a(x))
        if use_b:
            h = h + torch.relu(self.b(h))
        return self.out(h)


def build(kind: str, seed: int) -> nn.Module:
    dev = device_of_ranks()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(seed)
    return {"mlp": MLP, "backwards": BackwardsMLP, "cnn": CNN, "cnn_gn": lambda: CNN("group"),
            "lstm": Recurrent, "gru": lambda: Recurrent("gru"), "branchy": Branchy}[kind]().to(dev)


def batch(kind: str, seed: int, step: int, rank: int, micro: int = 0):
    g = torch.Generator().manual_seed(10_000 * seed + 100 * step + 10 * micro + rank)
    dev = device_of_ranks()
    if kind in ("mlp", "backwards"):
        out = (torch.randn(6, 13, generator=g), torch.randn(6, 5, generator=g))
    elif kind in ("cnn", "cnn_gn"):
        out = (torch.randn(4, 3, 9, 9, generator=g), torch.randint(0, 4, (4,), generator=g))
    elif kind in ("lstm", "gru"):
        lengths = torch.randint(1, T_MAX + 1, (5,), generator=g)  # stays on the CPU (pack_padded)
        tokens = torch.randint(0, VOCAB, (5, T_MAX), generator=g)
        return (tokens.to(dev), lengths, torch.randint(0, 3, (5,), generator=g).to(dev))
    elif kind == "branchy":
        out = (torch.randn(5, 6, generator=g), torch.randn(5, 2, generator=g))
    else:
        raise ValueError(kind)
    return tuple(t.to(dev) for t in out)


def full_batch(kind, seed, step, world, micro=0):
    parts = [batch(kind, seed, step, r, micro) for r in range(world)]
    return tuple(torch.cat(xs) for xs in zip(*parts))


def loss_of(kind: str, model, data, **fwd):
    if kind in ("mlp", "backwards", "branchy"):
        x, y = data
        out = model(x, **fwd) if fwd else model(x)
        return F.mse_loss(out.float(), y)
    if kind in ("cnn", "cnn_gn"):
        x, y = data
        return F.cross_entropy(model(x).float(), y)
    tokens, lengths, y = data
    return F.cross_entropy(model(tokens, lengths).float(), y)


def make_opt(name: str, params, **kw):
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    if name == "adamw_groups":  # per-group hyper-parameters: no decay on biases
        decay = [p for p in params if p.dim() > 1]
        other = [p for p in params if p.dim() <= 1]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": other, "weight_decay": 0.0, "lr": 3e-3}], lr=1e-2)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=0.05)
    if name == "rmsprop":
        return torch.optim.RMSprop(params, lr=1e-2, momentum=0.5)
    raise ValueError(name)


def train_step(kind, model, opt, micro_batches: List, *, ddp: bool, clip=None, autocast=None,
               fwd=None, set_to_none=True):
    """One optimizer step over ``micro_batches`` (all but the last inside ``no_sync``).
    Returns the clip norm (or None)."""
    opt.zero_grad(set_to_none=set_to_none)
    for k, data in enumerate(micro_batches):
        sync = contextlib.nullcontext() if not ddp or k == len(micro_batches) - 1 else model.no_sync()
        amp = (torch.autocast(device_of_ranks().type, dtype=autocast) if autocast is not None
               else contextlib.nullcontext())
        with sync:
            with amp:
                loss = loss_of(kind, model, data, **(fwd or {}))
            loss.backward()
    norm = clip(model) if clip is not None else None
    opt.step()
    return norm


def torch_clip(max_norm, norm_type):
    return lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm, norm_type)


def pyfused_clip(max_norm, norm_type, pass_params=False):
    import pyfused

    return lambda m: pyfused.clip_grad_norm_(list(m.parameters()) if pass_params else m, max_norm,
                                             norm_type)


def compare_training(rank, world, kind, *, opt="sgd", steps=3, micro=1, seed=1, ours=None,
                     theirs=None, full=True, clip=None, autocast=None, tol=torch.float32,
                     set_to_none=True):
    """Train the same model with torch DDP, pyfused DDP and (``full``) one process on the full
    batch; every parameter and buffer must agree after ``steps`` steps."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    from pyfused.layers import DistributedDataParallel

    ours, theirs = dict(ours or {}), dict(theirs or {})
    comm_hook = theirs.pop("comm_hook", None)
    local = build(kind, seed + rank)  # differs per rank: the broadcast must fix it
    ref = TorchDDP(copy.deepcopy(local), **theirs)
    if comm_hook is not None:
        ref.register_comm_hook(None, comm_hook)
    mine = DistributedDataParallel(copy.deepcopy(local), **ours)
    opt_ref = make_opt(opt, ref.parameters())
    opt_mine = mine.wrap_optimizer(make_opt(opt, mine.parameters()))
    single = build(kind, seed)  # rank 0's initial model
    opt_single = make_opt(opt, single.parameters())
    clip_max, clip_type, clip_params = (tuple(clip) + (False,))[:3] if clip else (None, None, False)
    norms = []
    for s in range(steps):
        mbs = [batch(kind, seed, s, rank, k) for k in range(micro)]
        n_ref = train_step(kind, ref, opt_ref, mbs, ddp=True, autocast=autocast,
                           clip=torch_clip(clip_max, clip_type) if clip else None)
        n_mine = train_step(kind, mine, opt_mine, mbs, ddp=True, autocast=autocast,
                            clip=pyfused_clip(clip_max, clip_type, clip_params) if clip else None,
                            set_to_none=set_to_none)
        if clip:
            norms.append((float(n_ref), float(n_mine)))
        if full:
            fb = [full_batch(kind, seed, s, world, k) for k in range(micro)]
            train_step(kind, single, opt_single, fb, ddp=False, autocast=autocast,
                       clip=torch_clip(clip_max, clip_type) if clip else None)
    mine.synchronize_params()
    tag = f"{kind} world={world} rank={rank} ours={ours}"
    for (name, p), q in zip(ref.module.named_parameters(), mine.module.parameters()):
        assert_close(q, p, tol, f"{tag}: parameter {name} vs torch DDP")
    for (name, b), c in zip(ref.module.named_buffers(), mine.module.buffers()):
        assert_close(c.float(), b.float(), tol, f"{tag}: buffer {name} vs torch DDP")
    if full:
        for (name, p), q in zip(single.named_parameters(), mine.module.parameters()):
            assert_close(q, p, tol, f"{tag}: parameter {name} vs single-process full batch")
    for a, b in norms:
        assert abs(a - b) <= 1e-5 * max(abs(a), 1.0), f"{tag}: clip norm {b} != torch's {a}"
    return norms


def group_still_in_step(world) -> bool:
    """After an error, the group must still work: one all-reduce, the same result everywhere."""
    t = torch.ones(1, device=device_of_ranks())
    dist.all_reduce(t)
    return int(t.item()) == world


def error_text(fn, *args, **kwargs) -> Dict[str, str]:
    from pyfused.comm import InputError

    try:
        fn(*args, **kwargs)
    except InputError as e:
        return {"type": "InputError", "msg": str(e)}
    except Exception as e:  # noqa: BLE001 - the test wants to see anything else that was raised
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None, "msg": ""}
