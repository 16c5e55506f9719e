"""Models, data and the single-process reference for the ``pyfused.fully_shard`` tests.

Sizes are odd on purpose: 37 rows split 10/10/10/7 at world 4 and 13/13/11 at world 3, a 5-row head
leaves rank 3 of 4 an empty shard. The MLP also has a frozen layer and a never-used parameter.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 37
VOCAB = 53


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return x + F.gelu(self.fc(self.norm(x)))


class MLP(nn.Module):
    def __init__(self, depth: int = 3, width: int = WIDTH):
        super().__init__()
        self.inp = nn.Linear(13, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 5)
        self.unused = nn.Linear(4, 6)

    def forward(self, x):
        x = self.frozen(self.inp(x))
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def units(self):
        return list(self.blocks)

    def loss(self, batch):
        x, y = batch
        return F.mse_loss(self(x), y)


class GRULM(nn.Module):
    """Embedding, two GRUs (each its own unit: nn.GRU keeps a flat list of its weights), LM head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.gru1 = nn.GRU(16, 24, batch_first=True)
        self.gru2 = nn.GRU(24, 24, batch_first=True)
        self.head = nn.Linear(24, VOCAB)

    def forward(self, ids):
        h, _ = self.gru1(self.embed(ids))
        h, _ = self.gru2(h)
        return self.head(h)

    def units(self):
        return [self.gru1, self.gru2]

    def loss(self, ids):
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class Llama(nn.Module):
    """A transformers LlamaForCausalLM from a tiny config (random weights, nothing downloaded)."""

    def __init__(self):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=44,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=32, use_cache=False)
        self.lm = LlamaForCausalLM(cfg)

    def forward(self, ids, labels=None):
        out = self.lm(input_ids=ids, labels=labels, use_cache=False)
        return out.logits if labels is None else out.loss

    def units(self):
        return list(self.lm.model.layers)

    def loss(self, ids):
        return self(ids, labels=ids)


MODELS = {"mlp": MLP, "gru": GRULM, "llama": Llama}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name]()


def batch(name: str, step: int, micro: int, rows: int):
    """The global micro-batch ``micro`` of ``step``: the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    if name == "mlp":
        return torch.randn(rows, 13, generator=g), torch.randn(rows, 5, generator=g)
    return torch.randint(0, VOCAB, (rows, 9), generator=g)


def rows_of(b, lo: int, hi: int):
    return tuple(t[lo:hi] for t in b) if isinstance(b, tuple) else b[lo:hi]


def make_optimizer(model: nn.Module):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def reference_training(name: str, steps: int, micro: int, rows: int, max_norm: float):
    """The single-process model trained on the global batches; returns (model, grad norms, the
    first step's gradients before clipping)."""
    model = build(name)
    opt = make_optimizer(model)
    norms, first = [], None
    for step in range(steps):
        for k in range(micro):
            (model.loss(batch(name, step, k, rows)) / micro).backward()
        if first is None:
            first = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad()
    return model, norms, first


def clone(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def unshard_growth(model: nn.Module, unit: nn.Module) -> int:
    """Bytes that gathering ``unit`` (a resharded fully_shard unit of ``model``) adds, by torch's
    MemTracker tracking ``model``: its all-gather output and its gathered parameters, if nothing
    else is held."""
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        before = max(v["Total"] for v in tracker.get_tracker_snapshot("current").values())
        unit.unshard()
        peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    unit.reshard()
    return peak - before

