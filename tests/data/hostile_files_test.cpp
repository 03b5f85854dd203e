// Files crafted to break the readers (found by the fuzz targets in fuzz/, docs/fuzzing.md): each is
// refused with the error the command line prints as one clear line - an std::runtime_error (or
// the Hugging Face config reader's std::invalid_argument) naming the file, with no C++ or JSON
// library text - never another exception type or a crash.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <typeinfo>
#include <vector>

#include "../test_files.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/sharded_checkpoint.h"
#include "data/corpus.h"
#include "data/token_shards.h"
#include "data/tokenizer.h"
#include "model/config/hf_config.h"
#include "train/config.h"

using mt::test::TestDir;

namespace {

void put(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// `body` must throw std::runtime_error or std::invalid_argument whose message names `file` and
// holds no library text.
template <class Body>
void expect_clear_error(const std::string& file, Body body) {
  std::string msg, type;
  try {
    body();
    ADD_FAILURE() << "no error for " << file;
    return;
  } catch (const std::invalid_argument& e) {
    msg = e.what();
  } catch (const std::runtime_error& e) {
    msg = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "an exception of type " << typeid(e).name() << " escaped: " << e.what();
    return;
  }
  EXPECT_NE(msg.find(file), std::string::npos) << "the message does not name " << file << ": " << msg;
  for (const char* lib : {"[json.exception.", "std::", "stoul", "_M_"})
    EXPECT_EQ(msg.find(lib), std::string::npos) << "library text '" << lib << "' in: " << msg;
}

std::string deep_array(int depth) { return std::string(static_cast<size_t>(depth), '[') + std::string(static_cast<size_t>(depth), ']'); }

std::string safetensors_with_header(std::string h) {
  while (h.size() % 8) h.push_back(' ');
  const uint64_t n = h.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + h;
}

}  // namespace

// A version-2 (uint32) shard read by the uint16 reader: was a std::logic_error.
TEST(HostileFiles, Uint32ShardReadAsUint16) {
  TestDir dir;
  const std::string path = dir.file("train.bin");
  {
    mt::TokenShardWriter w(path, 3, 4);
    const std::vector<uint32_t> t = {70000, 1, 2};
    w.write(t);
    w.close();
  }
  EXPECT_EQ(mt::read_token_shard32(path).size(), 3u);  // the file is good: the right reader reads it
  expect_clear_error(path, [&] { (void)mt::read_token_shard(path); });
}

// A JSON line with a number past double's range: was nlohmann::json::out_of_range escaping
// for_each_document. Now a bad line (file and line), and skipped with --skip-bad.
TEST(HostileFiles, JsonlNumberOutOfRange) {
  TestDir dir;
  const std::string path = dir.file("docs.jsonl");
  put(path, "{\"text\": \"fine\"}\n{\"text\": \"x\", \"n\": 9999e99999}\n");
  expect_clear_error(path, [&] {
    mt::for_each_document(path, mt::InputFormat::Jsonl, "text", false, [](std::string_view, int64_t) {});
  });
  try {
    mt::for_each_document(path, mt::InputFormat::Jsonl, "text", false, [](std::string_view, int64_t) {});
  } catch (const mt::BadInputError& e) {
    EXPECT_NE(std::string(e.what()).find(path + " line 2"), std::string::npos) << e.what();
  }
  std::vector<std::string> docs, warnings;
  const int64_t bad = mt::for_each_document(
      path, mt::InputFormat::Jsonl, "text", true, [&](std::string_view d, int64_t) { docs.emplace_back(d); }, &warnings);
  EXPECT_EQ(bad, 1);
  EXPECT_EQ(docs, std::vector<std::string>{"fine"});
}

// The same in a chat record (`prepare --format chat`).
TEST(HostileFiles, ChatRecordNumberOutOfRange) {
  expect_clear_error("chat.jsonl", [] {
    (void)mt::parse_chat_record(R"({"messages": [{"role": "user", "content": "hi"}], "n": 9999e99999})", "chat.jsonl", 1);
  });
  expect_clear_error("chat.jsonl", [] { (void)mt::parse_chat_record(R"({"messages": [)", "chat.jsonl", 1); });
}

// A malformed JSON line: the message is the parser's reason without nlohmann's error id.
TEST(HostileFiles, JsonlParseErrorHasNoLibraryId) {
  TestDir dir;
  const std::string path = dir.file("docs.jsonl");
  put(path, "{\"text\": \"unterminated}\n");
  expect_clear_error(path, [&] {
    mt::for_each_document(path, mt::InputFormat::Jsonl, "text", false, [](std::string_view, int64_t) {});
  });
}

// 100,000 nested arrays in every JSON the engine reads.
TEST(HostileFiles, DeepJson) {
  TestDir dir;
  const std::string deep = deep_array(100000);
  const std::string st = dir.file("model.safetensors");
  put(st, safetensors_with_header("{\"w\":" + deep + "}"));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });
  put(st, safetensors_with_header(deep));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });

  const std::string tok = dir.file("tokenizer.json");
  put(tok, "{\"model\":" + deep + "}");
  expect_clear_error(tok, [&] { (void)mt::make_tokenizer("hf", "", tok); });

  const std::string cfg = dir.file("config.json");
  put(cfg, "{\"model_type\":\"llama\",\"rope_scaling\":" + deep + "}");
  expect_clear_error(cfg, [&] { (void)mt::model_from_hf_config(cfg); });

  const std::string docs = dir.file("docs.jsonl");
  put(docs, "{\"text\":" + deep + "}\n");
  expect_clear_error(docs, [&] {
    mt::for_each_document(docs, mt::InputFormat::Jsonl, "text", false, [](std::string_view, int64_t) {});
  });

  put(dir.file("trainer.json"), "{\"step\":" + deep + "}");
  expect_clear_error(dir.file("trainer.json"), [&] { (void)mt::read_trainer_state(dir.path.string()); });
  put(dir.file("metadata.json"), "{\"format\":\"meshtrain-sharded\",\"files\":" + deep + "}");
  expect_clear_error(dir.file("metadata.json"), [&] { mt::ShardedCheckpoint s(dir.path.string()); });

  const std::string toml = dir.file("run.toml");
  put(toml, "[train]\nsteps = " + deep + "\n");
  expect_clear_error(toml, [&] { (void)mt::RunConfig::load(toml, {}); });
}

// A sharded checkpoint's index with a CRC that is not hex (was std::stoul's invalid_argument
// "stoul"), and a piece whose box overflows int64 (signed overflow in the bounds check).
TEST(HostileFiles, ShardedIndex) {
  TestDir dir;
  const std::string meta = dir.file("metadata.json");
  const std::string files = R"("files":[{"name":"rank0.safetensors","bytes":100,"crc32c":)";
  put(meta, R"({"format":"meshtrain-sharded",)" + files + R"("xyz"}],"tensors":{}})");
  expect_clear_error(meta, [&] { mt::ShardedCheckpoint s(dir.path.string()); });
  put(meta, R"({"format":"meshtrain-sharded",)" + files + R"("123456789"}],"tensors":{}})");
  expect_clear_error(meta, [&] { mt::ShardedCheckpoint s(dir.path.string()); });
  put(meta, R"({"format":"meshtrain-sharded",)" + files +
                R"("0a"}],"tensors":{"w":{"dtype":"F32","shape":[4,4],"pieces":[[0,0,9223372036854775807,2,0,4,"0"]]}}})");
  expect_clear_error(meta, [&] { mt::ShardedCheckpoint s(dir.path.string()); });
  put(meta, R"({"format":"meshtrain-sharded",)" + files +
                R"("0a"}],"tensors":{"w":{"dtype":"F32","shape":[-9223372036854775807,4],"pieces":[[0,0,1,1,0,4,"0"]]}}})");
  expect_clear_error(meta, [&] { mt::ShardedCheckpoint s(dir.path.string()); });
}

// safetensors shapes with a negative dimension or an element count that wraps around 2^64 to
// the recorded byte size.
TEST(HostileFiles, SafetensorsShapes) {
  TestDir dir;
  const std::string st = dir.file("model.safetensors");
  put(st, safetensors_with_header(R"({"w":{"dtype":"F32","shape":[-1,-4],"data_offsets":[0,0]}})"));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });
  // 2^62 * 4 bytes = 2^64 = 0 (mod 2^64): matched the empty range before.
  put(st, safetensors_with_header(R"({"w":{"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,0]}})"));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });
  put(st, safetensors_with_header(R"({"w":{"dtype":"F32","shape":[0,4611686018427387904],"data_offsets":[0,0]}})"));
  EXPECT_EQ(mt::read_safetensors(st).at("w").bytes.size(), 0u);  // an empty tensor of a wide shape is fine
}

// Integers written as numbers beyond int64 (parsed as floating point): nlohmann's conversion to an
// integer type is a cast, undefined behaviour out of range (UndefinedBehaviorSanitizer in
// checkpoint_meta_fuzz). Each reader takes only integers where it reads integers.
TEST(HostileFiles, FloatWhereAnIntegerBelongs) {
  TestDir dir;
  put(dir.file("trainer.json"), R"({"step": 2.8e89, "adam_steps": 1, "micro_batches": 1})");
  expect_clear_error(dir.file("trainer.json"), [&] { (void)mt::read_trainer_state(dir.path.string()); });
  put(dir.file("trainer.json"), R"({"step": 3, "adam_steps": 1, "micro_batches": 1, "has_optimizer": 2.5})");
  expect_clear_error(dir.file("trainer.json"), [&] { (void)mt::read_trainer_state(dir.path.string()); });
  put(dir.file("trainer.json"), R"({"step": 3, "adam_steps": 1, "micro_batches": 1})");
  EXPECT_EQ(mt::read_trainer_state(dir.path.string()).step, 3);

  const std::string st = dir.file("model.safetensors");
  put(st, safetensors_with_header(R"({"w":{"dtype":"F32","shape":[1e300],"data_offsets":[0,0]}})"));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });
  put(st, safetensors_with_header(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[0,-1e300]}})"));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });
  put(st, safetensors_with_header(R"({"w":{"dtype":"F32","shape":0,"data_offsets":[0,0]}})"));
  expect_clear_error(st, [&] { (void)mt::read_safetensors(st); });

  const std::string meta = dir.file("metadata.json");
  put(meta, R"({"format":"meshtrain-sharded","files":[{"name":"r0","bytes":1e300,"crc32c":"0"}],"tensors":{}})");
  expect_clear_error(meta, [&] { mt::ShardedCheckpoint s(dir.path.string()); });
  put(meta, R"({"format":"meshtrain-sharded","files":[{"name":"r0","bytes":10,"crc32c":"0"}],)"
            R"("tensors":{"w":{"dtype":"F32","shape":[4,4],"pieces":[[0,0,-9e300,2,0,4,"0"]]}}})");
  expect_clear_error(meta, [&] { mt::ShardedCheckpoint s(dir.path.string()); });

  const std::string tok = dir.file("tokenizer.json");
  put(tok, R"({"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"added_tokens":[{"id":1e300,"content":"<s>"}]})");
  expect_clear_error(tok, [&] { (void)mt::make_tokenizer("hf", "", tok); });
}
