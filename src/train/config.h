// Run configuration: the TOML file of docs/training.md plus `--section.key value` overrides.
// Every key is declared once in config.cpp with its type; unknown keys and badly typed values are
// errors that name the file and key.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/config/model_config.h"
#include "parallel/layout/parallel_plan.h"
#include "parallel/layout/pipeline_schedule.h"

namespace mt {

struct RunRecord;  // checkpoint/checkpoint.h

class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// A configuration error every rank of the job found together (the same message on every rank, after
// a collective): the job ends with exit code 2, rank 0 prints it, no rank aborts the others.
class JobConfigError : public ConfigError {
 public:
  using ConfigError::ConfigError;
};

struct RunConfig {
  struct Model {
    std::string preset = "gpt2-mini";
    std::string arch;          // "" = from preset
    int64_t n_layer = 0, n_head = 0, n_kv_head = 0, n_embd = 0, ffn_hidden = 0, seq_len = 0,
            vocab_size = 0;    // 0 = from preset
    double rope_theta = 0.0;   // 0 = from preset
    double norm_eps = 0.0;     // 0 = from preset / hf_config
    int64_t max_position = 0;  // GPT-2 position-table rows (0 = seq_len, or the hf_config's)
    std::string hf_config;     // a Hugging Face config.json: architecture and dimensions (instead of preset)
    // Mixture of experts (-1 / "" = the preset's; a dense preset has 0 experts).
    int64_t moe_experts = -1, moe_top_k = -1, moe_every = -1, moe_shared_experts = -1, moe_ffn_hidden = -1;
    std::string moe_router;                 // "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3)
    double moe_aux_loss_coef = -1, moe_z_loss_coef = -1, moe_capacity_factor = -1;
    bool moe_pad_to_capacity = false;
    // Attention kernel: auto (flash for bf16 on train.device = cuda, reference otherwise) | flash
    // (the bf16 tensor-core kernels: needs train.dtype = bf16) | reference (the fp32 kernels).
    std::string attention_kernel = "auto";
    // GPT-2's MLP: auto (fused for bf16 on train.device = cuda) | fused (the up projection's GELU and
    // the down projection's GELU gradient in the GEMM epilogues, pre-activation kept in bf16) | unfused.
    std::string mlp_kernel = "auto";
    // The residual stream between blocks and after attention: auto (bf16 for bf16 runs on
    // train.device = cuda with tp = pp = cp = 1, fp32 otherwise) | fp32 | bf16 (train.dtype = bf16).
    std::string residual_dtype = "auto";
    // The LM head's logits: auto (bf16 for bf16 runs on train.device = cuda with tp = 1 and no
    // train.loss_chunk_tokens, fp32 otherwise) | fp32 | bf16 (train.dtype = bf16, tp = 1, no chunked head).
    std::string logits_dtype = "auto";
  } model;
  struct Data {
    std::string train = "data/default/train.bin";
    std::string val = "data/default/val.bin";
    std::string tokenizer = "byte";   // how `sample` and the end-of-run sample decode: byte | gpt2 | hf
    std::string gpt2_dir;             // for tokenizer = gpt2 ("" = the repository's assets/gpt2)
    std::string tokenizer_file;       // for tokenizer = hf: a Hugging Face tokenizer.json
    bool shuffle = false;             // permuted shard and sample order every epoch (seeded by train.seed)
    bool document_masking = false;    // packed rows: attention stays within a document, positions restart per document
    int64_t document_separator = -1;  // the token that starts a document (-1 = data.tokenizer's separator)
    // Unpacked data (packing = false): one document per sample, padded to its micro-batch's longest
    // sample rounded up to pad_to_multiple (0 = to seq_len); group_by_length batches similar lengths
    // together over megabatches of length_group_window global batches (src/data/document_loader.h).
    bool packing = true;
    bool group_by_length = false;
    int64_t length_group_window = 50;
    int64_t pad_to_multiple = 16;
  } data;
  struct Train {
    int64_t steps = 1000, micro_batch = 4, grad_accum = 1;
    double lr = 6e-4, min_lr_ratio = 0.1;
    int64_t warmup_steps = 100;
    std::string lr_schedule = "cosine";  // cosine | linear | constant
    double weight_decay = 0.1, grad_clip = 1.0, beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
    int64_t seed = 1337;
    std::string dtype = "fp32";
    std::string device = "cpu";  // cpu | cuda (one GPU, one process: docs/gpu.md)
    std::string offload = "none";  // none | optimizer (cuda: fp32 master weights and moments in host memory)
    std::string activation_checkpointing = "none";  // parse_recompute (parallel/layout/parallel_config.h)
    int64_t threads = 0;
    int64_t eval_every = 100, eval_batches = 8;
    bool eval_at_start = false;          // a validation loss before the first step (printed, and in the final metrics)
    std::string checkpoint_dir;
    int64_t checkpoint_every = 0;
    int64_t checkpoint_keep = 0;         // newest checkpoints kept in checkpoint_dir (0 = all)
    std::string checkpoint_format = "sharded";  // sharded | full (rank 0 gathers, format 1)
    bool checkpoint_async = false;       // sharded: write from a background thread from a staging copy
    bool verify_checkpoint = true;       // sharded: check CRC32C of every piece on load
    int64_t loss_chunk_tokens = 0;       // chunked LM head + loss: never hold [tokens, vocab] logits (0 = off)
    std::string resume;                  // "" | "latest" | a checkpoint directory
    std::string init_from;               // "" | weights (.safetensors, HF names) or a checkpoint: fresh optimizer
    int64_t sample_tokens = 0;           // generate this many tokens at the end (0 = no sample)
    std::string sample_prompt = "";
    bool preflight = true;               // before allocating: the dry run's peak against the free memory (train/preflight.h)
  } train;
  struct Parallel {
    std::string strategy = "NO_SHARD";    // parse_sharding_strategy (parallel/layout/parallel_config.h)
    int64_t dp_replicate = 1, dp_shard = -1, tp = 1, pp = 1;
    int64_t ep = 1;  // expert parallelism: routed experts split over ep data-parallel ranks
    std::string pp_schedule = "1f1b";     // parse_pipeline_schedule
    int64_t pp_virtual_stages = 1, pp_microbatches = 0;
    std::string pp_partition;
    std::string pp_costs;  // zb1p / zbv: one micro-batch's F,B,W on a stage, e.g. "1,1.3,0.7" (empty = 1,1,1; auto)
    bool sequence_parallel = false;
    int64_t cp = 1;                 // context-parallel degree (ring attention)
    std::string cp_mode = "ring";   // ring | allgather
    bool tp_overlap = true;  // input-gradient reductions overlap the weight-gradient matmuls
    double bucket_mb = 25.0;
    bool reshard_after_forward = true;
    int64_t prefetch = 1;
    bool reduce_every_microbatch = true;
  } parallel;
  // LoRA fine-tuning (rank 0 = off): adapters on lora.targets, every base parameter frozen.
  struct Lora {
    int64_t rank = 0;
    double alpha = 0.0;             // 0 = rank (scale alpha / rank = 1)
    std::string targets = "q,v";    // Llama q,k,v,o,gate,up,down; GPT-2 c_attn | q,k,v, o, up, down
    double dropout = 0.0;
  } lora;
  struct Log {
    std::string metrics_out, trace_out;
    std::string tensorboard_dir;  // TensorBoard event files (rank 0)
    double peak_flops = 0.0;
    int64_t print_every = 1;
    // Stragglers (train/straggler.h): every straggler_every steps (0 = never) the ranks compare their
    // data wait and compute; a rank above the median by straggler_ratio and straggler_min_ms is named.
    int64_t straggler_every = 10;
    double straggler_ratio = 1.2, straggler_min_ms = 10.0;
  } log;

  // Loads `path` (may be empty: defaults only), then applies overrides in order.
  static RunConfig load(const std::string& path, const std::vector<std::pair<std::string, std::string>>& overrides);
  // The model dimensions after preset + explicit keys (resolved and validated).
  ModelConfig model_config() const;
  // The job's parallel plan from [parallel] (and what it needs of [train]) for a world of `world`
  // ranks, checked against `model` (the resolved model, its padded vocabulary a multiple of 64 x
  // tp); throws ConfigError with one message naming the key and the degree at fault.
  ParallelPlan parallel_plan(const ModelConfig& model, int world) const;
  // parallel.pp_costs as the zero-bubble schedules take them ({1, 1, 1} when empty or auto);
  // throws ConfigError for anything but three positive numbers or auto.
  parallel::StageCosts pp_stage_costs() const;
  // parallel.pp_costs = auto: the zero-bubble schedule is rebuilt for the costs the run measures.
  bool pp_costs_auto() const { return parallel.pp_costs == "auto"; }
  // Writes a plan's degrees, strategy, recompute and batch split into [parallel] and [train] (what
  // `train --auto` does with the planner's plan); parallel_plan() reads them back.
  void set_parallel_plan(const ParallelPlan& plan);
  // Every key as `section.key = value` lines (for --help and for checkpoints).
  std::string to_toml() const;
  // What a checkpoint of this run records: this configuration, the model.hf_config file and
  // train.checkpoint_keep.
  RunRecord checkpoint_record() const;
  static std::string keys_help();
};

// The run configuration stored with checkpoint `dir` (its config.toml; model.hf_config, when set,
// names the copy of the Hugging Face config inside the checkpoint).
RunConfig load_checkpoint_config(const std::string& dir);

// "F,B,W": three positive finite numbers (one micro-batch's forward, input-gradient and
// weight-gradient costs on a stage) into *c; false, *c unchanged, for anything else.
bool parse_stage_costs(const std::string& v, parallel::StageCosts* c);

}  // namespace mt
