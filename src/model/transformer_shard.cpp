// Tensor parallelism's view of the parameters: which runs of an unsplit parameter a tp rank holds,
// and the copies between the unsplit and the split layouts.
#include <stdexcept>

#include "kernels/backend.h"
#include "model/transformer.h"

namespace mt {

namespace {
// Calls f(full_index, local_index, count) for the contiguous runs that make up rank r's share of
// parameter p (local shape `lp`, full shape `fp`) under tensor parallelism of size t.
template <typename Fn>
void for_each_tp_run(const ParamInfo& lp, const ParamInfo& fp, int r, int t, const ModelConfig& c, Fn f) {
  const int64_t rows = lp.shape[0], cols = lp.shape.size() > 1 ? lp.numel / rows : 1;
  switch (lp.tp_split) {
    case TpSplit::None:
      f(0, 0, lp.numel);
      break;
    case TpSplit::Rows:
      f(r * rows * cols, 0, rows * cols);
      break;
    case TpSplit::Cols: {
      const int64_t full_cols = fp.numel / fp.shape[0];
      for (int64_t i = 0; i < rows; ++i) f(i * full_cols + r * cols, i * cols, cols);
      break;
    }
    case TpSplit::QkvRows: {  // [q; k; v] blocks of nh*hd, nkv*hd, nkv*hd rows, each split by heads
      const int64_t hd = c.head_dim();
      const int64_t full_blocks[3] = {c.n_head * hd, c.n_kv_head * hd, c.n_kv_head * hd};
      int64_t full_off = 0, local_off = 0;
      for (int b = 0; b < 3; ++b) {
        const int64_t lrows = full_blocks[b] / t;
        f((full_off + r * lrows) * cols, local_off * cols, lrows * cols);
        full_off += full_blocks[b];
        local_off += lrows;
      }
      break;
    }
  }
}
}  // namespace

std::vector<Transformer::TpRows> Transformer::tp_row_runs(const ParamInfo& lp, int64_t* col0) const {
  const int r = tpc_.rank, t = tpc_.size;
  const int64_t rows = lp.shape[0], cols = lp.shape.size() > 1 ? lp.numel / rows : 1;
  *col0 = 0;
  if (t == 1) return {{0, rows, 0}};  // unsplit: the parameter itself
  switch (lp.tp_split) {
    case TpSplit::None:
      return {{0, rows, 0}};
    case TpSplit::Rows:
      return {{0, rows, r * rows}};
    case TpSplit::Cols:
      *col0 = r * cols;
      return {{0, rows, 0}};
    case TpSplit::QkvRows: {  // as for_each_tp_run: q, k and v blocks each split by heads
      const int64_t hd = cfg_.head_dim();
      const int64_t full_blocks[3] = {cfg_.n_head * hd, cfg_.n_kv_head * hd, cfg_.n_kv_head * hd};
      std::vector<TpRows> out;
      int64_t full_off = 0, local_off = 0;
      for (int b = 0; b < 3; ++b) {
        const int64_t lrows = full_blocks[b] / t;
        out.push_back({local_off, lrows, full_off + r * lrows});
        full_off += full_blocks[b];
        local_off += lrows;
      }
      return out;
    }
  }
  return {};
}

void Transformer::shard_unit_from_full(const Transformer& full_layout, int u, const float* full, float* local) const {
  const int64_t lo = units_[u].offset, fo = full_layout.units_[u].offset;
  dev::zero(dev_, local, static_cast<size_t>(units_[u].numel) * sizeof(float));
  for (const auto& lp : params_) {
    if (lp.unit != u) continue;
    const ParamInfo& fp = full_layout.param(lp.name);
    for_each_tp_run(lp, fp, tpc_.rank, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
      dev::copy(dev_, local + (lp.offset - lo) + li, full + (fp.offset - fo) + fi, static_cast<size_t>(n) * sizeof(float));
    });
  }
}

void Transformer::shard_param_from_full(const ParamInfo& lp, const ParamInfo& fp, const float* full, float* local) const {
  for_each_tp_run(lp, fp, tpc_.rank, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
    dev::copy(dev_, local + li, full + fi, static_cast<size_t>(n) * sizeof(float));
  });
}

void Transformer::assemble_param_full(const ParamInfo& lp, const ParamInfo& fp, const std::vector<const float*>& locals,
                                      float* full) const {
  if (static_cast<int>(locals.size()) != tpc_.size) throw std::invalid_argument("assemble_param_full: one buffer per tp rank");
  for (int r = 0; r < tpc_.size; ++r)
    for_each_tp_run(lp, fp, r, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
      dev::copy(dev_, full + fi, locals[r] + li, static_cast<size_t>(n) * sizeof(float));
    });
}

void Transformer::assemble_unit_full(const Transformer& full_layout, int u, const std::vector<const float*>& locals,
                                     float* full) const {
  if (static_cast<int>(locals.size()) != tpc_.size) throw std::invalid_argument("assemble_unit_full: one buffer per tp rank");
  const int64_t lo = units_[u].offset, fo = full_layout.units_[u].offset;
  dev::zero(dev_, full, static_cast<size_t>(full_layout.units_[u].numel) * sizeof(float));
  for (const auto& lp : params_) {
    if (lp.unit != u) continue;
    const ParamInfo& fp = full_layout.param(lp.name);
    for (int r = 0; r < tpc_.size; ++r)
      for_each_tp_run(lp, fp, r, tpc_.size, cfg_, [&](int64_t fi, int64_t li, int64_t n) {
        dev::copy(dev_, full + (fp.offset - fo) + fi, locals[r] + (lp.offset - lo) + li, static_cast<size_t>(n) * sizeof(float));
      });
  }
}

}  // namespace mt
