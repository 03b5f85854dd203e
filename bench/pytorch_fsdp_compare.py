#!/usr/bin/python3
"""PyTorch FSDP (FULL_SHARD, SHARD_GRAD_OP) on CPU with gloo, beside meshtrain (docs/bench-notes/fsdp.md).

Same model and step as bench/pytorch_compare.py and `meshtrain train --model.preset gpt2-small-cpu
--train.micro_batch 4`: GPT-2 (learned positions, pre-LN, tanh GELU, tied head), 6 layers, 6 heads,
width 384, seq 256, vocab 50304, micro-batch 4 per rank, AdamW (lr 6e-4, betas 0.9/0.95, wd 0.1
on matrices) and global-norm clipping at 1.0 (FSDP.clip_grad_norm_), fp32, random byte tokens.
Each transformer block is its own FSDP unit (transformer_auto_wrap_policy); the root unit holds
the embeddings, final LayerNorm and the tied head -- the same units as meshtrain.

Debian's python3-torch 1.13 cannot run FSDP on a CPU as shipped. Three things stop it, each
recorded with its exact message by `--probe` (see docs/bench-notes/fsdp.md):
  1. `import torch.distributed.fsdp` fails on Python 3.11 (ValueError: mutable default <class
     'torch.distributed._shard.sharded_tensor.metadata.TensorProperties'> for field
     tensor_properties is not allowed: use default_factory) -- torch 1.13 predates 3.11's stricter
     dataclass check. Workaround: make torch.distributed's field-less-__hash__ dataclasses hashable
     (unsafe_hash=True) while the package is imported.
  2. FSDP(...) asks for a CUDA device (AssertionError: Torch not compiled with CUDA enabled), and
     its lazy init refuses CPU ("FSDP does not support CPU only execution"); it also uses CUDA
     streams/events and Tensor.record_stream / .cuda(). Workaround (--shim, the default): the
     FSDP modules see a stand-in `torch.cuda` whose streams and events do nothing, the compute
     device is the CPU, record_stream is a no-op and .cuda() inside clip_grad_norm_ returns the
     tensor. Without CUDA streams FSDP issues every collective synchronously: no overlap at all.
  3. gloo has neither the flat all-gather nor reduce-scatter FSDP calls ("no support for
     _allgather_base in Gloo process group", "ProcessGroup gloo does not support
     _reduce_scatter_base", "ProcessGroupGloo does not support reduce_scatter"). Workaround:
     _all_gather_base = gloo all_gather into views of the output (same bytes);
     _reduce_scatter_base = gloo all_reduce of the whole buffer, keep own chunk (2x the bytes of a
     real reduce-scatter).
So the numbers are "PyTorch 1.13 FSDP, made to run on CPU", not stock PyTorch behaviour.

Per rank: 1 torch thread, OPENBLAS_NUM_THREADS=1 (as the DDP reference), tcmalloc preloaded when
present. Reports per run (one JSON line): tokens_per_s (global, median over timed steps), step_ms,
peak RSS per rank (VmHWM) and RSS at start (after import + process group, before the model), and
the resident model state after a step (sharded flat params, their grads, AdamW moments), by rank.

With --meshtrain BIN the same configurations of meshtrain (FULL_SHARD / SHARD_GRAD_OP, same ranks,
1 thread per rank) run interleaved with the PyTorch ones (order reversed every second repeat) and
their peak RSS is sampled from /proc; a markdown table with medians over repeats ends the output.

  /usr/bin/python3 bench/pytorch_fsdp_compare.py --probe
  /usr/bin/python3 bench/pytorch_fsdp_compare.py --ranks 2 --steps 5 --repeats 2 \\
      --meshtrain build-fsdpbench/meshtrain --data /tmp/fsdpdata
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4"
# The model and its configuration (gpt2-small-cpu) are bench/pytorch_compare.py's, this script's
# sibling (its folder is on sys.path when it runs).
from pytorch_compare import B, T, build_model  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--strategies", default="FULL_SHARD,SHARD_GRAD_OP")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--first-repeat", type=int, default=1,
                   help="number of the first repeat (even: start with the reversed order), to add repeats to a series")
    p.add_argument("--meshtrain", default="", help="meshtrain binary: run it side by side")
    p.add_argument("--data", default="/tmp/fsdpdata", help="meshtrain data dir (train.bin)")
    p.add_argument("--mt-steps", type=int, default=8)
    p.add_argument("--out", default="/tmp/mt_pt_fsdp")
    p.add_argument("--probe", action="store_true", help="show stock 1.13 failing, exact errors, then exit")
    p.add_argument("--no-shim", action="store_true", help="run without the CPU workarounds (fails)")
    p.add_argument("--no-tcmalloc", action="store_true")
    p.add_argument("--no-wait", action="store_true", help="do not wait for other benchmarks or load before each run")
    p.add_argument("--max-load", type=float, default=1.5,
                   help="before each run wait (polling every 30 s) until the 1-min load is at most this")
    p.add_argument("--load-wait", type=int, default=300, help="give up waiting for the load after this many s")
    p.add_argument("--port", type=int, default=29581)
    p.add_argument("--child", nargs=2, metavar=("STRATEGY", "RESULT_FILE"), help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------------------------------------
# Workarounds
def import_fsdp_py311():
    """Import torch.distributed.fsdp on Python 3.11 (workaround 1)."""
    import dataclasses
    orig = dataclasses.dataclass

    def dc(cls=None, /, **kw):
        def wrap(c):
            k = kw
            if (c.__module__.startswith("torch.distributed") and "__hash__" not in c.__dict__
                    and not kw.get("frozen") and not kw.get("unsafe_hash")):
                k = dict(kw, unsafe_hash=True)
            return orig(c, **k)
        return wrap if cls is None else wrap(cls)

    dataclasses.dataclass = dc
    try:
        import torch.distributed.fsdp  # noqa: F401
        import torch.distributed.fsdp.fully_sharded_data_parallel  # noqa: F401
    finally:
        dataclasses.dataclass = orig


def install_cpu_shim():
    """Workarounds 2 and 3 (see the module docstring)."""
    import types
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_mod
    import torch.distributed.fsdp.flat_param as flat_mod
    import torch.distributed.algorithms._comm_hooks.default_hooks as hooks_mod

    class Stream:
        def wait_stream(self, s): pass
        def synchronize(self): pass

    class Event:
        def record(self, *a): pass
        def synchronize(self): pass
        def query(self): return True

    cur = Stream()
    fake_cuda = types.SimpleNamespace(
        is_available=lambda: True, Stream=lambda *a, **k: Stream(), Event=lambda *a, **k: Event(),
        current_stream=lambda *a: cur, stream=lambda s: contextlib.nullcontext(),
        synchronize=lambda *a: None, current_device=lambda: 0, device_count=lambda: 0)

    class TorchProxy(types.ModuleType):
        def __getattr__(self, n):
            return fake_cuda if n == "cuda" else getattr(torch, n)

    proxy = TorchProxy("torch")
    for m in (fsdp_mod, flat_mod, hooks_mod):
        m.torch = proxy
    torch.Tensor.record_stream = lambda self, s: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    fsdp_mod.FullyShardedDataParallel._get_compute_device = lambda self, *a, **k: torch.device("cpu")

    def all_gather_base(out, inp, group=None, async_op=False):
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), inp, group=group)

    def reduce_scatter_base(out, inp, op=dist.ReduceOp.SUM, group=None, async_op=False):
        buf = inp.clone()
        dist.all_reduce(buf, op=op, group=group)
        out.copy_(buf.chunk(dist.get_world_size(group))[dist.get_rank(group)])

    dist._all_gather_base = all_gather_base
    dist._reduce_scatter_base = reduce_scatter_base


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def worker(rank, args, strategy, result_file):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import_fsdp_py311()
    if not args.no_shim:
        install_cpu_shim()
    import functools
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy, BackwardPrefetch
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    rss0 = rss_kib("VmRSS")
    torch.manual_seed(0)
    model = build_model(torch)
    Block = type(model.h[0])  # the wrapping unit, as meshtrain's
    fsdp = FSDP(model, sharding_strategy=getattr(ShardingStrategy, strategy),
                auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    flat = list(fsdp.parameters())
    decay = [p for p in flat]  # flat params mix matrices and vectors; wd on all (cost is the same)
    opt = torch.optim.AdamW(decay, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=True)
    g = torch.Generator().manual_seed(1234 + rank)
    times = []
    state = {}
    for i in range(args.warmup + args.steps):
        x = torch.randint(0, 256, (B, T), generator=g)
        y = torch.randint(0, 256, (B, T), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = fsdp(x, y)
        loss.backward()
        fsdp.clip_grad_norm_(1.0)
        opt.step()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        if i == 0:
            state = {"params_bytes": sum(p.numel() * p.element_size() for p in flat),
                     "grads_bytes": sum(p.grad.numel() * p.grad.element_size() for p in flat if p.grad is not None),
                     "optimizer_bytes": sum(t.numel() * t.element_size() for s in opt.state.values()
                                            for t in s.values() if torch.is_tensor(t))}
    rec = {"rank": rank, "strategy": strategy, "step_s": times, "loss": float(loss),
           "rss_start_kib": rss0, "vmhwm_kib": rss_kib("VmHWM"), **state}
    all_recs = [None] * args.ranks
    dist.all_gather_object(all_recs, rec)
    if rank == 0:
        with open(result_file, "w") as f:
            json.dump(all_recs, f)
    dist.barrier()
    dist.destroy_process_group()


def run_pytorch(args, strategy, tag):
    """one FSDP measurement in a fresh interpreter (thread environment as the DDP reference)"""
    res = os.path.join(args.out, f"pt_{tag}.json")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", strategy, res] + \
        [a for a in sys.argv[1:] if a != "--probe"]
    with open(os.path.join(args.out, f"pt_{tag}.log"), "w") as log:
        rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if rc != 0 or not os.path.exists(res):
        return {"engine": "pytorch-fsdp", "strategy": strategy, "ranks": args.ranks, "error": f"rc {rc}, see {log.name}"}
    recs = json.load(open(res))
    step = [max(r["step_s"][i] for r in recs) for i in range(len(recs[0]["step_s"]))]
    tps = [B * T * args.ranks / s for s in step]
    return {"engine": "pytorch-fsdp", "strategy": strategy, "ranks": args.ranks,
            "tokens_per_s": round(statistics.median(tps), 1), "step_ms": round(1000 * statistics.median(step), 1),
            "per_step_tokens_per_s": [round(t, 1) for t in tps], "final_loss": round(recs[0]["loss"], 4),
            "vmhwm_mib_per_rank": [round(r["vmhwm_kib"] / 1024, 1) for r in recs],
            "rss_start_mib_per_rank": [round(r["rss_start_kib"] / 1024, 1) for r in recs],
            "model_state_mib_per_rank": [round((r["params_bytes"] + r["grads_bytes"] + r["optimizer_bytes"]) / 2**20, 2)
                                         for r in recs],
            "state_bytes_rank0": {k: recs[0][k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes")}}


def rank_pids(binary):
    """pids of running meshtrain rank processes (argv: BIN train ...)"""
    out = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and os.path.realpath(argv[0].decode(errors="replace")) == binary and argv[1] == b"train":
            out.append(p)
    return out


def run_meshtrain(args, strategy, tag):
    binary = os.path.realpath(args.meshtrain)
    metrics = os.path.join(args.out, f"mt_{tag}.jsonl")
    cmd = [binary, "launch", "-n", str(args.ranks), "--threads", "1", "--", "train",
           "--model.preset", "gpt2-small-cpu", "--train.micro_batch", "4",
           "--data.train", os.path.join(args.data, "train.bin"), "--data.val", "",
           "--train.steps", str(args.mt_steps), "--train.eval_every", "0", "--train.sample_tokens", "0",
           "--log.print_every", "1000", "--train.threads", "1", "--parallel.strategy", strategy,
           "--log.metrics_out", metrics]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("LD_PRELOAD", None)  # tcmalloc is for PyTorch; meshtrain has its own caching allocator
    hwm = {}
    with open(os.path.join(args.out, f"mt_{tag}.log"), "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            for p in rank_pids(binary):
                try:
                    for line in open(f"/proc/{p}/status"):
                        if line.startswith("VmHWM:"):
                            hwm[p] = max(hwm.get(p, 0), int(line.split()[1]))
                except OSError:
                    pass
            time.sleep(0.3)
    if proc.returncode != 0:
        return {"engine": "meshtrain", "strategy": strategy, "ranks": args.ranks, "error": f"rc {proc.returncode}"}
    recs = [json.loads(l) for l in open(metrics) if l.strip()]
    steps = [r for r in recs if not r.get("final")][1:]
    fin = [r for r in recs if r.get("final")][0]
    res = fin.get("mem_resident_by_category_per_rank", [fin.get("mem_resident_by_category")])
    state = [sum(r.get(k, 0) for k in ("params", "grads", "optimizer")) / 2**20 for r in res]
    return {"engine": "meshtrain", "strategy": strategy, "ranks": args.ranks,
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in steps), 1),
            "step_ms": round(statistics.median(r["step_ms"] for r in steps), 1),
            "vmhwm_mib_per_rank": [round(v / 1024, 1) for v in sorted(hwm.values())],
            "model_state_mib_per_rank": [round(s, 2) for s in state],
            "tracked_peak_total_mib_per_rank": [round(sum(r.values()) / 2**20, 1)
                                                for r in fin.get("mem_peak_by_category_per_rank", [])]}


def probe():
    """Stock torch 1.13 on CPU: show each failure with its exact message."""
    import traceback
    import torch

    def last(e):
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    try:
        import torch.distributed.fsdp  # noqa: F401
        print("1. stock import: ok")
    except Exception as e:  # noqa: BLE001
        print("1. stock `import torch.distributed.fsdp` ->", last(e))
    import_fsdp_py311()
    print("   with the dataclass workaround: import ok")
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(30000 + os.getpid() % 20000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        FSDP(torch.nn.Linear(8, 8))
        print("2. FSDP(module) on CPU: ok")
    except Exception as e:  # noqa: BLE001
        print("2. FSDP(torch.nn.Linear(8, 8)) ->", last(e))
    try:
        m = FSDP(torch.nn.Linear(8, 8), device_id=torch.device("cpu"))
        m(torch.randn(2, 8))
        print("   with device_id=cpu: forward ok")
    except Exception as e:  # noqa: BLE001
        print("   FSDP(..., device_id=torch.device('cpu')) then forward ->", last(e))
    import torch.distributed.fsdp.fully_sharded_data_parallel as fsdp_mod
    orig = fsdp_mod.FullyShardedDataParallel._get_compute_device
    fsdp_mod.FullyShardedDataParallel._get_compute_device = lambda self, *a, **k: torch.device("cpu")
    try:
        FSDP(torch.nn.Linear(8, 8))(torch.randn(2, 8))
        print("   with the compute device forced to cpu: forward ok")
    except Exception as e:  # noqa: BLE001
        print("   with the compute device forced to cpu, forward ->", last(e))
    fsdp_mod.FullyShardedDataParallel._get_compute_device = orig
    for name, fn in [("dist._all_gather_base", lambda: dist._all_gather_base(torch.zeros(4), torch.zeros(4))),
                     ("dist._reduce_scatter_base", lambda: dist._reduce_scatter_base(torch.zeros(4), torch.zeros(4))),
                     ("dist.reduce_scatter", lambda: dist.reduce_scatter(torch.zeros(4), [torch.zeros(4)]))]:
        try:
            fn()
            print(f"3. gloo {name}: ok")
        except Exception as e:  # noqa: BLE001
            print(f"3. gloo {name} ->", last(e))
    dist.destroy_process_group()
    del traceback


def busy_ticks():
    """busy CPU ticks of the whole machine (all cores; /proc/stat user nice system irq softirq steal)"""
    f = open("/proc/stat").readline().split()
    return sum(int(f[i]) for i in (1, 2, 3, 6, 7, 8))


def children_cpu_s():
    """user+system CPU of every reaped descendant (the run's whole process tree once it has exited)"""
    import resource
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


WAIT_PATTERN = os.environ.get("WAIT_PATTERN", "ddp_overlap|ddp_scaling|train_throughput|pytorch_compare|two_nodes")


def wait_quiet(max_load, load_wait):
    """wait until no other benchmark runs on this shared 2-core machine, then for the load"""
    waited = 0
    while subprocess.call(["pgrep", "-f", WAIT_PATTERN], stdout=subprocess.DEVNULL) == 0:
        time.sleep(10)
        waited += 10
    if waited:
        print(f"# waited {waited} s for other benchmarks", file=sys.stderr, flush=True)
    waited = 0
    while True:
        load1 = float(open("/proc/loadavg").read().split()[0])
        if load1 <= max_load:
            break
        if waited >= load_wait:
            print(f"# 1-min load still {load1} after {waited} s; starting anyway", file=sys.stderr, flush=True)
            break
        time.sleep(30)
        waited += 30
    if waited:
        print(f"# waited {waited} s for the 1-min load to fall to {max_load} (now {load1})", file=sys.stderr, flush=True)


def table(rows):
    med = statistics.median
    print("\n| engine | strategy | ranks | tokens/s (median over repeats) | step ms | peak RSS MiB per rank (VmHWM) "
          "| model state MiB per rank | per-repeat tokens/s | load (1/5/15 min) before | CPU used by others during the run |")
    print("|---|---|---:|---:|---:|---|---|---|---|---|")
    keys = []
    for r in rows:
        if (r["engine"], r["strategy"]) not in keys:
            keys.append((r["engine"], r["strategy"]))
    for eng, strat in sorted(keys, key=lambda k: (k[1], k[0])):
        rs = [r for r in rows if r["engine"] == eng and r["strategy"] == strat]
        ok = [r for r in rs if "error" not in r]
        if not ok:
            print(f"| {eng} | {strat} | {rs[0]['ranks']} | failed: {rs[0]['error']} | | | | | | |")
            continue
        hwm = [max(r["vmhwm_mib_per_rank"]) for r in ok if r["vmhwm_mib_per_rank"]]
        per = " / ".join("%.0f" % r["tokens_per_s"] for r in ok)
        load = ", ".join(r["load_before"].replace(" ", "/") for r in ok)
        print(f"| {eng} | {strat} | {ok[0]['ranks']} | {med(r['tokens_per_s'] for r in ok):.0f} | "
              f"{med(r['step_ms'] for r in ok):.0f} | {med(hwm) if hwm else float('nan'):.0f} (max over ranks) | "
              f"{ok[-1]['model_state_mib_per_rank'][0]:.1f} | {per} | {load} | " +
              ", ".join(f"{r['other_cpu_s']:.0f} core-s ({100 * r['other_cpu_share']:.0f}%)" for r in ok) + " |")


def main():
    args = parse()
    if args.child:
        import torch.multiprocessing as mp
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(args.port)
        mp.spawn(worker, args=(args, args.child[0], args.child[1]), nprocs=args.ranks, join=True)
        return
    if not args.no_tcmalloc and "tcmalloc" not in os.environ.get("LD_PRELOAD", ""):
        if os.path.exists(TCMALLOC):
            env = dict(os.environ, LD_PRELOAD=(TCMALLOC + " " + os.environ.get("LD_PRELOAD", "")).strip())
            os.execve(sys.executable, [sys.executable] + sys.argv, env)
        print(f"warning: {TCMALLOC} not found; PyTorch will be slower than it can be", file=sys.stderr)
    if args.probe:
        probe()
        return
    os.makedirs(args.out, exist_ok=True)
    import torch
    print(f"# torch {torch.__version__}, python {sys.version.split()[0]}, LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}, "
          f"shim {'off' if args.no_shim else 'on'}; raw output in {args.out}", file=sys.stderr, flush=True)
    runs = []
    for s in args.strategies.split(","):
        runs.append(("pt", s))
        if args.meshtrain:
            runs.append(("mt", s))
    rows = []
    for r in range(args.first_repeat, args.first_repeat + args.repeats):
        order = runs if r % 2 else runs[::-1]
        for eng, s in order:
            tag = f"{s}_n{args.ranks}_r{r}"
            if not args.no_wait:
                wait_quiet(args.max_load, args.load_wait)
            load = " ".join(open("/proc/loadavg").read().split()[:3])
            with open(os.path.join(args.out, "uptime.txt"), "a") as f:
                f.write(f"{eng} {tag}: " + subprocess.run(["uptime"], capture_output=True, text=True).stdout)
            print(f"# repeat {r}: {eng} {s}, load {load}", file=sys.stderr, flush=True)
            b0, c0, t0 = busy_ticks(), children_cpu_s(), time.time()
            row = run_pytorch(args, s, tag) if eng == "pt" else run_meshtrain(args, s, tag)
            # CPU-seconds used during the run by everything outside this run's process tree (other
            # users' jobs, this script's sampler), and that as a share of the machine's cores
            other = (busy_ticks() - b0) / os.sysconf("SC_CLK_TCK") - (children_cpu_s() - c0)
            row["other_cpu_s"] = round(other, 1)
            row["other_cpu_share"] = round(other / ((time.time() - t0) * os.cpu_count()), 3)
            row["repeat"] = r
            row["load_before"] = load
            print(json.dumps(row), flush=True)
            rows.append(row)
    table(rows)


if __name__ == "__main__":
    main()
