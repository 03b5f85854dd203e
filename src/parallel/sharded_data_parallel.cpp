#include "parallel/sharded_data_parallel.h"

#include <algorithm>

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "comm/world.h"
#include "kernels/backend.h"
#include "runtime/clock.h"

namespace mt::parallel {

struct ShardedDataParallel::UnitState {
  int64_t offset = 0, numel = 0;  // the unit's (padded) range of the flat buffer
  int64_t shard = 0;              // numel / N
  int64_t local = 0;              // offset of this rank's slice in the weight shard buffers
  // The unit's state (gradients, moments, master): the whole unit, or with a compact LoRA state its
  // run of adapters: `run` elements from `sin` in the unit, `snumel` padded, at `spos` of the
  // model's state-layout gradients; this rank's sshard of them at `slocal` of the state shards.
  int64_t sin = 0, run = 0, snumel = 0, sshard = 0, slocal = 0, spos = 0;
  Tensor gathered;                // ZeRO-3: full parameters in the compute dtype
  comm::WorkHandle gather_work;
  Tensor grad;                    // ZeRO-2/3: the unit's full gradient during backward
  comm::WorkHandle reduce_work;   // reduce-scatter of `grad` (or of the flat grads for ZeRO-1)
  comm::WorkHandle replicate_work;
  bool done_backward = false;
  // Split backward: B's whose W has not run yet. Their queued weight gradients point into `grad`,
  // so a reduction that completes while any is pending zeroes `grad` in place instead of freeing it.
  int pending_w = 0;
  bool replicate_after = false;   // the reduction belongs to the last micro-batch (hybrid all-reduce)
  bool keep = false;              // root unit: not resharded between forward and backward
};

bool ShardedDataParallel::params_sharded() const {
  return shards_parameters(opts_.strategy);
}
bool ShardedDataParallel::grads_sharded() const { return shards_gradients(opts_.strategy); }

ModelStorage ShardedDataParallel::storage_for(ShardingStrategy s, DType compute, int shard_size) {
  ModelStorage st;
  const bool p_sharded = shards_parameters(s);
  st.weights = !p_sharded;  // ZeRO-1/2 keep full parameters in the compute dtype
  st.master = false;        // fp32 master weights are sharded (bf16 mode)
  st.grads = !shards_gradients(s);
  st.unit_align = 16 * static_cast<int64_t>(shard_size);  // shards of whole 64-byte lines
  st.compact_state = true;  // LoRA: state for the adapters only
  (void)compute;
  return st;
}

ShardedDataParallel::ShardedDataParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> shard,
                                         std::shared_ptr<comm::ProcessGroup> replicate,
                                         std::shared_ptr<comm::ProcessGroup> norm, ShardOptions opts, AdamWConfig adam)
    : model_(model), shard_(std::move(shard)), replicate_(std::move(replicate)), norm_group_(std::move(norm)), opts_(opts),
      cd_(model.compute_dtype()), N_(shard_->size()), r_(shard_->rank()), tied_(model.config().tied_embeddings && model.owns_unit(0) && model.owns_unit(model.num_units() - 1)) {
  if (!is_sharded(opts_.strategy))
    throw std::invalid_argument("ShardedDataParallel: NO_SHARD is not a sharded strategy (DataParallel runs it)");
  if (opts_.prefetch < 0) throw std::invalid_argument("parallel.prefetch must be >= 0");
  const int U = model_.num_units();
  units_.resize(U);
  for (int u = 0; u < U; ++u) {
    UnitState& s = units_[u];
    s.offset = model_.unit(u).offset;
    s.numel = model_.unit(u).numel;
    if (s.numel % N_ != 0)
      throw std::logic_error("unit " + model_.unit(u).name + " is not padded to the shard group size " +
                             std::to_string(N_) + " (build the model with storage_for())");
    s.shard = s.numel / N_;
    s.local = shard_total_;
    shard_total_ += s.shard;
    const Transformer::StateRange& st = model_.state_range(u);
    s.sin = st.begin - s.offset;
    s.run = st.run;
    s.snumel = st.numel;
    s.spos = st.pos;
    if (s.snumel % N_ != 0) throw std::logic_error("unit " + model_.unit(u).name + ": state not padded to the shard group");
    s.sshard = s.snumel / N_;
    s.slocal = state_total_;
    state_total_ += s.sshard;
  }
  compact_ = model_.compact_state();
  units_[0].keep = tied_;
  units_[U - 1].keep = true;  // the head's weights are needed again right away by its backward
  // AdamW spans: this rank's slice of every parameter. w_off: where the span lies in the model's
  // full buffers (compact: in its state-layout gradients, ZeRO-1 reads them there).
  std::vector<AdamSpan> spans;
  for (size_t i = 0; i < model_.params().size(); ++i) {
    const ParamInfo& p = model_.params()[i];
    if (!p.trainable) continue;
    const UnitState& s = units_[p.unit];
    if (compact_) {  // in state coordinates of the unit
      const int64_t a = p.offset - model_.state_range(p.unit).begin, lo = r_ * s.sshard, hi = lo + s.sshard;
      const int64_t b = std::max(lo, a), e = std::min(hi, a + p.numel);
      if (b < e) spans.push_back({s.spos + b, s.slocal + (b - lo), e - b, p.decay, static_cast<int>(i)});
      continue;
    }
    const int64_t lo = s.offset + r_ * s.shard, hi = lo + s.shard;
    const int64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
    if (b < e) spans.push_back({b, s.local + (b - lo), e - b, p.decay, static_cast<int>(i)});
  }
  adam_ = std::make_unique<AdamW>(std::move(spans), state_total_, adam);
  const bool f32 = cd_ == DType::F32;
  if (compact_) {
    // The adapters' fp32 master (a copy of the trainable weights beside the compute-dtype ones).
    master_ = Tensor::zeros({state_total_}, DType::F32, MemCategory::Optimizer);
    if (params_sharded()) wshard_ = Tensor::zeros({shard_total_}, cd_, MemCategory::Params);
  } else if (params_sharded() || !f32) {
    master_ = Tensor::zeros({shard_total_}, DType::F32,
                            params_sharded() && f32 ? MemCategory::Params : MemCategory::Optimizer);
  }
  if (grads_sharded()) grad_shard_ = Tensor::zeros({state_total_}, DType::F32, MemCategory::Grads);
  // Norms of sharded gradients are summed over the shard group only (replicas hold the same
  // shard), on a group of the same members.
  if (!norm_group_ || norm_group_->global_ranks() != shard_->global_ranks())
    throw std::invalid_argument("sharded data parallel: the norm group must have the shard group's members");
}

ShardedDataParallel::~ShardedDataParallel() {
  for (int u = 0; u < model_.num_units(); ++u) {
    model_.set_unit_weights(u, nullptr);
    model_.set_unit_grads(u, nullptr);
  }
}

int64_t ShardedDataParallel::my_offset(int u) const { return units_[u].offset + r_ * units_[u].shard; }

float* ShardedDataParallel::master_slice(int u) {
  if (master_.defined()) return master_.f32() + units_[u].local;
  return model_.weights().f32() + my_offset(u);  // fp32 ZeRO-1/2: the full weights hold the master
}

void ShardedDataParallel::load_unit(int u, const float* w, const float* m, const float* v) {
  const UnitState& s = units_[u];
  if (s.numel == 0) return;  // another pipeline stage's unit
  if (compact_) {
    const Device d = model_.device();
    if (params_sharded()) {  // this rank's slice of the unit, compute dtype
      if (cd_ == DType::F32)
        dev::copy(d, wshard_.f32() + s.local, w + r_ * s.shard, static_cast<size_t>(s.shard) * sizeof(float));
      else
        model_.kernels().cast_f32_to_bf16(wshard_.bf() + s.local, w + r_ * s.shard, s.shard);
    } else if (cd_ == DType::F32) {
      dev::copy(d, model_.weights().f32() + s.offset, w, static_cast<size_t>(s.numel) * sizeof(float));
    } else {
      model_.kernels().cast_f32_to_bf16(model_.compute_weights().bf() + s.offset, w, s.numel);
    }
    // This rank's state slice of the run (padding zero).
    const int64_t lo = r_ * s.sshard, n = std::clamp<int64_t>(s.run - lo, 0, s.sshard);
    for (auto [t, src] : {std::pair<Tensor*, const float*>{&master_, w}, {&adam_->exp_avg(), m}, {&adam_->exp_avg_sq(), v}}) {
      if (s.sshard == 0) continue;
      dev::zero(d, t->f32() + s.slocal, static_cast<size_t>(s.sshard) * sizeof(float));
      if (src && n > 0) dev::copy(d, t->f32() + s.slocal, src + s.sin + lo, static_cast<size_t>(n) * sizeof(float));
    }
    return;
  }
  const int64_t mine = r_ * s.shard;  // this rank's slice of the unit
  const size_t bytes = static_cast<size_t>(s.shard) * sizeof(float);
  if (master_.defined()) dev::copy(model_.device(), master_.f32() + s.local, w + mine, bytes);
  for (auto [t, src] : {std::pair<Tensor*, const float*>{&adam_->exp_avg(), m}, {&adam_->exp_avg_sq(), v}}) {
    if (src) dev::copy(model_.device(), t->f32() + s.local, src + mine, bytes);
    else dev::zero(model_.device(), t->f32() + s.local, bytes);
  }
  if (!params_sharded()) {  // full parameters in the compute dtype
    if (cd_ == DType::F32)
      dev::copy(model_.device(), model_.weights().f32() + s.offset, w, static_cast<size_t>(s.numel) * sizeof(float));
    else
      model_.kernels().cast_f32_to_bf16(model_.compute_weights().bf() + s.offset, w, s.numel);
  }
}

void ShardedDataParallel::gather_run(int u, const Tensor& src, float* run) {
  const UnitState& s = units_[u];
  if (s.snumel == 0) return;
  Tensor all = Tensor::empty({s.snumel}, DType::F32, MemCategory::Workspace);
  shard_->all_gather(src.f32() + s.slocal, all.f32(), s.sshard, DType::F32)->wait();
  dev::copy(model_.device(), run, all.f32(), static_cast<size_t>(s.run) * sizeof(float));
}

void ShardedDataParallel::scatter_run(int u, float* run, Tensor& dst) {
  const UnitState& s = units_[u];
  if (s.snumel == 0) return;
  if (N_ > 1) shard_->all_reduce(run, s.snumel, DType::F32, comm::ReduceOp::Sum)->wait();
  dev::copy(model_.device(), dst.f32() + s.slocal, run + r_ * s.sshard, static_cast<size_t>(s.sshard) * sizeof(float));
}

void ShardedDataParallel::gather_unit(int u, float* w, float* m, float* v) {
  release_all();
  const UnitState& s = units_[u];
  if (s.numel == 0) return;
  if (compact_) {
    const Device d = model_.device();
    // The weights in the compute dtype (the frozen base has no other form), then the adapters'
    // fp32 master over them; the moments are zero outside the run.
    if (params_sharded()) {
      Tensor all = Tensor::empty({s.numel}, cd_, MemCategory::Workspace);
      shard_->all_gather(cd_ == DType::F32 ? static_cast<const void*>(wshard_.f32() + s.local)
                                           : static_cast<const void*>(wshard_.bf() + s.local),
                         all.raw(), s.shard, cd_)->wait();
      if (cd_ == DType::F32) dev::copy(d, w, all.f32(), static_cast<size_t>(s.numel) * sizeof(float));
      else model_.kernels().cast_bf16_to_f32(w, all.bf(), s.numel);
    } else if (cd_ == DType::F32) {
      dev::copy(d, w, model_.weights().f32() + s.offset, static_cast<size_t>(s.numel) * sizeof(float));
    } else {
      model_.kernels().cast_bf16_to_f32(w, model_.compute_weights().bf() + s.offset, s.numel);
    }
    gather_run(u, master_, w + s.sin);
    for (auto [dst, t] : {std::pair<float*, Tensor*>{m, &adam_->exp_avg()}, {v, &adam_->exp_avg_sq()}}) {
      if (!dst) continue;
      dev::zero(d, dst, static_cast<size_t>(s.numel) * sizeof(float));
      gather_run(u, *t, dst + s.sin);
    }
    return;
  }
  std::vector<comm::WorkHandle> ws;
  ws.push_back(shard_->all_gather(master_slice(u), w, s.shard, DType::F32));
  if (m) ws.push_back(shard_->all_gather(adam_->exp_avg().f32() + s.local, m, s.shard, DType::F32));
  if (v) ws.push_back(shard_->all_gather(adam_->exp_avg_sq().f32() + s.local, v, s.shard, DType::F32));
  comm::wait_all(ws);
}

int64_t ShardedDataParallel::unit_shard(int u) const { return units_[u].shard; }

void ShardedDataParallel::read_owned(int u, float* w, float* m, float* v) {
  const UnitState& s = units_[u];
  if (s.numel == 0) return;
  if (compact_) {
    // The owned slice of the weights is this rank's; the fp32 adapters and their moments inside it
    // may be another rank's state: the run is gathered (collective over the shard group; every
    // rank reads its units in the same order).
    const Device d = model_.device();
    const int64_t lo = r_ * s.shard;
    if (params_sharded()) {
      if (cd_ == DType::F32) dev::copy(d, w, wshard_.f32() + s.local, static_cast<size_t>(s.shard) * sizeof(float));
      else model_.kernels().cast_bf16_to_f32(w, wshard_.bf() + s.local, s.shard);
    } else if (cd_ == DType::F32) {
      dev::copy(d, w, model_.weights().f32() + s.offset + lo, static_cast<size_t>(s.shard) * sizeof(float));
    } else {
      model_.kernels().cast_bf16_to_f32(w, model_.compute_weights().bf() + s.offset + lo, s.shard);
    }
    for (float* dst : {m, v})
      if (dst) dev::zero(d, dst, static_cast<size_t>(s.shard) * sizeof(float));
    if (s.snumel == 0) return;
    // The run's overlap with the owned slice, in unit coordinates.
    const int64_t b = std::max(lo, s.sin), e = std::min(lo + s.shard, s.sin + s.run);
    Tensor run = Tensor::empty({s.snumel}, DType::F32, MemCategory::Workspace);
    for (auto [dst, t] : {std::pair<float*, Tensor*>{w, &master_}, {m, &adam_->exp_avg()}, {v, &adam_->exp_avg_sq()}}) {
      gather_run(u, *t, run.f32());  // collective: done for null destinations too
      if (dst && b < e) dev::copy(d, dst + (b - lo), run.f32() + (b - s.sin), static_cast<size_t>(e - b) * sizeof(float));
    }
    return;
  }
  const size_t bytes = static_cast<size_t>(s.shard) * sizeof(float);
  const Device d = model_.device();
  dev::copy(d, w, master_slice(u), bytes);
  if (m) dev::copy(d, m, adam_->exp_avg().f32() + s.local, bytes);
  if (v) dev::copy(d, v, adam_->exp_avg_sq().f32() + s.local, bytes);
}

void ShardedDataParallel::write_owned(int u, const float* w, const float* m, const float* v) {
  const UnitState& s = units_[u];
  if (s.numel == 0) return;
  if (compact_) {
    // The owned slice of the weights goes to this rank's weights; the adapters' fp32 master and
    // moments are the run summed over the shard group from the part of it each rank's slice holds
    // (collective: every rank writes its units in the same order).
    const Device d = model_.device();
    const int64_t lo = r_ * s.shard;
    if (params_sharded()) {
      if (cd_ == DType::F32) dev::copy(d, wshard_.f32() + s.local, w, static_cast<size_t>(s.shard) * sizeof(float));
      else model_.kernels().cast_f32_to_bf16(wshard_.bf() + s.local, w, s.shard);
    } else {  // ZeRO-1/2: the whole unit from every rank's slice
      void* full = model_.compute_weights().raw();
      const size_t es = cd_ == DType::F32 ? 4 : 2;
      char* unit = static_cast<char*>(full) + static_cast<size_t>(s.offset) * es;
      char* mine = unit + static_cast<size_t>(lo) * es;
      if (cd_ == DType::F32) dev::copy(d, mine, w, static_cast<size_t>(s.shard) * sizeof(float));
      else model_.kernels().cast_f32_to_bf16(reinterpret_cast<bf16*>(mine), w, s.shard);
      if (N_ > 1) shard_->all_gather(mine, unit, s.shard, cd_)->wait();
    }
    if (s.snumel == 0) return;
    const int64_t b = std::max(lo, s.sin), e = std::min(lo + s.shard, s.sin + s.run);
    Tensor run = Tensor::empty({s.snumel}, DType::F32, MemCategory::Workspace);
    for (auto [src, t] : {std::pair<const float*, Tensor*>{w, &master_}, {m, &adam_->exp_avg()}, {v, &adam_->exp_avg_sq()}}) {
      dev::zero(d, run.f32(), static_cast<size_t>(s.snumel) * sizeof(float));
      if (src && b < e) dev::copy(d, run.f32() + (b - s.sin), src + (b - lo), static_cast<size_t>(e - b) * sizeof(float));
      scatter_run(u, run.f32(), *t);  // collective: done for null sources too (zeros)
    }
    return;
  }
  const size_t bytes = static_cast<size_t>(s.shard) * sizeof(float);
  const Device d = model_.device();
  dev::copy(d, master_slice(u), w, bytes);  // fp32 ZeRO-1/2: the full weights' slice
  for (auto [t, src] : {std::pair<Tensor*, const float*>{&adam_->exp_avg(), m}, {&adam_->exp_avg_sq(), v}}) {
    if (src) dev::copy(d, t->f32() + s.local, src, bytes);
    else dev::zero(d, t->f32() + s.local, bytes);
  }
}

void ShardedDataParallel::finish_owned_load() {
  if (compact_) return;  // write_owned completed every unit
  if (params_sharded()) return;  // ZeRO-3 gathers from the master shard when it computes
  // ZeRO-1/2: the full parameters in the compute dtype from every rank's slice (as after a step).
  std::vector<comm::WorkHandle> ws;
  for (int u = 0; u < model_.num_units(); ++u) {
    const UnitState& s = units_[u];
    if (s.numel == 0) continue;
    if (cd_ == DType::F32) {
      float* full = model_.weights().f32() + s.offset;
      if (N_ > 1) ws.push_back(shard_->all_gather(full + r_ * s.shard, full, s.shard, DType::F32));
    } else {
      bf16* full = model_.compute_weights().bf() + s.offset;
      model_.kernels().cast_f32_to_bf16(full + r_ * s.shard, master_.f32() + s.local, s.shard);
      if (N_ > 1) ws.push_back(shard_->all_gather(full + r_ * s.shard, full, s.shard, DType::BF16));
    }
  }
  comm::wait_all(ws);
}

// ---- ZeRO-3 parameter gathering ------------------------------------------------------------

void ShardedDataParallel::gather(int u) {
  UnitState& s = units_[u];
  if (!params_sharded() || s.gathered.defined() || s.numel == 0) return;  // numel 0: another stage's unit
  s.gathered = Tensor::empty({s.numel}, cd_, MemCategory::Params);
  ++gathered_count_;
  max_gathered_ = std::max(max_gathered_, gathered_count_);
  if (compact_) {  // the weight shard is in the compute dtype already
    const void* src = cd_ == DType::F32 ? static_cast<const void*>(wshard_.f32() + s.local)
                                        : static_cast<const void*>(wshard_.bf() + s.local);
    s.gather_work = shard_->all_gather(src, s.gathered.raw(), s.shard, cd_);
    step_works_.push_back(s.gather_work);
    model_.set_unit_weights(u, s.gathered.raw());
    return;
  }
  const float* src = master_.f32() + s.local;
  if (cd_ == DType::F32) {
    float* dst = s.gathered.f32() + r_ * s.shard;
    dev::copy(model_.device(), dst, src, static_cast<size_t>(s.shard) * sizeof(float));
    s.gather_work = shard_->all_gather(dst, s.gathered.f32(), s.shard, DType::F32);
  } else {
    bf16* dst = s.gathered.bf() + r_ * s.shard;
    model_.kernels().cast_f32_to_bf16(dst, src, s.shard);
    s.gather_work = shard_->all_gather(dst, s.gathered.bf(), s.shard, DType::BF16);
  }
  step_works_.push_back(s.gather_work);
  model_.set_unit_weights(u, s.gathered.raw());
}

void ShardedDataParallel::ensure_gathered(int u) {
  if (!params_sharded()) return;
  gather(u);
  UnitState& s = units_[u];
  if (s.gather_work) {
    auto t0 = Clock::now();
    s.gather_work->wait();
    exposed_ms_ += ms_since(t0);
    s.gather_work.reset();
  }
}

void ShardedDataParallel::release(int u) {
  UnitState& s = units_[u];
  if (!s.gathered.defined()) return;
  if (s.gather_work) s.gather_work->wait();  // never free a buffer a collective still writes
  s.gather_work.reset();
  model_.set_unit_weights(u, nullptr);
  s.gathered = Tensor();
  --gathered_count_;
}

void ShardedDataParallel::with_full_unit(int u, const std::function<void(const void*)>& f) {
  if (!params_sharded()) return f(model_.unit_compute_weights(u));
  const bool was = units_[u].gathered.defined();
  ensure_gathered(u);
  f(units_[u].gathered.raw());
  if (!was) release(u);
}

void ShardedDataParallel::release_all() {
  for (int u = 0; u < model_.num_units(); ++u) release(u);
  // Between steps (an eval forward, a checkpoint's gathers): that communication belongs to no
  // training step, so the next step's comm_ms / exposed_comm_ms do not count it.
  for (auto& w : step_works_)
    if (w) w->wait();
  step_works_.clear();
  exposed_ms_ = 0;
}

// ---- hooks ------------------------------------------------------------------------------------

void ShardedDataParallel::begin_microbatch(bool last) { last_micro_ = last; }

void ShardedDataParallel::pre_forward(int u) {
  poll(false);
  const int U = model_.num_units();
  if (u == U - 1 && tied_) ensure_gathered(0);
  ensure_gathered(u);
  for (int k = 1; k <= opts_.prefetch && u + k < U; ++k) gather(u + k);
}

void ShardedDataParallel::post_forward(int u) {
  if (params_sharded() && opts_.reshard_after_forward && !units_[u].keep) release(u);
}

void ShardedDataParallel::ensure_grad_buffer(int u) {
  if (!grads_sharded()) return;
  UnitState& s = units_[u];
  if (s.reduce_work) poll(false, u);  // a pipeline runs the unit again before its last reduction ended
  if (s.grad.defined() || s.snumel == 0) return;  // kept across micro-batches; or nothing trains
  s.grad = Tensor::zeros({s.snumel}, DType::F32, MemCategory::Grads);
  model_.set_unit_grads(u, s.grad.f32());
}

void ShardedDataParallel::pre_backward(int u) {
  poll(false);
  const int U = model_.num_units();
  if (u == U - 1 && tied_) {
    ensure_gathered(0);
    ensure_grad_buffer(0);  // the head writes the tied embedding's gradient
  }
  ensure_gathered(u);
  for (int k = 1; k <= opts_.prefetch && u - k >= 0; ++k) gather(u - k);
  ensure_grad_buffer(u);
  if (model_.split_backward()) {
    ++units_[u].pending_w;
    if (u == U - 1 && tied_) ++units_[0].pending_w;  // the head's W adds to the tied embedding's gradient
  }
}

// A split backward's W (reduce_every_microbatch): an earlier micro-batch's W may have reduced the
// unit's gradient since this micro-batch's B; the reduction must have ended before W adds to it.
void ShardedDataParallel::pre_weights(int u) {
  poll(false);
  const int U = model_.num_units();
  for (int v : {u, u == U - 1 && tied_ ? 0 : -1}) {
    if (v < 0) continue;
    UnitState& s = units_[v];
    if (s.reduce_work) poll(false, v);
    if (grads_sharded() && !s.grad.defined())
      throw std::logic_error("sharded data parallel: W of unit " + std::to_string(u) + " without its gradient buffer");
    --s.pending_w;
  }
}

void ShardedDataParallel::post_backward(int u) {
  if (last_micro_) units_[u].done_backward = true;  // the synchronising backward of the unit
  if (params_sharded()) release(u);
  const bool reduce_now = last_micro_ || (grads_sharded() && opts_.reduce_every_microbatch);
  if (reduce_now) launch_reduce(u);
  poll(false);
}

// ---- gradient reduction -----------------------------------------------------------------------

void ShardedDataParallel::launch_reduce(int u) {
  UnitState& s = units_[u];
  s.replicate_after = last_micro_;
  if (s.snumel == 0) return;  // a frozen unit (LoRA): no gradient
  if (N_ == 1) {  // nothing to exchange: the unit's gradient is the shard
    s.reduce_work.reset();
    complete_reduce(u);
    return;
  }
  float* g = grads_sharded() ? s.grad.f32() : model_.grads().f32() + s.spos;
  inflight_.push_back(u);
  s.reduce_work = shard_->reduce_scatter(g, g + r_ * s.sshard, s.sshard, DType::F32, comm::ReduceOp::Avg);
  step_works_.push_back(s.reduce_work);
}

// The reduce-scatter of unit u has finished: fold the result into the gradient shard, free the
// unit's full gradient (zero it where a split backward's pending W still points into it), and
// (last micro-batch, hybrid) start the cross-replica average.
void ShardedDataParallel::complete_reduce(int u) {
  UnitState& s = units_[u];
  s.reduce_work.reset();
  float* shard_grad;
  if (grads_sharded()) {
    model_.kernels().accumulate(grad_shard_.f32() + s.slocal, s.grad.f32() + r_ * s.sshard, s.sshard);
    if (s.pending_w > 0) {
      dev::zero(model_.device(), s.grad.raw(), s.grad.nbytes());
    } else {
      model_.set_unit_grads(u, nullptr);
      s.grad = Tensor();
    }
    shard_grad = grad_shard_.f32() + s.slocal;
  } else {
    shard_grad = model_.grads().f32() + s.spos + r_ * s.sshard;
  }
  if (s.replicate_after && replicate_->size() > 1) {
    s.replicate_work = replicate_->all_reduce(shard_grad, s.sshard, DType::F32, comm::ReduceOp::Avg);
    step_works_.push_back(s.replicate_work);
  }
}

void ShardedDataParallel::poll(bool wait_all, int until) {
  // Completes reductions in launch order (a group's collectives finish in that order), which is
  // the same on every rank: the gradient shards accumulate deterministically and the replicas'
  // all-reduces are issued in one order everywhere.
  while (!inflight_.empty()) {
    const int u = inflight_.front();
    UnitState& s = units_[u];
    const bool must = wait_all || until >= 0;
    if (must) {
      auto t0 = Clock::now();
      s.reduce_work->wait();
      exposed_ms_ += ms_since(t0);
    } else if (!s.reduce_work->test()) {
      break;
    }
    inflight_.pop_front();
    complete_reduce(u);
    if (u == until) break;
  }
}

ShardStepStats ShardedDataParallel::finish_backward() {
  std::string missing;
  for (int u = 0; u < model_.num_units(); ++u)
    if (last_micro_ && model_.owns_unit(u) && !units_[u].done_backward) missing += (missing.empty() ? "" : ", ") + model_.unit(u).name;
  if (!missing.empty())
    throw std::runtime_error(std::string(to_string(opts_.strategy)) +
                             ": backward finished without producing gradients for unit(s) " + missing +
                             "; their reductions were never started");
  poll(true);
  ShardStepStats st;
  if (last_micro_) {
    auto t0 = Clock::now();
    for (auto& s : units_)
      if (s.replicate_work) {
        s.replicate_work->wait();
        s.replicate_work.reset();
      }
    exposed_ms_ += ms_since(t0);
    for (auto& s : units_) s.done_backward = false;
  }
  return st;
}

double ShardedDataParallel::grad_norm_sq(const std::vector<double>& weight) {
  double local = 0;
  for (const auto& sp : adam_->spans()) {
    const float* g = grads_sharded() ? grad_shard_.f32() + sp.s_off : model_.grads().f32() + sp.w_off;
    local += (weight.empty() ? 1.0 : weight[sp.param]) * model_.kernels().sum_squares(g, sp.n);
  }
  if (N_ == 1) return local;
  float f = static_cast<float>(local);
  norm_group_->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
  return static_cast<double>(f);
}

// Compact state: every unit's updated adapters, all-gathered in the compute dtype (the bytes of the
// adapters, not of the unit), into the full weights (ZeRO-1/2) or this rank's weight shard (ZeRO-3).
void ShardedDataParallel::push_adapters() {
  auto t0 = Clock::now();
  const size_t es = cd_ == DType::F32 ? 4 : 2;
  std::vector<Tensor> runs(units_.size());
  std::vector<comm::WorkHandle> ws;
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitState& s = units_[u];
    if (s.numel == 0 || s.snumel == 0) continue;
    runs[u] = Tensor::empty({s.snumel}, cd_, MemCategory::Workspace);
    char* all = static_cast<char*>(runs[u].raw());
    char* mine = all + static_cast<size_t>(r_ * s.sshard) * es;
    if (cd_ == DType::F32) dev::copy(model_.device(), mine, master_.f32() + s.slocal, static_cast<size_t>(s.sshard) * es);
    else model_.kernels().cast_f32_to_bf16(reinterpret_cast<bf16*>(mine), master_.f32() + s.slocal, s.sshard);
    if (N_ > 1) ws.push_back(shard_->all_gather(mine, all, s.sshard, cd_));
  }
  comm::wait_all(ws);
  for (auto& w : ws) step_works_.push_back(w);
  exposed_ms_ += ms_since(t0);
  for (size_t u = 0; u < units_.size(); ++u) {
    const UnitState& s = units_[u];
    if (!runs[u].defined()) continue;
    const char* all = static_cast<const char*>(runs[u].raw());
    if (!params_sharded()) {
      char* full = static_cast<char*>(model_.compute_weights().raw()) + static_cast<size_t>(s.offset + s.sin) * es;
      dev::copy(model_.device(), full, all, static_cast<size_t>(s.run) * es);
    } else {  // the run's part inside this rank's slice of the unit
      const int64_t lo = r_ * s.shard, b = std::max(lo, s.sin), e = std::min(lo + s.shard, s.sin + s.run);
      if (b >= e) continue;
      char* dst = static_cast<char*>(wshard_.raw()) + static_cast<size_t>(s.local + (b - lo)) * es;
      dev::copy(model_.device(), dst, all + static_cast<size_t>(b - s.sin) * es, static_cast<size_t>(e - b) * es);
    }
  }
}

bool ShardedDataParallel::grad_norm_sq_to(double* norm_sq, const std::vector<double>& weight) {
  if (model_.device() != Device::CUDA || N_ != 1 ||
      !std::all_of(weight.begin(), weight.end(), [](double w) { return w == 1.0; }))
    return false;
  // (the state layout: with a compact LoRA state, the adapters' gradients only)
  if (grads_sharded()) model_.kernels().sum_squares_to(norm_sq, grad_shard_.f32(), state_total_);
  else model_.kernels().sum_squares_to(norm_sq, model_.grads().f32(), model_.state_size());
  return true;
}

void ShardedDataParallel::optimizer_step(double lr, float grad_scale, ShardStepStats* stats, const double* norm_sq,
                                         double clip_max) {
  const bool f32 = cd_ == DType::F32;
  if (compact_) {
    adam_->step(master_.f32(), grads_sharded() ? grad_shard_.f32() : model_.grads().f32(), lr, grad_scale,
                /*w_by_state=*/true, /*g_by_state=*/grads_sharded(), nullptr, norm_sq, clip_max);
    if (grads_sharded()) grad_shard_.zero_();
    else model_.grads().zero_();
    push_adapters();
  } else if (master_.defined())
    adam_->step(master_.f32(), grads_sharded() ? grad_shard_.f32() : model_.grads().f32(), lr, grad_scale,
                /*w_by_state=*/true, /*g_by_state=*/grads_sharded(), nullptr, norm_sq, clip_max);
  else  // fp32 ZeRO-1/2: this rank's slices of the full fp32 weights are the master
    adam_->step(model_.weights().f32(), grads_sharded() ? grad_shard_.f32() : model_.grads().f32(), lr, grad_scale,
                false, grads_sharded(), nullptr, norm_sq, clip_max);
  if (!compact_ && grads_sharded()) grad_shard_.zero_();
  if (!compact_ && !grads_sharded()) model_.grads().zero_();
  if (!compact_ && !params_sharded()) {
    // ZeRO-1/2: every rank needs the updated full parameters: all-gather the slices in place.
    auto t0 = Clock::now();
    std::vector<comm::WorkHandle> ws;
    for (int u = 0; u < model_.num_units(); ++u) {
      const UnitState& s = units_[u];
      if (s.numel == 0) continue;
      if (f32) {
        float* full = model_.weights().f32() + s.offset;
        if (N_ > 1) ws.push_back(shard_->all_gather(full + r_ * s.shard, full, s.shard, DType::F32));
      } else {
        bf16* full = model_.compute_weights().bf() + s.offset;
        model_.kernels().cast_f32_to_bf16(full + r_ * s.shard, master_.f32() + s.local, s.shard);
        if (N_ > 1) ws.push_back(shard_->all_gather(full + r_ * s.shard, full, s.shard, DType::BF16));
      }
    }
    comm::wait_all(ws);
    for (auto& w : ws) step_works_.push_back(w);
    exposed_ms_ += ms_since(t0);
  }
  if (stats) {
    for (auto& w : step_works_)
      if (w) stats->comm_ms += w->elapsed_ms();
    stats->exposed_ms = exposed_ms_;
  }
  step_works_.clear();
  exposed_ms_ = 0;
}

}  // namespace mt::parallel
