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
  int64_t max_position = 0;      // GPT-2 position-table rows (0 = seq_len); Hugging Face max_position_embeddings
  float rope_theta = 10000.0f;
  // Llama 3.1 rotary scaling (Hugging Face rope_scaling with rope_type "llama3"); factor 0 = none.
  float rope_scaling_factor = 0.0f, rope_low_freq_factor = 1.0f, rope_high_freq_factor = 4.0f;
  int64_t rope_original_max_position = 8192;
  int64_t sliding_window = 0;    // Mistral's attention window (0 = none); seq_len may not exceed it
  float norm_eps = 1e-5f;        // LayerNorm / RMSNorm epsilon (Hugging Face layer_norm_epsilon / rms_norm_eps)
  bool tied_embeddings = true;   // GPT-2 ties wte and lm_head; Llama unties them unless the config ties
  bool qkv_bias = false;         // Llama family: biases on the q, k, v projections (Qwen 2)
  // Mixture of experts (0 experts = dense). Block l's MLP is an MoE layer when l % moe_every == 0:
  // a router over moe_experts expert MLPs (SwiGLU for Llama, GELU for GPT-2) of width
  // moe_ffn_hidden (0 = ffn_hidden), moe_top_k of them per token, plus moe_shared_experts always-on
  // experts (one MLP of moe_shared_experts x that width). Router scores: softmax (Mixtral) or
  // sigmoid (DeepSeek-V3); the chosen k scores are normalised to sum 1. Auxiliary losses:
  // load balancing (Switch / GShard, coefficient moe_aux_loss_coef) and router z-loss
  // (moe_z_loss_coef). moe_capacity_factor 0 = dropless; > 0 = each expert takes at most
  // ceil(factor x tokens x k / experts) of a micro-batch's tokens, the rest are dropped (counted).
  // moe_pad_to_capacity (needs a capacity factor): every expert receives exactly its capacity of
  // rows from each rank, zero rows filling up (Megatron's --moe-pad-expert-input-to-capacity), so
  // message, GEMM and activation sizes do not depend on the routing.
  int64_t moe_experts = 0;
  int64_t moe_top_k = 2;
  int64_t moe_every = 1;
  int64_t moe_shared_experts = 0;
  int64_t moe_ffn_hidden = 0;
  bool moe_sigmoid = false;
  float moe_aux_loss_coef = 0.01f;
  float moe_z_loss_coef = 0.0f;
  float moe_capacity_factor = 0.0f;
  bool moe_pad_to_capacity = false;

  // LoRA fine-tuning (lora_rank 0 = off): every targeted projection W [out, in] gains a trainable
  // adapter, y = x W^T + (alpha / rank) (x A^T) B^T with A [rank, in] and B [out, rank]; every
  // other parameter is frozen. lora_targets: LoraTarget bits (parse_lora_targets).
  int64_t lora_rank = 0;
  float lora_alpha = 0.0f;  // 0 = lora_rank (scale 1)
  uint32_t lora_targets = 0;
  float lora_dropout = 0.0f;
  bool lora() const { return lora_rank > 0; }
  float lora_scale() const {
    return (lora_alpha > 0 ? lora_alpha : static_cast<float>(lora_rank)) / static_cast<float>(lora_rank);
  }
  // Adapter parameters of one dense block (0 without LoRA).
  int64_t lora_block_params() const;
  bool moe() const { return moe_experts > 0; }
  bool is_moe_layer(int64_t l) const { return moe() && l % moe_every == 0; }
  int64_t moe_layers() const;
  int64_t expert_ffn() const { return moe_ffn_hidden > 0 ? moe_ffn_hidden : ffn_hidden; }
  // Parameters of one routed expert (or of one shared expert).
  int64_t expert_params() const;

  int64_t head_dim() const { return n_embd / n_head; }
  // The head_dim / 2 rotary inverse frequencies theta^(-2i/hd), with Llama 3.1 scaling when
  // rope_scaling_factor > 0, computed in float32 the way Hugging Face transformers does.
  std::vector<float> rope_inv_freq() const;
  bool rope_scaled() const { return rope_scaling_factor > 0; }
  // Fills derived fields (ffn_hidden, padded_vocab, tied) and checks divisibility.
  // Throws std::invalid_argument naming the offending key.
  void resolve();
  // Exact parameter count of the model as built (with padded vocabulary rows).
  int64_t num_params() const;
  // Parameters of one transformer block (of block l: MoE layers differ; the default is a dense block).
  int64_t block_params(int64_t l = -1) const;
  // Parameters one token's forward uses (an MoE layer counts its router, shared experts and k
  // routed experts); num_params() for a dense model.
  int64_t active_params() const;
  // Model FLOPs per token for training: 6 * N + 12 * L * h * s (N: the active parameters, excluding
  // position embeddings and an untied input embedding).
  double flops_per_token() const;
};

// LoRA targets. Llama: q, k, v, o (q_proj .. o_proj), gate, up, down (the MLP). GPT-2: c_attn (the
// fused q|k|v projection, one adapter), or q, k, v (adapters on its three row blocks), o
// (attn.c_proj), up (c_fc), down (mlp.c_proj); attn.c_proj, c_fc and mlp.c_proj are accepted as
// the same names.
enum LoraTarget : uint32_t {
  kLoraQ = 1, kLoraK = 2, kLoraV = 4, kLoraO = 8, kLoraGate = 16, kLoraUp = 32, kLoraDown = 64, kLoraQkv = 128
};
// A comma list of target names for `arch` as bits; throws std::invalid_argument naming the bad name.
uint32_t parse_lora_targets(const std::string& list, Arch arch);
// The names of the bits, comma-separated (the canonical spelling for `arch`).
std::string lora_targets_string(uint32_t targets, Arch arch);

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
