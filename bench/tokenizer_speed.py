#!/usr/bin/env python3
"""Tokenizer encoding speed, meshtrain vs the Hugging Face `tokenizers` library, side by side.

Writes a JSON-lines corpus (one document per non-empty line of the given text files), then for
each tokenizer.json times (a) the library's encode_batch over the documents with 1 thread and with
every core (RAYON_NUM_THREADS), text already in memory, and (b) `meshtrain prepare --threads 1`
and `--threads N` over the same file (reading and JSON parsing included, so meshtrain's figure is
the conservative one). Prints MB/s of input text.

usage: tokenizer_speed.py MESHTRAIN TEXT_FILE... [--tokenizer tokenizer.json ...]
"""
import json
import os
import subprocess
import sys
import tempfile
import time


def lib_speed(tok_path, docs, threads):
    code = f"""
import json, sys, time
from tokenizers import Tokenizer
t = Tokenizer.from_file({tok_path!r})
docs = [json.loads(l)["text"] for l in open({docs!r}, encoding="utf-8")]
n = sum(len(d.encode()) for d in docs)
best = 1e9
for _ in range(3):
    t0 = time.perf_counter(); t.encode_batch(docs, add_special_tokens=False); best = min(best, time.perf_counter() - t0)
print(n / best / 1e6)
"""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    return float(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout)


def ours(binary, tok_path, docs, threads, out):
    best = 0.0
    for _ in range(3):
        r = subprocess.run([binary, "prepare", "--input", docs, "--out", out, "--tokenizer", "hf", "--tokenizer-file", tok_path,
                            "--threads", str(threads), "--val-fraction", "0"], capture_output=True, text=True, check=True)
        mbs = float(r.stdout.split(" MB/s")[0].rsplit("(", 1)[1])
        best = max(best, mbs)
    return best


def main():
    args = sys.argv[1:]
    binary = args.pop(0)
    toks = []
    while "--tokenizer" in args:
        i = args.index("--tokenizer")
        toks.append(args[i + 1])
        del args[i:i + 2]
    with tempfile.TemporaryDirectory() as tmp:
        docs = os.path.join(tmp, "docs.jsonl")
        n = 0
        with open(docs, "w", encoding="utf-8") as f:
            for p in args:
                for line in open(p, encoding="utf-8"):
                    if line.strip():
                        f.write(json.dumps({"text": line}) + "\n")
                        n += 1
        cores = os.cpu_count()
        print(f"{n} documents, {os.path.getsize(docs) / 1e6:.1f} MB of JSON lines; {cores} cores")
        print("| tokenizer.json | tokenizers 1 thread | meshtrain 1 thread | tokenizers %d threads | meshtrain %d threads |" % (cores, cores))
        print("|---|---|---|---|---|")
        for t in toks:
            a = lib_speed(t, docs, 1)
            b = ours(binary, t, docs, 1, os.path.join(tmp, "o"))
            c = lib_speed(t, docs, cores)
            d = ours(binary, t, docs, cores, os.path.join(tmp, "o"))
            print(f"| {os.path.basename(t)} | {a:.1f} MB/s | {b:.1f} MB/s ({b / a:.2f}x) | {c:.1f} MB/s | {d:.1f} MB/s ({d / c:.2f}x) |")


if __name__ == "__main__":
    main()
