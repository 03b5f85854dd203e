#include "model/config/model_config.h"

#include <cmath>
#include <stdexcept>

namespace mt {

const char* arch_name(Arch a) { return a == Arch::GPT2 ? "gpt2" : "llama"; }

bool parse_arch(const std::string& s, Arch* out) {
  if (s == "gpt2") {
    *out = Arch::GPT2;
    return true;
  }
  if (s == "llama") {
    *out = Arch::Llama;
    return true;
  }
  return false;
}

void ModelConfig::resolve() {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(n_layer > 0, "model.n_layer must be positive");
  need(n_head > 0, "model.n_head must be positive");
  need(n_embd > 0, "model.n_embd must be positive");
  need(seq_len > 0, "model.seq_len must be positive");
  need(vocab_size > 0, "model.vocab_size must be positive");
  need(n_embd % n_head == 0, "model.n_embd (" + std::to_string(n_embd) +
                                 ") must be divisible by model.n_head (" + std::to_string(n_head) + ")");
  if (arch == Arch::GPT2) n_kv_head = n_head;
  if (n_kv_head <= 0) n_kv_head = n_head;
  need(n_head % n_kv_head == 0, "model.n_head (" + std::to_string(n_head) +
                                    ") must be divisible by model.n_kv_head (" + std::to_string(n_kv_head) + ")");
  if (arch == Arch::Llama) need(head_dim() % 2 == 0, "llama head dimension must be even for RoPE");
  if (ffn_hidden <= 0) {
    if (arch == Arch::GPT2) {
      ffn_hidden = 4 * n_embd;
    } else {  // Llama: 2/3 * 4h rounded up to a multiple of 64
      int64_t f = 8 * n_embd / 3;
      ffn_hidden = (f + 63) / 64 * 64;
    }
  }
  if (padded_vocab <= 0) padded_vocab = (vocab_size + 63) / 64 * 64;
  need(padded_vocab >= vocab_size, "model.padded_vocab must be >= model.vocab_size");
  if (max_position <= 0) max_position = seq_len;
  need(max_position >= seq_len || arch == Arch::Llama,
       "model.seq_len (" + std::to_string(seq_len) + ") exceeds the position table of model.max_position (" +
           std::to_string(max_position) + ") rows");
  if (sliding_window > 0)
    need(seq_len <= sliding_window, "model.seq_len (" + std::to_string(seq_len) +
                                        ") exceeds the config's sliding_window (" + std::to_string(sliding_window) +
                                        "): sliding-window attention is not supported");
  if (rope_scaled())
    need(rope_high_freq_factor > rope_low_freq_factor && rope_low_freq_factor > 0 && rope_original_max_position > 0,
         "rope_scaling: need high_freq_factor > low_freq_factor > 0 and original_max_position_embeddings > 0");
  if (arch == Arch::GPT2) tied_embeddings = true;
  if (arch == Arch::GPT2) qkv_bias = false;  // GPT-2's c_attn always has its bias
  need(moe_experts >= 0, "model.moe_experts must be >= 0 (0 = a dense model)");
  if (moe()) {
    need(moe_top_k >= 1 && moe_top_k <= moe_experts, "model.moe_top_k (" + std::to_string(moe_top_k) +
                                                         ") must be between 1 and model.moe_experts (" +
                                                         std::to_string(moe_experts) + ")");
    need(moe_every >= 1, "model.moe_every must be >= 1");
    need(moe_shared_experts >= 0, "model.moe_shared_experts must be >= 0");
    need(moe_ffn_hidden >= 0, "model.moe_ffn_hidden must be >= 0 (0 = model.ffn_hidden)");
    need(moe_aux_loss_coef >= 0 && moe_z_loss_coef >= 0, "model.moe_aux_loss_coef and model.moe_z_loss_coef must be >= 0");
    need(moe_capacity_factor >= 0, "model.moe_capacity_factor must be >= 0 (0 = dropless)");
  }
  need(!moe_pad_to_capacity || (moe() && moe_capacity_factor > 0),
       "model.moe_pad_to_capacity needs a mixture of experts (model.moe_experts > 0) with a capacity "
       "(model.moe_capacity_factor > 0): a dropless expert has no capacity to pad to");
  if (lora()) {
    need(lora_targets != 0, "lora.targets is empty: name at least one projection (e.g. q,v)");
    need(!moe(), "lora.rank > 0 with a mixture of experts: LoRA adapts dense models only (set lora.rank = 0)");
    need(lora_alpha >= 0, "lora.alpha must be >= 0 (0 = lora.rank)");
    need(lora_dropout >= 0 && lora_dropout < 1, "lora.dropout must be in [0, 1)");
    need(arch == Arch::Llama || !(lora_targets & kLoraGate), "lora.targets: gate is a Llama projection (GPT-2 has c_attn, q, k, v, o, up, down)");
    need(arch == Arch::GPT2 || !(lora_targets & kLoraQkv), "lora.targets: c_attn is GPT-2's (Llama has q, k, v, o, gate, up, down)");
    need(!((lora_targets & kLoraQkv) && (lora_targets & (kLoraQ | kLoraK | kLoraV))),
         "lora.targets: c_attn (the whole fused projection) and q / k / v (its parts) exclude each other");
  }
}

int64_t ModelConfig::lora_block_params() const {
  if (!lora()) return 0;
  const int64_t C = n_embd, hd = head_dim(), F = ffn_hidden, r = lora_rank;
  const int64_t q = n_head * hd, kv = n_kv_head * hd;
  int64_t n = 0;
  auto add = [&](uint32_t bit, int64_t in, int64_t out) {
    if (lora_targets & bit) n += r * (in + out);
  };
  add(kLoraQkv, C, q + 2 * kv);
  add(kLoraQ, C, q);
  add(kLoraK, C, kv);
  add(kLoraV, C, kv);
  add(kLoraO, q, C);
  add(kLoraGate, C, F);
  add(kLoraUp, C, F);
  add(kLoraDown, F, C);
  return n;
}

namespace {
struct LoraName {
  const char* name;
  uint32_t bit;
  int arch;  // 0 both, 1 GPT-2 only, 2 Llama only
  bool canonical;
};
const LoraName kLoraNames[] = {
    {"c_attn", kLoraQkv, 1, true}, {"q", kLoraQ, 0, true},       {"k", kLoraK, 0, true},
    {"v", kLoraV, 0, true},        {"o", kLoraO, 0, true},        {"gate", kLoraGate, 2, true},
    {"up", kLoraUp, 0, true},      {"down", kLoraDown, 0, true},  {"attn.c_proj", kLoraO, 1, false},
    {"c_fc", kLoraUp, 1, false},   {"mlp.c_proj", kLoraDown, 1, false},
};
}  // namespace

uint32_t parse_lora_targets(const std::string& list, Arch arch) {
  uint32_t bits = 0;
  size_t at = 0;
  while (at <= list.size()) {
    size_t e = list.find(',', at);
    if (e == std::string::npos) e = list.size();
    std::string t = list.substr(at, e - at);
    while (!t.empty() && t.front() == ' ') t.erase(t.begin());
    while (!t.empty() && t.back() == ' ') t.pop_back();
    at = e + 1;
    if (t.empty()) continue;
    bool found = false;
    for (const LoraName& n : kLoraNames) {
      if (t != n.name) continue;
      if ((n.arch == 1 && arch != Arch::GPT2) || (n.arch == 2 && arch != Arch::Llama)) break;
      bits |= n.bit;
      found = true;
      break;
    }
    if (!found)
      throw std::invalid_argument("lora.targets: unknown projection '" + t + "' for " + arch_name(arch) + " (use " +
                                  (arch == Arch::GPT2 ? "c_attn, q, k, v, o, up, down" : "q, k, v, o, gate, up, down") +
                                  ")");
  }
  return bits;
}

std::string lora_targets_string(uint32_t targets, Arch arch) {
  std::string s;
  for (const LoraName& n : kLoraNames) {
    if (!n.canonical || !(targets & n.bit)) continue;
    if ((n.arch == 1 && arch != Arch::GPT2) || (n.arch == 2 && arch != Arch::Llama)) continue;
    s += (s.empty() ? "" : ",") + std::string(n.name);
  }
  return s;
}

int64_t ModelConfig::moe_layers() const {
  int64_t n = 0;
  for (int64_t l = 0; l < n_layer; ++l) n += is_moe_layer(l) ? 1 : 0;
  return n;
}

int64_t ModelConfig::expert_params() const {
  const int64_t C = n_embd, F = expert_ffn();
  return arch == Arch::GPT2 ? C * F + F + F * C + C : 3 * C * F;
}

std::vector<float> ModelConfig::rope_inv_freq() const {
  // transformers: inv_freq = 1 / (base ** (arange(0, dim, 2).float() / dim)), float32 throughout;
  // llama3 scaling (_compute_llama3_parameters) divides the low frequencies by `factor`, keeps the
  // high ones and blends the band between them.
  const int64_t hd = head_dim(), half = hd / 2;
  std::vector<float> inv(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(hd);
    inv[static_cast<size_t>(i)] = 1.0f / std::pow(rope_theta, e);
  }
  if (!rope_scaled()) return inv;
  const float factor = rope_scaling_factor, lo = rope_low_freq_factor, hi = rope_high_freq_factor;
  const float old_len = static_cast<float>(rope_original_max_position);
  const float low_wavelen = old_len / lo, high_wavelen = old_len / hi;
  const float two_pi = static_cast<float>(2.0 * 3.14159265358979323846);
  for (float& f : inv) {
    const float wavelen = two_pi / f;
    float g = wavelen > low_wavelen ? f / factor : f;
    if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
      const float smooth = (old_len / wavelen - lo) / (hi - lo);
      g = (1.0f - smooth) * g / factor + smooth * g;
    }
    f = g;
  }
  return inv;
}

int64_t ModelConfig::block_params(int64_t l) const {
  const int64_t C = n_embd, hd = head_dim(), F = ffn_hidden;
  const int64_t qkv = (n_head + 2 * n_kv_head) * hd;
  if (l >= 0 && is_moe_layer(l)) {
    ModelConfig d = *this;
    d.moe_experts = 0;
    const int64_t mlp = arch == Arch::GPT2 ? C * F + F + F * C + C : 3 * C * F;
    return d.block_params() - mlp + moe_experts * C + (moe_experts + moe_shared_experts) * expert_params();
  }
  const int64_t lora = lora_block_params();
  if (arch == Arch::GPT2) {
    return 2 * C                // ln_1
           + C * qkv + qkv      // c_attn
           + C * C + C          // attn c_proj
           + 2 * C              // ln_2
           + C * F + F          // c_fc
           + F * C + C          // mlp c_proj
           + lora;              // LoRA adapters
  }
  return C                      // input_layernorm
         + C * qkv              // q,k,v proj (no bias)
         + C * C                // o_proj
         + C                    // post_attention_layernorm
         + 3 * C * F            // gate, up, down
         + (qkv_bias ? qkv : 0)  // q, k, v biases (Qwen 2)
         + lora;                 // LoRA adapters
}

int64_t ModelConfig::num_params() const {
  const int64_t C = n_embd;
  int64_t n = padded_vocab * C;
  for (int64_t l = 0; l < n_layer; ++l) n += block_params(l);
  if (arch == Arch::GPT2) {
    n += max_position * C + 2 * C;  // wpe, ln_f
  } else {
    n += C;                    // final norm
    if (!tied_embeddings) n += padded_vocab * C;
  }
  return n;
}

double ModelConfig::flops_per_token() const {
  // Parameters that multiply activations: the position table and an untied input embedding are
  // lookups, not matmuls (a tied table counts once, as the output projection).
  double n = static_cast<double>(active_params());
  if (arch == Arch::GPT2) n -= static_cast<double>(max_position * n_embd);
  if (!tied_embeddings) n -= static_cast<double>(padded_vocab * n_embd);
  return 6.0 * n + 12.0 * static_cast<double>(n_layer * n_embd * seq_len);
}

int64_t ModelConfig::active_params() const {
  return num_params() - moe_layers() * (moe_experts - moe_top_k) * expert_params();
}

ModelConfig llama_config(const char* name, int64_t L, int64_t H, int64_t KV, int64_t C, int64_t F, int64_t T,
                         int64_t V, float theta) {
  ModelConfig m;
  m.name = name;
  m.arch = Arch::Llama;
  m.n_layer = L;
  m.n_head = H;
  m.n_kv_head = KV;
  m.n_embd = C;
  m.ffn_hidden = F;
  m.seq_len = T;
  m.vocab_size = V;
  m.rope_theta = theta;
  m.tied_embeddings = false;
  return m;
}

namespace {
ModelConfig gpt2(const char* name, int64_t L, int64_t H, int64_t C, int64_t T, int64_t V) {
  ModelConfig m;
  m.name = name;
  m.arch = Arch::GPT2;
  m.n_layer = L;
  m.n_head = H;
  m.n_kv_head = H;
  m.n_embd = C;
  m.seq_len = T;
  m.vocab_size = V;
  return m;
}
ModelConfig moe_preset(ModelConfig m, int64_t E, int64_t k, int64_t shared, int64_t width, bool sigmoid) {
  m.moe_experts = E;
  m.moe_top_k = k;
  m.moe_shared_experts = shared;
  m.moe_ffn_hidden = width;
  m.moe_sigmoid = sigmoid;
  m.moe_aux_loss_coef = sigmoid ? 0.0001f : 0.02f;
  return m;
}
std::vector<ModelConfig> all_presets() {
  return {
      gpt2("gpt2-124m", 12, 12, 768, 1024, 50257),
      gpt2("gpt2-350m", 24, 16, 1024, 1024, 50257),
      gpt2("gpt2-774m", 36, 20, 1280, 1024, 50257),
      gpt2("gpt2-1.5b", 48, 25, 1600, 1024, 50257),
      gpt2("gpt3-175b", 96, 96, 12288, 2048, 50257),
      llama_config("llama3-8b", 32, 32, 8, 4096, 14336, 8192, 128256, 500000.0f),
      llama_config("llama3-70b", 80, 64, 8, 8192, 28672, 8192, 128256, 500000.0f),
      llama_config("llama3-405b", 126, 128, 8, 16384, 53248, 8192, 128256, 500000.0f),
      // Mixtures of experts: Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json: 46.7B parameters,
      // 12.9B active) and a DeepSeek-V3-like shape (61 layers of 7168, 256 routed experts of 2048
      // + 1 shared, top-8, sigmoid router; standard grouped-query attention instead of MLA, every
      // block MoE: about 690B parameters, 40B active).
      moe_preset(llama_config("mixtral-8x7b", 32, 32, 8, 4096, 14336, 4096, 32000, 1000000.0f), 8, 2, 0, 0, false),
      moe_preset(llama_config("deepseek-v3-like", 61, 128, 128, 7168, 18432, 4096, 129280, 10000.0f), 256, 8, 1, 2048,
                 true),
      // Small models that train on a CPU.
      gpt2("gpt2-tiny", 2, 2, 32, 32, 256),          // unit tests
      gpt2("gpt2-mini", 4, 4, 128, 128, 256),        // the default demo (byte tokenizer)
      gpt2("gpt2-small-cpu", 6, 6, 384, 256, 50257), // the benchmark config (GPT-2 vocabulary)
      llama_config("llama-tiny", 2, 4, 2, 32, 64, 32, 256, 10000.0f),
      llama_config("llama-mini", 4, 4, 2, 128, 352, 128, 256, 10000.0f),
      llama_config("llama-small-cpu", 6, 6, 2, 384, 1024, 256, 50257, 10000.0f),
  };
}
}  // namespace

ModelConfig model_preset(const std::string& name) {
  for (ModelConfig& m : all_presets())
    if (m.name == name) {
      m.resolve();
      return m;
    }
  std::string known;
  for (const auto& n : model_preset_names()) known += (known.empty() ? "" : ", ") + n;
  throw std::invalid_argument("unknown model preset '" + name + "' (known: " + known + ")");
}

std::vector<std::string> model_preset_names() {
  std::vector<std::string> v;
  for (const auto& m : all_presets()) v.push_back(m.name);
  return v;
}

}  // namespace mt
