#!/usr/bin/env python3
"""Makes tests/train/data/bpe-llama3-style.json, the small tokenizer.json the tests use, with the
Hugging Face `tokenizers` library: a byte-level BPE of 2,048 tokens trained on the text given
(tinyshakespeare), with Llama 3's pre-tokenizer (its Split regex, then ByteLevel without the regex),
ignore_merges, the special tokens <|begin_of_text|> and <|end_of_text|>, and a post-processor that
puts <|begin_of_text|> before a sequence, as Llama 3's tokenizer.json does.

usage: make_tokenizer_fixture.py TRAINING_TEXT OUT.json [VOCAB_SIZE]
"""
import sys

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")


def main():
    text_path, out = sys.argv[1], sys.argv[2]
    vocab = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([text_path], trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(out)


if __name__ == "__main__":
    main()
