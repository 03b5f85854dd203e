#include "parallel/data_parallel.h"

#include <chrono>
#include <cstring>
#include <stdexcept>

#include "kernels/backend.h"

namespace mt::parallel {

DataParallel::DataParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> dp, double bucket_mb,
                           double first_bucket_mb, bool sparse_embedding)
    : model_(model), dp_(std::move(dp)) {
  if (bucket_mb <= 0) throw std::invalid_argument("parallel.bucket_mb must be positive");
  const int U = model_.num_units();
  bucket_of_unit_.assign(U, -1);
  unit_done_.assign(U, 0);
  const int64_t cap = static_cast<int64_t>(bucket_mb * 1e6 / sizeof(float));
  const int64_t first_cap = static_cast<int64_t>(std::min(first_bucket_mb, bucket_mb) * 1e6 / sizeof(float));
  // Walk units from the last (first to finish backward) to the first.
  for (int u = U - 1; u >= 0; --u) {
    if (!model_.owns_unit(u)) continue;  // another pipeline stage's unit
    const UnitRange& r = model_.unit(u);
    // The open bucket is buckets_.back(); bucket 0 (the first to be reduced) has the small cap.
    bool fits = !buckets_.empty() && buckets_.back().numel + r.numel <= (buckets_.size() == 1 ? first_cap : cap);
    if (!fits) {
      Bucket b;
      b.first_unit = b.last_unit = u;
      b.offset = r.offset;
      b.numel = r.numel;
      b.units = 1;
      buckets_.push_back(b);
    } else {
      Bucket& b = buckets_.back();
      b.first_unit = u;
      b.offset = r.offset;
      b.numel += r.numel;
      ++b.units;
    }
    bucket_of_unit_[u] = static_cast<int>(buckets_.size()) - 1;
  }
  // Tied embedding: the token embedding (the embedding unit's first parameter) becomes its own
  // bucket, reduced when the head's backward has written its dense gradient; the embedding
  // unit's bucket keeps the rest (position table).
  tied_ = sparse_embedding && model_.can_hand_sparse_grad() && dp_->size() > 1;
  if (tied_) {
    const ParamInfo& wte = model_.params()[0];
    Bucket& b0 = buckets_[bucket_of_unit_[0]];
    if (b0.offset != wte.offset) throw std::logic_error("DDP: the token embedding does not start its bucket");
    b0.offset += wte.numel;
    b0.numel -= wte.numel;
    tied_offset_ = wte.offset;
    // The head hands over its weight gradient in chunks of about one bucket (at least 64 rows),
    // each reduced as soon as it is complete, while the head's backward goes on.
    tied_rows_ = std::max<int64_t>(64, cap / model_.config().n_embd);
  }
  if (model_.config().lora()) {  // the runs of trainable parameters in each bucket
    for (const ParamInfo& p : model_.params()) {
      if (!p.trainable || !model_.owns_unit(p.unit)) continue;
      Bucket& b = buckets_[bucket_of_unit_[p.unit]];
      const int64_t at = model_.state_offset(p);  // where its gradient lies
      if (!b.trainable.empty() && b.trainable.back().first + b.trainable.back().second == at)
        b.trainable.back().second += p.numel;
      else
        b.trainable.push_back({at, p.numel});
    }
  }
  reset();
}

bool DataParallel::takes_sparse_grad(int param) { return sync_ && tied_ && param == 0; }

int64_t DataParallel::grad_ready_rows(int param) { return takes_sparse_grad(param) ? tied_rows_ : 0; }

void DataParallel::grad_ready(int param, int64_t first_row, int64_t end_row) {
  (void)param;  // the token embedding (takes_sparse_grad)
  const int64_t C = model_.config().n_embd;
  float* g = model_.grads().f32() + tied_offset_ + first_row * C;
  tied_works_.push_back(
      dp_->all_reduce(g, static_cast<size_t>((end_row - first_row) * C), DType::F32, comm::ReduceOp::Avg));
}

// The lookup's rows and token ids of every rank (added in finish()).
void DataParallel::sparse_grad(int param, const int32_t* ids, const float* rows, int64_t n) {
  (void)param;
  const int64_t C = model_.config().n_embd, W = dp_->size();
  if (!gathered_rows_.defined() || gathered_rows_.numel() != W * n * C) {
    gathered_rows_ = Tensor::empty({W * n, C}, DType::F32, MemCategory::Comm);
    gathered_ids_ = Tensor::empty({W * n}, DType::I32, MemCategory::Comm);
  }
  sparse_n_ = n;
  ids_work_ = dp_->all_gather(ids, gathered_ids_.i32(), static_cast<size_t>(n), DType::I32);
  rows_work_ = dp_->all_gather(rows, gathered_rows_.f32(), static_cast<size_t>(n * C), DType::F32);
}

void DataParallel::reset() {
  std::fill(unit_done_.begin(), unit_done_.end(), 0);
  for (auto& b : buckets_) {
    b.pending = b.units;
    b.work.reset();
    b.works.clear();
  }
  tied_works_.clear();
  ids_work_.reset();
  rows_work_.reset();
}

void DataParallel::set_sync(bool sync) { sync_ = sync; }

void DataParallel::post_backward(int unit) {
  // Only the synchronising backward counts: each unit runs it once per step (with a pipeline, the
  // last micro-batch of the unit's stage), and its bucket starts when every unit in it is done.
  if (!sync_) return;
  unit_done_[unit] = 1;
  Bucket& b = buckets_[bucket_of_unit_[unit]];
  if (--b.pending == 0 && dp_->size() > 1 && b.numel > 0) launch(b);
}

void DataParallel::launch(Bucket& b) {
  if (model_.config().lora()) {
    for (const auto& [off, n] : b.trainable)
      b.works.push_back(dp_->all_reduce(model_.grads().f32() + off, static_cast<size_t>(n), DType::F32,
                                        comm::ReduceOp::Avg));
    return;
  }
  float* g = model_.grads().f32() + b.offset;
  b.work = dp_->all_reduce(g, static_cast<size_t>(b.numel), DType::F32, comm::ReduceOp::Avg);
}

DdpStepStats DataParallel::finish() {
  DdpStepStats st;
  if (!sync_) return st;
  std::string missing;
  for (int u = 0; u < model_.num_units(); ++u)
    if (model_.owns_unit(u) && !unit_done_[u]) missing += (missing.empty() ? "" : ", ") + model_.unit(u).name;
  if (!missing.empty())
    throw std::runtime_error("DDP: backward finished without producing gradients for unit(s) " + missing +
                             " on rank " + std::to_string(dp_->rank()) +
                             "; their buckets were never reduced (every unit must take part in the loss)");
  if (dp_->size() == 1) {
    reset();
    return st;
  }
  auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_) {
    if (b.work) b.work->wait();
    for (auto& w : b.works) w->wait();
  }
  if (tied_) {
    for (auto& w : tied_works_) w->wait();
    for (auto* w : {&ids_work_, &rows_work_})
      if (*w) (*w)->wait();
    // The dense part is averaged; add every rank's lookup rows / world, in rank order (the same
    // sum on every rank).
    const int64_t W = dp_->size(), n = sparse_n_, C = model_.config().n_embd;
    model_.kernels().scale(gathered_rows_.f32(), 1.0f / static_cast<float>(W), W * n * C);
    float* g = model_.grads().f32() + tied_offset_;
    for (int64_t r = 0; r < W; ++r)
      model_.kernels().embedding_backward(g, gathered_rows_.f32() + r * n * C, gathered_ids_.i32() + r * n, n, C);
  }
  st.exposed_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  for (auto& b : buckets_) {
    if (b.work) {
      st.comm_ms += b.work->elapsed_ms();
      ++st.buckets;
    }
    for (auto& w : b.works) st.comm_ms += w->elapsed_ms();
    if (!b.works.empty()) ++st.buckets;
  }
  for (auto& w : tied_works_) {
    st.comm_ms += w->elapsed_ms();
    ++st.buckets;
  }
  for (auto* w : {&ids_work_, &rows_work_})
    if (*w) {
      st.comm_ms += (*w)->elapsed_ms();
      ++st.buckets;
    }
  reset();
  return st;
}

}  // namespace mt::parallel
