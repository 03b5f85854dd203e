// Hugging Face tokenizer.json (`--tokenizer hf --tokenizer-file F`): make_tokenizer as the command
// line calls it; a tokenizer that loads then encodes and decodes a few texts.
#include <cstdint>

#include "data/tokenizer.h"
#include "fuzz_contract.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::write_file("tokenizer.json", data, size);
  std::unique_ptr<mt::Tokenizer> tok;
  mt::fuzz::expect_clear("tokenizer_json_fuzz", path, [&] { tok = mt::make_tokenizer("hf", "", path); });
  if (!tok) return 0;
  // Encoding, and decoding what was encoded, are not expected to throw at all.
  for (const char* text : {"Hello world, 123 don't!", "  \n\t x\xc3\xa9y \xe4\xb8\xad\xe6\x96\x87 <|endoftext|>", ""}) {
    const std::vector<int32_t> ids = tok->encode(text);
    for (int32_t id : ids)
      if (id < 0 || id >= tok->vocab_size()) mt::fuzz::crash("tokenizer_json_fuzz", "encode gave an id outside the vocabulary", "", "");
    std::vector<int32_t> doc;
    tok->encode_document(text, doc);
    (void)tok->decode(ids);
  }
  return 0;
}
