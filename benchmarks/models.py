"""Benchmark models, built in code (no downloads), sized for a 2-thread CPU step of ~50-300 ms.

Each ``make_*`` returns a :class:`Bench`: the model, a fixed pool of batches and a
``loss_fn(batch)`` that does the forward pass and returns the scalar loss (the
signature :meth:`nanguard.Guard.step` expects). Batches are generated once from a
fixed seed, so every configuration trains on exactly the same data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Bench:
    name: str
    model: nn.Module
    batches: List[Any]
    loss_fn: Callable[[Any], torch.Tensor]
    desc: str
    meta: Dict[str, Any] = field(default_factory=dict)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def make_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.01)


# --------------------------------------------------------------------------- MLP


class MLP(nn.Module):
    def __init__(self, d_in: int = 1024, width: int = 2048, depth: int = 4, n_out: int = 10) -> None:
        super().__init__()
        layers: List[nn.Module] = []
        d = d_in
        for _ in range(depth):
            layers += [nn.Linear(d, width), nn.GELU()]
            d = width
        layers.append(nn.Linear(d, n_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def make_mlp(batch: int = 512, n_batches: int = 4, seed: int = 0) -> Bench:
    torch.manual_seed(seed)
    d_in, width, depth = 1024, 1024, 4
    model = MLP(d_in, width, depth)
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(batch, d_in, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(n_batches)]

    def loss_fn(b):
        x, y = b
        return F.cross_entropy(model(x), y)

    return Bench("mlp", model, batches, loss_fn,
                 f"MLP {d_in}-{'-'.join([str(width)] * depth)}-10, GELU, batch {batch}")


# --------------------------------------------------------------------------- CNN


class SmallCNN(nn.Module):
    """CIFAR-sized conv net: 3 conv-BN-ReLU stages with pooling, then a linear head."""

    def __init__(self, n_out: int = 10, c: int = 32) -> None:
        super().__init__()

        def stage(ci, co):
            return nn.Sequential(nn.Conv2d(ci, co, 3, padding=1, bias=False), nn.BatchNorm2d(co), nn.ReLU(),
                                 nn.Conv2d(co, co, 3, padding=1, bias=False), nn.BatchNorm2d(co), nn.ReLU(),
                                 nn.MaxPool2d(2))

        self.features = nn.Sequential(stage(3, c), stage(c, 2 * c), stage(2 * c, 4 * c))
        self.head = nn.Linear(4 * c * 4 * 4, n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def make_cnn(batch: int = 64, n_batches: int = 4, seed: int = 0) -> Bench:
    torch.manual_seed(seed)
    model = SmallCNN()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [(torch.randn(batch, 3, 32, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
               for _ in range(n_batches)]

    def loss_fn(b):
        x, y = b
        return F.cross_entropy(model(x), y)

    return Bench("cnn", model, batches, loss_fn,
                 f"CNN 3x[conv-BN-ReLU x2 + maxpool] (32-64-128 ch) + linear, 32x32x3 input, batch {batch}")


# --------------------------------------------------------------------------- GPT


@dataclass
class GPTConfig:
    vocab_size: int = 2048
    block_size: int = 128
    n_layer: int = 6
    n_head: int = 4
    n_embd: int = 256
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(),
                                 nn.Linear(4 * cfg.n_embd, cfg.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT-style decoder: token + position embedding, pre-LN blocks, final LN, tied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight") or n.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def make_gpt(batch: int = 8, n_batches: int = 4, seed: int = 0, cfg: GPTConfig | None = None) -> Bench:
    torch.manual_seed(seed)
    cfg = cfg or GPTConfig()
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    T = cfg.block_size
    batches = []
    for _ in range(n_batches):
        seq = torch.randint(0, cfg.vocab_size, (batch, T + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))

    def loss_fn(b):
        x, y = b
        logits = model(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    return Bench("gpt", model, batches, loss_fn,
                 f"GPT {cfg.n_layer}L/{cfg.n_head}H/{cfg.n_embd}d, vocab {cfg.vocab_size}, ctx {T}, "
                 f"tied head, batch {batch}", meta={"cfg": cfg})


def faulty_lm_loss(model: nn.Module, fault_at: int, state: Dict[str, int]) -> Callable[[Any], torch.Tensor]:
    """An LM loss written as ``-log(softmax(logits))[target]`` (a common hand-rolled form).

    At training step ``fault_at`` (``state["step"]``, set by the training loop, so
    a replay of that step faults again) the logits get a 1e4 temperature spike:
    softmax underflows to exactly 0 for most targets and ``log(0) = -inf``, a log
    of a zero in the loss, born in the forward pass of that step.
    """

    def loss_fn(b):
        x, y = b
        logits = model(x)
        if state.get("step") == fault_at:
            logits = logits * 1e4
        p = torch.softmax(logits, dim=-1)
        return -torch.log(p.gather(-1, y.unsqueeze(-1))).mean()

    return loss_fn


MAKERS = {"mlp": make_mlp, "cnn": make_cnn, "gpt": make_gpt}
