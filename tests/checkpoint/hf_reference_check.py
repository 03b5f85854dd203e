#!/usr/bin/python3
"""Hugging Face weight compatibility, checked against an independent implementation.

Builds small GPT-2 and Llama models in PyTorch with Hugging Face's conventions written out here
(GPT2LMHeadModel: Conv1D weights stored [in, out], fused c_attn split q|k|v, tanh GELU, tied head;
LlamaForCausalLM: nn.Linear [out, in], rotate-half RoPE, RMSNorm eps 1e-5, SwiGLU, grouped-query
attention with each key/value head serving n_head / n_kv_head consecutive query heads), saves random
weights as a safetensors file with Hugging Face names, and has `meshtrain train --train.init_from`
that file with lr 0: the loss of meshtrain's first step must equal the reference's loss on the same
tokens. A weight read in the wrong layout, order or convention changes that loss by far more than
the tolerance.

usage: hf_reference_check.py MESHTRAIN_BINARY
Exits 77 (skipped) when PyTorch is not installed (apt-get install python3-torch).
"""
import json
import math
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIP: python3-torch is not installed (apt-get install -y python3-torch); "
          "the Hugging Face layout check needs it")
    sys.exit(77)

B, T = 2, 32  # micro-batch and sequence: the first training batch is tokens[0 : B*T + 1]
TOL = 2e-5


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        flat = t.detach().to(torch.float32).contiguous().view(-1).tolist()
        blob = struct.pack("<%df" % len(flat), *flat)
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def write_shard(path, tokens):  # llm.c layout: 256 int32 header (magic, version, count), uint16 tokens
    head = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *head) + struct.pack("<%dH" % len(tokens), *tokens))


def causal_attention(q, k, v):  # [B, nh, T, hd]
    hd = q.shape[-1]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
    att = att.masked_fill(~mask, float("-inf")).softmax(-1)
    return att @ v


def gpt2(L, nh, C, V):
    hd, Fh = C // nh, 4 * C
    r = lambda *s: torch.randn(*s) * 0.2
    W = {"wte.weight": r(V, C), "wpe.weight": r(T, C), "ln_f.weight": 1 + r(C), "ln_f.bias": r(C)}
    for l in range(L):
        p = f"h.{l}."
        W.update({p + "ln_1.weight": 1 + r(C), p + "ln_1.bias": r(C),
                  p + "attn.c_attn.weight": r(C, 3 * C), p + "attn.c_attn.bias": r(3 * C),  # Conv1D: [in, out]
                  p + "attn.c_proj.weight": r(C, C), p + "attn.c_proj.bias": r(C),
                  p + "ln_2.weight": 1 + r(C), p + "ln_2.bias": r(C),
                  p + "mlp.c_fc.weight": r(C, Fh), p + "mlp.c_fc.bias": r(Fh),
                  p + "mlp.c_proj.weight": r(Fh, C), p + "mlp.c_proj.bias": r(C)})

    def logits(ids):
        x = W["wte.weight"][ids] + W["wpe.weight"][: ids.shape[1]]
        for l in range(L):
            p = f"h.{l}."
            h = F.layer_norm(x, (C,), W[p + "ln_1.weight"], W[p + "ln_1.bias"], 1e-5)
            q, k, v = (h @ W[p + "attn.c_attn.weight"] + W[p + "attn.c_attn.bias"]).split(C, dim=-1)
            heads = lambda t: t.view(B, T, nh, hd).transpose(1, 2)
            y = causal_attention(heads(q), heads(k), heads(v)).transpose(1, 2).reshape(B, T, C)
            x = x + y @ W[p + "attn.c_proj.weight"] + W[p + "attn.c_proj.bias"]
            h = F.layer_norm(x, (C,), W[p + "ln_2.weight"], W[p + "ln_2.bias"], 1e-5)
            h = F.gelu(h @ W[p + "mlp.c_fc.weight"] + W[p + "mlp.c_fc.bias"], approximate="tanh")
            x = x + h @ W[p + "mlp.c_proj.weight"] + W[p + "mlp.c_proj.bias"]
        x = F.layer_norm(x, (C,), W["ln_f.weight"], W["ln_f.bias"], 1e-5)
        return x @ W["wte.weight"].T  # tied head

    return W, logits


def llama(L, nh, nkv, C, Fh, V, theta):
    hd = C // nh
    r = lambda *s: torch.randn(*s) * 0.2
    W = {"model.embed_tokens.weight": r(V, C), "model.norm.weight": 1 + r(C), "lm_head.weight": r(V, C)}
    for l in range(L):
        p = f"model.layers.{l}."
        W.update({p + "input_layernorm.weight": 1 + r(C), p + "post_attention_layernorm.weight": 1 + r(C),
                  p + "self_attn.q_proj.weight": r(nh * hd, C), p + "self_attn.k_proj.weight": r(nkv * hd, C),
                  p + "self_attn.v_proj.weight": r(nkv * hd, C), p + "self_attn.o_proj.weight": r(C, nh * hd),
                  p + "mlp.gate_proj.weight": r(Fh, C), p + "mlp.up_proj.weight": r(Fh, C),
                  p + "mlp.down_proj.weight": r(C, Fh)})

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w

    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def rope(x):  # rotate_half: dimension i pairs with i + hd/2
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def logits(ids):
        x = W["model.embed_tokens.weight"][ids]
        for l in range(L):
            p = f"model.layers.{l}."
            h = rms(x, W[p + "input_layernorm.weight"])
            q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, T, nh, hd).transpose(1, 2)
            k = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
            v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, T, nkv, hd).transpose(1, 2)
            q, k = rope(q), rope(k)
            k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
            y = causal_attention(q, k, v).transpose(1, 2).reshape(B, T, nh * hd)
            x = x + y @ W[p + "self_attn.o_proj.weight"].T
            h = rms(x, W[p + "post_attention_layernorm.weight"])
            x = x + (F.silu(h @ W[p + "mlp.gate_proj.weight"].T) * (h @ W[p + "mlp.up_proj.weight"].T)) @ W[
                p + "mlp.down_proj.weight"].T
        return rms(x, W["model.norm.weight"]) @ W["lm_head.weight"].T

    return W, logits


def check(mt, work, name, preset, W, logits, V, prefix=""):
    tokens = [int(t) for t in torch.randint(0, V, (B * T * 4 + 1,))]
    shard, weights, metrics = (os.path.join(work, f"{name}.{x}") for x in ("bin", "safetensors", "jsonl"))
    write_shard(shard, tokens)
    write_safetensors(weights, {prefix + k: v for k, v in W.items()})
    ids = torch.tensor(tokens[: B * T]).view(B, T)
    tg = torch.tensor(tokens[1: B * T + 1]).view(B, T)
    with torch.no_grad():
        ref = F.cross_entropy(logits(ids).reshape(-1, V), tg.reshape(-1)).item()
    cmd = [mt, "train", "--model.preset", preset, "--data.train", shard, "--data.val", "",
           "--train.steps", "1", "--train.lr", "0", "--train.micro_batch", str(B), "--train.threads", "1",
           "--train.sample_tokens", "0", "--train.init_from", weights, "--log.metrics_out", metrics]
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, MESHTRAIN_MPI="0"))
    if out.returncode != 0:
        print(out.stdout)
        print(f"FAIL {name}: meshtrain exited {out.returncode}")
        return False
    got = [json.loads(l) for l in open(metrics) if l.strip() and not json.loads(l).get("final")][0]["loss"]
    ok = abs(got - ref) <= TOL
    print(f"{'ok  ' if ok else 'FAIL'} {name}: reference loss {ref:.7f}, meshtrain {got:.7f}, "
          f"difference {got - ref:+.2e} (tolerance {TOL:g})")
    return ok


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    mt = sys.argv[1]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        W, f = gpt2(L=2, nh=2, C=32, V=256)
        ok = check(mt, work, "gpt2", "gpt2-tiny", W, f, 256)
        # GPT2LMHeadModel's state dict spells the same tensors with a "transformer." prefix.
        ok &= check(mt, work, "gpt2-prefixed", "gpt2-tiny", W, f, 256, prefix="transformer.")
        W, f = llama(L=2, nh=4, nkv=2, C=32, Fh=64, V=256, theta=10000.0)
        ok &= check(mt, work, "llama", "llama-tiny", W, f, 256)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
