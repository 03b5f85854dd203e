#include "model/config/hf_config.h"
#include "runtime/strings.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

namespace mt {

namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  const std::string& origin;
  std::invalid_argument bad(const std::string& key, const std::string& what) const {
    return std::invalid_argument(origin + ": " + key + " " + what);
  }
  bool has(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  int64_t pos_int(std::initializer_list<const char*> keys, bool required, int64_t fallback) const {
    for (const char* k : keys) {
      if (!has(k)) continue;
      if (!j[k].is_number_integer() || j[k].get<int64_t>() <= 0) throw bad(k, "must be a positive integer");
      return j[k].get<int64_t>();
    }
    if (required) throw std::invalid_argument(origin + ": missing key '" + *keys.begin() + "'");
    return fallback;
  }
  double pos_num(const char* k, double fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_number() || !(j[k].get<double>() > 0)) throw bad(k, "must be a positive number");
    return j[k].get<double>();
  }
  bool flag(const char* k, bool fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_boolean()) throw bad(k, "must be true or false");
    return j[k].get<bool>();
  }
  std::string str(const char* k, const std::string& fallback) const {
    if (!has(k)) return fallback;
    if (!j[k].is_string()) throw bad(k, "must be a string");
    return j[k].get<std::string>();
  }
  // Refuses a true flag the engine cannot honour.
  void refuse_true(const char* k, const std::string& why) const {
    if (flag(k, false)) throw bad(k, "= true is not supported (" + why + ")");
  }
};

void read_rope_scaling(const Reader& r, ModelConfig& m) {
  if (!r.has("rope_scaling")) return;
  const json& s = r.j["rope_scaling"];
  if (!s.is_object()) throw r.bad("rope_scaling", "must be an object or null");
  std::string type = s.contains("rope_type") ? s["rope_type"].get<std::string>()
                                             : s.value("type", std::string());
  if (type == "default") return;
  if (type != "llama3")
    throw r.bad("rope_scaling", "of type '" + type + "' is not supported (supported: llama3, as in Llama 3.1)");
  Reader rs{s, r.origin};
  auto need = [&](const char* k) {
    if (!rs.has(k)) throw r.bad("rope_scaling", std::string("(llama3) needs '") + k + "'");
  };
  for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) need(k);
  m.rope_scaling_factor = static_cast<float>(rs.pos_num("factor", 0));
  m.rope_low_freq_factor = static_cast<float>(rs.pos_num("low_freq_factor", 0));
  m.rope_high_freq_factor = static_cast<float>(rs.pos_num("high_freq_factor", 0));
  m.rope_original_max_position = rs.pos_int({"original_max_position_embeddings"}, true, 0);
  if (!(m.rope_high_freq_factor > m.rope_low_freq_factor))
    throw r.bad("rope_scaling", "needs high_freq_factor > low_freq_factor");
}

// A float field as the shortest decimal that reads back as the same float (1e-05, not 9.99e-06).
double decimal(float f) {
  char buf[32];
  for (int prec = 6; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) break;
  }
  return std::strtod(buf, nullptr);
}

}  // namespace

ModelConfig model_from_hf_json(const std::string& text, const std::string& origin, bool strict) {
  json j;
  try {
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw std::invalid_argument(origin + ": not valid JSON (" + json_error_text(e.what()) + ")");
  }
  if (!j.is_object()) throw std::invalid_argument(origin + ": expected a JSON object");
  const Reader r{j, origin};
  const std::string type = r.str("model_type", "");
  ModelConfig m;
  m.name = origin;
  // Mixture of experts in any family.
  for (const char* k : {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"})
    if (strict && type != "mixtral" && r.has(k) && !(j[k].is_number_integer() && j[k].get<int64_t>() <= 1))
      throw r.bad(k, "is set: of the mixture-of-experts families only Mixtral (model_type mixtral) is supported");
  if (type == "gpt2") {
    m.arch = Arch::GPT2;
    m.n_embd = r.pos_int({"n_embd", "hidden_size"}, true, 0);
    m.n_layer = r.pos_int({"n_layer", "num_hidden_layers"}, true, 0);
    m.n_head = r.pos_int({"n_head", "num_attention_heads"}, true, 0);
    m.n_kv_head = m.n_head;
    m.max_position = r.pos_int({"n_positions", "max_position_embeddings", "n_ctx"}, false, 1024);
    m.vocab_size = r.pos_int({"vocab_size"}, true, 0);
    m.ffn_hidden = r.pos_int({"n_inner"}, false, 0);
    m.norm_eps = static_cast<float>(r.pos_num("layer_norm_epsilon", 1e-5));
    const std::string act = r.str("activation_function", "gelu_new");
    if (!strict) {
    } else if (act != "gelu_new" && act != "gelu_pytorch_tanh")
      throw r.bad("activation_function", "'" + act + "' is not supported (the engine's GPT-2 MLP is gelu_new)");
    if (!r.flag("tie_word_embeddings", true))
      throw r.bad("tie_word_embeddings", "= false is not supported for GPT-2 (its head is the token embedding)");
    r.refuse_true("scale_attn_by_inverse_layer_idx", "attention is scaled by 1/sqrt(head_dim) only");
    r.refuse_true("reorder_and_upcast_attn", "not implemented");
    if (!r.flag("scale_attn_weights", true)) throw r.bad("scale_attn_weights", "= false is not supported");
  } else if (type == "llama" || type == "mistral" || type == "qwen2" || type == "mixtral" ||
             (!strict && r.has("hidden_size"))) {
    m.arch = Arch::Llama;
    if (type == "mixtral") {  // every block's MLP is block_sparse_moe: softmax top-k over SwiGLU experts
      m.moe_experts = r.pos_int({"num_local_experts"}, true, 0);
      m.moe_top_k = r.pos_int({"num_experts_per_tok"}, false, 2);
      m.moe_every = 1;
      m.moe_aux_loss_coef = static_cast<float>(r.has("router_aux_loss_coef") ? j["router_aux_loss_coef"].get<double>() : 0.001);
      if (strict && r.has("router_jitter_noise") && j["router_jitter_noise"].get<double>() != 0.0)
        throw r.bad("router_jitter_noise", "is not 0: router noise is not implemented");
    }
    m.qkv_bias = type == "qwen2";  // Qwen 2: biases on q, k, v (not on o or the MLP)
    m.n_embd = r.pos_int({"hidden_size"}, true, 0);
    m.n_layer = r.pos_int({"num_hidden_layers"}, true, 0);
    m.n_head = r.pos_int({"num_attention_heads"}, true, 0);
    m.n_kv_head = r.pos_int({"num_key_value_heads"}, false, m.n_head);
    m.ffn_hidden = r.pos_int({"intermediate_size"}, true, 0);
    m.vocab_size = r.pos_int({"vocab_size"}, true, 0);
    m.max_position = r.pos_int({"max_position_embeddings"}, false, strict ? 2048 : 4096);
    m.norm_eps = static_cast<float>(r.pos_num("rms_norm_eps", 1e-6));
    m.rope_theta = static_cast<float>(r.pos_num("rope_theta", 10000.0));
    m.tied_embeddings = r.flag("tie_word_embeddings", false);
    if (!strict) {
      m.seq_len = m.max_position;
      try {
        m.resolve();
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(origin + ": " + e.what());
      }
      return m;
    }
    const std::string act = r.str("hidden_act", "silu");
    if (act != "silu") throw r.bad("hidden_act", "'" + act + "' is not supported (the engine's MLP is SwiGLU: silu)");
    if (type != "qwen2") r.refuse_true("attention_bias", "the engine's Llama attention has biases only as Qwen 2's q/k/v");
    r.refuse_true("mlp_bias", "the engine's MLP projections have no bias");
    if (r.has("head_dim") && r.pos_int({"head_dim"}, true, 0) * m.n_head != m.n_embd)
      throw r.bad("head_dim", "(" + std::to_string(j["head_dim"].get<int64_t>()) +
                                  ") must be hidden_size / num_attention_heads");
    if ((type == "mistral" || type == "mixtral") && r.has("sliding_window") && !j["sliding_window"].is_null())
      m.sliding_window = r.pos_int({"sliding_window"}, true, 0);
    if (r.flag("use_sliding_window", false) && r.has("sliding_window"))
      m.sliding_window = r.pos_int({"sliding_window"}, true, 0);
    read_rope_scaling(r, m);
  } else {
    if (!strict)
      throw std::invalid_argument(origin + ": missing key 'hidden_size' (model_type '" + type +
                                  "'; supported: gpt2 and Llama-style decoders)");
    throw r.bad("model_type", "'" + type + "' is not supported (supported: gpt2, llama, mistral, qwen2)");
  }
  m.seq_len = m.max_position;
  if (m.sliding_window > 0 && m.seq_len > m.sliding_window) m.seq_len = m.sliding_window;
  try {
    m.resolve();
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(origin + ": " + e.what());
  }
  return m;
}

ModelConfig model_from_hf_config(const std::string& path, bool strict) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument("cannot open the Hugging Face config '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return model_from_hf_json(ss.str(), path, strict);
}

std::string hf_config_json(const ModelConfig& m) {
  json j;
  if (m.arch == Arch::GPT2 && m.moe())
    throw std::invalid_argument("a GPT-2 mixture of experts has no Hugging Face config (only Mixtral's form is exported)");
  if (m.arch == Arch::GPT2) {
    j = {{"architectures", {"GPT2LMHeadModel"}},
         {"model_type", "gpt2"},
         {"n_embd", m.n_embd},
         {"n_layer", m.n_layer},
         {"n_head", m.n_head},
         {"n_positions", m.max_position},
         {"n_ctx", m.max_position},
         {"n_inner", m.ffn_hidden},
         {"vocab_size", m.vocab_size},
         {"layer_norm_epsilon", decimal(m.norm_eps)},
         {"activation_function", "gelu_new"},
         {"resid_pdrop", 0.0},
         {"embd_pdrop", 0.0},
         {"attn_pdrop", 0.0},
         {"tie_word_embeddings", true},
         {"scale_attn_weights", true}};
  } else {
    j = {{"architectures", {m.qkv_bias ? "Qwen2ForCausalLM" : "LlamaForCausalLM"}},
         {"model_type", m.qkv_bias ? "qwen2" : "llama"},
         {"hidden_size", m.n_embd},
         {"intermediate_size", m.ffn_hidden},
         {"num_hidden_layers", m.n_layer},
         {"num_attention_heads", m.n_head},
         {"num_key_value_heads", m.n_kv_head},
         {"head_dim", m.head_dim()},
         {"max_position_embeddings", std::max(m.max_position, m.seq_len)},
         {"vocab_size", m.vocab_size},
         {"rms_norm_eps", decimal(m.norm_eps)},
         {"rope_theta", decimal(m.rope_theta)},
         {"hidden_act", "silu"},
         {"attention_bias", false},
         {"mlp_bias", false},
         {"attention_dropout", 0.0},
         {"tie_word_embeddings", m.tied_embeddings},
         {"rope_scaling", nullptr}};
    if (m.qkv_bias) {  // Qwen2Config: no attention_bias / mlp_bias / head_dim keys; full attention
      for (const char* k : {"attention_bias", "mlp_bias", "head_dim"}) j.erase(k);
      j["use_sliding_window"] = false;
    }
    if (m.moe()) {  // Mixtral: every block an MoE layer with softmax top-k and no shared experts
      if (m.moe_every != 1 || m.moe_shared_experts > 0 || m.moe_sigmoid || m.qkv_bias ||
          (m.moe_ffn_hidden > 0 && m.moe_ffn_hidden != m.ffn_hidden))
        throw std::invalid_argument(
            "this mixture of experts has no Hugging Face config: only Mixtral's form (model.moe_every = 1, no shared "
            "experts, softmax router, expert width = ffn_hidden) is exported");
      j["architectures"] = {"MixtralForCausalLM"};
      j["model_type"] = "mixtral";
      j["num_local_experts"] = m.moe_experts;
      j["num_experts_per_tok"] = m.moe_top_k;
      j["router_aux_loss_coef"] = decimal(m.moe_aux_loss_coef);
      j["router_jitter_noise"] = 0.0;
      j["output_router_logits"] = false;
      j["sliding_window"] = nullptr;
      for (const char* k : {"mlp_bias", "rope_scaling"}) j.erase(k);
    }
    if (m.rope_scaled())
      j["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", decimal(m.rope_scaling_factor)},
                           {"low_freq_factor", decimal(m.rope_low_freq_factor)},
                           {"high_freq_factor", decimal(m.rope_high_freq_factor)},
                           {"original_max_position_embeddings", m.rope_original_max_position}};
  }
  j["torch_dtype"] = "float32";
  return j.dump(2) + "\n";
}

}  // namespace mt
