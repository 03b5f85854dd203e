#include "train/config.h"

#include <toml++/toml.h>

#include "checkpoint/checkpoint.h"
#include "model/config/hf_config.h"
#include "parallel/layout/parallel_config.h"
#include "parallel/mesh.h"
#include "runtime/strings.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <sstream>

namespace mt {

namespace {

enum class Kind { Int, Float, Bool, String };

struct Field {
  std::string key;  // "section.name"
  Kind kind;
  void* ptr;
  std::string help;
};

// "A | B | C": the values of a key in the parallel configuration's vocabulary.
template <class E>
std::string alternatives(const std::vector<E>& values) {
  std::string s;
  for (E v : values) s += (s.empty() ? "" : " | ") + std::string(to_string(v));
  return s;
}

std::vector<Field> fields(RunConfig& c) {
  return {
      {"model.preset", Kind::String, &c.model.preset, "named model preset (see `meshtrain train --help`)"},
      {"model.arch", Kind::String, &c.model.arch, "gpt2 | llama (default: the preset's)"},
      {"model.n_layer", Kind::Int, &c.model.n_layer, "transformer blocks"},
      {"model.n_head", Kind::Int, &c.model.n_head, "attention heads"},
      {"model.n_kv_head", Kind::Int, &c.model.n_kv_head, "key/value heads (llama, grouped-query attention)"},
      {"model.n_embd", Kind::Int, &c.model.n_embd, "hidden size"},
      {"model.ffn_hidden", Kind::Int, &c.model.ffn_hidden, "MLP hidden size (default 4*n_embd, llama 8/3*n_embd)"},
      {"model.seq_len", Kind::Int, &c.model.seq_len, "context length (tokens per sequence)"},
      {"model.vocab_size", Kind::Int, &c.model.vocab_size, "vocabulary (padded to a multiple of 64 internally)"},
      {"model.rope_theta", Kind::Float, &c.model.rope_theta, "RoPE base (llama)"},
      {"model.norm_eps", Kind::Float, &c.model.norm_eps, "LayerNorm / RMSNorm epsilon (0 = the preset's 1e-5 or the hf_config's)"},
      {"model.max_position", Kind::Int, &c.model.max_position,
       "GPT-2 position-table rows, >= seq_len (0 = seq_len, or the hf_config's max_position_embeddings)"},
      {"model.hf_config", Kind::String, &c.model.hf_config,
       "Hugging Face config.json (gpt2, llama incl. 3.1 rope_scaling, mistral): architecture, dimensions, norm epsilon, "
       "rope_theta, tied head; replaces model.preset, explicit model.* keys still override"},
      {"model.moe_experts", Kind::Int, &c.model.moe_experts,
       "mixture of experts: routed experts per MoE layer (0 = dense; -1 = the preset's)"},
      {"model.moe_top_k", Kind::Int, &c.model.moe_top_k, "experts per token (-1 = the preset's, 2 by default)"},
      {"model.moe_every", Kind::Int, &c.model.moe_every, "block l's MLP is an MoE layer when l % moe_every == 0 (-1 = the preset's, 1)"},
      {"model.moe_shared_experts", Kind::Int, &c.model.moe_shared_experts,
       "always-on shared experts per MoE layer, DeepSeek style (-1 = the preset's, 0)"},
      {"model.moe_ffn_hidden", Kind::Int, &c.model.moe_ffn_hidden, "hidden size of one expert (0 = model.ffn_hidden; -1 = the preset's)"},
      {"model.moe_router", Kind::String, &c.model.moe_router,
       "softmax (Mixtral: softmax scores, top-k renormalised) | sigmoid (DeepSeek-V3: sigmoid scores, top-k normalised)"},
      {"model.moe_aux_loss_coef", Kind::Float, &c.model.moe_aux_loss_coef,
       "load-balancing loss coefficient, Switch/GShard form (-1 = the preset's, 0.01)"},
      {"model.moe_z_loss_coef", Kind::Float, &c.model.moe_z_loss_coef, "router z-loss coefficient (-1 = the preset's, 0 = off)"},
      {"model.moe_capacity_factor", Kind::Float, &c.model.moe_capacity_factor,
       "expert capacity = factor x tokens x top_k / experts per micro-batch, overflow dropped and counted (0 = dropless; -1 = the preset's, 0)"},
      {"model.attention_kernel", Kind::String, &c.model.attention_kernel,
       "auto | flash | reference: flash = bf16 q, k, v in the flash-attention kernels (train.dtype = bf16, no "
       "context parallelism); reference = the fp32 kernels; auto = flash for bf16 on train.device = cuda"},
      {"model.mlp_kernel", Kind::String, &c.model.mlp_kernel,
       "auto | fused | unfused: fused = the MLP's pre-activations kept in bf16 (GPT-2: GELU in the up projection's "
       "GEMM epilogue and its gradient in the down projection's; Llama: bf16 gate and up, SwiGLU on them) (bf16, one "
       "rank of tp and pp, no LoRA); auto = fused in bf16 on train.device = cuda"},
      {"model.residual_dtype", Kind::String, &c.model.residual_dtype,
       "auto | fp32 | bf16: bf16 = the residual stream between blocks and after attention kept in bf16, each add "
       "rounding once (train.dtype = bf16, tp = pp = cp = 1; gradients stay fp32); auto = bf16 for bf16 on "
       "train.device = cuda with one model-parallel rank, fp32 otherwise"},
      {"model.logits_dtype", Kind::String, &c.model.logits_dtype,
       "auto | fp32 | bf16: bf16 = the LM head's logits written in bf16 by its GEMM, the loss in fp32 arithmetic "
       "and their gradient written over them in bf16 (train.dtype = bf16, parallel.tp = 1, train.loss_chunk_tokens "
       "= 0); auto = bf16 for bf16 on train.device = cuda where that applies, fp32 otherwise"},
      {"model.moe_pad_to_capacity", Kind::Bool, &c.model.moe_pad_to_capacity,
       "pad every expert's rows to its capacity with zero rows (needs model.moe_capacity_factor > 0): routing-independent "
       "message, GEMM and activation sizes"},
      {"data.train", Kind::String, &c.data.train, "training token shards: a file or a glob"},
      {"data.val", Kind::String, &c.data.val, "validation token shards (empty = no eval)"},
      {"data.tokenizer", Kind::String, &c.data.tokenizer, "byte | gpt2 | hf: how samples are decoded"},
      {"data.gpt2_dir", Kind::String, &c.data.gpt2_dir, "directory with encoder.json and vocab.bpe (\"\" = assets/gpt2)"},
      {"data.tokenizer_file", Kind::String, &c.data.tokenizer_file, "tokenizer.json for data.tokenizer = hf"},
      {"data.shuffle", Kind::Bool, &c.data.shuffle,
       "visit shards and their T-token samples in a new permuted order every epoch (seeded by train.seed)"},
      {"data.document_masking", Kind::Bool, &c.data.document_masking,
       "packed sequences: attention never crosses a document boundary and positions restart per document"},
      {"data.document_separator", Kind::Int, &c.data.document_separator,
       "the token id that starts a new document for data.document_masking (-1 = data.tokenizer's: byte '\\n' = 10, "
       "gpt2 <|endoftext|> = 50256, hf its end-of-text token)"},
      {"data.packing", Kind::Bool, &c.data.packing,
       "true: fixed seq_len windows of the packed token stream; false: one document per sample (documents start at "
       "data.document_separator), truncated to seq_len and padded, padding untrained"},
      {"data.group_by_length", Kind::Bool, &c.data.group_by_length,
       "data.packing = false: each global batch holds documents of similar length (sorted within megabatches of "
       "data.length_group_window global batches, batch order shuffled by train.seed)"},
      {"data.length_group_window", Kind::Int, &c.data.length_group_window,
       "data.group_by_length: global batches per megabatch that is sorted by length"},
      {"data.pad_to_multiple", Kind::Int, &c.data.pad_to_multiple,
       "data.packing = false: a micro-batch is padded to its longest document rounded up to this (0 = to seq_len)"},
      {"train.steps", Kind::Int, &c.train.steps, "optimizer steps"},
      {"train.micro_batch", Kind::Int, &c.train.micro_batch, "sequences per rank per micro-batch"},
      {"train.grad_accum", Kind::Int, &c.train.grad_accum, "micro-batches per step"},
      {"train.lr", Kind::Float, &c.train.lr, "peak learning rate"},
      {"train.min_lr_ratio", Kind::Float, &c.train.min_lr_ratio, "final lr as a fraction of the peak"},
      {"train.warmup_steps", Kind::Int, &c.train.warmup_steps, "linear warm-up steps"},
      {"train.lr_schedule", Kind::String, &c.train.lr_schedule, "cosine | linear | constant (after warm-up)"},
      {"train.weight_decay", Kind::Float, &c.train.weight_decay, "AdamW decoupled weight decay (matrices only)"},
      {"train.grad_clip", Kind::Float, &c.train.grad_clip, "global gradient-norm clip (0 = off)"},
      {"train.beta1", Kind::Float, &c.train.beta1, "AdamW beta1"},
      {"train.beta2", Kind::Float, &c.train.beta2, "AdamW beta2"},
      {"train.eps", Kind::Float, &c.train.eps, "AdamW epsilon"},
      {"train.seed", Kind::Int, &c.train.seed, "seed of the weight initialisation"},
      {"train.dtype", Kind::String, &c.train.dtype, "fp32 | bf16 (bf16 compute, fp32 master weights and reduction)"},
      {"train.device", Kind::String, &c.train.device, "cpu | cuda (one GPU, one process: docs/gpu.md)"},
      {"train.offload", Kind::String, &c.train.offload,
       "none | optimizer (train.device = cuda: fp32 master weights and Adam moments in pinned host memory, "
       "AdamW on the CPU; docs/gpu.md)"},
      {"train.loss_chunk_tokens", Kind::Int, &c.train.loss_chunk_tokens,
       "compute the LM head, loss and head gradients this many tokens at a time in forward, so the [tokens, vocab] "
       "logits are never held (0 = off)"},
      {"train.activation_checkpointing", Kind::String, &c.train.activation_checkpointing,
       alternatives(all_recompute_modes()) + " (every second block)"},
      {"train.threads", Kind::Int, &c.train.threads, "compute threads per rank (0 = cores / ranks on this node)"},
      {"train.eval_every", Kind::Int, &c.train.eval_every, "steps between validation losses (0 = never)"},
      {"train.eval_batches", Kind::Int, &c.train.eval_batches, "micro-batches per validation loss"},
      {"train.eval_at_start", Kind::Bool, &c.train.eval_at_start,
       "also compute the validation loss before the first step (printed; val_loss_start in the final metrics)"},
      {"train.checkpoint_dir", Kind::String, &c.train.checkpoint_dir, "where checkpoints go (empty = none)"},
      {"train.checkpoint_every", Kind::Int, &c.train.checkpoint_every, "steps between checkpoints (0 = only at the end)"},
      {"train.checkpoint_keep", Kind::Int, &c.train.checkpoint_keep,
       "keep only the newest N checkpoints in checkpoint_dir, older ones removed after a new one is complete (0 = all)"},
      {"train.checkpoint_format", Kind::String, &c.train.checkpoint_format,
       "sharded (every rank writes what it holds, in parallel; loads under any layout) | full (rank 0 gathers and "
       "writes Hugging Face model.safetensors + optimizer.safetensors, unit by unit)"},
      {"train.checkpoint_async", Kind::Bool, &c.train.checkpoint_async,
       "sharded checkpoints: copy this rank's state to a staging buffer and write it from a background thread while "
       "training continues (at most one save in flight)"},
      {"train.verify_checkpoint", Kind::Bool, &c.train.verify_checkpoint,
       "check every piece's CRC32C when loading a sharded checkpoint (each rank checks some of the files)"},
      {"train.resume", Kind::String, &c.train.resume,
       "\"latest\" (the newest in checkpoint_dir; none yet = start fresh) or a checkpoint directory"},
      {"train.init_from", Kind::String, &c.train.init_from,
       "start from these weights (a .safetensors file with Hugging Face names, or a checkpoint): fresh optimizer, step 0"},
      {"train.sample_tokens", Kind::Int, &c.train.sample_tokens, "tokens to generate after training (0 = none)"},
      {"train.sample_prompt", Kind::String, &c.train.sample_prompt, "prompt of the end-of-run sample"},
      {"train.preflight", Kind::Bool, &c.train.preflight,
       "before allocating, every rank compares its dry-run peak memory with the memory free for it and the job "
       "stops (exit 2) with the figures and a layout that fits when it does not"},
      {"parallel.strategy", Kind::String, &c.parallel.strategy, alternatives(all_sharding_strategies())},
      {"parallel.dp_replicate", Kind::Int, &c.parallel.dp_replicate, "replica groups"},
      {"parallel.dp_shard", Kind::Int, &c.parallel.dp_shard, "shard group size (-1 = what the world size leaves)"},
      {"parallel.tp", Kind::Int, &c.parallel.tp, "tensor-parallel degree"},
      {"parallel.pp", Kind::Int, &c.parallel.pp, "pipeline-parallel degree"},
      {"parallel.ep", Kind::Int, &c.parallel.ep,
       "expert-parallel degree (MoE): routed experts split over this many data-parallel ranks, tokens exchanged by all-to-all"},
      {"parallel.pp_schedule", Kind::String, &c.parallel.pp_schedule, alternatives(all_pipeline_schedules())},
      {"parallel.pp_virtual_stages", Kind::Int, &c.parallel.pp_virtual_stages, "stages per rank (interleaved)"},
      {"parallel.pp_microbatches", Kind::Int, &c.parallel.pp_microbatches, "0 = grad_accum"},
      {"parallel.tp_overlap", Kind::Bool, &c.parallel.tp_overlap,
       "with tp > 1: reduce the column-parallel input gradients while the weight gradients are computed"},
      {"parallel.sequence_parallel", Kind::Bool, &c.parallel.sequence_parallel,
       "with tp > 1: norms and residuals on sequence shards (all-gather / reduce-scatter instead of all-reduce)"},
      {"parallel.cp", Kind::Int, &c.parallel.cp,
       "context-parallel degree: each sequence split into 2 cp chunks, rank i holds chunks i and 2cp-1-i (ring attention)"},
      {"parallel.cp_mode", Kind::String, &c.parallel.cp_mode,
       "ring (K/V blocks passed around the cp ranks, overlapped with attention) | allgather (all K/V gathered per layer)"},
      {"parallel.pp_partition", Kind::String, &c.parallel.pp_partition,
       "blocks per (virtual) stage, e.g. \"3,3,2\" (embedding joins the first, head the last); empty = balanced by cost"},
      {"parallel.pp_costs", Kind::String, &c.parallel.pp_costs,
       "zb1p / zbv: relative F,B,W of one micro-batch on a stage (e.g. \"1,1.3,0.7\", as a run's pp_stage_ms reports "
       "them) that the schedule is built for; empty = 1,1,1 (zb1p: the fixed ZB-H1 order); auto = rebuilt after the "
       "run's second step for the costs it measured"},
      {"parallel.bucket_mb", Kind::Float, &c.parallel.bucket_mb, "gradient bucket size in MB (DDP)"},
      {"parallel.reshard_after_forward", Kind::Bool, &c.parallel.reshard_after_forward, "free gathered params after forward"},
      {"parallel.prefetch", Kind::Int, &c.parallel.prefetch, "units gathered ahead (FULL_SHARD)"},
      {"parallel.reduce_every_microbatch", Kind::Bool, &c.parallel.reduce_every_microbatch,
       "sharded grads: reduce-scatter every micro-batch (less memory) or only the last (less comm)"},
      {"lora.rank", Kind::Int, &c.lora.rank, "LoRA adapter rank (0 = off: full fine-tuning); the base is frozen (docs/finetuning.md)"},
      {"lora.alpha", Kind::Float, &c.lora.alpha, "LoRA alpha: adapters are scaled by alpha / rank (0 = rank)"},
      {"lora.targets", Kind::String, &c.lora.targets,
       "projections with adapters: llama q,k,v,o,gate,up,down; gpt2 c_attn (whole) or q,k,v (its parts), o, up, down"},
      {"lora.dropout", Kind::Float, &c.lora.dropout, "dropout probability on the adapters' input (PEFT's lora_dropout; mask from train.seed, step, adapter and sample)"},
      {"log.metrics_out", Kind::String, &c.log.metrics_out, "JSON-lines metrics file (rank 0)"},
      {"log.trace_out", Kind::String, &c.log.trace_out, "Chrome trace file per rank"},
      {"log.tensorboard_dir", Kind::String, &c.log.tensorboard_dir, "TensorBoard event files directory (rank 0)"},
      {"log.peak_flops", Kind::Float, &c.log.peak_flops, "peak FLOP/s per rank for MFU (0 = MFU omitted)"},
      {"log.print_every", Kind::Int, &c.log.print_every, "steps between progress lines"},
      {"log.straggler_every", Kind::Int, &c.log.straggler_every,
       "steps between the ranks' comparison of data wait and compute (one small all-gather; 0 = never)"},
      {"log.straggler_ratio", Kind::Float, &c.log.straggler_ratio,
       "a rank is a straggler when its busy time (data wait + compute) exceeds the ranks' median by this factor"},
      {"log.straggler_min_ms", Kind::Float, &c.log.straggler_min_ms,
       "... and by at least this many ms per step (so noise does not name anyone)"},
  };
}

Field* find(std::vector<Field>& fs, const std::string& key) {
  for (auto& f : fs)
    if (f.key == key) return &f;
  return nullptr;
}

// What to do about an unknown "section.name": the section it belongs in when another section has
// the name, else the nearest key.
std::string unknown_key_hint(const std::vector<Field>& fs, const std::string& key) {
  const size_t dot = key.find('.');
  const std::string name = dot == std::string::npos ? key : key.substr(dot + 1);
  std::vector<std::string> keys;
  for (const auto& f : fs) {
    if (f.key.substr(f.key.find('.') + 1) == name)
      return " (" + name + " belongs in [" + f.key.substr(0, f.key.find('.')) + "]: write it there as " + name +
             " = ..., or on the command line as --" + f.key + ")";
    keys.push_back(f.key);
  }
  const std::string near = closest_name(key, keys);
  return near.empty() ? " (docs/training.md lists the keys)" : " (did you mean " + near + "?)";
}

void set_from_string(Field& f, const std::string& v, const std::string& where) {
  auto bad = [&](const char* what) {
    return ConfigError(where + ": " + f.key + " expects " + what + ", got '" + v + "'");
  };
  switch (f.kind) {
    case Kind::Int: {
      try {
        size_t pos = 0;
        long long x = std::stoll(v, &pos);
        if (pos != v.size()) throw bad("an integer");
        *static_cast<int64_t*>(f.ptr) = x;
      } catch (const ConfigError&) {
        throw;
      } catch (...) {
        throw bad("an integer");
      }
      break;
    }
    case Kind::Float: {
      try {
        size_t pos = 0;
        double x = std::stod(v, &pos);
        if (pos != v.size()) throw bad("a number");
        *static_cast<double*>(f.ptr) = x;
      } catch (const ConfigError&) {
        throw;
      } catch (...) {
        throw bad("a number");
      }
      break;
    }
    case Kind::Bool:
      if (v == "true" || v == "1") *static_cast<bool*>(f.ptr) = true;
      else if (v == "false" || v == "0") *static_cast<bool*>(f.ptr) = false;
      else throw bad("true or false");
      break;
    case Kind::String: {
      std::string s = v;
      if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
      *static_cast<std::string*>(f.ptr) = s;
      break;
    }
  }
}

void set_from_node(Field& f, const toml::node& n, const std::string& where) {
  auto bad = [&](const char* what) { return ConfigError(where + ": " + f.key + " must be " + what); };
  switch (f.kind) {
    case Kind::Int:
      if (auto v = n.value_exact<int64_t>()) *static_cast<int64_t*>(f.ptr) = *v;
      else throw bad("an integer");
      break;
    case Kind::Float:
      if (auto v = n.value<double>()) *static_cast<double*>(f.ptr) = *v;
      else throw bad("a number");
      break;
    case Kind::Bool:
      if (auto v = n.value_exact<bool>()) *static_cast<bool*>(f.ptr) = *v;
      else throw bad("true or false");
      break;
    case Kind::String:
      if (auto v = n.value_exact<std::string>()) *static_cast<std::string*>(f.ptr) = *v;
      else throw bad("a string");
      break;
  }
}

std::string value_string(const Field& f) {
  std::ostringstream os;
  switch (f.kind) {
    case Kind::Int: os << *static_cast<int64_t*>(f.ptr); break;
    case Kind::Float: os << *static_cast<double*>(f.ptr); break;
    case Kind::Bool: os << (*static_cast<bool*>(f.ptr) ? "true" : "false"); break;
    case Kind::String: os << '"' << *static_cast<std::string*>(f.ptr) << '"'; break;
  }
  return os.str();
}

}  // namespace

RunConfig RunConfig::load(const std::string& path, const std::vector<std::pair<std::string, std::string>>& overrides) {
  RunConfig c;
  auto fs = fields(c);
  if (!path.empty()) {
    toml::table tbl;
    try {
      tbl = toml::parse_file(path);
    } catch (const toml::parse_error& e) {
      std::ostringstream os;
      os << path << ":" << e.source().begin.line << ":" << e.source().begin.column << ": " << e.description();
      throw ConfigError(os.str());
    } catch (const std::exception& e) {
      throw ConfigError(path + ": " + e.what());
    }
    for (auto&& [sec, node] : tbl) {
      const toml::table* st = node.as_table();
      if (!st) throw ConfigError(path + ": top-level key '" + std::string(sec.str()) + "' must be a [section]");
      for (auto&& [key, val] : *st) {
        std::string full = std::string(sec.str()) + "." + std::string(key.str());
        Field* f = find(fs, full);
        if (!f) throw ConfigError(path + ": unknown key " + full + unknown_key_hint(fs, full));
        set_from_node(*f, val, path);
      }
    }
  }
  for (const auto& [k, v] : overrides) {
    Field* f = find(fs, k);
    if (!f) throw ConfigError("command line: unknown key --" + k + unknown_key_hint(fs, k));
    set_from_string(*f, v, "command line");
  }
  return c;
}

ModelConfig RunConfig::model_config() const {
  const bool hf = !model.hf_config.empty();
  ModelConfig m;
  if (hf) {
    try {
      m = model_from_hf_config(model.hf_config);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(std::string("model.hf_config: ") + e.what());
    }
    m.name = "hf:" + model.hf_config;
  } else {
    m = model_preset(model.preset);
    m.name = model.preset;
  }
  if (!model.arch.empty()) {
    const Arch before = m.arch;
    if (!parse_arch(model.arch, &m.arch)) throw ConfigError("model.arch must be gpt2 or llama, got '" + model.arch + "'");
    if (m.arch != before) m.tied_embeddings = m.arch == Arch::GPT2;  // the new family's convention
  }
  auto ov = [](int64_t v, int64_t& dst) {
    if (v > 0) dst = v;
  };
  bool custom = model.n_layer || model.n_head || model.n_kv_head || model.n_embd || model.ffn_hidden ||
                model.seq_len || model.vocab_size || !model.arch.empty() || model.max_position || model.norm_eps > 0;
  ov(model.n_layer, m.n_layer);
  ov(model.n_head, m.n_head);
  ov(model.n_kv_head, m.n_kv_head);
  ov(model.n_embd, m.n_embd);
  if (model.ffn_hidden > 0) m.ffn_hidden = model.ffn_hidden;
  else if (model.n_embd > 0 || !model.arch.empty()) m.ffn_hidden = 0;  // re-derive from the new width
  ov(model.seq_len, m.seq_len);
  // A preset's position table follows seq_len (as it always has); an hf_config's keeps its
  // max_position_embeddings rows, of which the first seq_len are used.
  if (model.seq_len > 0 && !hf) m.max_position = model.seq_len;
  ov(model.max_position, m.max_position);
  if (model.norm_eps > 0) m.norm_eps = static_cast<float>(model.norm_eps);
  if (model.vocab_size > 0) {
    m.vocab_size = model.vocab_size;
    m.padded_vocab = 0;
  }
  if (model.rope_theta > 0) m.rope_theta = static_cast<float>(model.rope_theta);
  const bool moe_over = model.moe_experts >= 0 || model.moe_top_k >= 0 || model.moe_every >= 0 ||
                        model.moe_shared_experts >= 0 || model.moe_ffn_hidden >= 0 || !model.moe_router.empty() ||
                        model.moe_aux_loss_coef >= 0 || model.moe_z_loss_coef >= 0 || model.moe_capacity_factor >= 0 ||
                        model.moe_pad_to_capacity;
  if (model.moe_experts >= 0) m.moe_experts = model.moe_experts;
  if (model.moe_top_k >= 0) m.moe_top_k = model.moe_top_k;
  if (model.moe_every >= 0) m.moe_every = model.moe_every;
  if (model.moe_shared_experts >= 0) m.moe_shared_experts = model.moe_shared_experts;
  if (model.moe_ffn_hidden >= 0) m.moe_ffn_hidden = model.moe_ffn_hidden;
  if (!model.moe_router.empty()) {
    if (model.moe_router != "softmax" && model.moe_router != "sigmoid")
      throw ConfigError("model.moe_router must be softmax or sigmoid, got '" + model.moe_router + "'");
    m.moe_sigmoid = model.moe_router == "sigmoid";
  }
  if (model.moe_aux_loss_coef >= 0) m.moe_aux_loss_coef = static_cast<float>(model.moe_aux_loss_coef);
  if (model.moe_z_loss_coef >= 0) m.moe_z_loss_coef = static_cast<float>(model.moe_z_loss_coef);
  if (model.moe_capacity_factor >= 0) m.moe_capacity_factor = static_cast<float>(model.moe_capacity_factor);
  if (model.moe_pad_to_capacity) m.moe_pad_to_capacity = true;
  if (custom || moe_over) m.name += "+overrides";
  if (lora.rank < 0) throw ConfigError("lora.rank must be >= 0 (0 = off), got " + std::to_string(lora.rank));
  if (lora.rank > 0) {
    if (!(lora.dropout >= 0 && lora.dropout < 1))
      throw ConfigError("lora.dropout = " + std::to_string(lora.dropout) + " is outside [0, 1): set a probability below 1");
    if (lora.dropout > 0 && train.device != "cpu")
      throw ConfigError("lora.dropout > 0 runs on train.device = cpu only; set lora.dropout = 0 on " + train.device);
    m.lora_rank = lora.rank;
    m.lora_alpha = static_cast<float>(lora.alpha);
    m.lora_dropout = static_cast<float>(lora.dropout);
    try {
      m.lora_targets = parse_lora_targets(lora.targets, m.arch);
    } catch (const std::invalid_argument& e) {
      throw ConfigError(e.what());
    }
  }
  try {
    m.resolve();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  return m;
}

std::string RunConfig::to_toml() const {
  RunConfig copy = *this;
  auto fs = fields(copy);
  std::string out, cur;
  for (const auto& f : fs) {
    std::string sec = f.key.substr(0, f.key.find('.'));
    if (sec != cur) {
      out += (cur.empty() ? "[" : "\n[") + sec + "]\n";
      cur = sec;
    }
    out += f.key.substr(f.key.find('.') + 1) + " = " + value_string(f) + "\n";
  }
  return out;
}

RunRecord RunConfig::checkpoint_record() const { return RunRecord{to_toml(), model.hf_config, train.checkpoint_keep}; }

RunConfig load_checkpoint_config(const std::string& dir) {
  RunConfig c = RunConfig::load(checkpoint_config_toml(dir), {});
  const std::string hf = checkpoint_hf_config(dir);
  if (!c.model.hf_config.empty() && !hf.empty()) c.model.hf_config = hf;
  return c;
}

std::string RunConfig::keys_help() {
  RunConfig c;
  auto fs = fields(c);
  std::string out;
  for (const auto& f : fs) {
    std::string line = "  --" + f.key + " " + value_string(f);
    if (line.size() < 44) line.resize(44, ' ');
    out += line + " " + f.help + "\n";
  }
  return out;
}

ParallelPlan RunConfig::parallel_plan(const ModelConfig& mc, int world) const {
  const auto& p = parallel;
  ParallelPlan d;
  try {
    d.strategy = parse_sharding_strategy(p.strategy, "parallel.strategy");
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  for (auto [name, v] : {std::pair<const char*, int64_t>{"parallel.dp_replicate", p.dp_replicate},
                         {"parallel.tp", p.tp}, {"parallel.pp", p.pp}, {"parallel.cp", p.cp}, {"parallel.pp_virtual_stages", p.pp_virtual_stages}})
    if (v < 1) throw ConfigError(std::string(name) + " must be >= 1, got " + std::to_string(v));
  if (p.dp_shard == 0 || p.dp_shard < -1) throw ConfigError("parallel.dp_shard must be -1 or >= 1");
  if (p.pp_microbatches < 0) throw ConfigError("parallel.pp_microbatches must be >= 0");
  if (p.prefetch < 0) throw ConfigError("parallel.prefetch must be >= 0");
  d.dp_replicate = static_cast<int>(p.dp_replicate);
  d.dp_shard = static_cast<int>(p.dp_shard);
  d.tp = static_cast<int>(p.tp);
  d.pp = static_cast<int>(p.pp);
  d.cp = static_cast<int>(p.cp);
  d.ep = static_cast<int>(p.ep);
  d.virtual_stages = static_cast<int>(p.pp_virtual_stages);
  d.cp_mode = p.cp_mode;
  d.sequence_parallel = p.sequence_parallel;
  if (train.offload == "optimizer") d.offload = Offload::Optimizer;
  else if (train.offload != "none")
    throw ConfigError("train.offload must be none or optimizer, got '" + train.offload + "'");
  d.micro_batch = train.micro_batch;
  // With a pipeline the step's micro-batches are the schedule's (pp_microbatches, default grad_accum).
  d.microbatches = d.pp > 1 && p.pp_microbatches > 0 ? p.pp_microbatches : train.grad_accum;
  try {
    check_plan(d, mc, world);
  } catch (const PlanError& e) {
    throw ConfigError(e.what());
  }
  if (d.cp > 1 && mc.lora() && mc.lora_dropout > 0)
    throw ConfigError("lora.dropout > 0 with parallel.cp = " + std::to_string(d.cp) +
                      ": adapter dropout is not supported with context parallelism; set lora.dropout = 0 or parallel.cp = 1");
  if (d.cp > 1 && train.sample_tokens > 0)
    throw ConfigError("train.sample_tokens: sampling at the end of training is not supported with parallel.cp > 1 "
                      "(generation runs on whole sequences; sample from the checkpoint with `meshtrain sample`)");
  try {
    d.checkpointing = parse_recompute(train.activation_checkpointing, "train.activation_checkpointing");
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  try {
    if (d.pp > 1) d.schedule = parse_pipeline_schedule(p.pp_schedule, "parallel.pp_schedule");
  } catch (const std::invalid_argument& e) {
    throw ConfigError(std::string("pipeline: ") + e.what());
  }
  pp_stage_costs();  // refused here, before any rank builds a model
  return d;
}

bool parse_stage_costs(const std::string& v, parallel::StageCosts* c) {
  double x[3];
  char tail = 0;
  if (std::sscanf(v.c_str(), "%lf,%lf,%lf%c", &x[0], &x[1], &x[2], &tail) != 3 || !(x[0] > 0 && x[1] > 0 && x[2] > 0) ||
      !std::isfinite(x[0] + x[1] + x[2]))
    return false;
  c->f = x[0];
  c->b = x[1];
  c->w = x[2];
  return true;
}

parallel::StageCosts RunConfig::pp_stage_costs() const {
  parallel::StageCosts c;
  const std::string& v = parallel.pp_costs;
  if (v.empty() || v == "auto") return c;
  if (!parse_stage_costs(v, &c))
    throw ConfigError("parallel.pp_costs must be three positive numbers F,B,W (e.g. \"1,1.3,0.7\") or auto, got '" + v +
                      "'");
  return c;
}

void RunConfig::set_parallel_plan(const ParallelPlan& p) {
  parallel.strategy = to_string(p.strategy);
  parallel.dp_replicate = p.dp_replicate;
  parallel.dp_shard = p.dp_shard;
  parallel.tp = p.tp;
  parallel.pp = p.pp;
  train.activation_checkpointing = to_string(p.checkpointing);
  train.micro_batch = p.micro_batch;
  train.grad_accum = p.microbatches;
  train.offload = to_string(p.offload);
}

}  // namespace mt
