#!/usr/bin/env python3
"""meshtrain's Hugging Face tokenizer against the `tokenizers` library (the oracle).

Builds tokenizer.json variants of the byte-level BPE family from the repository's fixture
tests/data/fixtures/bpe-llama3-style.json (Llama 3's pre-tokenizer) by replacing components: GPT-2's
ByteLevel regex, Qwen 2's NFC normalizer and pattern, Mistral Tekken's pattern, add_prefix_space,
Digits, every Split behaviour and invert, added tokens with lstrip / rstrip / single_word /
normalized, unk_token; plus the real GPT-2 tokenizer built from assets/gpt2. For each variant it
encodes a set of texts (the GPT-2 reference texts, hand-written edge cases, seeded random Unicode
strings, tinyshakespeare when /work/shared is there) with `meshtrain tokenize` and with the library,
and decodes the library's ids with `meshtrain tokenize --decode --json`: every id and every
decoded string must be equal.

usage: hf_tokenizer_check.py MESHTRAIN_BINARY [--write-vectors OUT.json]
  --write-vectors writes the variants (as patches of the fixture) with the library's ids and
  decodings for a subset of the texts: the checked-in vectors the C++ test reads.
Exits 77 (skipped) when the `tokenizers` package is not installed (pip install tokenizers).
"""
import copy
import json
import os
import random
import subprocess
import sys
import tempfile

try:
    import tokenizers
    from tokenizers import Tokenizer
except ImportError:
    print("SKIP: the Python package `tokenizers` is not installed (pip install tokenizers); "
          "the Hugging Face tokenizer oracle check needs it")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FIXTURE = os.path.join(HERE, "fixtures", "bpe-llama3-style.json")

GPT2_RE = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+")
TEKKEN_RE = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
             r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_level(prefix=False, regex=False):
    return {"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": True, "use_regex": regex}


def split(pattern, behavior="Isolated", invert=False, literal=False):
    return {"type": "Split", "pattern": {"String" if literal else "Regex": pattern}, "behavior": behavior,
            "invert": invert}


def added(id_, content, special=True, lstrip=False, rstrip=False, single_word=False, normalized=False):
    return {"id": id_, "content": content, "single_word": single_word, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def variants(base):
    """name -> patch of the fixture (top-level keys replaced)."""
    n = max(base["model"]["vocab"].values()) + 1
    seq = lambda *p: {"type": "Sequence", "pretokenizers": list(p)}
    v = {
        "llama3": {},
        "gpt2_bytelevel_regex": {"pre_tokenizer": byte_level(regex=True)},
        "bytelevel_prefix_space": {"pre_tokenizer": byte_level(prefix=True, regex=True)},
        "split_then_prefix_space": {"pre_tokenizer": seq(split(r"\n"), byte_level(prefix=True))},
        "qwen2_nfc": {"normalizer": {"type": "NFC"}, "pre_tokenizer": seq(split(QWEN2_RE), byte_level())},
        "tekken": {"pre_tokenizer": seq(split(TEKKEN_RE), byte_level())},
        "digits_individual": {"pre_tokenizer": seq({"type": "Digits", "individual_digits": True},
                                                   byte_level(regex=True))},
        "digits_runs": {"pre_tokenizer": seq({"type": "Digits", "individual_digits": False}, split(QWEN2_RE),
                                             byte_level())},
        "split_removed": {"pre_tokenizer": seq(split(r"\s+", "Removed"), byte_level())},
        "split_prev": {"pre_tokenizer": seq(split(r"[,.!?]", "MergedWithPrevious"), byte_level())},
        "split_next": {"pre_tokenizer": seq(split(r"\s+", "MergedWithNext"), byte_level())},
        "split_contiguous": {"pre_tokenizer": seq(split(r"\p{P}", "Contiguous"), byte_level())},
        "split_invert": {"pre_tokenizer": seq(split(r"\p{L}+", "Isolated", invert=True), byte_level())},
        "split_literal": {"pre_tokenizer": seq(split("the", "Isolated", literal=True), byte_level())},
        "split_lazy_lookahead": {"pre_tokenizer": seq(split(r"\w+?(?=\s)|\d{2,3}|[a-z]{2,}?e|(?i)ab+c"),
                                                      byte_level())},
        "added_tokens": {"added_tokens": base["added_tokens"] + [
            added(n, "<mask>", lstrip=True, rstrip=True),
            added(n + 1, "hello", special=False, single_word=True),
            added(n + 2, " world", special=False, normalized=True),
            added(n + 3, "<|end_of_text|><|x|>", special=True),
            added(n + 4, "é", special=False, normalized=True)],
            "normalizer": {"type": "NFC"}},
    }
    return v


def apply(base, patch):
    j = copy.deepcopy(base)
    for k, val in patch.items():
        j[k] = val
    return j


def texts(shared):
    out = []
    with open(os.path.join(HERE, "fixtures", "gpt2_vectors.json"), encoding="utf-8") as f:
        out += [c["text"] for c in json.load(f)]
    out += [
        "", " ", "  ", "\n", "\n\n\n", "\r\n\r\n", "a\r\nb", " \n x", "x  \n\n  y", "\t\ttab", "trailing   ",
        "I'll don't they're we've she'd it's I'M YOU'LL 'S 'ſ 'K 'k IT'S", "The Kelvin sign K and ſ long s",
        "12345678 1,000,000 3.14159 ٣٤٥ ½ ² Ⅻ", "café cafe\u0301 e\u0301\u0323 \u1100\u1161\u11a8 한국어 Å Å",
        "ﬁnance ﬀ ǅungla ǈ ǋ", "Ж жук Ὀδυσσεύς 中文字符 日本語のテキスト", "emoji 🦙🦙 👍🏽 ❤️ 🇫🇷",
        "<|end_of_text|>hello<|begin_of_text|> <|end_of_text|><|x|>", "a<mask>b  <mask>  c hello world helloworld",
        "say hello, hello.hello _hello hello_ é e\u0301", "CamelCaseWords and HTTPServer iPhone McDonald's",
        "path/to/file.txt https://example.com/a?b=c&d=e", "x" * 300 + " " + "ab" * 200, "!!!???...,,,;;;",
        "\u00a0nbsp\u2003em\u3000ideo\u2028line\u0085nel", "mixed123abc456def 7x8y 99bottles",
        "  leading spaces and\ttabs\tand\nnewlines\n", "ǅ\u0345\u0301 \u0300a \u0338= ≠", "ab abbbc ABC aBbC",
    ]
    rng = random.Random(1234)
    pools = [" ", "\n", "\t", "\r\n", "\u00a0", "\u3000", "'", "'s", "'LL", "a", "Z", "é", "e\u0301", "ß", "ſ", "K",
             "Ж", "中", "한", "\u1100\u1161", "0", "7", "٣", "½", ".", ",", "!", "-", "_", "/", "🦙", "\u0301",
             "the", "The", "hello", " world", "<mask>", "<|end_of_text|>", "ǅ", "İ", "ﬁ"]
    for _ in range(200):
        out.append("".join(rng.choice(pools) for _ in range(rng.randint(1, 40))))
    if shared and os.path.exists(shared):
        with open(shared, encoding="utf-8") as f:
            paras = f.read().split("\n\n")
        out += paras[:300]
    return out


def run_meshtrain(binary, tok_path, args, stdin_path):
    r = subprocess.run([binary, "tokenize", "--tokenizer", "hf", "--tokenizer-file", tok_path] + args
                       + ["--input", stdin_path], capture_output=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"meshtrain tokenize failed ({tok_path}): {r.stderr.decode(errors='replace')}")
    return r.stdout.decode("utf-8").split("\n")[:-1]


def gpt2_tokenizer_json(tmp):
    from tokenizers import decoders, models, pre_tokenizers
    d = os.path.join(ROOT, "assets", "gpt2")
    bpe = models.BPE.from_file(os.path.join(d, "encoder.json"), os.path.join(d, "vocab.bpe"))
    t = Tokenizer(bpe)
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.add_special_tokens(["<|endoftext|>"])
    p = os.path.join(tmp, "gpt2.json")
    t.save(p)
    return p


def main():
    binary = sys.argv[1]
    write = sys.argv[sys.argv.index("--write-vectors") + 1] if "--write-vectors" in sys.argv else None
    with open(FIXTURE, encoding="utf-8") as f:
        base = json.load(f)
    shared = os.path.join(ROOT, "..", "shared", "data", "tinyshakespeare", "input.txt")
    all_texts = texts(shared)
    failures, checked = 0, 0
    vectors = {"tokenizers_version": tokenizers.__version__, "fixture": "bpe-llama3-style.json", "variants": []}
    with tempfile.TemporaryDirectory() as tmp:
        inp = os.path.join(tmp, "texts.jsonl")
        with open(inp, "w", encoding="utf-8") as f:
            for t in all_texts:
                f.write(json.dumps({"text": t}) + "\n")
        cases = [(name, apply(base, patch), patch) for name, patch in variants(base).items()]
        cases.append(("gpt2_real", None, None))
        for name, j, patch in cases:
            if j is None:
                path = gpt2_tokenizer_json(tmp)
            else:
                path = os.path.join(tmp, name + ".json")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(j, f)
            ref = Tokenizer.from_file(path)
            got = run_meshtrain(binary, path, [], inp)
            want_ids = [ref.encode(t, add_special_tokens=False).ids for t in all_texts]
            ids_path = os.path.join(tmp, name + ".ids")
            with open(ids_path, "w") as f:
                for ids in want_ids:
                    f.write(" ".join(map(str, ids)) + "\n")
            dec = run_meshtrain(binary, path, ["--decode", "--json"], ids_path)
            special = run_meshtrain(binary, path, ["--special"], inp)
            for i, t in enumerate(all_texts):
                checked += 1
                want = " ".join(map(str, want_ids[i]))
                want_special = " ".join(map(str, ref.encode(t, add_special_tokens=True).ids))
                want_text = ref.decode(want_ids[i], skip_special_tokens=False)
                problems = []
                if got[i] != want:
                    problems.append(f"ids\n    meshtrain {got[i][:300]}\n    tokenizers {want[:300]}")
                if special[i] != want_special:
                    problems.append(f"ids with special tokens\n    meshtrain {special[i][:200]}\n    tokenizers {want_special[:200]}")
                if json.loads(dec[i]) != want_text:
                    problems.append(f"decode\n    meshtrain {dec[i][:200]!r}\n    tokenizers {json.dumps(want_text)[:200]!r}")
                if problems:
                    failures += 1
                    if failures <= 20:
                        print(f"MISMATCH [{name}] text {i} {t[:80]!r}: " + "; ".join(problems))
            print(f"{name}: {len(all_texts)} texts checked")
            if write and patch is not None:
                # the hand-written edge cases, a quarter of the GPT-2 texts, 30 random strings
                sub = list(range(117, 150)) + list(range(0, 117, 4)) + list(range(150, 180))
                vectors["variants"].append({
                    "name": name, "patch": patch,
                    "cases": [{"text": all_texts[i], "ids": want_ids[i],
                               "ids_special": ref.encode(all_texts[i], add_special_tokens=True).ids,
                               "decoded": ref.decode(want_ids[i], skip_special_tokens=False)} for i in sub]})
    if write:
        with open(write, "w", encoding="utf-8") as f:
            json.dump(vectors, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        print("wrote", write)
    print(f"{checked - failures} passed, {failures} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
