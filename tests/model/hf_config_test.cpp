// Hugging Face config.json -> ModelConfig (GPT-2, Llama 2 / 3 / 3.1 with llama3 rope scaling, Mistral),
// refusals naming the field, the config.json written for an export, and Llama 3.1's rotary
// frequencies against the checked-in vector from transformers (tests/model/fixtures).
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "model/config/hf_config.h"
#include "model/transformer.h"

namespace mt {
namespace {

std::string error_of(const std::string& json) {
  try {
    model_from_hf_json(json, "cfg.json");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "no error";
}

const char* kLlama31_8B = R"({"architectures":["LlamaForCausalLM"],"model_type":"llama","hidden_size":4096,
  "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
  "vocab_size":128256,"max_position_embeddings":131072,"rms_norm_eps":1e-05,"rope_theta":500000.0,
  "tie_word_embeddings":false,"hidden_act":"silu","attention_bias":false,"mlp_bias":false,"head_dim":128,
  "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                  "original_max_position_embeddings":8192,"rope_type":"llama3"}})";

TEST(HfModelConfig, Gpt2) {
  const ModelConfig m = model_from_hf_json(
      R"({"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"n_positions":1024,"n_ctx":1024,
          "vocab_size":50257,"layer_norm_epsilon":1e-05,"activation_function":"gelu_new","n_inner":null})",
      "cfg.json");
  EXPECT_EQ(m.arch, Arch::GPT2);
  EXPECT_EQ(m.max_position, 1024);
  EXPECT_EQ(m.seq_len, 1024);
  EXPECT_FLOAT_EQ(m.norm_eps, 1e-5f);
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_EQ(m.num_params(), model_preset("gpt2-124m").num_params());
  const ModelConfig e = model_from_hf_json(
      R"({"model_type":"gpt2","n_embd":32,"n_layer":1,"n_head":2,"n_positions":64,"vocab_size":100,
          "layer_norm_epsilon":1e-6})", "cfg.json");
  EXPECT_FLOAT_EQ(e.norm_eps, 1e-6f);
  EXPECT_EQ(e.max_position, 64);
}

TEST(HfModelConfig, Llama2And3AndTiedLlama32) {
  const ModelConfig l2 = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":4096,"intermediate_size":11008,"num_hidden_layers":32,
          "num_attention_heads":32,"num_key_value_heads":32,"vocab_size":32000,"max_position_embeddings":4096,
          "rms_norm_eps":1e-05,"rope_scaling":null,"tie_word_embeddings":false,"hidden_act":"silu"})",
      "cfg.json");
  EXPECT_EQ(l2.arch, Arch::Llama);
  EXPECT_FLOAT_EQ(l2.rope_theta, 10000.0f);  // transformers' default
  EXPECT_FALSE(l2.rope_scaled());
  EXPECT_FALSE(l2.tied_embeddings);
  EXPECT_NEAR(static_cast<double>(l2.num_params()), 6.74e9, 0.01e9);
  const ModelConfig l3 = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
          "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":8192,
          "rms_norm_eps":1e-05,"rope_theta":500000.0,"tie_word_embeddings":false})", "cfg.json");
  EXPECT_EQ(l3.num_params(), model_preset("llama3-8b").num_params());
  EXPECT_FLOAT_EQ(l3.rope_theta, 500000.0f);
  const ModelConfig t = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,
          "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"max_position_embeddings":131072,
          "rms_norm_eps":1e-05,"rope_theta":500000.0,"tie_word_embeddings":true,
          "rope_scaling":{"factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                          "original_max_position_embeddings":8192,"rope_type":"llama3"}})", "cfg.json");
  EXPECT_TRUE(t.tied_embeddings);
  EXPECT_NEAR(static_cast<double>(t.num_params()), 1.236e9, 0.005e9);  // meta-llama/Llama-3.2-1B
  // A tied Llama has no lm_head parameter.
  ModelConfig small = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":32,"intermediate_size":64,"num_hidden_layers":1,
          "num_attention_heads":2,"vocab_size":64,"max_position_embeddings":16,"tie_word_embeddings":true})",
      "cfg.json");
  Transformer tm(small, ModelOptions{.storage = ModelStorage{.weights = false, .master = false, .grads = false}});
  for (const auto& p : tm.params()) EXPECT_NE(p.name, "lm_head.weight");
  EXPECT_EQ(tm.num_params(), small.num_params());
  EXPECT_FLOAT_EQ(small.norm_eps, 1e-6f);  // LlamaConfig's default rms_norm_eps
}

TEST(HfModelConfig, Llama31RopeScalingMatchesTransformers) {
  const ModelConfig m = model_from_hf_json(kLlama31_8B, "cfg.json");
  ASSERT_TRUE(m.rope_scaled());
  EXPECT_FLOAT_EQ(m.rope_scaling_factor, 8.0f);
  EXPECT_EQ(m.rope_original_max_position, 8192);
  EXPECT_EQ(m.max_position, 131072);
  std::ifstream f(std::string(MT_SOURCE_DIR) + "/tests/model/fixtures/llama31_rope_inv_freq.json");
  ASSERT_TRUE(f.good()) << "missing checked-in vector (tests/checkpoint/hf_export_check.py --write-vectors)";
  const auto j = nlohmann::json::parse(f);
  const std::vector<double> want = j["inv_freq"].get<std::vector<double>>();
  const std::vector<float> got = m.rope_inv_freq();
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], 1e-6 * want[i]) << "frequency " << i;
  // The scaling changes the low frequencies (divided by 8), keeps the high ones.
  ModelConfig plain = m;
  plain.rope_scaling_factor = 0;
  const std::vector<float> base = plain.rope_inv_freq();
  EXPECT_FLOAT_EQ(got[0], base[0]);
  EXPECT_NEAR(got.back(), base.back() / 8.0f, 1e-6 * base.back());
  // And the model uses them: the same weights give another loss with scaling than without.
  ModelConfig tiny = model_from_hf_json(
      R"({"model_type":"llama","hidden_size":32,"intermediate_size":64,"num_hidden_layers":1,
          "num_attention_heads":2,"vocab_size":64,"max_position_embeddings":32,
          "rope_scaling":{"rope_type":"llama3","factor":4.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
                          "original_max_position_embeddings":8}})", "cfg.json");
  ModelConfig unscaled = tiny;
  unscaled.rope_scaling_factor = 0;
  Transformer a(tiny, DType::F32), b(unscaled, DType::F32);
  a.init_weights(3);
  b.init_weights(3);
  std::vector<int32_t> x(32), y(32);
  for (int i = 0; i < 32; ++i) x[static_cast<size_t>(i)] = (i * 7) % 64, y[static_cast<size_t>(i)] = (i * 7 + 3) % 64;
  EXPECT_NE(a.forward(x.data(), y.data(), 1, 32, false), b.forward(x.data(), y.data(), 1, 32, false));
}

TEST(HfModelConfig, NormEpsilonIsUsedByTheNorms) {
  for (const char* preset : {"gpt2-tiny", "llama-tiny"}) {
    ModelConfig c = model_preset(preset), d = c;
    d.norm_eps = 0.5f;
    Transformer a(c, DType::F32), b(d, DType::F32);
    a.init_weights(1);
    b.init_weights(1);
    std::vector<int32_t> x(16, 5), y(16, 7);
    for (int i = 0; i < 16; ++i) x[static_cast<size_t>(i)] = i % 200;
    EXPECT_NE(a.forward(x.data(), y.data(), 1, 16, false), b.forward(x.data(), y.data(), 1, 16, false)) << preset;
  }
}

// Qwen/Qwen2-0.5B config.json: a Llama block with q/k/v biases, tied head, full attention.
TEST(HfModelConfig, Qwen2) {
  const ModelConfig m = model_from_hf_json(
      R"({"architectures":["Qwen2ForCausalLM"],"model_type":"qwen2","hidden_size":896,"intermediate_size":4864,
          "num_hidden_layers":24,"num_attention_heads":14,"num_key_value_heads":2,"vocab_size":151936,
          "max_position_embeddings":131072,"rms_norm_eps":1e-06,"rope_theta":1000000.0,
          "tie_word_embeddings":true,"use_sliding_window":false,"sliding_window":131072,"max_window_layers":24,
          "hidden_act":"silu"})", "cfg.json");
  EXPECT_EQ(m.arch, Arch::Llama);
  EXPECT_TRUE(m.qkv_bias);
  EXPECT_TRUE(m.tied_embeddings);
  EXPECT_EQ(m.sliding_window, 0);
  EXPECT_FLOAT_EQ(m.rope_theta, 1e6f);
  // 494,032,768 parameters (Qwen2-0.5B's count) plus the vocabulary padded to 151,936 (already a multiple of 64).
  EXPECT_EQ(m.num_params(), 494032768);
  const auto j = nlohmann::json::parse(hf_config_json(m));
  EXPECT_EQ(j["model_type"], "qwen2");
  EXPECT_EQ(j["architectures"][0], "Qwen2ForCausalLM");
  EXPECT_TRUE(model_from_hf_json(hf_config_json(m), "b.json").qkv_bias);
}

TEST(HfModelConfig, MistralSlidingWindow) {
  const ModelConfig m = model_from_hf_json(
      R"({"model_type":"mistral","hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
          "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":32000,"max_position_embeddings":32768,
          "rms_norm_eps":1e-05,"rope_theta":10000.0,"sliding_window":4096,"tie_word_embeddings":false})",
      "cfg.json");
  EXPECT_EQ(m.sliding_window, 4096);
  EXPECT_EQ(m.seq_len, 4096);  // full causal attention equals the window's while the sequence fits it
  ModelConfig longer = m;
  longer.seq_len = 8192;
  try {
    longer.resolve();
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("sliding_window"), std::string::npos) << e.what();
  }
  const ModelConfig v3 = model_from_hf_json(
      R"({"model_type":"mistral","hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
          "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"max_position_embeddings":512,
          "sliding_window":null})", "cfg.json");
  EXPECT_EQ(v3.sliding_window, 0);
  EXPECT_EQ(v3.seq_len, 512);
}

TEST(HfModelConfig, UnsupportedConfigsAreRefusedNamingTheField) {
  const std::string llama = R"("hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
      "num_attention_heads":4,"vocab_size":100)";
  struct Case {
    std::string json, field;
  } cases[] = {
      {R"({"model_type":"t5","d_model":512})", "model_type"},
      {R"({"model_type":"qwen2_moe",)" + llama + "}", "model_type"},
      {R"({"model_type":"llama","num_local_experts":8,)" + llama + "}", "num_local_experts"},
      {R"({"model_type":"mixtral","num_local_experts":8,"router_jitter_noise":0.1,)" + llama + "}", "router_jitter_noise"},
      {R"({"model_type":"llama",)" + llama + R"(,"rope_scaling":{"rope_type":"yarn","factor":4.0}})", "rope_scaling"},
      {R"({"model_type":"llama",)" + llama + R"(,"rope_scaling":{"rope_type":"llama3","factor":4.0}})", "rope_scaling"},
      {R"({"model_type":"llama",)" + llama + R"(,"hidden_act":"gelu"})", "hidden_act"},
      {R"({"model_type":"llama",)" + llama + R"(,"attention_bias":true})", "attention_bias"},
      {R"({"model_type":"llama",)" + llama + R"(,"mlp_bias":true})", "mlp_bias"},
      {R"({"model_type":"llama",)" + llama + R"(,"head_dim":32})", "head_dim"},
      {R"({"model_type":"llama",)" + llama + R"(,"rms_norm_eps":-1})", "rms_norm_eps"},
      {R"({"model_type":"gpt2","n_embd":32,"n_layer":1,"n_head":2,"vocab_size":10,"tie_word_embeddings":false})",
       "tie_word_embeddings"},
      {R"({"model_type":"gpt2","n_embd":32,"n_layer":1,"n_head":2,"vocab_size":10,"activation_function":"relu"})",
       "activation_function"},
      {R"({"model_type":"llama","hidden_size":64})", "num_hidden_layers"},
  };
  for (const Case& c : cases) {
    const std::string m = error_of(c.json);
    EXPECT_NE(m.find("cfg.json"), std::string::npos) << c.json << "\n" << m;
    EXPECT_NE(m.find(c.field), std::string::npos) << c.json << "\n" << m;
  }
  // The planner's lenient reading still sizes such models.
  EXPECT_NO_THROW(model_from_hf_json(R"({"model_type":"qwen2_moe",)" + llama + "}", "cfg.json", false));
}

// Mixtral: every block an MoE layer (softmax top-k over SwiGLU experts); its export reads back.
TEST(HfModelConfig, MixtralAndItsExport) {
  const ModelConfig m = model_from_hf_json(R"({"model_type":"mixtral","hidden_size":64,"intermediate_size":96,
      "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
      "num_local_experts":8,"num_experts_per_tok":2,"router_aux_loss_coef":0.02,"sliding_window":null})", "m.json");
  EXPECT_EQ(m.arch, Arch::Llama);
  EXPECT_EQ(m.moe_experts, 8);
  EXPECT_EQ(m.moe_top_k, 2);
  EXPECT_EQ(m.moe_every, 1);
  EXPECT_FALSE(m.moe_sigmoid);
  EXPECT_FLOAT_EQ(m.moe_aux_loss_coef, 0.02f);
  EXPECT_EQ(m.expert_ffn(), 96);
  const auto j = nlohmann::json::parse(hf_config_json(m));
  EXPECT_EQ(j["architectures"][0], "MixtralForCausalLM");
  EXPECT_EQ(j["num_local_experts"], 8);
  const ModelConfig r = model_from_hf_json(j.dump(), "b.json");
  EXPECT_EQ(r.num_params(), m.num_params());
  EXPECT_EQ(r.active_params(), m.active_params());
  ModelConfig d = m;  // DeepSeek-style shapes have no Hugging Face config here: refused, saying why
  d.moe_shared_experts = 1;
  EXPECT_THROW(hf_config_json(d), std::invalid_argument);
}

// The config.json of an export reads back as the same model.
TEST(HfModelConfig, ExportedConfigReadsBack) {
  for (const std::string& src :
       {std::string(kLlama31_8B),
        std::string(R"({"model_type":"gpt2","n_embd":64,"n_layer":2,"n_head":4,"n_positions":256,"vocab_size":300,
                        "layer_norm_epsilon":1e-6})")}) {
    ModelConfig m = model_from_hf_json(src, "a.json");
    m.seq_len = 128;  // trained shorter than the position table
    const std::string out = hf_config_json(m);
    const auto j = nlohmann::json::parse(out);
    EXPECT_EQ(j["torch_dtype"], "float32");
    const ModelConfig r = model_from_hf_json(out, "b.json");
    EXPECT_EQ(r.arch, m.arch);
    EXPECT_EQ(r.num_params(), m.num_params()) << out;
    EXPECT_EQ(r.max_position, m.max_position);
    EXPECT_EQ(r.norm_eps, m.norm_eps);
    EXPECT_EQ(r.rope_theta, m.rope_theta);
    EXPECT_EQ(r.tied_embeddings, m.tied_embeddings);
    EXPECT_EQ(r.rope_inv_freq(), m.rope_inv_freq());
    if (m.arch == Arch::GPT2) {
      EXPECT_DOUBLE_EQ(j["layer_norm_epsilon"].get<double>(), 1e-6);
    }
  }
}

}  // namespace
}  // namespace mt
