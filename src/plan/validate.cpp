#include "plan/validate.h"

#include <fcntl.h>
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "kernels/cpu/activation.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/gemm.h"
#include "parallel/pipeline_executor.h"
#include "parallel/pipeline_schedule.h"
#include "plan/planner.h"
#include "plan/text_table.h"
#include "runtime/memory.h"
#include "runtime/tensor.h"

extern char** environ;

namespace mt::plan {

namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;
double secs_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string fmt(const char* f, double v) {
  char buf[128];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

bool sharded_params(const std::string& s) { return s == "FULL_SHARD" || s == "HYBRID_SHARD"; }
bool known_strategy(const std::string& s) {
  return s == "NO_SHARD" || s == "ZERO1" || s == "SHARD_GRAD_OP" || s == "FULL_SHARD" || s == "HYBRID_SHARD" ||
         s == "HYBRID_SHARD_ZERO2";
}

Strategy planner_strategy(const std::string& s) {
  if (s == "NO_SHARD") return Strategy::DDP;
  if (s == "ZERO1") return Strategy::ZeRO1;
  if (s == "SHARD_GRAD_OP" || s == "HYBRID_SHARD_ZERO2") return Strategy::ZeRO2;
  if (s == "FULL_SHARD") return Strategy::ZeRO3;
  return Strategy::HSDP;
}

}  // namespace

// ---- the engine layout ----------------------------------------------------------------------------------

int EngineLayout::shard_size() const {
  if (strategy == "NO_SHARD") return 1;
  return hybrid() ? dp_ranks() / std::max(1, dp_replicate) : dp_ranks();
}

int EngineLayout::replicas() const { return hybrid() ? std::max(1, dp_replicate) : 1; }

std::string EngineLayout::label() const {
  std::string s;
  if (strategy == "NO_SHARD") s = "DDP x" + std::to_string(dp_ranks());
  else if (strategy == "HYBRID_SHARD") s = "HSDP " + std::to_string(replicas()) + "x" + std::to_string(shard_size());
  else if (strategy == "HYBRID_SHARD_ZERO2")
    s = "HSDP-ZeRO-2 " + std::to_string(replicas()) + "x" + std::to_string(shard_size());
  else s = std::string(strategy_label(planner_strategy(strategy))) + " x" + std::to_string(dp_ranks());
  if (tp > 1) s += " tp" + std::to_string(tp) + (sequence_parallel ? " sp" : "");
  if (pp > 1) s += " pp" + std::to_string(pp) + " " + pp_schedule;
  if (virtual_stages() > 1) s += " v" + std::to_string(virtual_stages());
  s += bf16 ? " bf16" : " fp32";
  if (grad_accum > 1) s += " accum" + std::to_string(grad_accum);
  if (checkpointing != Checkpointing::None) s += std::string(" ac:") + checkpointing_name(checkpointing);
  return s + " " + model;
}

std::vector<std::string> EngineLayout::train_args() const {
  std::vector<std::string> a = {"--model.preset", model,
          "--train.micro_batch", std::to_string(micro_batch),
          "--train.grad_accum", std::to_string(grad_accum),
          "--train.dtype", bf16 ? "bf16" : "fp32",
          "--train.activation_checkpointing", checkpointing_name(checkpointing),
          "--parallel.strategy", strategy,
          "--parallel.dp_replicate", std::to_string(replicas()),
          "--parallel.dp_shard", "-1",
          "--parallel.tp", std::to_string(tp),
          "--parallel.reduce_every_microbatch", reduce_every_microbatch ? "true" : "false",
          "--parallel.reshard_after_forward", reshard_after_forward ? "true" : "false",
          "--parallel.bucket_mb", fmt("%g", bucket_mb)};
  if (sequence_parallel) a.insert(a.end(), {"--parallel.sequence_parallel", "true"});
  if (pp > 1) a.insert(a.end(), {"--parallel.pp", std::to_string(pp), "--parallel.pp_schedule", pp_schedule});
  if (virtual_stages() > 1) a.insert(a.end(), {"--parallel.pp_virtual_stages", std::to_string(virtual_stages())});
  return a;
}

void check_engine_layout(const EngineLayout& e) {
  if (!known_strategy(e.strategy)) throw std::invalid_argument("unknown strategy '" + e.strategy + "'");
  if (e.ranks < 1) throw std::invalid_argument("ranks must be >= 1");
  if (e.tp < 1 || e.ranks % e.tp != 0)
    throw std::invalid_argument("tp " + std::to_string(e.tp) + " does not divide " + std::to_string(e.ranks) + " ranks");
  if (e.pp < 1 || e.ranks % (e.tp * e.pp) != 0)
    throw std::invalid_argument("tp " + std::to_string(e.tp) + " x pp " + std::to_string(e.pp) + " does not divide " +
                                std::to_string(e.ranks) + " ranks");
  if (e.pp > 1 && e.pp_schedule != "gpipe" && e.pp_schedule != "1f1b" && e.pp_schedule != "interleaved_1f1b")
    throw std::invalid_argument("pipeline schedule '" + e.pp_schedule + "': the validation predicts gpipe, 1f1b and "
                                "interleaved_1f1b");
  if (e.pp > 1 && e.pp_schedule == "interleaved_1f1b" && (e.pp_virtual_stages < 2 || e.grad_accum % e.pp != 0))
    throw std::invalid_argument("interleaved_1f1b needs pp_virtual_stages >= 2 and micro-batches a multiple of pp");
  if (e.sequence_parallel && e.tp < 2) throw std::invalid_argument("sequence parallelism needs tp > 1");
  if (e.hybrid() && (e.dp_replicate < 1 || e.dp_ranks() % e.dp_replicate != 0))
    throw std::invalid_argument("dp_replicate " + std::to_string(e.dp_replicate) + " does not divide " +
                                std::to_string(e.dp_ranks()) + " data-parallel ranks");
  if (!e.hybrid() && e.dp_replicate != 1) throw std::invalid_argument("dp_replicate > 1 needs a HYBRID_* strategy");
  if (e.micro_batch < 1 || e.grad_accum < 1) throw std::invalid_argument("micro_batch and grad_accum must be >= 1");
  const ModelConfig m = plan_model_preset(e.model);
  for (auto [v, what] : {std::pair<int64_t, const char*>{m.n_head, "n_head"}, {m.n_kv_head, "n_kv_head"},
                         {m.ffn_hidden, "ffn_hidden"}})
    if (v % e.tp != 0)
      throw std::invalid_argument(e.model + ": " + what + " (" + std::to_string(v) + ") is not divisible by tp " +
                                  std::to_string(e.tp));
  if (e.sequence_parallel && (e.micro_batch * m.seq_len) % e.tp != 0)
    throw std::invalid_argument("sequence parallelism needs micro_batch x seq_len divisible by tp");
  if (e.pp > 1) {
    if (e.pp > m.n_layer + 2) throw std::invalid_argument("pp " + std::to_string(e.pp) + " exceeds the model's units");
    ModelConfig r = m;
    r.resolve();
    if (r.tied_embeddings && sharded_params(e.strategy))
      throw std::invalid_argument("pp > 1 with " + e.strategy + " on a tied-embedding model: the engine refuses it");
  }
}

Layout planner_layout(const EngineLayout& e) {
  Layout l;
  l.strategy = planner_strategy(e.strategy);
  l.tp = e.tp;
  if (l.strategy == Strategy::DDP) {
    l.dp_replicate = e.dp_ranks();
    l.dp_shard = 1;
  } else if (e.hybrid()) {
    l.dp_replicate = e.replicas();
    l.dp_shard = e.shard_size();
    if (e.replicas() == 1) l.strategy = Strategy::ZeRO3;  // a hybrid over one replica is plain sharding
  } else {
    l.dp_replicate = 1;
    l.dp_shard = e.dp_ranks();
  }
  l.micro_batch = e.micro_batch;
  l.microbatches = e.grad_accum;
  l.checkpointing = e.checkpointing;
  if (e.pp > 1) {
    l.pp = e.pp;
    l.schedule = e.pp_schedule == "gpipe" ? Schedule::GPipe
                 : e.virtual_stages() > 1   ? Schedule::Interleaved
                                            : Schedule::OneFOneB;
    l.virtual_stages = e.virtual_stages();
  }
  return l;
}

TrainSetup planner_setup(const ModelConfig& m, const EngineLayout& e) {
  TrainSetup st;
  st.fp32 = !e.bf16;
  st.grad_bytes = 4;     // this engine keeps fp32 gradients
  st.reduce_bytes = 4;   // and reduces in fp32
  st.seq = m.seq_len;    // it trains at the model's full context
  st.global_batch = static_cast<int64_t>(e.dp_ranks()) * e.micro_batch * e.grad_accum;
  st.micro_batch = e.micro_batch;
  st.attention = AttentionImpl::Flash;  // kernels/attention.h keeps only the log-sum-exp
  st.dropout = false;
  st.sequence_parallel = e.sequence_parallel && e.tp > 1;  // model/transformer.cpp set_sequence_parallel
  st.bucket_bytes = e.bucket_mb * 1e6;
  return st;
}

// ---- exact accounting --------------------------------------------------------------------------------------

ModelConfig engine_model(const ModelConfig& m_in, const EngineLayout& e) {
  ModelConfig m = m_in;
  m.resolve();
  if (e.tp > 1) {
    const int64_t q = 64 * static_cast<int64_t>(e.tp);
    m.padded_vocab = (m.vocab_size + q - 1) / q * q;
  }
  return m;
}

std::vector<int64_t> engine_unit_sizes(const ModelConfig& m_in, int64_t align, int tp) {
  ModelConfig m = m_in;
  m.resolve();
  const int64_t t = std::max(1, tp);
  // One tp rank's share: heads, MLP width and vocabulary rows divided by t.
  const int64_t C = m.n_embd, V = m.padded_vocab / t, F = m.ffn_hidden / t, hd = m.head_dim();
  const int64_t nh = m.n_head / t, nkv = m.n_kv_head / t;
  const bool gpt = m.arch == Arch::GPT2;
  align = std::max<int64_t>(1, align);
  auto pad = [&](int64_t n) { return (n + align - 1) / align * align; };
  std::vector<int64_t> u;
  u.push_back(pad(V * C + (gpt ? m.seq_len * C : 0)));  // wte (+ wpe, replicated)
  // GPT-2: ln_1, c_attn (q, k, v heads split) + its bias, c_proj (split by input) + its bias
  // (replicated), ln_2, c_fc + bias (split), mlp c_proj (split by input) + bias (replicated).
  const int64_t block = gpt ? (2 * C + 3 * nh * hd * C + 3 * nh * hd + C * nh * hd + C + 2 * C + F * C + F + C * F + C)
                            : (C + nh * hd * C + 2 * nkv * hd * C + C * nh * hd + C + 3 * F * C);
  for (int64_t l = 0; l < m.n_layer; ++l) u.push_back(pad(block));
  u.push_back(pad(gpt ? 2 * C : C + V * C));  // ln_f (head tied to wte) | norm + lm_head
  return u;
}

int64_t engine_unit_align(const EngineLayout& e) {
  return e.strategy == "NO_SHARD" ? 1 : 16 * static_cast<int64_t>(e.shard_size());  // 64-byte shard lines
}

// ---- pipeline stages -----------------------------------------------------------------------------------------

std::vector<double> engine_unit_costs(const ModelConfig& c_in) {
  ModelConfig c = c_in;
  c.resolve();
  return parallel::unit_costs(c);
}

std::vector<std::pair<int, int>> engine_stage_partition(const ModelConfig& m_in, int S) {
  ModelConfig m = m_in;
  m.resolve();
  return parallel::partition_stages(m, S).stages;
}

std::string describe_stage_partition(const std::vector<std::pair<int, int>>& p) {
  parallel::StagePartition part;
  part.stages = p;
  return part.describe();
}

std::vector<char> engine_owned_units(const ModelConfig& m_in, const EngineLayout& e, int pp_rank) {
  const ModelConfig m = engine_model(m_in, e);
  const int U = static_cast<int>(m.n_layer) + 2;
  if (e.pp <= 1) return std::vector<char>(static_cast<size_t>(U), 1);
  parallel::StagePartition part;
  part.stages = engine_stage_partition(m, e.num_stages());  // stage s on rank s % pp
  return parallel::stage_units_of_rank(part, e.pp, pp_rank, U);
}

std::vector<int64_t> engine_stage_unit_sizes(const ModelConfig& m, const EngineLayout& e, int pp_rank) {
  std::vector<int64_t> u = engine_unit_sizes(engine_model(m, e), engine_unit_align(e), e.tp);
  const std::vector<char> own = engine_owned_units(m, e, pp_rank);
  for (size_t i = 0; i < u.size(); ++i)
    if (!own[i]) u[i] = 0;  // another stage's unit: no parameters, no padding
  return u;
}

int64_t engine_flat_size(const ModelConfig& m, const EngineLayout& e, int pp_rank) {
  int64_t s = 0;
  for (int64_t n : engine_stage_unit_sizes(m, e, pp_rank)) s += n;
  return s;
}

namespace {
parallel::PipeSchedule engine_schedule(const EngineLayout& e) {
  const int P = std::max(1, e.pp);
  return parallel::make_schedule(P == 1 ? "gpipe" : e.pp_schedule, P, static_cast<int>(e.grad_accum),
                                 e.virtual_stages());
}
// Slots the executor creates per model chunk of this rank (parallel/pipeline_executor.cpp: a
// micro-batch takes a slot of its chunk's pool at its forward and gives it back after its
// backward, so each pool grows to the chunk's peak number of micro-batches in flight).
std::vector<int> engine_chunk_slots(const EngineLayout& e, int pp_rank) {
  const int v = e.virtual_stages();
  if (e.pp <= 1) return {1};
  std::vector<int> in_flight(static_cast<size_t>(v), 0), peak(static_cast<size_t>(v), 0);
  const parallel::PipeSchedule sched = engine_schedule(e);  // (a temporary's member would dangle in the loop)
  for (const parallel::PipeAction& a : sched.per_rank.at(static_cast<size_t>(pp_rank))) {
    const size_t c = static_cast<size_t>(a.stage / e.pp);
    if (a.kind == parallel::PipeAction::Forward) peak[c] = std::max(peak[c], ++in_flight[c]);
    if (a.kind == parallel::PipeAction::Backward) --in_flight[c];
  }
  return peak;
}
}  // namespace

int engine_activation_slots(const EngineLayout& e, int pp_rank) {
  if (e.pp <= 1) return 1;
  // The schedule checker's in-flight count is the executor's peak of slots in use at once.
  return parallel::check_schedule(engine_schedule(e)).peak_in_flight.at(static_cast<size_t>(pp_rank));
}

namespace {
int64_t residual_rows(const ModelConfig& m, const EngineLayout& e) {
  const int64_t N = e.micro_batch * m.seq_len;
  return e.sequence_parallel && e.tp > 1 ? N / e.tp : N;
}
// DDP over a tied embedding held whole by one rank (parallel/data_parallel.cpp, Transformer::
// can_defer_embedding_grad): the head's dense part of the token embedding's gradient is its own
// bucket, all-reduced right after the head's backward, and the last micro-batch's lookup rows (token
// ids and their N x C gradient rows, kept as workspace) are all-gathered and added at the end.
bool ddp_defers_embedding(const ModelConfig& m, const EngineLayout& e, const std::vector<char>& own) {
  return e.strategy == "NO_SHARD" && e.dp_ranks() > 1 && m.tied_embeddings && e.tp == 1 && own.front() && own.back();
}
}  // namespace

uint64_t engine_pp_message_bytes(const ModelConfig& m_in, const EngineLayout& e) {
  const ModelConfig m = engine_model(m_in, e);
  return static_cast<uint64_t>(residual_rows(m, e) * m.n_embd) * 4;
}

int engine_pp_boundaries(const EngineLayout& e, int pp_rank) {
  if (e.pp <= 1) return 0;
  // Each of this rank's stages s = c * pp + pp_rank: a boundary with s - 1 unless first, with s + 1
  // unless last.
  int b = 0;
  const int S = e.num_stages();
  for (int s = pp_rank; s < S; s += e.pp) b += (s > 0 ? 1 : 0) + (s < S - 1 ? 1 : 0);
  return b;
}

bool engine_tied_split(const ModelConfig& m_in, const EngineLayout& e) {
  ModelConfig m = m_in;
  m.resolve();
  return e.pp > 1 && m.tied_embeddings;  // stage 0 on rank 0, the last stage on rank pp - 1
}

uint64_t engine_tied_rows_elems(const ModelConfig& m_in, const EngineLayout& e) {
  const ModelConfig m = engine_model(m_in, e);
  return static_cast<uint64_t>(m.padded_vocab / std::max(1, e.tp) * m.n_embd);
}

double engine_activation_bytes(const ModelConfig& m_in, const EngineLayout& e, int pp_rank) {
  const ModelConfig m = engine_model(m_in, e);
  const double t = std::max(1, e.tp);  // this tp rank's heads, MLP width and vocabulary columns
  const double C = m.n_embd, F = m.ffn_hidden / t, hd = m.head_dim(), nh = m.n_head / t, nkv = m.n_kv_head / t;
  const double V = m.padded_vocab / t;
  const int64_t L = m.n_layer;
  const bool gpt = m.arch == Arch::GPT2, bf = e.bf16;
  const double ce = bf ? 2 : 4;  // compute dtype
  const double qkv = (nh + 2 * nkv) * hd;
  const double N = static_cast<double>(e.micro_batch) * static_cast<double>(m.seq_len);
  const double R = static_cast<double>(residual_rows(m, e));  // N, or N / tp with sequence parallelism
  // One stored block: per residual row (this rank's rows) the norm outputs and statistics and the
  // second residual input; per token the split tensors.
  const double block = R * (ce * C + 4 + (gpt ? 4 : 0)     // ln1 output, rstd (+ mean)
                            + 4 * C                          // second residual input
                            + ce * C + 4 + (gpt ? 4 : 0))    // ln2 output, stats
                       + N * (4 * qkv + 4 * nh * hd + (bf ? 2 * nh * hd : 0)  // qkv, attention out (+ bf16)
                              + 4 * nh                                        // log-sum-exp per head
                              + 4 * F + (gpt ? 0 : 4 * F) + ce * F);          // FFN pre-act (+ up), act
  auto recomputed = [&](int64_t l) {
    return e.checkpointing == Checkpointing::Full || (e.checkpointing == Checkpointing::Selective && l % 2 == 1);
  };
  // One slot per micro-batch in flight, per model chunk (stage) of this rank: a slot holds what its
  // stage's units keep for backward and their input and output rows.
  const std::vector<int> slots = engine_chunk_slots(e, pp_rank);
  std::vector<std::pair<int, int>> stages;  // this rank's stages' unit ranges, chunk by chunk
  if (e.pp <= 1) {
    stages.push_back({0, static_cast<int>(L) + 1});
  } else {
    const std::vector<std::pair<int, int>> all = engine_stage_partition(m, e.num_stages());
    for (int c = 0; c < e.virtual_stages(); ++c) stages.push_back(all.at(static_cast<size_t>(c * e.pp + pp_rank)));
  }
  double total = 0;
  for (size_t c = 0; c < stages.size(); ++c) {
    double slot = 0;
    std::vector<char> out(static_cast<size_t>(L + 1), 0);  // unit outputs this stage's slot keeps
    for (int64_t u = stages[c].first; u <= stages[c].second; ++u) {
      if (u == 0) {
        slot += 4 * N;  // ids
        out[0] = 1;
      } else if (u <= L) {
        out[static_cast<size_t>(u - 1)] = out[static_cast<size_t>(u)] = 1;  // input (the stage's received one) and output
        if (!recomputed(u - 1)) slot += block;
      } else {
        out[static_cast<size_t>(L)] = 1;
        slot += 4 * N                       // targets
                + N * (4 * C + (bf ? 2 * C : 0))  // head input, all rows (+ bf16)
                + R * 8                     // final norm's rstd, mean
                + N * 4 * V + 4 * N;        // fp32 logits (this rank's columns), losses
      }
    }
    for (char o : out) slot += o ? R * 4 * C : 0;
    total += slots.at(c) * slot;
  }
  return total + (e.checkpointing != Checkpointing::None ? block : 0.0);
}

double engine_workspace_bytes(const ModelConfig& m_in, const EngineLayout& e, int pp_rank) {
  const ModelConfig m = engine_model(m_in, e);
  const double t = std::max(1, e.tp);
  const double C = m.n_embd, F = m.ffn_hidden / t, hd = m.head_dim(), nh = m.n_head / t, nkv = m.n_kv_head / t;
  const double qkv = (nh + 2 * nkv) * hd;
  const double tokens = static_cast<double>(e.micro_batch) * static_cast<double>(m.seq_len);
  // Residual gradient + d(normed), dqkv, datty, dfc, dup/dact, d act, scratch.
  double ws = tokens * 4 * (C + C + qkv + C + 3 * F + std::max(C, F));
  if (e.sequence_parallel && e.tp > 1)  // gathered rows (+ bf16), gathered gradient, partial sums, norm grads
    ws += tokens * C * (4 + (e.bf16 ? 2 : 0) + 4 + 4) + 4 * std::max(2 * C, 16.0);
  if (ddp_defers_embedding(m, e, engine_owned_units(m_in, e, pp_rank)))
    ws += tokens * (4 * C + 4);  // the lookup's deferred gradient rows and token ids
  if (e.bf16) {
    // bf16 computes from bf16 weights only; vectors (norms, biases) and GPT-2's position table are
    // widened to fp32 copies on first use and kept (the qkv and fc biases are tp-split) — of the
    // units this rank owns.
    const std::vector<char> own = engine_owned_units(m_in, e, pp_rank);
    const bool gpt = m.arch == Arch::GPT2;
    const double vec_block = gpt ? (2 * C + 3 * nh * hd + C + 2 * C + F + C) : 2 * C;
    double vec = 0;
    for (int64_t l = 0; l < m.n_layer; ++l) vec += own[static_cast<size_t>(l + 1)] ? vec_block : 0;
    if (own.back()) vec += gpt ? 2 * C : C;
    if (own.front() && gpt) vec += static_cast<double>(m.seq_len) * C;
    ws += 4 * vec;
  }
  return ws;
}

EngineMemory engine_memory(const ModelConfig& m, const EngineLayout& e, int pp_rank) {
  const double flat = static_cast<double>(engine_flat_size(m, e, pp_rank));
  const Strategy s = planner_strategy(e.strategy);
  ModelStateBytes z = zero_model_state(flat, s, e.shard_size(), !e.bf16, false, /*grad_bytes=*/4);
  EngineMemory r;
  r.params = z.params;
  r.grads = z.grads;
  r.optimizer = z.optimizer;
  // The policy the ZeRO table does not describe: sharded parameters in bf16 keep no bf16 shard (a
  // unit's bf16 weights are cast from the fp32 master when it is gathered, and freed after use).
  if (e.bf16 && sharded_params(e.strategy)) r.params = 0;
  if (engine_tied_split(m, e)) {
    const double rows = static_cast<double>(engine_tied_rows_elems(m, e));
    if (pp_rank == e.pp - 1) {  // the head's replica of the token embedding and its gradient
      r.params += rows * (e.bf16 ? 2 : 4);
      r.grads += rows * 4;
    }
    if (pp_rank == 0) r.grads += rows * 4;  // receives the head's gradient (PipelineExecutor::grad_bytes)
  }
  r.activations = engine_activation_bytes(m, e, pp_rank);
  r.workspace = engine_workspace_bytes(m, e, pp_rank);
  return r;
}

uint64_t collective_bytes(Collective kind, uint64_t count, int elem_bytes, int n) {
  if (n <= 1) return 0;
  const uint64_t b = count * static_cast<uint64_t>(elem_bytes), un = static_cast<uint64_t>(n);
  switch (kind) {
    case Collective::AllReduce: return 2 * (un - 1) * b / un;
    case Collective::ReduceScatter:  // count = per-rank part: (n-1)/n of the n*count buffer
    case Collective::AllGather: return (un - 1) * b;
  }
  return 0;
}

uint64_t broadcast_bytes(uint64_t count, int elem_bytes, int n) {
  return n <= 1 ? 0 : count * static_cast<uint64_t>(elem_bytes);
}

uint64_t EngineComm::total(const std::string& g, int64_t steps) const {
  uint64_t t = 0;
  if (auto it = setup.find(g); it != setup.end()) t += it->second;
  if (auto it = per_step.find(g); it != per_step.end()) t += static_cast<uint64_t>(steps) * it->second;
  return t;
}

uint64_t EngineComm::dp_per_step() const {
  uint64_t t = 0;
  for (const auto& [g, b] : per_step)
    if (g != "metrics" && g != "grad_norm" && g != "tp" && g != "tp_aux" && g != "pp" && g != "pp_aux") t += b;
  return t;
}

uint64_t EngineComm::tp_per_step() const {
  auto it = per_step.find("tp");
  return it == per_step.end() ? 0 : it->second;
}

std::vector<TpCollective> engine_tp_collectives(const ModelConfig& m_in, const EngineLayout& e, int pp_rank) {
  std::vector<TpCollective> v;
  if (e.tp <= 1) return v;
  const ModelConfig m = engine_model(m_in, e);
  const std::vector<char> own = engine_owned_units(m_in, e, pp_rank);
  const int64_t L = m.n_layer;
  const bool sp = e.sequence_parallel, gpt = m.arch == Arch::GPT2;
  const uint64_t N = static_cast<uint64_t>(e.micro_batch * m.seq_len), C = static_cast<uint64_t>(m.n_embd);
  const uint64_t NC = N * C, RC = static_cast<uint64_t>(residual_rows(m, e)) * C;
  const uint64_t norm_grads = gpt ? 2 * C : C;  // a norm's weight (+ bias) gradient contributions
  // Activations (and the input gradients summed over the tp ranks) move in the compute dtype
  // (ProcessGroupTpComm::*_activations); AG32 is an fp32 gather of gradient rows.
  const int es = e.bf16 ? 2 : 4;
  const TpCollective AR{Collective::AllReduce, NC, es}, AG{Collective::AllGather, RC, es},
      RS{Collective::ReduceScatter, RC, es}, AG32{Collective::AllGather, RC, 4};
  // Backward, overlapped with a matmul: input-gradient sums (and SP's norm-output re-gathers).
  const TpCollective ARo{Collective::AllReduce, NC, es, true}, AGo{Collective::AllGather, RC, es, true},
      RSo{Collective::ReduceScatter, RC, es, true};
  auto ar = [](uint64_t n) { return TpCollective{Collective::AllReduce, n, 4}; };
  auto rc = [&](int64_t l) {
    return e.checkpointing == Checkpointing::Full || (e.checkpointing == Checkpointing::Selective && l % 2 == 1);
  };
  auto block_fwd = [&]() {
    if (sp) v.insert(v.end(), {AG, RS, AG, RS});  // ln1 gathered, attention out scattered, ln2, MLP
    else v.insert(v.end(), {AR, AR});               // attention c_proj, MLP c_proj
  };
  // Forward (Transformer::forward_units, block_forward, tp_cross_entropy).
  if (own.front()) v.push_back(sp ? RS : AR);  // vocab-parallel embedding: partial rows summed
  for (int64_t l = 0; l < L; ++l)
    if (own[static_cast<size_t>(l + 1)]) block_fwd();
  if (own.back()) {
    if (sp) v.push_back(AG);  // the final norm's rows gathered for the output projection
    v.push_back(ar(N));       // cross-entropy: row maxima (max)
    v.push_back(ar(2 * N));   // sums of exponentials | target logits (sum)
  }
  // Backward (backward_units, block_backward); a recomputed block re-runs block_forward.
  if (own.back()) {
    v.push_back(sp ? RSo : ARo);     // head: partial input gradients (under the weight gradient)
    if (sp) v.push_back(ar(norm_grads));  // the final norm's gradient from this rank's rows, summed
  }
  for (int64_t l = L - 1; l >= 0; --l) {
    if (!own[static_cast<size_t>(l + 1)]) continue;
    if (rc(l)) block_fwd();
    if (sp)  // per half (MLP, attention): output gradient gathered (fp32), norm output re-gathered,
             // input gradient reduce-scattered, the norm's gradient summed
      v.insert(v.end(), {AG32, AGo, RSo, ar(norm_grads), AG32, AGo, RSo, ar(norm_grads)});
    else
      v.insert(v.end(), {ARo, ARo});  // MLP and attention column-parallel input gradients
  }
  if (own.front() && sp) v.push_back(AG32);  // every token's gradient for this rank's vocabulary rows
  return v;
}

std::vector<uint64_t> engine_tp_allreduces(const ModelConfig& m, const EngineLayout& e) {
  std::vector<uint64_t> v;
  for (const TpCollective& c : engine_tp_collectives(m, e, 0))
    if (c.kind == Collective::AllReduce) v.push_back(c.count);
  return v;
}

double engine_tp_seconds(const ModelConfig& m, const EngineLayout& e, const Cluster& c, int pp_rank) {
  if (e.tp <= 1) return 0;
  const GroupShape g = group_shape(e.tp, 1, c.gpus_per_node);  // tp ranks are adjacent
  double s = 0;
  for (const TpCollective& x : engine_tp_collectives(m, e, pp_rank)) {
    if (x.overlapped) continue;  // hidden behind its matmul
    // collective() takes the whole buffer: the reduced one, or the gathered / scattered n x part.
    const double bytes = x.elem_bytes * static_cast<double>(x.count) * (x.kind == Collective::AllReduce ? 1.0 : e.tp);
    s += collective(x.kind, bytes, g, c).time;
  }
  return static_cast<double>(e.grad_accum) * s;
}

PipeTimeline engine_pp_timeline(const EngineLayout& e, const std::vector<double>& fwd, const std::vector<double>& bwd,
                                double msg_s) {
  const int P = std::max(1, e.pp), M = static_cast<int>(e.grad_accum), S = e.num_stages();
  // Each rank's compute order: the engine's own action lists (parallel/pipeline_schedule.h);
  // stage s runs on rank s % P and hands its activation to stage s + 1 (its gradient to s - 1).
  struct Step {
    bool fwd;
    int m, s;
  };
  std::vector<std::vector<Step>> order(static_cast<size_t>(P));
  const parallel::PipeSchedule sched = engine_schedule(e);
  for (int r = 0; r < P; ++r)
    for (const parallel::PipeAction& a : sched.per_rank[static_cast<size_t>(r)])
      if (parallel::is_compute(a.kind))
        order[static_cast<size_t>(r)].push_back({a.kind == parallel::PipeAction::Forward, a.microbatch, a.stage});
  std::vector<std::vector<double>> fdone(static_cast<size_t>(S), std::vector<double>(static_cast<size_t>(M), -1)),
      bdone = fdone;
  std::vector<double> free_at(static_cast<size_t>(P), 0.0);
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      const size_t ur = static_cast<size_t>(r);
      while (next[ur] < order[ur].size()) {
        const Step st = order[ur][next[ur]];
        const size_t um = static_cast<size_t>(st.m), us = static_cast<size_t>(st.s);
        double ready = 0;
        if (st.fwd && st.s > 0) {
          if (fdone[us - 1][um] < 0) break;
          ready = fdone[us - 1][um] + msg_s;  // the activation from the previous stage
        }
        if (!st.fwd && st.s < S - 1) {
          if (bdone[us + 1][um] < 0) break;
          ready = bdone[us + 1][um] + msg_s;  // the gradient from the next stage
        }
        const double end = std::max(free_at[ur], ready) + (st.fwd ? fwd[us] : bwd[us]);
        (st.fwd ? fdone : bdone)[us][um] = end;
        free_at[ur] = end;
        ++next[ur];
        progress = true;
      }
    }
  }
  PipeTimeline t;
  for (double f : free_at) t.makespan = std::max(t.makespan, f);
  for (int r = 0; r < P; ++r) {
    double busy = 0;
    for (int st = r; st < S; st += P) busy += M * (fwd[static_cast<size_t>(st)] + bwd[static_cast<size_t>(st)]);
    t.busy.push_back(busy);
    t.bubble += t.makespan > 0 ? (1.0 - busy / t.makespan) / P : 0.0;
  }
  return t;
}

EngineComm engine_comm(const ModelConfig& m_in, const EngineLayout& e) {
  check_engine_layout(e);
  const ModelConfig m = engine_model(m_in, e);
  EngineComm c;
  // W: every rank (the metrics group); D: the data-parallel group (ranks / (tp x pp)); N: the shard
  // group. Rank 0 — the first pipeline stage — is the one the metrics report.
  const int W = e.ranks, D = e.dp_ranks(), N = e.shard_size(), R = e.replicas(), t = e.tp, P = e.pp;
  const int es = e.bf16 ? 2 : 4;  // parameters travel in the compute dtype, gradients in fp32
  const int64_t M = e.grad_accum;
  const std::vector<int64_t> units = engine_stage_unit_sizes(m_in, e, 0);
  const std::vector<char> own = engine_owned_units(m_in, e, 0);
  const int U = static_cast<int>(units.size());
  int64_t flat = 0;
  for (int64_t n : units) flat += n;
  const bool gpt = m.arch == Arch::GPT2;  // GPT-2 ties the head to the embedding (Llama does not)
  auto add = [](std::map<std::string, uint64_t>& to, const std::string& g, uint64_t b) { to[g] += b; };

  // Setup: every rank checks it built the same model (parallel/strategy.cpp verify_same_model: the
  // fingerprint length, then 3 x (2 + units) values, over the data-parallel group); DDP then
  // broadcasts rank 0's weights. Summary: the per-rank memory table (2 x categories int64 values,
  // sent as 4 x categories f32 slots) is all-gathered over the metrics group.
  add(c.setup, "dp", collective_bytes(Collective::AllGather, 1, 4, D));
  add(c.setup, "dp", collective_bytes(Collective::AllGather, 3 * (2 + static_cast<uint64_t>(U)), 4, D));
  if (e.strategy == "NO_SHARD") add(c.setup, "dp", broadcast_bytes(static_cast<uint64_t>(flat), 4, D));
  add(c.setup, "metrics", collective_bytes(Collective::AllGather, 4 * static_cast<uint64_t>(kNumMemCategories), 4, W));
  // Per step: the mean loss over the data-parallel ranks, on the metrics group (which holds every
  // rank; the trainer skips it when there is a single data-parallel rank).
  if (D > 1) add(c.per_step, "metrics", collective_bytes(Collective::AllReduce, 1, 4, W));
  // Tensor parallelism: the model's collectives every micro-batch; the gradient norm's sum over the
  // tp ranks once per step on the auxiliary tp communicator.
  if (t > 1) {
    uint64_t tp_bytes = 0;
    for (const TpCollective& x : engine_tp_collectives(m_in, e, 0))
      tp_bytes += collective_bytes(x.kind, x.count, x.elem_bytes, t);
    add(c.per_step, "tp", static_cast<uint64_t>(M) * tp_bytes);
    add(c.per_step, "tp_aux", collective_bytes(Collective::AllReduce, 1, 4, t));
  }
  // Pipeline: per micro-batch an activation and its gradient across each of this stage's boundaries
  // (a send and a receive each count their buffer); per step, for a tied embedding cut apart, the
  // head's fp32 gradient in and the updated weights (compute dtype) out; on pp_aux the loss, the
  // gradient norm and the bubble figure summed over the stages.
  if (P > 1) {
    add(c.per_step, "pp", static_cast<uint64_t>(M) * 2 * static_cast<uint64_t>(engine_pp_boundaries(e, 0)) *
                              engine_pp_message_bytes(m_in, e));
    if (engine_tied_split(m_in, e)) add(c.per_step, "pp", engine_tied_rows_elems(m_in, e) * (4 + static_cast<uint64_t>(es)));
    add(c.per_step, "pp_aux", 3 * collective_bytes(Collective::AllReduce, 1, 4, P));
  }

  if (e.strategy == "NO_SHARD") {
    // Buckets of whole units (this stage's) from the head backwards; the first bucket is capped at
    // 1 MB (parallel/data_parallel.cpp), the rest at bucket_mb. All-reduced once per step (the last
    // micro-batch; the others accumulate locally).
    const int64_t cap = static_cast<int64_t>(e.bucket_mb * 1e6 / sizeof(float));
    const int64_t first_cap = static_cast<int64_t>(std::min(1.0, e.bucket_mb) * 1e6 / sizeof(float));
    std::vector<int64_t> buckets;
    for (int u = U - 1; u >= 0; --u) {
      if (!own[static_cast<size_t>(u)]) continue;
      const bool fits = !buckets.empty() && buckets.back() + units[u] <= (buckets.size() == 1 ? first_cap : cap);
      if (fits) buckets.back() += units[u];
      else buckets.push_back(units[u]);
    }
    if (ddp_defers_embedding(m, e, own)) {
      // The token embedding leaves the embedding's bucket (the last one) for a bucket of its own;
      // the lookup's ids (N int32) and gradient rows (N x C fp32) are all-gathered.
      const int64_t wte = m.padded_vocab * m.n_embd, Ntok = e.micro_batch * m.seq_len;
      buckets.back() -= wte;
      buckets.push_back(wte);
      add(c.per_step, "dp", collective_bytes(Collective::AllGather, static_cast<uint64_t>(Ntok), 4, D));
      add(c.per_step, "dp", collective_bytes(Collective::AllGather, static_cast<uint64_t>(Ntok * m.n_embd), 4, D));
    }
    for (int64_t b : buckets) add(c.per_step, "dp", collective_bytes(Collective::AllReduce, static_cast<uint64_t>(b), 4, D));
    return c;
  }

  const std::string shard_g = e.hybrid() ? "dp_shard" : "dp";
  const std::string rep_g = e.hybrid() ? "dp_replicate" : "replicate_none";
  const bool zero3 = sharded_params(e.strategy);
  const bool zero1 = e.strategy == "ZERO1";
  // Reduce-scatters (fp32, one per unit): ZeRO-1 accumulates full gradients and reduces on the last
  // micro-batch only; ZeRO-2/3 reduce every micro-batch unless told not to.
  const int64_t reductions = (!zero1 && e.reduce_every_microbatch) ? M : 1;
  for (int u = 0; u < U; ++u) {
    if (!own[static_cast<size_t>(u)]) continue;
    const uint64_t shard = static_cast<uint64_t>(units[u] / N);
    add(c.per_step, shard_g, static_cast<uint64_t>(reductions) * collective_bytes(Collective::ReduceScatter, shard, 4, N));
    // Hybrid: the gradient shard is averaged across replicas once per step.
    add(c.per_step, rep_g, collective_bytes(Collective::AllReduce, shard, 4, R));
    if (zero3) {
      // Forward gathers every unit; backward gathers the blocks again (and an untied embedding) —
      // the head, and with tied embeddings the embedding, stay gathered from their forward through
      // their backward. Without resharding after forward nothing is gathered twice.
      const bool root = u == U - 1 || (u == 0 && gpt);
      const int64_t gathers = 1 + ((e.reshard_after_forward && !root) ? 1 : 0);
      add(c.per_step, shard_g, static_cast<uint64_t>(M * gathers) * collective_bytes(Collective::AllGather, shard, es, N));
    } else {
      // ZeRO-1/2: the updated parameters, gathered once after the optimizer step.
      add(c.per_step, shard_g, collective_bytes(Collective::AllGather, shard, es, N));
    }
  }
  // The squared gradient norm of the shards, summed over the shard group.
  add(c.per_step, "grad_norm", collective_bytes(Collective::AllReduce, 1, 4, N));
  return c;
}

// ---- ceilings ----------------------------------------------------------------------------------------------

ComputeCeiling measure_compute_here(const ModelConfig& m_in, int64_t micro_batch, bool use_bf16, double seconds,
                                    double stream_bytes, int tp) {
  EngineLayout shape;
  shape.tp = std::max(1, tp);
  const ModelConfig m = engine_model(m_in, shape);
  const int64_t t = shape.tp;  // one tp rank's share: heads, MLP width, vocabulary columns
  const int64_t T = m.seq_len, B = micro_batch, N = B * T, C = m.n_embd, F = m.ffn_hidden / t, hd = m.head_dim();
  const int64_t nh = m.n_head / t, nkv = m.n_kv_head / t, V = m.padded_vocab / t;
  const bool gpt = m.arch == Arch::GPT2;
  // (in, out) of every linear of one block, and the head.
  std::vector<std::pair<int64_t, int64_t>> lin;
  if (gpt) lin = {{C, 3 * nh * hd}, {nh * hd, C}, {C, F}, {F, C}};
  else lin = {{C, (nh + 2 * nkv) * hd}, {nh * hd, C}, {C, F}, {C, F}, {F, C}};
  const int64_t qkvw = (nh + 2 * nkv) * hd;
  int64_t max_in = C, max_out = V, max_w = C * V;  // the head: C -> V
  for (auto [in, o] : lin) max_in = std::max(max_in, in), max_out = std::max(max_out, o), max_w = std::max(max_w, in * o);
  auto sz = [](int64_t n) { return static_cast<size_t>(n); };
  std::vector<float> x(sz(N * max_in), 0.01f), dx(sz(N * max_in));       // inputs, their gradient
  std::vector<float> y(sz(N * max_out), 0.02f), out(sz(N * max_out));    // output gradient, outputs
  std::vector<float> w(sz(max_w), 0.001f), dw(sz(max_w), 0.f);
  std::vector<bf16> xb(x.size()), wb(w.size());
  kernels::cpu::cast_f32_to_bf16(xb.data(), x.data(), static_cast<int64_t>(x.size()));
  kernels::cpu::cast_f32_to_bf16(wb.data(), w.data(), static_cast<int64_t>(w.size()));
  std::vector<float> qkv(sz(N * qkvw), 0.01f), att(sz(N * nh * hd)), lse(sz(N * nh)), dqkv(sz(N * qkvw)),
      datt(sz(N * nh * hd), 0.01f);
  std::vector<float> bias(sz(max_out), 0.01f), dbias(sz(max_out), 0.f);
  // One linear layer forward and backward exactly as the model calls it (kernels/gemm.h: GPT-2's
  // linears have biases, Llama's and the head do not).
  auto linear = [&](int64_t in, int64_t o, bool has_bias) {
    const float* b = has_bias ? bias.data() : nullptr;
    float* db = has_bias ? dbias.data() : nullptr;
    if (use_bf16) {
      kernels::cpu::linear_forward_bf16(out.data(), xb.data(), wb.data(), b, N, in, o);
      kernels::cpu::linear_backward_bf16(dx.data(), dw.data(), db, y.data(), xb.data(), wb.data(), N, in, o);
    } else {
      kernels::cpu::linear_forward(out.data(), x.data(), w.data(), b, N, in, o);
      kernels::cpu::linear_backward(dx.data(), dw.data(), db, y.data(), x.data(), w.data(), N, in, o);
    }
  };
  auto attention = [&]() {
    kernels::cpu::attention_forward(att.data(), lse.data(), qkv.data(), B, T, nh, nkv, hd);
    kernels::cpu::attention_backward(dqkv.data(), datt.data(), qkv.data(), att.data(), lse.data(), B, T, nh, nkv, hd);
  };
  // The planner's FLOP count (cost_model.cpp): 2 x weights forward, twice that backward; attention
  // 4 s h per token forward (full, non-causal), twice that backward.
  double gemm_flops_layer = 0;
  for (auto [in, o] : lin) gemm_flops_layer += 6.0 * static_cast<double>(N) * in * o;
  const double head_flops = 6.0 * static_cast<double>(N) * C * V;
  const double attn_flops_layer = 12.0 * static_cast<double>(N) * T * nh * hd;

  // Warm-up (library JIT, page faults): one layer.
  for (auto [in, o] : lin) linear(in, o, gpt);
  attention();
  double t_gemm = 0, t_attn = 0, f_gemm = 0, f_attn = 0;
  const auto t0 = Clock::now();
  do {
    for (int64_t l = 0; l < m.n_layer; ++l) {
      auto a = Clock::now();
      for (auto [in, o] : lin) linear(in, o, gpt);
      t_gemm += secs_since(a);
      f_gemm += gemm_flops_layer;
      a = Clock::now();
      attention();
      t_attn += secs_since(a);
      f_attn += attn_flops_layer;
    }
    auto a = Clock::now();
    linear(C, V, false);
    t_gemm += secs_since(a);
    f_gemm += head_flops;
  } while (secs_since(t0) < seconds);

  ComputeCeiling r;
  r.gemm_flops_per_s = f_gemm / t_gemm;
  r.flops_per_s = (f_gemm + f_attn) / (t_gemm + t_attn);
  r.threads = omp_get_max_threads();
  r.procs = 1;
  // Streaming: dst += src over two arrays (12 bytes per element: two reads, one write).
  const int64_t n = std::max<int64_t>(1 << 16, static_cast<int64_t>(stream_bytes / 8));
  Tensor a = Tensor::zeros({n}, DType::F32, MemCategory::Workspace);
  Tensor b = Tensor::zeros({n}, DType::F32, MemCategory::Workspace);
  kernels::cpu::accumulate(a.f32(), b.f32(), n);
  double bytes = 0;
  const auto s0 = Clock::now();
  do {
    kernels::cpu::accumulate(a.f32(), b.f32(), n);
    bytes += 12.0 * static_cast<double>(n);
  } while (secs_since(s0) < std::max(0.05, 0.25 * seconds));
  r.mem_bw = bytes / secs_since(s0);
  return r;
}

std::string compute_probe_json(const ComputeCeiling& c) {
  json j = {{"flops_per_s", c.flops_per_s},
            {"gemm_flops_per_s", c.gemm_flops_per_s},
            {"mem_bw", c.mem_bw},
            {"threads", c.threads}};
  return j.dump() + "\n";
}

// ---- processes ---------------------------------------------------------------------------------------------

namespace {

int detect_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int c = CPU_COUNT(&set);
    if (c > 0) return c;
  }
  const unsigned h = std::thread::hardware_concurrency();
  return h ? static_cast<int>(h) : 1;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw std::runtime_error("cannot resolve /proc/self/exe");
  buf[n] = 0;
  return buf;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string tail(const std::string& s, size_t n) { return s.size() <= n ? s : "..." + s.substr(s.size() - n); }

// A child process (in our process group, so that an interrupt reaches it too), stdout and stderr
// to `log`.
struct Child {
  pid_t pid = -1;
  std::string log;
};

Child spawn(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env_set,
            const std::string& log) {
  std::vector<std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    const std::string k = kv.substr(0, kv.find('='));
    bool overridden = false;
    for (const auto& [n, v] : env_set) overridden |= n == k;
    if (!overridden) env.push_back(kv);
  }
  for (const auto& [n, v] : env_set) env.push_back(n + "=" + v);
  std::vector<char*> cargv, cenv;
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  for (const auto& a : env) cenv.push_back(const_cast<char*>(a.c_str()));
  cenv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawnattr_t at;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawnattr_init(&at);
  Child c;
  c.log = log;
  const int rc = posix_spawn(&c.pid, cargv[0], &fa, &at, cargv.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  posix_spawnattr_destroy(&at);
  if (rc != 0) throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(rc));
  return c;
}

// Waits for the child; after `timeout_s` it is ended (mpirun passes the signal on to its ranks).
// Returns the exit code (128 + signal when it died of one, 124 on the timeout).
int wait_child(const Child& c, double timeout_s) {
  const auto t0 = Clock::now();
  int status = 0;
  for (;;) {
    const pid_t r = waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) break;
    if (r < 0) return 127;
    if (secs_since(t0) > timeout_s) {
      kill(c.pid, SIGTERM);
      for (int i = 0; i < 100 && waitpid(c.pid, &status, WNOHANG) == 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      kill(c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      return 124;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

int run_child(const std::vector<std::string>& argv, const std::vector<std::pair<std::string, std::string>>& env,
              const std::string& log, double timeout_s) {
  return wait_child(spawn(argv, env, log), timeout_s);
}

std::vector<std::pair<std::string, std::string>> rank_env(int threads) {
  std::string tun = "glibc.malloc.hugetlb=1";  // what `meshtrain launch` gives every rank
  if (const char* t = std::getenv("GLIBC_TUNABLES"); t && *t)
    tun = std::string(t).find("glibc.malloc.hugetlb") != std::string::npos ? t : std::string(t) + ":" + tun;
  return {{"OMP_NUM_THREADS", std::to_string(threads)}, {"GLIBC_TUNABLES", tun}};
}

int threads_per_rank(int ranks, int cores) { return std::max(1, cores / std::max(1, ranks)); }

// N probe processes at once, as the N ranks of a job will run.
ComputeCeiling probe_compute(const ValidateOptions& o, const std::string& dir, const EngineLayout& e, int cores) {
  const int threads = threads_per_rank(e.ranks, cores);
  std::vector<Child> kids;
  for (int i = 0; i < e.ranks; ++i)
    kids.push_back(spawn({o.binary, "plan", "--probe-compute", "--model", e.model, "--micro-batch",
                          std::to_string(e.micro_batch), "--dtype", e.bf16 ? "bf16" : "fp32", "--tp",
                          std::to_string(e.tp), "--probe-seconds", fmt("%g", o.probe_seconds)},
                         rank_env(threads), dir + "/probe" + std::to_string(i) + ".log"));
  ComputeCeiling sum;
  std::string err;
  for (const auto& k : kids) {
    const int rc = wait_child(k, 60 + 10 * o.probe_seconds);
    const std::string out = read_file(k.log);
    if (rc != 0) {
      err = "compute probe exited with " + std::to_string(rc) + ": " + tail(out, 800);
      continue;
    }
    try {
      const json j = json::parse(out.substr(out.find('{')));
      sum.flops_per_s += j.at("flops_per_s").get<double>();
      sum.gemm_flops_per_s += j.at("gemm_flops_per_s").get<double>();
      sum.mem_bw += j.at("mem_bw").get<double>();
    } catch (const std::exception& ex) {
      err = std::string("compute probe output unreadable (") + ex.what() + "): " + tail(out, 400);
    }
  }
  if (!err.empty()) throw std::runtime_error(err);
  const double n = static_cast<double>(e.ranks);
  sum.flops_per_s /= n;
  sum.gemm_flops_per_s /= n;
  sum.mem_bw /= n;
  sum.procs = e.ranks;
  sum.threads = threads;
  return sum;
}

// `meshtrain launch -n N -- bench comm` over the sizes the layouts use, fitted to the planner's
// collective time t = bytes_per_rank / bw + steps x alpha by least squares on relative error.
CommCeiling probe_comm(const ValidateOptions& o, const std::string& dir, int ranks, const EngineLayout* busy_like,
                       int cores) {
  CommCeiling c;
  c.ranks = ranks;
  c.busy = busy_like != nullptr;
  const std::string tag = std::to_string(ranks) + (c.busy ? "_busy" : "");
  const std::string log = dir + "/bench_comm_" + tag + ".log";
  std::vector<std::string> argv = {o.binary,      "launch",    "-n",          std::to_string(ranks), "--",
                                   "bench",       "comm",      "--ops",       "all_gather,reduce_scatter,all_reduce",
                                   "--min-bytes", "32K",       "--max-bytes", "4M",
                                   "--factor",    "4",         "--no-mpi",    "--no-check"};
  if (c.busy) argv.insert(argv.end(), {"--iters", "5", "--warmup", "1"});
  // Busy: the collectives measured while one single-threaded compute process per rank keeps a core
  // busy the way every rank's compute thread will (on a CPU the communication threads then compete
  // with the compute threads for the cores; with more cores than ranks they find idle ones).
  struct Load {  // ended however this function is left
    std::vector<Child> kids;
    void stop() {
      for (const Child& k : kids) {
        kill(k.pid, SIGKILL);
        int st = 0;
        waitpid(k.pid, &st, 0);
      }
      kids.clear();
    }
    ~Load() { stop(); }
  } guard;
  std::vector<Child>& load = guard.kids;
  if (busy_like)
    for (int i = 0; i < ranks; ++i)
      load.push_back(spawn({o.binary, "plan", "--probe-compute", "--model", busy_like->model, "--micro-batch",
                            std::to_string(busy_like->micro_batch), "--dtype", busy_like->bf16 ? "bf16" : "fp32",
                            "--tp", std::to_string(busy_like->tp), "--probe-seconds", "20"},
                           rank_env(1), dir + "/load" + tag + std::to_string(i) + ".log"));
  const int rc = run_child(argv, {}, log, 120);
  guard.stop();
  const std::string out = read_file(log);
  if (rc != 0) throw std::runtime_error("bench comm on " + std::to_string(ranks) + " ranks failed (exit " +
                                        std::to_string(rc) + "): " + tail(out, 800));
  // Rows: "  <op> <size> <count> | <time us> <algbw> <busbw> ...".
  double a11 = 0, a12 = 0, a22 = 0, b1 = 0, b2 = 0;
  int rows = 0;
  std::istringstream in(out);
  std::string line;
  const double n = ranks;
  while (std::getline(in, line)) {
    std::istringstream ls(line);
    std::string op, size, bar;
    double count = 0, us = 0;
    if (!(ls >> op >> size >> count >> bar >> us) || bar != "|") continue;
    Collective k;
    if (op == "all_reduce") k = Collective::AllReduce;
    else if (op == "all_gather") k = Collective::AllGather;
    else if (op == "reduce_scatter") k = Collective::ReduceScatter;
    else continue;
    const double passes = k == Collective::AllReduce ? 2 : 1;
    const double x = passes * (n - 1) / n * count * 4;  // bytes per rank (f32)
    const double y = passes * (n - 1);                   // ring steps
    const double t = us * 1e-6;
    // Minimise sum ((x u + y a) / t - 1)^2 over u = 1/bw, a = alpha.
    const double X = x / t, Y = y / t;
    a11 += X * X, a12 += X * Y, a22 += Y * Y, b1 += X, b2 += Y;
    ++rows;
  }
  const double det = a11 * a22 - a12 * a12;
  double u = 0, a = 0;
  if (rows >= 2 && det > 0) {
    u = (b1 * a22 - a12 * b2) / det;
    a = (a11 * b2 - a12 * b1) / det;
  }
  if (!(u > 0) || !(a >= 0)) {  // degenerate: bandwidth from the volume alone
    u = b1 / std::max(a11, 1e-30);
    a = 0;
  }
  if (!(u > 0)) throw std::runtime_error("bench comm on " + std::to_string(ranks) + " ranks: no usable rows: " + tail(out, 400));
  c.bw = 1.0 / u;
  c.latency_s = a;
  c.source = "meshtrain launch -n " + std::to_string(ranks) + " -- bench comm, " + std::to_string(rows) +
             " points 32K-4M of all_gather, reduce_scatter, all_reduce" +
             (c.busy ? ", with " + std::to_string(ranks) + " single-threaded compute probes running"
                     : ", machine otherwise idle");
  return c;
}

// A few hundred KB of deterministic text, turned into token shards by `meshtrain prepare`.
std::string prepare_data(const ValidateOptions& o, const std::string& dir) {
  const std::string text = dir + "/corpus.txt";
  {
    std::ofstream f(text);
    static const char* words[] = {"the", "model", "shards", "its", "state", "over", "ranks", "and", "gathers",
                                  "each", "unit", "before", "compute", "gradient", "reduce", "scatter", "memory",
                                  "bytes", "step", "time", "planner", "predicts", "measured", "layout"};
    uint64_t s = 0x9e3779b97f4a7c15ULL;
    for (int i = 0; i < 60000; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      f << words[s % (sizeof words / sizeof *words)] << ((i % 13 == 12) ? ".\n" : " ");
    }
  }
  const std::string out = dir + "/data";
  const int rc = run_child({o.binary, "prepare", "--tokenizer", "byte", "--input", text, "--out", out}, {},
                           dir + "/prepare.log", 120);
  if (rc != 0) throw std::runtime_error("meshtrain prepare failed: " + tail(read_file(dir + "/prepare.log"), 600));
  return out + "/train.bin";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The cluster the measured ceilings describe: one node holding the job's ranks, per-rank compute
// and memory bandwidth as the probes saw them with all ranks running, the collectives as bench comm
// saw them. Overlap efficiency and per-kernel overhead stay the `this-cpu` preset's.
Cluster measured_cluster(const ComputeCeiling& cc, const CommCeiling& comm, int ranks) {
  Cluster c = cluster_preset("this-cpu");
  c.name = "this-cpu (measured)";
  c.description = "this machine as measured just before the job";
  c.gpus = ranks;
  c.gpus_per_node = ranks;
  c.shared_node = false;  // the probes already ran N at once: their figures are per rank
  c.mem_per_gpu /= ranks;
  c.mem_reserved /= ranks;
  c.peak_flops_fp32 = c.peak_flops_bf16 = cc.flops_per_s;
  c.compute_efficiency = 1.0;  // measured at the model's own shapes
  c.mem_bw = cc.mem_bw;
  c.mem_bw_efficiency = 1.0;
  c.intra = {comm.bw, comm.latency_s};
  c.inter = c.intra;
  return c;
}

// One run of a layout: the compute ceiling measured just before and just after the job (their mean
// is the ceiling the prediction uses; their spread shows how much the machine's load moved), the
// job, its metrics.
struct JobRun {
  std::string error;
  ComputeCeiling before, after, mean;
  std::vector<json> steps;
  json fin;
};

JobRun run_job(const ValidateOptions& o, const std::string& dir, const std::string& data, const EngineLayout& e,
               const std::string& tag, int cores) {
  JobRun j;
  try {
    j.before = probe_compute(o, dir, e, cores);
  } catch (const std::exception& ex) {
    j.error = ex.what();
    return j;
  }
  const std::string metrics = dir + "/metrics" + tag + ".jsonl", log = dir + "/train" + tag + ".log";
  std::vector<std::string> argv = {o.binary,          "launch", "-n", std::to_string(e.ranks), "--", "train",
                                   "--data.train",    data,     "--data.val", "",
                                   "--train.steps",   std::to_string(o.steps),
                                   "--train.sample_tokens", "0",
                                   "--train.checkpoint_dir", "",
                                   "--log.print_every", "1000",
                                   "--log.metrics_out", metrics};
  for (const auto& a : e.train_args()) argv.push_back(a);
  const int rc = run_child(argv, {}, log, 300);
  if (rc != 0) {
    j.error = "the job exited with " + std::to_string(rc) + ": " + tail(read_file(log), 1500);
    return j;
  }
  try {
    j.after = probe_compute(o, dir, e, cores);
  } catch (const std::exception& ex) {
    j.error = ex.what();
    return j;
  }
  j.mean = j.before;
  j.mean.flops_per_s = 0.5 * (j.before.flops_per_s + j.after.flops_per_s);
  j.mean.gemm_flops_per_s = 0.5 * (j.before.gemm_flops_per_s + j.after.gemm_flops_per_s);
  j.mean.mem_bw = 0.5 * (j.before.mem_bw + j.after.mem_bw);
  std::ifstream f(metrics);
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    json x = json::parse(line);
    if (x.value("final", false)) j.fin = x;
    else j.steps.push_back(x);
  }
  if (j.fin.is_null() || static_cast<int>(j.steps.size()) != o.steps) j.error = "incomplete metrics in " + metrics;
  return j;
}

void time_check(const ValidateOptions& o, const ModelConfig& m_in, const EngineLayout& e, const CommCeiling& cc,
                const CommCeiling& tp_cc, const JobRun& j, LayoutResult& r) {
  const ModelConfig m = engine_model(m_in, e);
  const Cluster cl = measured_cluster(j.mean, cc, e.ranks);
  const Estimate est = estimate(m, cl, planner_setup(m, e), planner_layout(e));
  // Tensor parallelism: estimate() charges the textbook collectives (one all-reduce pair per layer
  // each way, another for embedding + head, three loss all-reduces, in the activation dtype); the
  // engine's own schedule (engine_tp_allreduces, fp32) replaces them, all exposed — on the link the
  // tp ranks see while they wait for the result (tp_cc, chosen by run_validation).
  const double tp_s = e.tp > 1 ? engine_tp_seconds(m, e, measured_cluster(j.mean, tp_cc, e.ranks)) : 0.0;
  const double tp_delta = e.tp > 1 ? tp_s - est.tp_exposed_s : 0.0;
  TimeRow& t = r.time;
  t.predicted_s = est.time.total() + tp_delta;
  t.compute_s = est.time.compute;
  t.exposed_s = est.time.exposed_comm + tp_delta;
  t.tp_exposed_s = tp_s;
  t.bubble_s = 0;
  if (e.pp > 1) {
    // Pipeline: estimate() assumes even stages (ceil(L / pp) blocks each, the head on the last);
    // the engine cuts by cost. Each rank's forward / backward time per micro-batch is the whole
    // model's (estimate() of the same job without the pipeline, on one rank's measured ceilings)
    // times its units' share of the cost (engine_unit_costs), 1/3 forward and 2/3 backward; the
    // schedule's timeline of those, with a stage-boundary message on the link the waiting rank
    // sees (tp_cc), gives compute + bubble + exposed sends; then the optimizer on the largest stage,
    // the tied embedding's exchange, the stages' data-parallel reduction and the pp_aux sums.
    EngineLayout one = e;
    one.pp = 1;
    one.ranks = e.ranks / e.pp;
    const Cluster cl1 = measured_cluster(j.mean, cc, one.ranks);
    const Estimate whole = estimate(m, cl1, planner_setup(m, one), planner_layout(one));
    const double M = static_cast<double>(e.grad_accum);
    const double per_mb = (whole.time.compute - whole.optimizer_s) / M;  // forward + backward, whole model
    const std::vector<double> cost = engine_unit_costs(m);
    double total_cost = 0;
    for (double x : cost) total_cost += x;
    const Cluster tcl = measured_cluster(j.mean, tp_cc, e.ranks);
    // Per stage (stage s on rank s % pp; interleaving gives each rank several): its units' share of
    // the cost; a rank's tp time is spread over its stages by their cost.
    const std::vector<std::pair<int, int>> stages = engine_stage_partition(engine_model(m, e), e.num_stages());
    auto stage_frac = [&](size_t st) {
      double c = 0;
      for (int u = stages[st].first; u <= stages[st].second; ++u) c += cost[static_cast<size_t>(u)];
      return c / total_cost;
    };
    std::vector<double> fwd(stages.size()), bwd(stages.size());
    double worst_busy = 0, opt_s = 0, frac_max = 0;
    for (int p = 0; p < e.pp; ++p) {
      double rank_frac = 0;
      for (size_t st = static_cast<size_t>(p); st < stages.size(); st += static_cast<size_t>(e.pp)) rank_frac += stage_frac(st);
      const double tp_mb = e.tp > 1 ? engine_tp_seconds(m, e, tcl, p) / M : 0.0;
      for (size_t st = static_cast<size_t>(p); st < stages.size(); st += static_cast<size_t>(e.pp)) {
        const double f = stage_frac(st), tp_share = rank_frac > 0 ? tp_mb * f / rank_frac : 0.0;
        fwd[st] = per_mb * f / 3 + tp_share / 3;
        bwd[st] = 2 * per_mb * f / 3 + 2 * tp_share / 3;
      }
      worst_busy = std::max(worst_busy, M * (per_mb * rank_frac + tp_mb));
      frac_max = std::max(frac_max, rank_frac);
      // Adam over the rank's shard (estimate()'s 28 bytes per parameter at the streaming rate).
      opt_s = std::max(opt_s, 28.0 * static_cast<double>(engine_flat_size(m, e, p)) / e.shard_size() / cl1.mem_bw);
    }
    const Link link = tcl.intra;  // point-to-point: one message, its bytes once
    const double msg_s = static_cast<double>(engine_pp_message_bytes(m, e)) / link.bw + link.latency_s;
    const PipeTimeline tl = engine_pp_timeline(e, fwd, bwd, msg_s);
    double exposed = whole.dp_exposed_s * frac_max;  // the stage's own gradient reduction
    if (engine_tied_split(m, e))  // head gradient in, weights out: blocking, one after the other
      exposed += static_cast<double>(engine_tied_rows_elems(m, e)) * (4 + (e.bf16 ? 2 : 4)) / link.bw + 2 * link.latency_s;
    exposed += 3 * collective(Collective::AllReduce, 4, group_shape(e.pp, e.ranks / e.pp, e.ranks), tcl).time;
    t.compute_s = worst_busy + opt_s;
    t.bubble_s = tl.makespan - worst_busy;
    t.exposed_s = exposed;
    t.tp_exposed_s = e.tp > 1 ? engine_tp_seconds(m, e, tcl, 0) : 0.0;
    t.predicted_s = tl.makespan + opt_s + exposed;
    t.bubble_predicted = tl.bubble;
    t.bubble_measured = j.fin.value("pp_bubble", 0.0);
  }
  std::vector<double> ms, ex;
  for (size_t i = 1; i < j.steps.size(); ++i) {
    ms.push_back(j.steps[i].value("step_ms", 0.0) / 1e3);
    ex.push_back(j.steps[i].value("exposed_comm_ms", 0.0) / 1e3);
  }
  t.measured_exposed_s = median(ex);
  t.measured_s = median(ms);
  if (!ms.empty()) {
    t.measured_min_s = *std::min_element(ms.begin(), ms.end());
    t.measured_max_s = *std::max_element(ms.begin(), ms.end());
  }
  t.error = t.measured_s > 0 ? t.predicted_s / t.measured_s - 1 : 0;
  t.checked = o.check_time;
  t.ok = std::fabs(t.error) <= o.time_tolerance;
  t.ceiling_drift = j.before.flops_per_s > 0 ? j.after.flops_per_s / j.before.flops_per_s - 1 : 0;
  r.compute = j.mean;
  r.textbook_dp_bytes = est.comm.intra_node + est.comm.inter_node;
}

LayoutResult run_layout(const ValidateOptions& o, const std::string& dir, const std::string& data,
                        const EngineLayout& e, int index, int cores, const CommCeiling& cc, const CommCeiling& tp_cc) {
  LayoutResult r;
  r.layout = e;
  r.comm_ceiling = cc;
  r.tp_comm_ceiling = tp_cc;
  const ModelConfig m = plan_model_preset(e.model);
  const std::string tag = std::to_string(index);
  JobRun j = run_job(o, dir, data, e, tag, cores);
  if (!j.error.empty()) {
    r.error = j.error;
    return r;
  }
  const json& fin = j.fin;

  // Memory: every rank's resident bytes against the prediction (per pipeline stage: the ranks of
  // pipeline coordinate k hold stage k).
  r.flat_predicted = engine_flat_size(m, e, 0);
  r.flat_measured = fin.value("flat_size", int64_t{0});
  if (e.pp > 1) {
    r.stages_predicted = describe_stage_partition(engine_stage_partition(engine_model(m, e), e.num_stages()));
    r.stages_measured = fin.value("pp_stages", std::string());
    r.slots_predicted = engine_activation_slots(e, 0);
    r.slots_measured = fin.value("pp_peak_activation_slots", 0);
  }
  std::vector<json> per_rank;
  if (fin.contains("mem_resident_by_category_per_rank"))
    for (const auto& x : fin["mem_resident_by_category_per_rank"]) per_rank.push_back(x);
  else
    per_rank.push_back(fin["mem_resident_by_category"]);
  auto measured_of = [](const json& pr, const std::string& cat) {
    if (cat == "model state") return pr.value("params", 0.0) + pr.value("grads", 0.0) + pr.value("optimizer", 0.0);
    return pr.value(cat, 0.0);
  };
  struct Want {
    const char* cat;
    double pred;
    MemCheck check;
  };
  for (int stage = 0; stage < e.pp; ++stage) {
    const EngineMemory pm = engine_memory(m, e, stage);
    const Want wants[] = {{"model state", pm.params + pm.grads + pm.optimizer, MemCheck::Exact},
                          {"params", pm.params, MemCheck::Exact},
                          {"grads", pm.grads, MemCheck::Exact},
                          {"optimizer", pm.optimizer, MemCheck::Exact},
                          {"activations", pm.activations, MemCheck::Within},
                          {"workspace", pm.workspace, MemCheck::AtLeast},
                          {"comm", 0.0, MemCheck::Info}};
    for (const Want& w : wants) {
      MemRow row;
      row.category = w.cat;
      row.pp_rank = e.pp > 1 ? stage : -1;
      row.predicted = w.pred;
      row.check = w.check;
      row.ok = true;
      double worst = -1;
      for (size_t rank = 0; rank < per_rank.size(); ++rank) {
        if (per_rank.size() > 1 && e.pp_rank_of(static_cast<int>(rank)) != stage) continue;
        const json& pr = per_rank[rank];
        const double meas = measured_of(pr, w.cat);
        bool ok = true;
        switch (w.check) {
          case MemCheck::Exact: ok = std::llround(meas) == std::llround(w.pred); break;
          case MemCheck::Within: ok = std::fabs(meas - w.pred) <= o.mem_tolerance * std::max(w.pred, 1.0); break;
          case MemCheck::AtLeast: ok = meas >= w.pred; break;
          case MemCheck::Info: break;
        }
        if (worst < 0 || std::fabs(meas - w.pred) > std::fabs(worst - w.pred)) worst = meas;
        row.ok = row.ok && ok;
      }
      row.measured = worst;
      r.mem.push_back(row);
    }
  }

  // Communication: every group's total against setup + steps x per step, to the byte.
  const EngineComm pc = engine_comm(m, e);
  std::map<std::string, uint64_t> measured;
  for (const auto& [g, b] : fin["comm_bytes_by_group"].items()) measured[g] = b.get<uint64_t>();
  std::vector<std::string> groups;
  auto add_group = [&](const std::string& g) {
    if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
  };
  for (const auto& [g, b] : pc.per_step) add_group(g);
  for (const auto& [g, b] : pc.setup) add_group(g);
  for (const auto& [g, b] : measured)
    if (b != 0) add_group(g);  // a group the prediction does not know about fails below
  for (const auto& g : groups) {
    CommRow row;
    row.group = g;
    row.per_step = pc.per_step.count(g) ? pc.per_step.at(g) : 0;
    row.setup = pc.setup.count(g) ? pc.setup.at(g) : 0;
    row.measured_total = measured.count(g) ? measured.at(g) : 0;
    row.measured_per_step = (static_cast<double>(row.measured_total) - static_cast<double>(row.setup)) / o.steps;
    row.ok = row.measured_total == pc.total(g, o.steps);
    if (row.per_step == 0 && row.setup == 0 && row.measured_total == 0) continue;  // groups of one rank
    r.comm.push_back(row);
  }

  // Step time; on a miss, one more run (a shared machine's load can move between the ceiling probes
  // and the job: the spread of the two probes shows it).
  time_check(o, m, e, cc, tp_cc, j, r);
  r.attempts = 1;
  if (o.check_time && !r.time.ok && o.retries > 0) {
    for (int k = 0; k < o.retries && !r.time.ok; ++k) {
      r.first_time_error = r.first_time_error == 0 ? r.time.error : r.first_time_error;
      JobRun again = run_job(o, dir, data, e, tag + "r" + std::to_string(k + 1), cores);
      if (!again.error.empty()) break;
      ++r.attempts;
      time_check(o, m, e, cc, tp_cc, again, r);
    }
  }

  r.ok = r.flat_predicted == r.flat_measured && r.stages_predicted == r.stages_measured &&
         r.slots_predicted == r.slots_measured;
  for (const auto& x : r.mem) r.ok = r.ok && x.ok;
  for (const auto& x : r.comm) r.ok = r.ok && x.ok;
  if (o.check_time) r.ok = r.ok && r.time.ok;
  return r;
}

}  // namespace

std::vector<EngineLayout> default_validation_layouts() {
  auto mk = [](const char* strategy, int ranks, int rep = 1) {
    EngineLayout e;
    e.strategy = strategy;
    e.ranks = ranks;
    e.dp_replicate = rep;
    return e;
  };
  std::vector<EngineLayout> v = {mk("NO_SHARD", 2), mk("ZERO1", 2), mk("SHARD_GRAD_OP", 2), mk("FULL_SHARD", 2),
                                 mk("FULL_SHARD", 4), mk("HYBRID_SHARD", 4, 2)};
  v[2].grad_accum = 2;  // ZeRO-2 reduce-scatters every micro-batch
  EngineLayout ddp_bf16 = mk("NO_SHARD", 2);
  ddp_bf16.bf16 = true;
  v.push_back(ddp_bf16);
  EngineLayout llama = mk("FULL_SHARD", 2);
  llama.model = "llama-mini";
  llama.bf16 = true;
  llama.checkpointing = Checkpointing::Selective;
  v.push_back(llama);
  // Tensor parallelism: tp = 2 alone (one data-parallel rank), and tp = 2 inside ZeRO-3 over two
  // data-parallel ranks (mesh dp_shard = 2 x tp = 2).
  EngineLayout tp2 = mk("NO_SHARD", 2);
  tp2.tp = 2;
  v.push_back(tp2);
  EngineLayout tp2z3 = mk("FULL_SHARD", 4);
  tp2z3.tp = 2;
  v.push_back(tp2z3);
  // Sequence parallelism: tp = 2 with the residual stream split over the tp ranks.
  EngineLayout sp = tp2;
  sp.sequence_parallel = true;
  v.push_back(sp);
  // ... in bf16: activations cross the tp group in bf16, gradients and statistics in fp32.
  EngineLayout sp_bf16 = sp;
  sp_bf16.bf16 = true;
  v.push_back(sp_bf16);
  // Pipelines: pp = 2 with 4 micro-batches (GPT-2's tied embedding cut apart), 1F1B and GPipe, and
  // 1F1B x DDP over 2 data-parallel ranks (mesh pp = 2 x dp_shard = 2).
  EngineLayout pp2 = mk("NO_SHARD", 2);
  pp2.pp = 2;
  pp2.grad_accum = 4;
  v.push_back(pp2);
  EngineLayout gpipe = pp2;
  gpipe.pp_schedule = "gpipe";
  v.push_back(gpipe);
  EngineLayout ppdp = pp2;
  ppdp.ranks = 4;
  v.push_back(ppdp);
  // Interleaved 1F1B: two model chunks per rank (4 stages over 2 ranks).
  EngineLayout inter = pp2;
  inter.pp_schedule = "interleaved_1f1b";
  inter.pp_virtual_stages = 2;
  v.push_back(inter);
  return v;
}

std::vector<std::string> validation_layout_names() {
  return {"ddp", "zero1",       "zero2",  "zero3", "zero3x4",   "hsdp",   "ddp-bf16",
          "llama-zero3-bf16", "tp2", "tp2-zero3x4", "tp2-sp", "tp2-sp-bf16", "pp2", "pp2-gpipe", "pp2-dp2", "pp2-interleaved"};
}

ValidationReport run_validation(const ValidateOptions& in) {
  ValidateOptions o = in;
  if (o.binary.empty()) o.binary = self_exe();
  if (o.layouts.empty()) o.layouts = default_validation_layouts();
  if (o.steps < 2) throw std::invalid_argument("--validate needs at least 2 steps (the first pays warm-up)");
  for (const auto& e : o.layouts) check_engine_layout(e);
  const auto t0 = Clock::now();
  ValidationReport rep;
  rep.cores = detect_cores();

  std::string dir = o.work_dir;
  bool made = false;
  if (dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    std::string templ = std::string(tmp && *tmp ? tmp : "/tmp") + "/meshtrain-validate-XXXXXX";
    std::vector<char> buf(templ.begin(), templ.end());
    buf.push_back(0);
    if (!mkdtemp(buf.data())) throw std::runtime_error("cannot create a work directory under " + templ);
    dir = buf.data();
    made = true;
  } else {
    std::filesystem::create_directories(dir);
  }
  struct Cleanup {
    std::string dir;
    bool on;
    ~Cleanup() {
      if (on) {
        std::error_code ec;
        std::filesystem::remove_all(dir, ec);
      }
    }
  } cleanup{dir, made && !o.keep};
  if (o.progress && o.keep) *o.progress << "work directory " << dir << "\n";

  const std::string data = prepare_data(o, dir);
  // Ceilings first: the collectives on every rank count used.
  std::vector<int> counts;
  for (const auto& e : o.layouts)
    if (e.ranks > 1 && std::find(counts.begin(), counts.end(), e.ranks) == counts.end()) counts.push_back(e.ranks);
  for (int n : o.check_time ? counts : std::vector<int>{}) {  // not needed when step time is not checked
    const EngineLayout* like = nullptr;
    for (const auto& e : o.layouts)
      if (e.ranks == n && !like) like = &e;
    for (const EngineLayout* busy : {static_cast<const EngineLayout*>(nullptr), like}) {
      rep.comm_ceilings.push_back(probe_comm(o, dir, n, busy, rep.cores));
      const CommCeiling& c = rep.comm_ceilings.back();
      if (o.progress)
        *o.progress << "ceiling: collectives on " << n << " ranks" << (c.busy ? " (cores busy)" : "") << ": "
                    << fmt("%.2f GB/s", c.bw / 1e9) << " per rank, " << fmt("%.0f us", c.latency_s * 1e6)
                    << " per ring step\n";
    }
  }
  int i = 0;
  for (const auto& e : o.layouts) {
    CommCeiling cc;  // a single rank never communicates; unmeasured: the this-cpu preset's link
    cc.ranks = e.ranks;
    cc.bw = cluster_preset("this-cpu").intra.bw;
    cc.latency_s = cluster_preset("this-cpu").intra.latency_s;
    cc.busy = true;
    cc.source = "this-cpu preset (not measured)";
    for (const auto& c : rep.comm_ceilings)  // the job's conditions: its ranks computing
      if (c.ranks == e.ranks && c.busy) cc = c;
    // Tensor parallelism's blocking all-reduces: every rank of the tp group waits for the result, so
    // with a core per rank nothing competes with the communication threads (the idle ceiling); with
    // more ranks than cores the other ranks keep computing meanwhile (the busy one).
    CommCeiling tp_cc = cc;
    if (e.ranks <= rep.cores)
      for (const auto& c : rep.comm_ceilings)
        if (c.ranks == e.ranks && !c.busy) tp_cc = c;
    const auto tj = Clock::now();
    LayoutResult r = run_layout(o, dir, data, e, i++, rep.cores, cc, tp_cc);
    if (o.progress) {
      *o.progress << (r.ok ? "ok    " : "FAIL  ") << e.label() << fmt(" (%.1f s)", secs_since(tj));
      if (r.error.empty())
        *o.progress << ": compute ceiling " << fmt("%.1f GFLOP/s", r.compute.flops_per_s / 1e9) << " per rank, step "
                    << fmt("%.0f ms", r.time.measured_s * 1e3) << " measured vs " << fmt("%.0f ms", r.time.predicted_s * 1e3)
                    << " predicted";
      else
        *o.progress << ": " << r.error;
      *o.progress << "\n";
      o.progress->flush();
    }
    rep.results.push_back(std::move(r));
  }
  rep.ok = !rep.results.empty();
  for (const auto& r : rep.results) rep.ok = rep.ok && r.error.empty() && r.ok;
  rep.seconds = secs_since(t0);
  return rep;
}

// ---- output ------------------------------------------------------------------------------------------------

namespace {


std::string num(double v) {
  // 1234567 -> "1,234,567"
  const long long x = std::llround(v);
  std::string s = std::to_string(std::llabs(x)), o;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i && (s.size() - i) % 3 == 0) o += ',';
    o += s[i];
  }
  return (x < 0 ? "-" : "") + o;
}

std::string diff_cell(double pred, double meas) {
  if (pred == 0 && meas == 0) return "0";
  if (pred == 0) return "inf";
  return fmt("%+.2f%%", 100.0 * (meas / pred - 1));
}

}  // namespace

std::string format_validation(const ValidationReport& rep) {
  std::ostringstream o;
  o << "Planner vs this engine: " << rep.results.size() << " jobs on " << rep.cores << " cores"
    << fmt(" (%.0f s)", rep.seconds) << "\n\nCeilings measured first:\n";
  for (const auto& c : rep.comm_ceilings)
    o << "  collectives, " << c.ranks << " ranks" << (c.busy ? ", cores busy" : ", idle") << ": "
      << fmt("%.2f GB/s", c.bw / 1e9) << " per rank (busbw), "
      << fmt("%.0f us", c.latency_s * 1e6) << " per ring step  [" << c.source << "]\n";
  for (const auto& r : rep.results)
    if (r.error.empty())
      o << "  compute, " << r.layout.label() << ": " << fmt("%.1f", r.compute.flops_per_s / 1e9)
        << " GFLOP/s per rank matmul+attention (" << fmt("%.1f", r.compute.gemm_flops_per_s / 1e9) << " GEMM alone), "
        << fmt("%.1f GB/s", r.compute.mem_bw / 1e9) << " streaming; " << r.compute.procs << " probes x "
        << r.compute.threads << " threads\n";

  for (const auto& r : rep.results)
    if (!r.error.empty()) o << "\nFAILED " << r.layout.label() << ": " << r.error << "\n";

  // Memory.
  o << "\nPer-rank memory between steps, bytes (measured: the rank furthest from the prediction). exact: to the\n"
       "byte; 10%: within the tolerance; >=: the model's own buffers, kernels add scratch; info: not predicted:\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& r : rep.results) {
    if (!r.error.empty()) continue;
    bool first = true;
    for (const auto& m : r.mem) {
      const char* chk = m.check == MemCheck::Exact ? "exact" : m.check == MemCheck::Within ? "10%"
                        : m.check == MemCheck::AtLeast ? ">=" : "info";
      const bool info = m.check == MemCheck::Info;
      const std::string cat = m.pp_rank >= 0 ? "stage " + std::to_string(m.pp_rank) + ": " + m.category : m.category;
      rows.push_back({first ? r.layout.label() : "", cat, info ? "-" : num(m.predicted), num(m.measured),
                      info ? "" : diff_cell(m.predicted, m.measured), chk, info ? "" : m.ok ? "ok" : "FAIL"});
      first = false;
    }
    rows.push_back({"", r.layout.pp > 1 ? "stage 0: flat elements" : "flat elements",
                    num(static_cast<double>(r.flat_predicted)), num(static_cast<double>(r.flat_measured)),
                    diff_cell(static_cast<double>(r.flat_predicted), static_cast<double>(r.flat_measured)), "exact",
                    r.flat_predicted == r.flat_measured ? "ok" : "FAIL"});
    if (r.layout.pp > 1) {
      rows.push_back({"", "stage 0: activation slots", std::to_string(r.slots_predicted),
                      std::to_string(r.slots_measured), "", "exact",
                      r.slots_predicted == r.slots_measured ? "ok" : "FAIL"});
      rows.push_back({"", "stages: " + r.stages_predicted, "", r.stages_measured, "", "exact",
                      r.stages_predicted == r.stages_measured ? "ok" : "FAIL"});
    }
  }
  o << format_table({"layout", "category", "predicted", "measured", "diff", "check", ""}, rows,
             {false, false, true, true, true, false, false});

  // Communication.
  o << "\nBytes per collective group (rank 0, algorithm volume; per step = (total - setup) / steps; the "
       "total must match exactly):\n";
  rows.clear();
  for (const auto& r : rep.results) {
    if (!r.error.empty()) continue;
    bool first = true;
    for (const auto& c : r.comm) {
      rows.push_back({first ? r.layout.label() : "", c.group, num(static_cast<double>(c.per_step)),
                      c.measured_per_step == std::floor(c.measured_per_step) ? num(c.measured_per_step)
                                                                             : fmt("%.1f", c.measured_per_step),
                      num(static_cast<double>(c.setup)),
                      num(static_cast<double>(c.measured_total)), c.ok ? "exact" : "FAIL"});
      first = false;
    }
    rows.push_back({"",
                    r.layout.pp > 1   ? "(textbook dp+pp/step)"
                    : r.layout.tp > 1 ? "(textbook dp+tp/step)"
                                      : "(textbook dp/step)",
                    num(r.textbook_dp_bytes), "", "", "", ""});
  }
  o << format_table({"layout", "group", "predicted/step", "measured/step", "setup", "measured total", ""}, rows,
             {false, false, true, true, true, true, false});
  o << "(textbook: estimate()'s DP volume for the same layout — Psi x dtype per collective without the engine's\n"
       " unit padding, kept roots or gradient-norm / loss all-reduces; with tp also its TP volume: a pair of\n"
       " all-reduces per layer each way, one pair each for embedding and head, three loss all-reduces; with\n"
       " pp its 2 sends per micro-batch of B x T x C in the activation dtype, no tied-embedding exchange)\n";

  // Step time.
  o << "\nStep time: estimate() on the ceilings measured just before and after each job (drift: after/before)\n"
       "vs the median of the steps after the first:\n";
  rows.clear();
  for (const auto& r : rep.results) {
    if (!r.error.empty()) continue;
    std::string verdict = !r.time.checked ? "(not checked)" : r.time.ok ? "ok" : "FAIL";
    if (r.attempts > 1) verdict += fmt(" (run %.0f; first ", r.attempts) + fmt("%+.0f%%)", 100 * r.first_time_error);
    rows.push_back({r.layout.label(), fmt("%.1f", r.compute.flops_per_s / 1e9), fmt("%+.0f%%", 100 * r.time.ceiling_drift),
                    fmt("%.1f", r.time.compute_s * 1e3),
                    fmt("%.1f", r.time.exposed_s * 1e3) +
                        (r.layout.tp > 1 ? " (tp " + fmt("%.1f", r.time.tp_exposed_s * 1e3) + ")" : std::string()) +
                        (r.layout.pp > 1 ? " + bubble " + fmt("%.1f", r.time.bubble_s * 1e3) +
                                               fmt(" (%.0f%% / ", 100 * r.time.bubble_predicted) +
                                               fmt("%.0f%% idle)", 100 * r.time.bubble_measured)
                                         : std::string()) +
                        " / " + fmt("%.1f", r.time.measured_exposed_s * 1e3),
                    fmt("%.1f", r.time.predicted_s * 1e3), fmt("%.1f", r.time.measured_s * 1e3),
                    fmt("%.0f", r.time.measured_min_s * 1e3) + "-" + fmt("%.0f", r.time.measured_max_s * 1e3),
                    fmt("%+.1f%%", 100 * r.time.error), verdict});
  }
  o << "(pipelines: + bubble = the critical rank's idle time in the schedule's timeline, then the predicted / measured\n"
       " mean idle share of the pp ranks; the engine's exposed is the data-parallel wait only)\n";
  o << format_table({"layout", "GFLOP/s", "drift", "compute ms", "exposed ms pred/meas", "predicted ms", "measured ms", "range",
              "error", "25%"},
             rows, {false, true, true, true, true, true, true, true, true, false});
  o << "\n" << (rep.ok ? "All checks passed." : "Some checks FAILED.") << "\n";
  return o.str();
}

std::string validation_json(const ValidationReport& rep) {
  json j;
  j["ok"] = rep.ok;
  j["cores"] = rep.cores;
  j["seconds"] = rep.seconds;
  j["comm_ceilings"] = json::array();
  for (const auto& c : rep.comm_ceilings)
    j["comm_ceilings"].push_back(
        {{"ranks", c.ranks}, {"busy", c.busy}, {"bw", c.bw}, {"latency_s", c.latency_s}, {"source", c.source}});
  j["layouts"] = json::array();
  for (const auto& r : rep.results) {
    json x = {{"label", r.layout.label()}, {"ok", r.ok}, {"error", r.error}, {"strategy", r.layout.strategy},
              {"ranks", r.layout.ranks}, {"tp", r.layout.tp}, {"sequence_parallel", r.layout.sequence_parallel},
              {"pp", r.layout.pp}, {"pp_schedule", r.layout.pp > 1 ? r.layout.pp_schedule : std::string()},
              {"dp_replicate", r.layout.replicas()},
              {"dtype", r.layout.bf16 ? "bf16" : "fp32"},
              {"model", r.layout.model}};
    if (r.error.empty()) {
      x["compute_ceiling"] = {{"flops_per_s", r.compute.flops_per_s},
                              {"gemm_flops_per_s", r.compute.gemm_flops_per_s},
                              {"mem_bw", r.compute.mem_bw}};
      x["flat_size"] = {{"predicted", r.flat_predicted}, {"measured", r.flat_measured}};
      x["memory"] = json::array();
      for (const auto& m : r.mem)
        x["memory"].push_back({{"category", m.category}, {"pp_rank", m.pp_rank}, {"predicted", m.predicted},
                               {"measured", m.measured},
                               {"check", m.check == MemCheck::Exact    ? "exact"
                                         : m.check == MemCheck::Within ? "within"
                                         : m.check == MemCheck::AtLeast ? "at_least"
                                                                        : "info"},
                               {"ok", m.ok}});
      x["comm"] = json::array();
      for (const auto& c : r.comm)
        x["comm"].push_back({{"group", c.group}, {"predicted_per_step", c.per_step}, {"setup", c.setup},
                             {"measured_total", c.measured_total}, {"measured_per_step", c.measured_per_step},
                             {"ok", c.ok}});
      x["textbook_dp_bytes_per_step"] = r.textbook_dp_bytes;
      x["step_time_s"] = {{"predicted", r.time.predicted_s}, {"compute", r.time.compute_s},
                          {"exposed_comm", r.time.exposed_s}, {"tp_exposed_comm", r.time.tp_exposed_s},
                          {"measured_median", r.time.measured_s},
                          {"measured_exposed_comm_median", r.time.measured_exposed_s},
                          {"error", r.time.error}, {"checked", r.time.checked}, {"ok", r.time.ok},
                          {"ceiling_drift", r.time.ceiling_drift}, {"attempts", r.attempts},
                          {"bubble", r.time.bubble_s}, {"pp_bubble_predicted", r.time.bubble_predicted},
                          {"pp_bubble_measured", r.time.bubble_measured}};
      if (r.layout.pp > 1)
        x["pipeline"] = {{"stages_predicted", r.stages_predicted}, {"stages_measured", r.stages_measured},
                         {"activation_slots_predicted", r.slots_predicted},
                         {"activation_slots_measured", r.slots_measured}};
    }
    j["layouts"].push_back(x);
  }
  return j.dump(2) + "\n";
}

}  // namespace mt::plan
