#!/usr/bin/env python3
"""`meshtrain prepare --format chat` against Hugging Face's apply_chat_template.

For the chatml and llama3 templates, the token shard meshtrain writes from
tests/data/fixtures/chat_small.jsonl must equal, record by record, what transformers'
apply_chat_template(messages, tokenize=True) gives for the same tokenizer.json (the small
fixture tokenizer with the templates' special tokens added), the records joined by the
tokenizer's end-of-text token; and the loss mask must equal its assistant-token mask (the
templates mark each assistant message's content and closing token as {% generation %}).
Without transformers, the template is rendered with jinja2 and encoded with `tokenizers` (the
same two steps apply_chat_template takes) and the mask is not checked. Exit 77 (skipped) when
neither is installed.

usage: chat_template_check.py MESHTRAIN_BINARY
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "fixtures")
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TEMPLATES = {
    "chatml": (
        "{%- for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{%- else %}{{ message['content'] + '<|im_end|>' }}{%- endif %}"
        "{{ '\\n' }}"
        "{%- endfor %}"),
    "llama3": (
        "{{- bos_token }}"
        "{%- for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
        "{% endgeneration %}{%- else %}{{ message['content'] | trim + '<|eot_id|>' }}{%- endif %}"
        "{%- endfor %}"),
}


def records():
    out = []
    with open(os.path.join(FIX, "chat_small.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if "messages" in r:
                out.append(r["messages"])
            else:
                out.append([{"role": "user", "content": r["prompt"]},
                            {"role": "assistant", "content": r["completion"]}])
    return out


def read_u32_shard(path):
    with open(path, "rb") as f:
        data = f.read()
    h = struct.unpack("<256i", data[:1024])
    n = h[2]
    if h[1] == 1:
        return list(struct.unpack("<%dH" % n, data[1024:1024 + 2 * n]))
    return list(struct.unpack("<%dI" % n, data[1024:1024 + 4 * n]))


def read_mask(path):
    with open(path, "rb") as f:
        data = f.read()
    h = struct.unpack("<256i", data[:1024])
    assert h[0] == 20240522, h[0]
    return list(data[1024:1024 + h[2]])


def main():
    binary = sys.argv[1]
    oracle = None
    try:
        from transformers import PreTrainedTokenizerFast  # noqa: F401
        oracle = "transformers"
    except Exception:
        try:
            import jinja2  # noqa: F401
            import tokenizers  # noqa: F401
            oracle = "jinja2+tokenizers"
        except Exception:
            print("skipped: neither transformers nor jinja2 + tokenizers is installed")
            return 77
    with tempfile.TemporaryDirectory() as d:
        j = json.load(open(os.path.join(FIX, "bpe-llama3-style.json"), encoding="utf-8"))
        nid = len(j["model"]["vocab"])
        for t in SPECIALS:
            j["added_tokens"].append({"id": nid, "content": t, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": True})
            nid += 1
        tok_path = os.path.join(d, "tokenizer.json")
        json.dump(j, open(tok_path, "w", encoding="utf-8"))
        recs = records()
        failures = 0
        for name, tmpl in TEMPLATES.items():
            out = os.path.join(d, name)
            p = subprocess.run([binary, "prepare", "--format", "chat", "--template", name, "--input",
                                os.path.join(FIX, "chat_small.jsonl"), "--out", out, "--tokenizer", "hf",
                                "--tokenizer-file", tok_path, "--val-fraction", "0", "--threads", "1"],
                               capture_output=True, text=True)
            if p.returncode != 0:
                print(p.stdout, p.stderr)
                return 1
            got = read_u32_shard(os.path.join(out, "train.bin"))
            got_mask = read_mask(os.path.join(out, "train.bin.mask"))
            want, want_mask = [], []
            if oracle == "transformers":
                from transformers import PreTrainedTokenizerFast
                tk = PreTrainedTokenizerFast(tokenizer_file=tok_path, bos_token="<|begin_of_text|>",
                                             eos_token="<|end_of_text|>")
                eos = tk.convert_tokens_to_ids("<|end_of_text|>")
                for i, msgs in enumerate(recs):
                    if i > 0:
                        want.append(eos)
                        want_mask.append(0)
                    enc = tk.apply_chat_template(msgs, chat_template=tmpl, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True)
                    want += list(enc["input_ids"])
                    want_mask += list(enc["assistant_masks"])
            else:
                import jinja2
                from tokenizers import Tokenizer
                tk = Tokenizer.from_file(tok_path)
                plain = tmpl.replace("{% generation %}", "").replace("{% endgeneration %}", "")
                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
                t = env.from_string(plain)
                eos = tk.token_to_id("<|end_of_text|>")
                for i, msgs in enumerate(recs):
                    if i > 0:
                        want.append(eos)
                    text = t.render(messages=msgs, bos_token="<|begin_of_text|>")
                    want += tk.encode(text, add_special_tokens=False).ids
                want_mask = None
            if got != want:
                k = next((i for i in range(min(len(got), len(want))) if got[i] != want[i]), min(len(got), len(want)))
                print("%s: tokens differ from %s at %d (meshtrain %d tokens, oracle %d): %s vs %s" %
                      (name, oracle, k, len(got), len(want), got[k:k + 8], want[k:k + 8]))
                failures += 1
            elif want_mask is not None and got_mask != want_mask:
                k = next(i for i in range(len(got_mask)) if got_mask[i] != want_mask[i])
                print("%s: loss mask differs from the assistant mask at token %d" % (name, k))
                failures += 1
            else:
                print("%s: %d tokens, %d trained: equal to %s%s" %
                      (name, len(got), sum(got_mask), oracle, "" if want_mask is None else " (mask too)"))
        return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
