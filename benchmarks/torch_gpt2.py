"""The issue's PyTorch reference, measured here: python benchmarks/torch_gpt2.py [--batch 16 64]

GPT-2 small as in nanoGPT (vocab 50257, or nanoGPT's padded 50304; tied head, LayerNorm with
bias, tanh GELU, flash SDPA, dropout 0), bf16 autocast, fused AdamW (lr 6e-4, weight decay 0.1
on >= 2-D params), global norm clipping at 1.0. Timed like benchmarks/throughput.py: random
tokens, 3 warm-up steps, median of 5 repeats of 10 back-to-back steps, each repeat closed by
torch.cuda.synchronize().
Needs a CUDA GPU and torch (the GPU image has it; jaxllm itself does not depend on torch).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

T, D, L, H = 1024, 768, 12, 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.fc_out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (a.view(b, t, H, D // H).transpose(1, 2) for a in (q, k, v))  # (B, H, T, Dh)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, D))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, self.vocab).float(), targets.view(-1))


def bench(batch: int, vocab: int, compile_: bool, steps: int = 10, repeats: int = 5) -> float:
    torch.manual_seed(0)
    model = GPT(vocab).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-4,
        betas=(0.9, 0.95),
        fused=True,
    )
    fwd = torch.compile(model) if compile_ else model
    x = torch.randint(0, 50257, (batch, T + 1), device="cuda")  # GPT-2's real token ids
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / steps)
    return batch * T / statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    p.add_argument("--vocab", type=int, nargs="+", default=[50257, 50304])
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| batch | vocab | mode | tokens/s |\n|---|---|---|---|")
    for b in args.batch:
        for vocab in args.vocab:
            for compile_ in (False, True):
                tps = bench(b, vocab, compile_)
                mode = "torch.compile" if compile_ else "eager"
                print(f"| {b} | {vocab} | {mode} | {tps:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
