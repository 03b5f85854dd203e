#!/usr/bin/python3
"""PyTorch reference for the meshtrain benchmark config (single-process and DDP throughput).

The same model as `meshtrain train --model.preset gpt2-small-cpu --train.micro_batch 4`: GPT-2
(learned positions, pre-LayerNorm blocks, tanh-GELU MLP, tied LM head), 6 layers, 6 heads, width
384, seq 256, vocab 50304, micro-batch 4 (1024 tokens per step and rank), AdamW (lr 6e-4,
betas 0.9/0.95, weight decay 0.1 on matrices, eps 1e-8) and global-norm clipping at 1.0, trained
in eager mode on random token ids < 256 (the byte-level data meshtrain's benchmark uses).

Modes (--mode, comma-separated; default eager,ddp):
  eager  one process: fp32, and bf16 with torch.autocast("cpu", torch.bfloat16) (--dtypes)
  ddp    DistributedDataParallel with gloo on --ranks processes (torch.multiprocessing.spawn),
         1 thread each (torch.set_num_threads(1), OPENBLAS_NUM_THREADS=1), default 25 MB buckets;
         tokens/s counts the global batch (ranks x 1024 tokens)
Threads (--threads, eager only): "default" leaves PyTorch as it comes (Debian's 1.13: 1 intra-op
thread; its GEMMs go to OpenBLAS, which starts its own threads, one per core) -- the fastest
setting for that build; "1" pins everything to one thread (OPENBLAS_NUM_THREADS=1), the fair
partner for meshtrain's 1-thread runs; "2" sets 2 torch threads and 2 OpenBLAS threads.

Prints one JSON line per measurement: {"mode", "dtype", "threads", "ranks", "tokens_per_s"
(median over timed steps), "step_ms" (median), "steps", "per_step_tokens_per_s"}.

Install (Debian 12):  apt-get install -y python3-torch libgoogle-perftools4
Run with /usr/bin/python3 (the interpreter that has torch). tcmalloc: the script re-executes
itself with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4 when that library exists and
is not preloaded yet (--no-tcmalloc to skip): with glibc malloc PyTorch re-faults its big buffers
every step and runs several times slower.

  /usr/bin/python3 bench/pytorch_compare.py --steps 10 --mode eager,ddp --dtypes fp32,bf16
  # side by side with meshtrain (same config, dtype, threads; torch "default" vs meshtrain 2 threads):
  /usr/bin/python3 bench/pytorch_compare.py --mode eager --threads default,1 --meshtrain build-bench/meshtrain
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--bf16-steps", type=int, default=2,
                   help="timed steps of the bf16 run (1 warm-up step; bf16 is very slow without AVX512-BF16)")
    p.add_argument("--mode", default="eager,ddp")
    p.add_argument("--dtypes", default="fp32,bf16",
                   help="eager dtypes: fp32,bf16 (bf16 runs only once, at the first --threads setting: "
                        "its GEMMs do not use OpenBLAS, so the thread setting makes no difference)")
    p.add_argument("--threads", default="default", help="eager: default | 1 | 2 (comma list ok)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb")
    p.add_argument("--foreach", type=int, default=1, help="AdamW foreach implementation (1 = yes)")
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--meshtrain", default="", help="meshtrain binary: after each eager measurement run "
                   "meshtrain on the same config, dtype and thread count (default threads -> 2) side by side")
    p.add_argument("--data", default="/tmp/mt_benchdata/train.bin", help="token shard for --meshtrain")
    p.add_argument("--mt-steps", type=int, default=8, help="meshtrain steps (the first is not counted)")
    return p.parse_args()


# Configuration of gpt2-small-cpu
L, H, C, T, V, B = 6, 6, 384, 256, 50304, 4


def build_model(torch):
    nn = torch.nn
    F = torch.nn.functional

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn = nn.Linear(C, 3 * C)
            self.c_proj = nn.Linear(C, C)
            # a plain attribute, not a buffer: DDP would broadcast buffers, and gloo has no bool
            self.mask = torch.tril(torch.ones(T, T, dtype=torch.bool)).view(1, 1, T, T)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.c_attn(x).split(C, dim=2)
            q = q.view(b, t, H, c // H).transpose(1, 2)
            k = k.view(b, t, H, c // H).transpose(1, 2)
            v = v.view(b, t, H, c // H).transpose(1, 2)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // H))
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
            att = F.softmax(att, dim=-1)
            y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
            return self.c_proj(y)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = nn.LayerNorm(C)
            self.attn = Attn()
            self.ln_2 = nn.LayerNorm(C)
            self.c_fc = nn.Linear(C, 4 * C)
            self.c_proj = nn.Linear(4 * C, C)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(V, C)
            self.wpe = nn.Embedding(T, C)
            self.h = nn.ModuleList([Block() for _ in range(L)])
            self.ln_f = nn.LayerNorm(C)
            self.lm_head = nn.Linear(C, V, bias=False)
            self.lm_head.weight = self.wte.weight  # tied
            for n, p in self.named_parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, 0.0, 0.02)
                else:
                    nn.init.zeros_(p) if n.endswith("bias") else nn.init.ones_(p)

        def forward(self, idx, targets):
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.wte(idx) + self.wpe(pos)
            for blk in self.h:
                x = blk(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, V), targets.view(-1))

    return GPT()


def make_optimizer(torch, model, foreach):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=6e-4, betas=(0.9, 0.95), eps=1e-8)
    if foreach:
        try:
            return torch.optim.AdamW(groups, foreach=True, **kw)
        except TypeError:
            pass
    return torch.optim.AdamW(groups, **kw)


def train_loop(torch, model, opt, steps, warmup, bf16, ddp_model=None, sync=None):
    g = torch.Generator().manual_seed(1234)
    net = ddp_model if ddp_model is not None else model
    times = []
    for i in range(warmup + steps):
        x = torch.randint(0, 256, (B, T), generator=g)
        y = torch.randint(0, 256, (B, T), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = net(x, y)
        else:
            loss = net(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if sync:
            sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times, float(loss)


def report(mode, dtype, threads, ranks, times, loss):
    tok = B * T * ranks
    tps = [tok / t for t in times]
    print(json.dumps({"mode": mode, "dtype": dtype, "threads": threads, "ranks": ranks,
                      "tokens_per_s": round(statistics.median(tps), 1),
                      "step_ms": round(1000 * statistics.median(times), 1), "steps": len(times),
                      "final_loss": round(loss, 4),
                      "per_step_tokens_per_s": [round(x, 1) for x in tps]}), flush=True)


def eager(args, dtype, threads):
    import torch
    if threads != "default":
        torch.set_num_threads(int(threads))
    torch.manual_seed(0)
    model = build_model(torch)
    opt = make_optimizer(torch, model, args.foreach)
    bf16 = dtype == "bf16"
    times, loss = train_loop(torch, model, opt, args.bf16_steps if bf16 else args.steps,
                             min(args.warmup, 1) if bf16 else args.warmup, bf16)
    report("eager", dtype, threads, 1, times, loss)


def ddp_worker(rank, args):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    model = build_model(torch)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb)
    opt = make_optimizer(torch, model, args.foreach)
    times, loss = train_loop(torch, model, opt, args.steps, args.warmup, False, ddp_model=ddp)
    if rank == 0:
        report("ddp-gloo", "fp32", 1, args.ranks, times, loss)
    dist.barrier()
    dist.destroy_process_group()


def run_meshtrain(args, dtype, threads):
    """meshtrain on the same config; the median of its per-step tokens_per_s after the first step"""
    import subprocess
    import tempfile
    t = "2" if threads == "default" else threads
    with tempfile.NamedTemporaryFile(suffix=".jsonl") as f:
        cmd = [args.meshtrain, "train", "--model.preset", "gpt2-small-cpu", "--train.micro_batch", str(B),
               "--data.train", args.data, "--data.val", "", "--train.steps", str(args.mt_steps),
               "--train.eval_every", "0", "--train.sample_tokens", "0", "--log.print_every", "1000",
               "--train.dtype", dtype, "--train.threads", t, "--log.metrics_out", f.name]
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        rc = subprocess.call(cmd, env=env, stdout=subprocess.DEVNULL)
        recs = [json.loads(l) for l in open(f.name) if l.strip()]
    steps = [r for r in recs if not r.get("final")][1:]
    tps = [r["tokens_per_s"] for r in steps]
    print(json.dumps({"mode": "meshtrain", "dtype": dtype, "threads": t, "ranks": 1,
                      "tokens_per_s": round(statistics.median(tps), 1) if tps else None,
                      "steps": len(tps), "per_step_tokens_per_s": [round(x, 1) for x in tps]}), flush=True)
    return rc


def run_child(args, mode, dtype, threads):
    """each measurement in a fresh interpreter, with the thread environment it needs"""
    import subprocess
    env = dict(os.environ)
    if threads == "1" or mode == "ddp":
        env["OPENBLAS_NUM_THREADS"] = "1"
        env["OMP_NUM_THREADS"] = "1"
    elif threads == "2":
        env["OPENBLAS_NUM_THREADS"] = "2"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, dtype, threads] + sys.argv[1:]
    return subprocess.call(cmd, env=env)


def main():
    if len(sys.argv) > 4 and sys.argv[1] == "--child":
        mode, dtype, threads = sys.argv[2:5]
        sys.argv = [sys.argv[0]] + sys.argv[5:]
        args = parse()
        if mode == "eager":
            eager(args, dtype, threads)
        else:
            import torch.multiprocessing as mp
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(args.port))
            mp.spawn(ddp_worker, args=(args,), nprocs=args.ranks, join=True)
        return
    args = parse()
    if not args.no_tcmalloc and "tcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        if os.path.exists(TCMALLOC):
            env = dict(os.environ, LD_PRELOAD=(TCMALLOC + " " + os.environ.get("LD_PRELOAD", "")).strip())
            os.execve(sys.executable, [sys.executable] + sys.argv, env)
        print(f"warning: {TCMALLOC} not found (apt-get install libgoogle-perftools4); "
              "PyTorch will be slower than it can be", file=sys.stderr)
    try:
        import torch
    except ImportError:
        sys.exit("torch not importable with %s: apt-get install -y python3-torch" % sys.executable)
    print(f"# torch {torch.__version__}, LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}, "
          f"default intra-op threads {torch.get_num_threads()}", file=sys.stderr, flush=True)
    rc = 0
    for mode in args.mode.split(","):
        if mode == "eager":
            for threads in args.threads.split(","):
                for dtype in args.dtypes.split(","):
                    if dtype == "bf16" and threads != args.threads.split(",")[0]:
                        continue
                    rc |= run_child(args, "eager", dtype, threads)
                    if args.meshtrain:
                        rc |= run_meshtrain(args, dtype, threads)
        elif mode == "ddp":
            rc |= run_child(args, "ddp", "fp32", "1")
        else:
            sys.exit(f"unknown mode {mode}")
    sys.exit(rc)


if __name__ == "__main__":
    main()
