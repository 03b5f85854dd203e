#include "parallel/expert_parallel.h"

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "runtime/clock.h"

namespace mt::parallel {

void ProcessGroupExpertComm::all_gather_counts(const int64_t* mine, int64_t* all, int64_t n) {
  const auto t0 = Clock::now();
  if (g_->size() == 1) {
    for (int64_t i = 0; i < n; ++i) all[i] = mine[i];
  } else {
    g_->all_gather(mine, all, static_cast<size_t>(n), DType::I64)->wait();
  }
  ms_ += ms_since(t0);
}

void ProcessGroupExpertComm::all_to_all_v(const void* send, const int64_t* send_rows, void* recv,
                                          const int64_t* recv_rows, int64_t row_elems, DType dt) {
  const auto t0 = Clock::now();
  const int R = g_->size(), me = g_->rank();
  std::vector<size_t> sc(static_cast<size_t>(R)), rc(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) {
    sc[r] = static_cast<size_t>(send_rows[r] * row_elems);
    rc[r] = static_cast<size_t>(recv_rows[r] * row_elems);
    if (r != me) bytes_ += send_rows[r] * row_elems * static_cast<int64_t>(dtype_size(dt));
  }
  g_->all_to_all_v(send, sc.data(), recv, rc.data(), dt)->wait();
  ms_ += ms_since(t0);
}

ExpertParallel::ExpertParallel(Transformer& model, std::shared_ptr<comm::ProcessGroup> edp,
                               std::shared_ptr<comm::ProcessGroup> ep_aux, std::shared_ptr<comm::ProcessGroup> tp_aux,
                               int dp, AdamWConfig adam)
    : model_(model), edp_(std::move(edp)), ep_aux_(std::move(ep_aux)), tp_aux_(std::move(tp_aux)), dp_(dp),
      adam_(AdamW::full_spans(model.expert_params()), model.expert_size(), adam) {
  const int tp = tp_aux_ ? tp_aux_->size() : 1;
  if (tp != model.tp_size())
    throw std::logic_error("ExpertParallel: the tp group has " + std::to_string(tp) + " ranks, the model is split " +
                           std::to_string(model.tp_size()) + " ways");
}

void ExpertParallel::reduce_grads(StepComm* c) {
  if (model_.expert_size() == 0) return;
  float* g = model_.expert_grads().f32();
  const int64_t n = model_.expert_size();
  if (edp_->size() > 1) {
    const auto t0 = Clock::now();
    comm::WorkHandle w = edp_->all_reduce(g, static_cast<size_t>(n), DType::F32, comm::ReduceOp::Sum);
    w->wait();
    if (c) {
      c->exposed_ms += ms_since(t0);
      c->comm_ms += w->elapsed_ms();
    }
  }
  model_.kernels().scale(g, 1.0f / static_cast<float>(dp_), n);
}

double ExpertParallel::grad_norm_sq() {
  double s = 0;
  const float* g = model_.expert_grads().defined() ? model_.expert_grads().f32() : nullptr;
  if (model_.expert_size() > 0 && model_.tp_size() == 1) {
    s = model_.kernels().sum_squares(g, model_.expert_size());
  } else if (model_.expert_size() > 0) {
    // The caller sums over the tp ranks: split parameters are disjoint slices, replicated ones
    // (identical on every tp rank) count 1/tp on each.
    const double rep = 1.0 / static_cast<double>(model_.tp_size());
    for (const ParamInfo& p : model_.expert_params())
      s += model_.kernels().sum_squares(g + p.offset, p.numel) * (p.tp_split == TpSplit::None ? rep : 1.0);
  }
  float f = static_cast<float>(s);
  if (ep_aux_->size() > 1) ep_aux_->all_reduce(&f, 1, DType::F32, comm::ReduceOp::Sum)->wait();
  return static_cast<double>(f);
}

void ExpertParallel::optimizer_step(double lr, float grad_scale) {
  if (model_.expert_size() == 0) return;
  const bool bf = model_.compute_dtype() == DType::BF16;
  adam_.step(model_.expert_weights().f32(), model_.expert_grads().f32(), lr, grad_scale, false, false,
             bf ? model_.expert_compute_weights().bf() : nullptr);
}

std::string ExpertParallel::name_on_rank(const ParamInfo& p, int r) const {
  const std::string key = ".experts.";
  const size_t at = p.name.find(key);
  if (at == std::string::npos) throw std::logic_error("not an expert parameter: " + p.name);
  const size_t b = at + key.size(), e = p.name.find('.', b);
  const int64_t El = model_.config().moe_experts / model_.ep_size();
  const int64_t local = std::stoll(p.name.substr(b, e - b)) - model_.ep_rank() * El;
  return p.name.substr(0, b) + std::to_string(r * El + local) + p.name.substr(e);
}

void ExpertParallel::load_unit(const Transformer& ref, int u, const float* w, const float* m, const float* v) {
  const int64_t base = ref.unit(u).offset;
  // With tp this rank's slice of each expert parameter (as the model's own tp-split parameters).
  for (const ParamInfo& p : model_.expert_params()) {
    if (p.unit != u) continue;
    const ParamInfo& f = ref.param(p.name);
    if (w) model_.shard_param_from_full(p, f, w + (f.offset - base), model_.expert_weights().f32() + p.offset);
    if (m) model_.shard_param_from_full(p, f, m + (f.offset - base), adam_.exp_avg().f32() + p.offset);
    if (v) model_.shard_param_from_full(p, f, v + (f.offset - base), adam_.exp_avg_sq().f32() + p.offset);
  }
  if (model_.compute_dtype() == DType::BF16 && model_.expert_size() > 0)
    model_.kernels().cast_f32_to_bf16(model_.expert_compute_weights().bf(), model_.expert_weights().f32(),
                                      model_.expert_size());
}

void ExpertParallel::gather_unit(const Transformer& ref, int u, float* w, float* m, float* v) {
  // This unit's local experts are one contiguous range of the expert buffers (the same size on
  // every ep rank): all-gathered, then each rank's parameters put in place by name.
  int64_t lo = -1, hi = -1;
  std::vector<const ParamInfo*> ps;
  for (const ParamInfo& p : model_.expert_params())
    if (p.unit == u) {
      if (lo < 0) lo = p.offset;
      hi = p.offset + p.numel;
      ps.push_back(&p);
    }
  if (ps.empty()) return;
  const int R = ep_aux_->size(), T = model_.tp_size();
  const int64_t n = hi - lo, base = ref.unit(u).offset;
  // Over ep (every ep rank's experts, this tp slice), then with tp over the tp ranks (every slice):
  // tp rank t's copy of ep rank r's range is at (t * R + r) * n.
  Tensor all = Tensor::empty({n * R}, DType::F32, MemCategory::Workspace);
  Tensor allt = T > 1 ? Tensor::empty({n * R * T}, DType::F32, MemCategory::Workspace) : Tensor();
  const float* src[3] = {model_.expert_weights().f32(), adam_.exp_avg().f32(), adam_.exp_avg_sq().f32()};
  float* dst[3] = {w, m, v};
  for (int i = 0; i < 3; ++i) {
    if (!dst[i]) continue;
    ep_aux_->all_gather(src[i] + lo, all.f32(), static_cast<size_t>(n), DType::F32)->wait();
    const float* g = all.f32();
    if (T > 1) {
      tp_aux_->all_gather(all.f32(), allt.f32(), static_cast<size_t>(n * R), DType::F32)->wait();
      g = allt.f32();
    }
    for (int r = 0; r < R; ++r)
      for (const ParamInfo* p : ps) {
        const ParamInfo& f = ref.param(name_on_rank(*p, r));
        std::vector<const float*> parts;
        for (int t = 0; t < T; ++t) parts.push_back(g + (static_cast<int64_t>(t) * R + r) * n + (p->offset - lo));
        model_.assemble_param_full(*p, f, parts, dst[i] + (f.offset - base));
      }
  }
}

int64_t ExpertParallel::unit_begin(int u) const {
  for (const ParamInfo& p : model_.expert_params())
    if (p.unit == u) return p.offset;
  return 0;
}

int64_t ExpertParallel::unit_numel(int u) const {
  int64_t n = 0;
  for (const ParamInfo& p : model_.expert_params())
    if (p.unit == u) n += p.numel;
  return n;
}

void ExpertParallel::read_local(int u, float* w, float* m, float* v) {
  const int64_t b = unit_begin(u), n = unit_numel(u);
  if (n == 0) return;
  const Device d = model_.device();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (w) dev::copy(d, w, model_.expert_weights().f32() + b, bytes);
  if (m) dev::copy(d, m, adam_.exp_avg().f32() + b, bytes);
  if (v) dev::copy(d, v, adam_.exp_avg_sq().f32() + b, bytes);
}

void ExpertParallel::write_local(int u, const float* w, const float* m, const float* v) {
  const int64_t b = unit_begin(u), n = unit_numel(u);
  if (n == 0) return;
  const Device d = model_.device();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  dev::copy(d, model_.expert_weights().f32() + b, w, bytes);
  if (m)
    dev::copy(d, adam_.exp_avg().f32() + b, m, bytes);
  else
    dev::zero(d, adam_.exp_avg().f32() + b, bytes);
  if (v)
    dev::copy(d, adam_.exp_avg_sq().f32() + b, v, bytes);
  else
    dev::zero(d, adam_.exp_avg_sq().f32() + b, bytes);
  if (model_.compute_dtype() == DType::BF16)
    model_.kernels().cast_f32_to_bf16(model_.expert_compute_weights().bf() + b, model_.expert_weights().f32() + b, n);
}

StateBytes ExpertParallel::state_bytes() const {
  const int64_t n = model_.expert_size();
  const bool f32 = model_.compute_dtype() == DType::F32;
  return f32 ? StateBytes{4 * n, 4 * n, 8 * n} : StateBytes{2 * n, 4 * n, 12 * n};
}

}  // namespace mt::parallel
