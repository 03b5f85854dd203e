#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (OUT_DIR/<target>/): small valid files made from
the repository's fixtures and configs, and a few edge cases. Deterministic; scripts/fuzz.sh runs it
into build-fuzz/seeds before every campaign. Usage: python3 fuzz/make_corpus.py OUT_DIR"""
import json
import os
import shutil
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = None  # set by main() from the command line


def put(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def safetensors(tensors, metadata=None):
    header, body = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(body), len(body) + len(raw)]}
        body += raw
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + body


def shard(version, tokens, vocab=0, text_bytes=0):
    header = [0] * 256
    header[0], header[1], header[2] = 20240520, version, len(tokens)
    header[3], header[4], header[5] = vocab, text_bytes & 0xFFFFFFFF, text_bytes >> 32
    fmt = "<%d%s" % (len(tokens), "H" if version == 1 else "I")
    return struct.pack("<256i", *header) + struct.pack(fmt, *tokens)


def main():
    global OUT
    if len(sys.argv) != 2:
        sys.exit("usage: python3 fuzz/make_corpus.py OUT_DIR")
    OUT = os.path.abspath(sys.argv[1])
    shutil.rmtree(OUT, ignore_errors=True)

    # safetensors: an f32 matrix and a bf16 vector with metadata, a scalar, empty and zero-size cases.
    f32 = struct.pack("<6f", 0.5, -1.0, 2.0, 3.5, 0.0, 1e-3)
    put("safetensors", "two_tensors.safetensors",
        safetensors({"wte.weight": ("F32", [2, 3], f32), "ln.bias": ("BF16", [4], b"\x80\x3f" * 4)}, {"format": "pt"}))
    put("safetensors", "scalar_i64.safetensors", safetensors({"step": ("I64", [], struct.pack("<q", 7))}))
    put("safetensors", "zero_size.safetensors", safetensors({"empty": ("F16", [0, 5], b"")}))
    put("safetensors", "empty_header.safetensors", safetensors({}))
    put("safetensors", "truncated.safetensors", safetensors({"w": ("F32", [2, 3], f32)})[:-4])

    # token shards: version 1 (uint16) and 2 (uint32), with and without the text record, empty.
    put("token_shard", "v1.bin", shard(1, [15496, 995, 11, 50256, 0, 1, 2]))
    put("token_shard", "v1_described.bin", shard(1, [1, 2, 3, 4], vocab=256, text_bytes=4))
    put("token_shard", "v2.bin", shard(2, [128000, 9906, 1917, 128001]))
    put("token_shard", "v2_described.bin", shard(2, [70000, 5], vocab=70001, text_bytes=12))
    put("token_shard", "empty.bin", shard(1, []))

    # JSON lines: documents with escapes and Unicode, blank and CRLF lines, a bad line.
    head = open(os.path.join(ROOT, "tests", "data", "fixtures", "tinyshakespeare_head.txt"), encoding="utf-8").read()
    paras = [p for p in head.split("\n\n") if p.strip()][:6]
    put("jsonl", "shakespeare.jsonl", "".join(json.dumps({"text": p}) + "\n" for p in paras))
    put("jsonl", "mixed.jsonl",
        '{"text": "caf\\u00e9 \\ud83d\\ude00", "id": 1}\n\n{"id": 2, "text": "tab\\there", "meta": {"a": [1, 2.5e3]}}\r\n'
        '   \n{"text": ""}\n')
    put("jsonl", "bad_line.jsonl", '{"text": "ok"}\n{"text": 3}\n[1, 2]\n{"other": "x"}\nnot json\n')

    # tokenizer.json: the byte-level BPE fixture, cut to its byte alphabet and first merges.
    tok = json.load(open(os.path.join(ROOT, "tests", "data", "fixtures", "bpe-llama3-style.json"), encoding="utf-8"))
    model = tok["model"]
    keep = {t: i for t, i in model["vocab"].items() if i < 300}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ") if isinstance(m, str) else m
        if a in keep and b in keep and (a + b) in keep:
            merges.append(m)
    model["vocab"], model["merges"] = keep, merges
    tok["added_tokens"] = [t for t in tok["added_tokens"] if t["id"] < 300]
    put("tokenizer_json", "bpe_small.json", json.dumps(tok, ensure_ascii=False))
    gpt2_like = {"version": "1.0", "added_tokens": [{"id": 5, "content": "<|endoftext|>", "special": True,
                                                     "single_word": False, "lstrip": False, "rstrip": False,
                                                     "normalized": False}],
                 "normalizer": None,
                 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                   "use_regex": True},
                 "post_processor": {"type": "ByteLevel", "trim_offsets": True},
                 "decoder": {"type": "ByteLevel"},
                 "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False,
                           "vocab": {"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120ab": 4}, "merges": ["a b", "\u0120 ab"]}}
    put("tokenizer_json", "gpt2_like.json", json.dumps(gpt2_like, ensure_ascii=False))

    # config.json: GPT-2, Llama 3.1 (rope scaling), Qwen 2 and Mistral shapes (small dimensions).
    put("hf_config", "gpt2.json", json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2,
                                              "n_positions": 64, "vocab_size": 100, "layer_norm_epsilon": 1e-6,
                                              "activation_function": "gelu_new", "n_inner": None}))
    put("hf_config", "llama31.json", json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "head_dim": 16,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 128, "rope_type": "llama3"}}))
    put("hf_config", "qwen2.json", json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": 1024, "max_window_layers": 2, "hidden_act": "silu"}))
    put("hf_config", "mistral.json", json.dumps({
        "model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "vocab_size": 320, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
        "hidden_act": "silu"}))
    put("hf_config", "moe_refused.json", json.dumps({"model_type": "mixtral", "hidden_size": 64, "num_local_experts": 4}))

    # TOML run configs: the shipped configs and a small one with every section.
    for name in sorted(os.listdir(os.path.join(ROOT, "configs"))):
        if name.endswith(".toml"):
            put("toml_config", name, open(os.path.join(ROOT, "configs", name), encoding="utf-8").read())
    put("toml_config", "small.toml",
        '[model]\npreset = "llama-tiny"\nseq_len = 32\n\n[data]\ntrain = "t.bin"\n\n'
        '[train]\nsteps = 3\nlr = 1e-3\ndtype = "bf16"\ncheckpoint_async = true\n\n'
        '[parallel]\nstrategy = "FULL_SHARD"\ntp = 2\n\n[log]\nprint_every = 1\n')
    put("toml_config", "bad_key.toml", '[train]\nstepz = 3\n')

    # Checkpoint metadata: trainer.json of a full and a blended run, a sharded checkpoint's index.
    put("checkpoint_meta", "trainer.json", json.dumps({"format_version": 1, "format": "full", "step": 20,
                                                       "adam_steps": 20, "micro_batches": 40, "num_params": 1234,
                                                       "has_optimizer": True}, indent=2))
    put("checkpoint_meta", "trainer_blend.json", json.dumps({
        "format_version": 2, "format": "sharded", "step": 5, "adam_steps": 5, "micro_batches": 5, "num_params": 99,
        "has_optimizer": True, "data": {"samples": 80, "datasets": [{"pattern": "a/*.bin", "samples": 60},
                                                                     {"pattern": "b.bin", "samples": 20}]}}))
    put("checkpoint_meta", "metadata.json", json.dumps({
        "format": "meshtrain-sharded", "format_version": 2, "step": 5, "adam_steps": 5, "micro_batches": 5,
        "num_params": 24, "model": {"arch": "llama", "n_layer": 1, "n_embd": 4, "vocab_size": 6},
        "layout": {"dp": 2}, "piece_columns": ["file", "offset", "row0", "rows", "col0", "cols", "crc32c"],
        "files": [{"name": "rank0.safetensors", "rank": 0, "bytes": 200, "crc32c": "1a2b3c4d"},
                  {"name": "rank1.safetensors", "rank": 1, "bytes": 200, "crc32c": "00000000"}],
        "tensors": {"wte.weight": {"dtype": "F32", "shape": [6, 4], "hf_transposed": False,
                                   "pieces": [[0, 64, 0, 3, 0, 4, "deadbeef"], [1, 64, 3, 3, 0, 4, "0badf00d"]]}}}, indent=1))


if __name__ == "__main__":
    main()
