#!/usr/bin/python3
"""LoRA checkpoints against Hugging Face transformers + PEFT.

For a tiny Llama (grouped-query attention, adapters on q, k, v, o, gate, up, down) and a tiny GPT-2
(adapters on c_attn, attn.c_proj, c_fc, mlp.c_proj): meshtrain trains a base model, exports it,
fine-tunes it with LoRA from that base (train.init_from), then

  * `meshtrain export --adapter` (adapter_config.json + adapter_model.safetensors) loaded with
    peft.PeftModel.from_pretrained onto the exported base must give meshtrain's validation loss,
  * the merged export (`meshtrain export`, no adapters) loaded by transformers alone must give it too,

where meshtrain's loss is its validation loss before the first step of a run resumed from the LoRA
checkpoint at lr 0 (the same batches).

usage: lora_peft_check.py MESHTRAIN_BINARY
Exits 77 (skipped) when torch, transformers or peft is not installed (pip install transformers peft).
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
    import peft
    from transformers import AutoModelForCausalLM
    from peft import PeftModel
except Exception as e:  # ImportError, or versions that do not fit together
    print(f"SKIP: torch, transformers and peft are needed (pip install transformers peft): {e}")
    sys.exit(77)

B, T = 2, 16
TOL = 1e-5

GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": 256,
        "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "n_inner": None}
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
CASES = (("llama", LLAMA, "q,k,v,o,gate,up,down"), ("gpt2", GPT2, "c_attn,o,up,down"))


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


def final(metrics):
    with open(metrics) as f:
        return [json.loads(l) for l in f if '"final"' in l][-1]


def torch_loss(model, tokens):
    x = torch.tensor([tokens[b * T: b * T + T] for b in range(B)])
    y = torch.tensor([tokens[b * T + 1: b * T + T + 1] for b in range(B)])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).double(), y.reshape(-1)).item()


def check(mt, work, name, cfg, targets, tokens):
    d = os.path.join(work, name)
    os.makedirs(d)
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    shard = os.path.join(work, "train.bin")
    common = [mt, "train", "--model.hf_config", cfg_path, "--model.seq_len", str(T), "--data.train", shard,
              "--data.val", "", "--train.micro_batch", str(B), "--train.threads", "1", "--train.sample_tokens", "0",
              "--log.print_every", "100", "--train.warmup_steps", "0"]
    lora = ["--lora.rank", "4", "--lora.alpha", "8", "--lora.targets", targets]
    base_ck, lora_ck = os.path.join(d, "base_ck"), os.path.join(d, "lora_ck")
    run(common + ["--train.steps", "3", "--train.lr", "3e-3", "--train.checkpoint_dir", base_ck])
    base_hf, adapter, merged = os.path.join(d, "base_hf"), os.path.join(d, "adapter"), os.path.join(d, "merged")
    run([mt, "export", "--checkpoint", base_ck, "--out", base_hf])
    run(common + lora + ["--train.steps", "4", "--train.lr", "2e-2", "--train.init_from", base_ck,
                         "--train.checkpoint_dir", lora_ck])
    run([mt, "export", "--checkpoint", lora_ck, "--out", adapter, "--adapter"])
    run([mt, "export", "--checkpoint", lora_ck, "--out", merged])
    metrics = os.path.join(d, "m.jsonl")
    run(common + lora + ["--train.steps", "5", "--train.lr", "0", "--train.resume", lora_ck, "--train.init_from", base_ck, "--data.val", shard,
                         "--train.eval_at_start", "true", "--train.eval_batches", "1", "--train.eval_every", "1000",
                         "--train.checkpoint_dir", os.path.join(d, "eval_ck"), "--log.metrics_out", metrics])
    got = final(metrics)["val_loss_start"]
    base = AutoModelForCausalLM.from_pretrained(base_hf, torch_dtype=torch.float32).eval()
    plain = torch_loss(base, tokens)
    with_adapter = torch_loss(PeftModel.from_pretrained(base, adapter).eval(), tokens)
    merged_loss = torch_loss(AutoModelForCausalLM.from_pretrained(merged, torch_dtype=torch.float32).eval(), tokens)
    ok = abs(with_adapter - got) <= TOL and abs(merged_loss - got) <= TOL and abs(plain - got) > 100 * TOL
    print(f"{'ok  ' if ok else 'FAIL'} {name}: meshtrain {got:.7f}, transformers + peft adapter {with_adapter:.7f}, "
          f"merged export {merged_loss:.7f} (tolerance {TOL:.0e}); the base alone {plain:.7f}")
    return ok


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    mt = os.path.abspath(sys.argv[1])
    print(f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}")
    text = ("It was the best of times, it was the worst of times, it was the age of wisdom, "
            "it was the age of foolishness, it was the epoch of belief. ") * 20
    tokens = list(text.encode())
    ok = True
    with tempfile.TemporaryDirectory(prefix="mt_lora_peft_") as work:
        write_shard(os.path.join(work, "train.bin"), tokens)
        for name, cfg, targets in CASES:
            try:
                ok &= check(mt, work, name, cfg, targets, tokens)
            except Exception as e:
                print(f"FAIL {name}: {e}")
                ok = False
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
