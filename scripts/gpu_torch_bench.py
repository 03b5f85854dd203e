#!/usr/bin/env python3
"""GPT-2 124M training throughput in PyTorch, eager and torch.compile, for gpu_check.sh.

The model meshtrain's gpt2-124m preset describes (12 layers of width 768, 12 heads, learned
positions, LayerNorm, tanh GELU, vocabulary 50257 padded to 50304, output tied to the token
table), trained with AdamW under bf16 autocast on random tokens. Prints one line per mode:
  result eager|compile B 8, T 1024: N tokens/s, MFU M% (steps 3-S, peak P FLOP/s)
MFU counts 6 x (parameters without the position table) + 12 x layers x width x T FLOPs per token,
as meshtrain does.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

V, VP, L, C, H = 50257, 50304, 12, 768, 12


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.out = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, H, C // H).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(nn.Module):
    def __init__(self, T):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VP, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block() for _ in range(L))
        self.lnf = nn.LayerNorm(C)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.lnf(x), self.wte.weight)[..., :V]
        return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))


def measure(model, B, T, steps, peak, label):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    x = torch.randint(0, V, (B, T + 1), device="cuda")
    rates = []
    for s in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if s >= 2:  # the first steps compile and warm up
            rates.append(B * T / (time.perf_counter() - t0))
    tok = sum(rates) / len(rates)
    n = sum(p.numel() for p in model.parameters()) - T * C
    flops = 6.0 * n + 12.0 * L * C * T
    mfu = "MFU %.1f%%" % (100.0 * flops * tok / peak) if peak > 0 else "MFU n/a"
    print("result %s B %d, T %d: %.0f tokens/s, %s (steps 3-%d, peak %g FLOP/s, loss %.3f)"
          % (label, B, T, tok, mfu, steps, peak, loss.item()), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--peak", type=float, default=0.0)
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT2(a.seq).cuda()
    measure(model, a.batch, a.seq, a.steps, a.peak, "eager")
    measure(torch.compile(model), a.batch, a.seq, a.steps, a.peak, "compile")


if __name__ == "__main__":
    main()
