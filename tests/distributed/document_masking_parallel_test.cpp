// Document masking (data.document_masking) under context and pipeline parallelism: the same
// training as one process with the masking on, on a corpus of short lines (documents of 3 to 24
// bytes, so every row of 32 tokens holds several and many cross a cp chunk or start on another cp
// rank). One process with the masking is checked against each document alone by
// tests/model/document_masking_test.cpp; here every layout is checked against that process.
#include <gtest/gtest.h>

#include <string>

#include "harness.h"

namespace mt {
namespace {

// fp32: the tolerances of the context- and pipeline-parallel parity tests (rounding-level
// differences: sums merged per block, reduced over ranks, accumulated in another order).
constexpr double kLossTol = 1e-5, kWeightTol = 2e-5;
const std::string kDocs = "--data.document_masking true ";
const std::string kLlama = "--model.preset llama-tiny ";

class DocumentMaskingParallel : public ParityFixture {
 protected:
  void SetUp() override {
    ParityFixture::SetUp();
    std::string text;
    for (int i = 0; i < 900; ++i) {
      const int len = 2 + (i * 7) % 23;  // 2 .. 24 bytes, then the newline that starts the next document
      for (int j = 0; j < len; ++j) text += static_cast<char>('a' + (i * 3 + j * 5) % 26);
      text += '\n';
    }
    std::vector<int32_t> toks(text.begin(), text.end());
    write_token_shard((dir_ / "train.bin").string(), toks);
  }
};

TEST_F(DocumentMaskingParallel, ContextParallelMatchesOneProcess) {
  const auto ref = train(1, 8, 1, "single", kDocs);
  // The test can fail: without the masking the same run trains differently.
  const auto plain = train(1, 8, 1, "plain");
  ASSERT_EQ(ref.losses.size(), 8u);
  ASSERT_EQ(plain.losses.size(), 8u);
  EXPECT_GT(std::abs(ref.losses[0] - plain.losses[0]), 1e-3) << "document masking changes nothing";
  expect_close(ref, train(2, 8, 1, "cp2", kDocs + "--parallel.cp 2"), kLossTol, kWeightTol, "gpt2 docs cp=2 (ring)");
  expect_close(ref, train(2, 8, 1, "cp2ag", kDocs + "--parallel.cp 2 --parallel.cp_mode allgather"), kLossTol,
               kWeightTol, "gpt2 docs cp=2 (allgather)");
}

TEST_F(DocumentMaskingParallel, ContextParallelLlamaAndWithDataParallel) {
  const auto ref = train(1, 8, 1, "single", kLlama + kDocs);
  expect_close(ref, train(2, 8, 1, "cp2", kLlama + kDocs + "--parallel.cp 2"), kLossTol, kWeightTol,
               "llama docs cp=2 (RoPE, grouped-query)");
  expect_close(ref, train(4, 4, 1, "cp2dp2", kLlama + kDocs + "--parallel.cp 2 --train.activation_checkpointing full"),
               kLossTol, kWeightTol, "llama docs cp=2 x dp=2, full recompute");
}

// Single process: micro-batch 2, 4 micro-batches per step (the pipeline runs are 4 micro-batches).
TEST_F(DocumentMaskingParallel, PipelineMatchesOneProcessOnEverySchedule) {
  const auto ref = train(1, 2, 4, "single", kDocs);
  expect_close(ref, train(2, 2, 4, "1f1b", kDocs + "--parallel.pp 2"), kLossTol, kWeightTol, "docs pp=2 1f1b");
  expect_close(ref,
               train(2, 2, 4, "inter",
                     kDocs + "--parallel.pp 2 --parallel.pp_schedule interleaved_1f1b --parallel.pp_virtual_stages 2"),
               kLossTol, kWeightTol, "docs pp=2 interleaved v=2");
  expect_close(ref, train(2, 2, 4, "zb1p", kDocs + "--parallel.pp 2 --parallel.pp_schedule zb1p"), kLossTol,
               kWeightTol, "docs pp=2 zb1p");
  const std::string m = "--model.n_layer 6 ";  // zbv at pp=2: 4 stages
  expect_close(train(1, 2, 4, "single6", m + kDocs),
               train(2, 2, 4, "zbv", m + kDocs + "--parallel.pp 2 --parallel.pp_schedule zbv"), kLossTol, kWeightTol,
               "docs pp=2 zbv");
}

TEST_F(DocumentMaskingParallel, PipelineLlamaAndWithContextParallel) {
  const auto ref = train(1, 2, 4, "single", kLlama + kDocs);
  expect_close(ref, train(2, 2, 4, "pp2", kLlama + kDocs + "--parallel.pp 2"), kLossTol, kWeightTol,
               "llama docs pp=2 (RoPE on the second stage)");
  expect_close(ref, train(4, 2, 4, "cp2pp2", kLlama + kDocs + "--parallel.cp 2 --parallel.pp 2"), kLossTol,
               kWeightTol, "llama docs cp=2 x pp=2");
}

}  // namespace
}  // namespace mt
