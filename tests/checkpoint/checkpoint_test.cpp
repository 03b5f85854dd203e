// Checkpoint files: the streaming safetensors writer / reader, unit-by-unit checkpoints (same
// result in any unit order, equal to the whole-model helpers), atomic replacement (an unfinished
// checkpoint leaves the previous one and `latest` untouched) and errors that name file and tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "../test_files.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "model/transformer.h"
#include "train/config.h"

namespace fs = std::filesystem;

namespace mt {
namespace {

class CheckpointTest : public ::testing::Test {
 protected:
  // Random full state in the model's layout; padded vocabulary rows zero, as training keeps them.
  static std::vector<float> random_state(const Transformer& m, uint32_t seed) {
    std::vector<float> v(static_cast<size_t>(m.flat_size()), 0.0f);
    std::mt19937 rng(seed);
    std::normal_distribution<float> d;
    for (const auto& p : m.params()) {
      const bool vocab = p.name == "wte.weight" || p.name == "model.embed_tokens.weight" || p.name == "lm_head.weight";
      const int64_t n = vocab ? m.config().vocab_size * p.shape[1] : p.numel;
      for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(p.offset + i)] = d(rng);
    }
    return v;
  }
  static std::string read_file(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  static void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
    try {
      f();
      ADD_FAILURE() << "no error";
    } catch (const std::exception& e) {
      for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what() << " lacks " << p;
    }
  }
  test::TestDir tmp_;
  const fs::path& dir_ = tmp_.path;
};

ModelConfig tiny(const std::string& preset) { return model_preset(preset); }

TEST_F(CheckpointTest, StreamingWriterMatchesWholeFileWriterInAnyOrder) {
  std::map<std::string, SafeTensor> ts;
  std::vector<std::pair<std::string, SafeTensorInfo>> header;
  for (int i = 0; i < 4; ++i) {
    SafeTensor t;
    t.shape = {3, i + 1};
    t.bytes.resize(static_cast<size_t>(3 * (i + 1)) * 4);
    for (size_t b = 0; b < t.bytes.size(); ++b) t.bytes[b] = static_cast<char>(b * 7 + i);
    const std::string name = "t" + std::to_string(i);
    SafeTensorInfo info;
    info.shape = t.shape;
    header.emplace_back(name, info);
    ts.emplace(name, std::move(t));
  }
  const fs::path a = dir_ / "a.safetensors", b = dir_ / "b.safetensors";
  write_safetensors(a.string(), ts, {{"k", "v"}});
  {
    SafetensorsWriter w(b.string(), header, {{"k", "v"}});
    for (int i = 3; i >= 0; --i) {
      const std::string name = "t" + std::to_string(i);
      w.write(name, ts[name].bytes.data(), ts[name].bytes.size());
    }
    EXPECT_FALSE(fs::exists(b));  // only the temporary file until finish()
    w.finish();
  }
  EXPECT_EQ(read_file(a), read_file(b));
  std::map<std::string, std::string> meta;
  auto back = read_safetensors(b.string(), &meta);
  EXPECT_EQ(meta["k"], "v");
  for (const auto& [name, t] : ts) EXPECT_EQ(back.at(name).bytes, t.bytes) << name;

  // Unfinished: nothing is left behind, not even the temporary file.
  const fs::path c = dir_ / "c.safetensors";
  {
    SafetensorsWriter w(c.string(), header);
    w.write("t0", ts["t0"].bytes.data(), ts["t0"].bytes.size());
    expect_error([&] { w.finish(); }, {"t1", "never written"});
  }
  EXPECT_FALSE(fs::exists(c));
  EXPECT_FALSE(fs::exists(c.string() + ".tmp"));
}

TEST_F(CheckpointTest, ReaderNamesFileAndTensorOnDamage) {
  std::map<std::string, SafeTensor> ts;
  SafeTensor t;
  t.shape = {1000};
  t.bytes.resize(4000, 1);
  ts.emplace("big", t);
  const fs::path p = dir_ / "x.safetensors";
  write_safetensors(p.string(), ts);
  fs::resize_file(p, fs::file_size(p) - 100);
  expect_error([&] { SafetensorsReader r(p.string()); }, {p.string(), "big", "outside the file"});
  std::ofstream(p, std::ios::binary | std::ios::trunc) << "abc";
  expect_error([&] { SafetensorsReader r(p.string()); }, {p.string(), "truncated"});
  // Hostile headers: 100,000 nested arrays, a scalar, metadata that is not strings - each one line
  // naming the file, never a bare JSON-library message.
  auto with_header = [&](const std::string& h) {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    const uint64_t n = h.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << h;
  };
  with_header(std::string(100000, '[') + std::string(100000, ']'));
  expect_error([&] { SafetensorsReader r(p.string()); }, {p.string(), "bad safetensors header", "found a array"});
  with_header("42");
  expect_error([&] { SafetensorsReader r(p.string()); }, {p.string(), "expected a JSON object"});
  with_header(R"({"__metadata__": {"format": 7}})");
  expect_error([&] { SafetensorsReader r(p.string()); }, {p.string(), "__metadata__ value of format must be a string"});
  with_header(R"({"__metadata__": [1]})");
  expect_error([&] { SafetensorsReader r(p.string()); }, {p.string(), "__metadata__ must be an object"});
}

// Units written in reverse order give the same files as the whole-model helper; reading unit by
// unit and reading the whole model give back exactly what was saved.
TEST_F(CheckpointTest, UnitByUnitEqualsWholeModel) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    SCOPED_TRACE(preset);
    Transformer m(tiny(preset), DType::F32);
    const auto w = random_state(m, 1), mo = random_state(m, 2), vo = random_state(m, 3);
    RunConfig cfg = RunConfig::load("", {{"model.preset", preset}});
    TrainerState st{7, 7, 21};
    const fs::path ra = dir_ / (std::string(preset) + "_a"), rb = dir_ / (std::string(preset) + "_b");
    save_checkpoint(ra.string(), m, w.data(), mo.data(), vo.data(), st, cfg.checkpoint_record());
    {
      CheckpointWriter wr(rb.string(), m, true, st.step);
      for (int u = m.num_units() - 1; u >= 0; --u) {
        const int64_t o = m.unit(u).offset;
        wr.write_unit(u, w.data() + o, mo.data() + o, vo.data() + o);
      }
      wr.commit(st, cfg.checkpoint_record());
    }
    for (const char* f : {"model.safetensors", "optimizer.safetensors", "trainer.json"})
      EXPECT_EQ(read_file(ra / "step_00000007" / f), read_file(rb / "step_00000007" / f)) << f;

    std::vector<float> w2(w.size(), -1.0f), m2(w.size(), -1.0f), v2(w.size(), -1.0f);
    TrainerState back = load_checkpoint(resolve_checkpoint(ra.string()), m, w2.data(), m2.data(), v2.data());
    EXPECT_EQ(back.step, 7);
    EXPECT_EQ(back.micro_batches, 21);
    EXPECT_EQ(w2, w);
    EXPECT_EQ(m2, mo);
    EXPECT_EQ(v2, vo);
    CheckpointReader rd(resolve_checkpoint(rb.string()), m, true);
    for (int u = 0; u < m.num_units(); ++u) {
      const UnitRange& r = m.unit(u);
      std::vector<float> a(static_cast<size_t>(r.numel)), b(a.size()), c(a.size());
      rd.read_unit(u, a.data(), b.data(), c.data());
      EXPECT_EQ(0, std::memcmp(a.data(), w.data() + r.offset, a.size() * 4)) << r.name;
      EXPECT_EQ(0, std::memcmp(c.data(), vo.data() + r.offset, c.size() * 4)) << r.name;
    }
  }
}

// An error before commit (here: the writer is simply dropped) leaves the previous checkpoint, and
// `latest` pointing at it, as they were, and no hidden directory behind.
TEST_F(CheckpointTest, UnfinishedCheckpointLeavesThePreviousOneIntact) {
  Transformer m(tiny("gpt2-tiny"), DType::F32);
  const auto w = random_state(m, 4);
  RunConfig cfg = RunConfig::load("", {{"model.preset", "gpt2-tiny"}});
  const fs::path root = dir_ / "ck";
  save_checkpoint(root.string(), m, w.data(), w.data(), w.data(), TrainerState{5, 5, 5}, cfg.checkpoint_record());
  const std::string before = read_file(root / "step_00000005" / "model.safetensors");
  for (int64_t step : {5, 6}) {  // the same step (a rewrite) and a new one
    CheckpointWriter wr(root.string(), m, true, step);
    wr.write_unit(0, w.data(), w.data(), w.data());
  }
  EXPECT_EQ(resolve_checkpoint(root.string()), (root / "step_00000005").string());
  EXPECT_EQ(read_file(root / "step_00000005" / "model.safetensors"), before);
  for (const auto& e : fs::directory_iterator(root))
    EXPECT_NE(e.path().filename().string()[0], '.') << "left behind: " << e.path();
}

TEST_F(CheckpointTest, ErrorsNameTheFileAndTheTensor) {
  Transformer m(tiny("gpt2-tiny"), DType::F32);
  const auto w = random_state(m, 5);
  RunConfig cfg = RunConfig::load("", {{"model.preset", "gpt2-tiny"}});
  const fs::path root = dir_ / "ck";
  save_checkpoint(root.string(), m, w.data(), nullptr, nullptr, TrainerState{3, 3, 3}, cfg.checkpoint_record());
  const std::string dir = resolve_checkpoint(root.string());
  std::vector<float> buf(w.size());
  // Weights only: asking for optimizer state says so.
  expect_error([&] { load_checkpoint(dir, m, buf.data(), buf.data(), buf.data()); }, {dir, "no optimizer state"});
  // Another model: the parameter counts differ.
  ModelConfig other = tiny("gpt2-tiny");
  other.n_layer += 1;
  Transformer m2(other, DType::F32);
  std::vector<float> buf2(static_cast<size_t>(m2.flat_size()));
  expect_error([&] { load_checkpoint(dir, m2, buf2.data(), nullptr, nullptr); }, {dir, "parameters"});
  // A tensor of the wrong shape (same count: a transposed matrix saved as its own layout).
  {
    auto ts = read_safetensors((fs::path(dir) / "model.safetensors").string());
    auto& t = ts.at("h.0.attn.c_attn.weight");
    std::swap(t.shape[0], t.shape[1]);
    write_safetensors((fs::path(dir) / "model.safetensors").string(), ts);
    expect_error([&] { load_checkpoint(dir, m, buf.data(), nullptr, nullptr); },
                 {"model.safetensors", "h.0.attn.c_attn.weight", "shape"});
  }
  // Truncated weights file.
  const fs::path mf = fs::path(dir) / "model.safetensors";
  fs::resize_file(mf, fs::file_size(mf) / 2);
  expect_error([&] { load_checkpoint(dir, m, buf.data(), nullptr, nullptr); }, {mf.string(), "truncated"});
  // `latest` naming a directory that is not a checkpoint.
  std::ofstream(root / "latest", std::ios::trunc) << "step_00000099\n";
  expect_error([&] { resolve_checkpoint(root.string()); }, {"latest", "step_00000099"});
}

}  // namespace
}  // namespace mt
