// Transformer dimensions, named presets and parameter arithmetic shared by the model, the trainer
// and the planner.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace mt {

enum class Arch { GPT2, Llama };

struct ModelConfig {
  std::string name = "custom";
  Arch arch = Arch::GPT2;
  int64_t n_layer = 12;
  int64_t n_head = 12;
  int64_t n_kv_head = 12;   // == n_head for GPT-2; grouped-query attention for Llama
  int64_t n_embd = 768;
  int64_t ffn_hidden = 0;   // 0 = 4*n_embd (GPT-2) or the Llama rule (see resolve())
  int64_t seq_len = 1024;
  int64_t vocab_size = 50257;    // real vocabulary
  int64_t padded_vocab = 0;      // 0 = vocab rounded up to a multiple of 64 (see resolve())
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  bool tied_embeddings = true;   // GPT-2 ties wte and lm_head; Llama does not

  int64_t head_dim() const { return n_embd / n_head; }
  // Fills derived fields (ffn_hidden, padded_vocab, tied) and checks divisibility.
  // Throws std::invalid_argument naming the offending key.
  void resolve();
  // Exact parameter count of the model as built (with padded vocabulary rows).
  int64_t num_params() const;
  // Parameters of one transformer block.
  int64_t block_params() const;
  // Model FLOPs per token for training: 6 * N + 12 * L * h * s (N excludes position embeddings and
  // an untied input embedding).
  double flops_per_token() const;
};

const char* arch_name(Arch a);
bool parse_arch(const std::string& s, Arch* out);

// A Llama-style configuration from its dimensions (untied embeddings; call resolve() before use).
ModelConfig llama_config(const char* name, int64_t L, int64_t H, int64_t KV, int64_t C, int64_t F, int64_t T,
                         int64_t V, float theta = 10000.0f);

// Named presets: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt3-175b, llama3-8b, llama3-70b,
// llama3-405b, and tiny ones for tests and demos (gpt2-tiny, gpt2-small-cpu, llama-tiny, llama-small-cpu).
// Throws std::invalid_argument for an unknown name, listing the known ones.
ModelConfig model_preset(const std::string& name);
std::vector<std::string> model_preset_names();

}  // namespace mt
