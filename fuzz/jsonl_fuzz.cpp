// JSON-lines corpora (`prepare --input x.jsonl`, `tokenize --input`): for_each_document, strict and
// with --skip-bad.
#include <cstdint>

#include "data/corpus.h"
#include "fuzz_contract.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = mt::fuzz::write_file("docs.jsonl", data, size);
  for (bool skip_bad : {false, true}) {
    mt::fuzz::expect_clear("jsonl_fuzz", path, [&] {
      size_t bytes = 0;
      std::vector<std::string> warnings;
      mt::for_each_document(path, mt::InputFormat::Jsonl, "text", skip_bad,
                            [&](std::string_view doc, int64_t) { bytes += doc.size(); }, &warnings);
      for (const auto& w : warnings) {
        if (!mt::fuzz::contains(w, path.c_str())) mt::fuzz::crash("jsonl_fuzz", "a warning does not name the file", "", w);
        if (const char* bad = mt::fuzz::library_text(w)) mt::fuzz::crash("jsonl_fuzz", std::string("library text '") + bad + "' in a warning", "", w);
      }
    });
  }
  return 0;
}
