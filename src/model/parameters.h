// The model's parameters: one flat fp32 buffer in unit order, each parameter a named range of it.
//
// Names follow Hugging Face conventions (GPT2LMHeadModel without the "transformer." prefix is added
// at export, LlamaForCausalLM). GPT-2's Conv1D weights are stored [out, in] here (what the GEMM
// wants) and transposed on export; `hf_transposed` marks them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

// How tensor parallelism splits a parameter across the tp ranks (Megatron layout).
enum class TpSplit : uint8_t {
  None,     // replicated (norms, row-parallel biases, position embeddings)
  Rows,     // dimension 0 split: column-parallel weights and their biases, vocab-parallel embeddings
  Cols,     // dimension 1 split: row-parallel weights
  QkvRows,  // GPT-2's fused [q; k; v] rows: each of the three blocks split by heads
};

struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // elements into the flat buffer
  int64_t numel = 0;
  int unit = 0;        // which model unit owns it
  bool decay = true;   // weight decay applies (matrices yes; norms, biases, embeddings no)
  bool hf_transposed = false;
  TpSplit tp_split = TpSplit::None;
  // LoRA (ModelConfig::lora_rank > 0): base parameters are frozen (no gradient, never updated);
  // the adapters are the trainable ones. An adapter names the base weight it adapts (lora_base, an
  // index into the same parameter list), whether it is A [rank, in] or B [rows, rank], and the
  // base weight's output rows it adds to ([lora_row0, lora_row0 + lora_rows): a part of a fused
  // q|k|v matrix, or all of it).
  bool trainable = true;
  int lora_base = -1;
  char lora_kind = 0;  // 'A' or 'B' on adapters
  int64_t lora_row0 = 0, lora_rows = 0;
};

// A contiguous range of the flat buffer owned by one unit (embedding, block i, head).
struct UnitRange {
  std::string name;
  int64_t offset = 0;
  int64_t numel = 0;
};

}  // namespace mt
