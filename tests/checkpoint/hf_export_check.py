#!/usr/bin/python3
"""model.hf_config and `meshtrain export` against Hugging Face transformers itself.

For a tiny GPT-2 (a 64-row position table trained at seq_len 16, layer_norm_epsilon 1e-6), a tiny
Llama 3.1-style model (grouped-query attention, rope_scaling of rope_type llama3 with an
original_max_position_embeddings short enough that the scaling changes most frequencies, untied
head), a tiny Llama with a tied head and a tiny Qwen 2 (q/k/v biases, tied): meshtrain trains a few steps from the config.json
(model.hf_config), exports the checkpoint (meshtrain export), transformers loads the export with
AutoModelForCausalLM.from_pretrained, and its loss on the first training batch must equal the loss
meshtrain reports for that batch when it starts from the same checkpoint with lr 0.

The rotary frequencies meshtrain derives (meshtrain model-info --json) must equal transformers'
ROPE_INIT_FUNCTIONS["llama3"] for the tiny config and for Llama 3.1 8B's. With --write-vectors the
latter are written to tests/model/fixtures/llama31_rope_inv_freq.json, which test_model checks without
Python.

usage: hf_export_check.py MESHTRAIN_BINARY [--write-vectors]
Exits 77 (skipped) when torch or transformers is not installed (pip install transformers).
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

try:
    import torch
    import torch.nn.functional as F
    import transformers
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
except Exception as e:  # ImportError, or a transformers too old / too new for this torch
    print(f"SKIP: torch and transformers are needed (pip install transformers): {e}")
    sys.exit(77)

B, T, STEPS = 2, 16, 3
TOL = 1e-5  # observed <= 1e-7; a model run without its rope scaling is off by 2.6e-4
HERE = os.path.dirname(os.path.abspath(__file__))
VECTORS = os.path.join(HERE, "..", "model", "fixtures", "llama31_rope_inv_freq.json")

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 256,
        "layer_norm_epsilon": 1e-6, "activation_function": "gelu_new", "n_inner": None}
LLAMA31 = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
           "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16}}
LLAMA_TIED = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 32,
              "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "tie_word_embeddings": True}
QWEN2 = {"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_sliding_window": False,
         "sliding_window": 64, "hidden_act": "silu"}
# meta-llama/Llama-3.1-8B config.json (the fields the rotary frequencies depend on).
LLAMA31_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


def write_shard(path, tokens):  # llm.c layout: 256 int32 header (magic, version, count), uint16 tokens
    head = [20240520, 1, len(tokens)] + [0] * 253
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *head) + struct.pack("<%dH" % len(tokens), *tokens))


def run(cmd):
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=240)
    if out.returncode != 0:
        print(" ".join(cmd))
        print(out.stdout[-3000:])
        raise RuntimeError(f"{cmd[1]} exited {out.returncode}")
    return out.stdout


def hf_inv_freq(cfg):
    conf = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](conf, "cpu")
    return inv.tolist()


def mt_inv_freq(mt, work, name, cfg):
    path = os.path.join(work, name + ".json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    return json.loads(run([mt, "model-info", "--hf-config", path, "--json"]))["rope_inv_freq"]


def check_rope(mt, work, name, cfg):
    ref, got = hf_inv_freq(cfg), mt_inv_freq(mt, work, name, cfg)
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got)) if len(ref) == len(got) else float("inf")
    ok = worst <= 1e-6
    print(f"{'ok  ' if ok else 'FAIL'} rope {name}: {len(got)} frequencies, max relative difference {worst:.2e}")
    return ok, ref


def check_model(mt, work, name, cfg, tokens):
    d = os.path.join(work, name)
    os.makedirs(d)
    cfg_path, ck, out = os.path.join(d, "config.json"), os.path.join(d, "ck"), os.path.join(d, "hf")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    shard = os.path.join(work, "train.bin")
    common = [mt, "train", "--model.hf_config", cfg_path, "--model.seq_len", str(T), "--data.train", shard,
              "--data.val", "", "--train.micro_batch", str(B), "--train.threads", "1", "--train.sample_tokens", "0",
              "--log.print_every", "100"]
    run(common + ["--train.steps", str(STEPS), "--train.lr", "3e-3", "--train.warmup_steps", "0",
                  "--train.checkpoint_dir", ck])
    run([mt, "export", "--checkpoint", ck, "--out", out])
    metrics = os.path.join(d, "m.jsonl")
    run(common + ["--train.steps", "1", "--train.lr", "0", "--train.init_from", ck, "--log.metrics_out", metrics])
    with open(metrics) as f:
        got = [json.loads(l) for l in f if '"final"' not in l][0]["loss"]
    model = AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    x = torch.tensor([tokens[b * T: b * T + T] for b in range(B)])
    y = torch.tensor([tokens[b * T + 1: b * T + T + 1] for b in range(B)])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), y.reshape(-1)).item()
    ok = abs(ref - got) <= TOL
    print(f"{'ok  ' if ok else 'FAIL'} {name} ({type(model).__name__}): transformers loss {ref:.7f}, "
          f"meshtrain {got:.7f}, |diff| {abs(ref - got):.1e} (tolerance {TOL:.0e})")
    return ok


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    mt = os.path.abspath(sys.argv[1])
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    text = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
            "it was the age of foolishness, it was the epoch of belief. ") * 20
    tokens = list(text.encode())
    ok = True
    with tempfile.TemporaryDirectory(prefix="mt_hf_export_") as work:
        write_shard(os.path.join(work, "train.bin"), tokens)
        for name, cfg in (("gpt2", GPT2), ("llama31", LLAMA31), ("llama_tied", LLAMA_TIED), ("qwen2", QWEN2)):
            try:
                ok &= check_model(mt, work, name, cfg, tokens)
            except Exception as e:
                print(f"FAIL {name}: {e}")
                ok = False
        r1, _ = check_rope(mt, work, "llama31_tiny", LLAMA31)
        r2, ref8b = check_rope(mt, work, "llama31_8b", LLAMA31_8B)
        ok &= r1 and r2
        if "--write-vectors" in sys.argv:
            with open(VECTORS, "w") as f:
                json.dump({"source": f"transformers {transformers.__version__} ROPE_INIT_FUNCTIONS['llama3']",
                           "config": LLAMA31_8B, "inv_freq": ref8b}, f, indent=1)
                f.write("\n")
            print(f"wrote {VECTORS}")
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
