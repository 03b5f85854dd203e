// Hugging Face model configs (config.json) to and from ModelConfig: GPT-2 (`gpt2`), Llama 2 / 3 /
// 3.1 (`llama`, with rope_scaling of rope_type "llama3"), Mistral (`mistral`, full attention while
// the sequence fits its sliding window) and Qwen 2 dense (`qwen2`: a Llama block with q/k/v
// biases). What the engine cannot reproduce is refused, naming the field.
#pragma once
#include <string>

#include "model/config/model_config.h"

namespace mt {

// Parses config.json text; `origin` (the file name) starts every error message. Throws
// std::invalid_argument naming the field for a missing or bad value and for anything unsupported
// (an unknown model_type, mixture of experts, attention or MLP biases, an activation other than the
// architecture's, rope_scaling other than llama3, a head_dim other than hidden_size / heads, GPT-2
// with untied embeddings). seq_len is set to max_position_embeddings (callers usually override it).
// strict = false (the planner, which only needs sizes): dimensions only, as before training
// support existed - any model_type with hidden_size is read as a Llama-style decoder, no refusals.
ModelConfig model_from_hf_json(const std::string& json_text, const std::string& origin, bool strict = true);
// Reads `path` and parses it; an unreadable file is an std::invalid_argument naming it.
ModelConfig model_from_hf_config(const std::string& path, bool strict = true);
// A config.json that transformers' AutoModelForCausalLM loads for this model (GPT2LMHeadModel or
// LlamaForCausalLM), pretty-printed.
std::string hf_config_json(const ModelConfig& m);

}  // namespace mt
