#include "checkpoint/model_state.h"

#include <cstring>
#include <vector>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "checkpoint/host_staging.h"

namespace mt {

namespace {
Tensor workspace(int64_t n) { return Tensor::empty({n}, DType::F32, MemCategory::Workspace); }
}  // namespace

ModelState::ModelState(Transformer& model, const Transformer& ref, parallel::Strategy& strategy,
                       comm::ProcessGroup& tp_aux, comm::ProcessGroup* pp_aux)
    : model_(model), ref_(ref), strategy_(strategy), tp_aux_(tp_aux), pp_aux_(pp_aux) {
  if (ref.unit(0).offset != 0) throw std::logic_error("the embedding unit must start the flat buffer");
}

void ModelState::load(CheckpointReader* reader, uint64_t seed, const Transformer* base_layout) {
  Tensor init;  // a fresh run's initial weights (one random stream over the whole model)
  base_crcs_.assign(static_cast<size_t>(ref_.num_units()), 0);
  if (!reader) {
    init = workspace(ref_.flat_size());
    if (init.device() != Device::Meta) {  // computed on the host
      HostStaging host(init.device());
      float* h = host.in(init.f32(), ref_.flat_size());
      ref_.init_weights_into(seed, h);
      if (ref_.config().lora())
        for (int u = 0; u < ref_.num_units(); ++u) base_crcs_[static_cast<size_t>(u)] = lora_base_unit_crc(ref_, u, h + ref_.unit(u).offset);
      host.upload();
    }
  }
  const bool moments = reader && reader->has_moments();
  strategy_.begin_load();
  for (int u = 0; u < model_.num_units(); ++u) {
    const int64_t rn = ref_.unit(u).numel, ln = model_.unit(u).numel;
    const bool replica = u == 0 && model_.has_tied_replica();
    if (ln == 0 && !replica) continue;  // another pipeline stage's unit
    Tensor fw, fm, fv;
    const float* w = init.defined() ? init.f32() + ref_.unit(u).offset : nullptr;
    if (reader) {
      fw = workspace(rn);
      if (moments) {
        fm = workspace(rn);
        fv = workspace(rn);
      }
      HostStaging host(fw.device());  // the file is read into host memory
      if (base_layout) {  // LoRA on a base model: base parameters by name, adapters initialised
        float* hw = host.in(fw.f32(), rn);
        std::vector<float> base(static_cast<size_t>(base_layout->unit(u).numel));
        reader->read_unit(u, base.data(), nullptr, nullptr);
        std::memset(hw, 0, static_cast<size_t>(rn) * sizeof(float));
        ref_.init_lora_unit(seed, u, hw);
        for (const ParamInfo& p : base_layout->params()) {
          if (p.unit != u) continue;
          const ParamInfo& q = ref_.param(p.name);
          std::memcpy(hw + (q.offset - ref_.unit(u).offset), base.data() + (p.offset - base_layout->unit(u).offset),
                      static_cast<size_t>(p.numel) * sizeof(float));
        }
        base_crcs_[static_cast<size_t>(u)] = lora_base_unit_crc(ref_, u, hw);
      } else {
        float* hw = host.in(fw.f32(), rn);
        reader->read_unit(u, hw, moments ? host.in(fm.f32(), rn) : nullptr, moments ? host.in(fv.f32(), rn) : nullptr);
        if (ref_.config().lora()) base_crcs_[static_cast<size_t>(u)] = lora_base_unit_crc(ref_, u, hw);
      }
      host.upload();
      w = fw.f32();
    }
    if (replica) model_.load_tied_replica(ref_, w);  // unit 0's range starts with the token embedding
    if (ln == 0) continue;
    Tensor lw = workspace(ln), lm, lv;
    model_.shard_unit_from_full(ref_, u, w, lw.f32());
    if (moments) {
      lm = workspace(ln);
      lv = workspace(ln);
      model_.shard_unit_from_full(ref_, u, fm.f32(), lm.f32());
      model_.shard_unit_from_full(ref_, u, fv.f32(), lv.f32());
    }
    strategy_.load_unit(u, lw.f32(), moments ? lm.f32() : nullptr, moments ? lv.f32() : nullptr);
    if (ep_) ep_->load_unit(ref_, u, w, moments ? fm.f32() : nullptr, moments ? fv.f32() : nullptr);
  }
}

void ModelState::gather_full_unit(int u, bool moments, Tensor* out) {
  const int64_t rn = ref_.unit(u).numel, ln = model_.unit(u).numel;
  const int n = moments ? 3 : 1, tp = tp_aux_.size();
  Tensor local[3];
  for (int i = 0; i < n; ++i) out[i] = Tensor::zeros({rn}, DType::F32, MemCategory::Workspace);
  if (ln > 0) {
    for (int i = 0; i < n; ++i) local[i] = workspace(ln);
    strategy_.gather_unit(u, local[0].f32(), moments ? local[1].f32() : nullptr, moments ? local[2].f32() : nullptr);
    Tensor all = tp > 1 ? workspace(ln * tp) : Tensor();
    for (int i = 0; i < n; ++i) {
      std::vector<const float*> parts{local[i].f32()};
      if (tp > 1) {
        tp_aux_.all_gather(local[i].f32(), all.f32(), static_cast<size_t>(ln), DType::F32)->wait();
        parts.clear();
        for (int r = 0; r < tp; ++r) parts.push_back(all.f32() + r * ln);
      }
      model_.assemble_unit_full(ref_, u, parts, out[i].f32());
    }
    if (ep_) ep_->gather_unit(ref_, u, out[0].f32(), moments ? out[1].f32() : nullptr, moments ? out[2].f32() : nullptr);
  }
  if (pp_aux_)
    for (int i = 0; i < n; ++i)
      pp_aux_->all_reduce(out[i].f32(), static_cast<size_t>(rn), DType::F32, comm::ReduceOp::Sum)->wait();
}

void ModelState::save(CheckpointWriter* writer) {
  for (int u = 0; u < model_.num_units(); ++u) {
    Tensor full[3];
    gather_full_unit(u, true, full);
    if (!writer) continue;
    HostStaging host(full[0].device());  // the file is written from host memory
    const int64_t n = ref_.unit(u).numel;
    writer->write_unit(u, host.out(full[0].f32(), n), host.out(full[1].f32(), n), host.out(full[2].f32(), n));
  }
}

// With expert parallelism a unit's range in a rank's file is the strategy's owned range followed,
// on the ranks that write experts (the first of each edp group), by the unit's local experts.
int64_t ModelState::strategy_numel(int u) const {
  if (model_.unit(u).numel == 0) return 0;
  const parallel::Strategy::OwnedSpan sp = strategy_.owned_span(u);
  return sp.end - sp.begin;
}

int64_t ModelState::expert_numel(int u) const {
  if (!ep_ || !ep_->writes_checkpoint() || model_.unit(u).numel == 0) return 0;
  return ep_->unit_numel(u);
}

std::vector<std::vector<LocalPiece>> ModelState::owned_pieces() const {
  std::vector<std::vector<LocalPiece>> out(static_cast<size_t>(model_.num_units()));
  for (int u = 0; u < model_.num_units(); ++u) {
    if (model_.unit(u).numel == 0) continue;  // another pipeline stage's unit
    const parallel::Strategy::OwnedSpan sp = strategy_.owned_span(u);
    // Replicas split the range they share: replica i writes the i-th of `replicas` parts.
    const int64_t len = sp.end - sp.begin;
    const int64_t b = sp.begin + len * sp.replica / sp.replicas, e = sp.begin + len * (sp.replica + 1) / sp.replicas;
    std::vector<LocalPiece>& pieces = out[static_cast<size_t>(u)];
    pieces = unit_pieces(model_, ref_, u, b, e, true);
    // LoRA: the frozen base is not stored (it comes from the run's base model on load).
    std::erase_if(pieces, [&](const LocalPiece& p) {
      return !checkpoint_stores(ref_.params()[static_cast<size_t>(p.param)], ref_.config());
    });
    for (LocalPiece& p : pieces) p.local += b - sp.begin;
    if (expert_numel(u) > 0)
      for (LocalPiece p : expert_unit_pieces(model_, ref_, u, true)) {
        p.local += len;
        pieces.push_back(p);
      }
  }
  return out;
}

int64_t ModelState::owned_numel(int u) const { return strategy_numel(u) + expert_numel(u); }

void ModelState::snapshot_unit(int u, float* w, float* m, float* v) {
  const int64_t ns = strategy_numel(u), ne = expert_numel(u);
  float* dst[3] = {w, m, v};
  if (ns > 0) {
    Tensor t[3] = {workspace(ns), workspace(ns), workspace(ns)};
    strategy_.read_owned(u, t[0].f32(), t[1].f32(), t[2].f32());
    for (int k = 0; k < 3; ++k)
      dev::copy_to_host(t[k].device(), dst[k], t[k].f32(), static_cast<size_t>(ns) * sizeof(float));
  }
  if (ne > 0) {
    Tensor t[3] = {workspace(ne), workspace(ne), workspace(ne)};
    ep_->read_local(u, t[0].f32(), t[1].f32(), t[2].f32());
    for (int k = 0; k < 3; ++k)
      dev::copy_to_host(t[k].device(), dst[k] + ns, t[k].f32(), static_cast<size_t>(ne) * sizeof(float));
  }
}

void ModelState::load_owned(const ShardedCheckpoint& ck, bool moments, int64_t adam_steps) {
  strategy_.begin_load();
  HostBuffer host[3];
  const int kinds = moments ? 3 : 1;
  // Reads `pieces` (offsets into a range of n elements) into n-element device buffers t[0..kinds).
  auto read = [&](const std::vector<LocalPiece>& pieces, int64_t n, Tensor* t) {
    for (int k = 0; k < kinds; ++k) {  // padding stays zero
      float* h = host[k].reserve(static_cast<size_t>(n));
      std::fill(h, h + n, 0.0f);
    }
    for (const LocalPiece& p : pieces)
      for (int k = 0; k < kinds; ++k)
        ck.read_box(logical_name(ref_.params()[static_cast<size_t>(p.param)], k), p.box, host[k].data() + p.local);
    for (int k = 0; k < kinds; ++k) {
      t[k] = workspace(n);
      dev::copy_from_host(t[k].device(), t[k].f32(), host[k].data(), static_cast<size_t>(n) * sizeof(float));
    }
  };
  for (int u = 0; u < model_.num_units(); ++u) {
    if (u == 0 && model_.has_tied_replica()) {
      // The head's copy of a tied embedding: the token embedding's rows (first parameter of unit 0).
      const ParamInfo& wte = ref_.params().front();
      const int64_t rows = ref_.config().vocab_size, cols = logical_cols(wte);
      Tensor full = Tensor::zeros({wte.numel}, DType::F32, MemCategory::Workspace);
      HostBuffer h;
      ck.read_box(logical_name(wte, 0), Box{0, rows, 0, cols}, h.reserve(static_cast<size_t>(rows * cols)));
      dev::copy_from_host(full.device(), full.f32(), h.data(), static_cast<size_t>(rows * cols) * sizeof(float));
      model_.load_tied_replica(ref_, full.f32());
    }
    const int64_t n = strategy_numel(u);
    if (n > 0) {
      const parallel::Strategy::OwnedSpan sp = strategy_.owned_span(u);
      Tensor t[3];
      read(unit_pieces(model_, ref_, u, sp.begin, sp.end, false), n, t);
      strategy_.write_owned(u, t[0].f32(), moments ? t[1].f32() : nullptr, moments ? t[2].f32() : nullptr);
    }
    // Expert parallelism: every rank reads all of its local experts (whatever layout wrote them).
    const int64_t ne = ep_ && model_.unit(u).numel > 0 ? ep_->unit_numel(u) : 0;
    if (ne > 0) {
      Tensor t[3];
      read(expert_unit_pieces(model_, ref_, u, false), ne, t);
      ep_->write_local(u, t[0].f32(), moments ? t[1].f32() : nullptr, moments ? t[2].f32() : nullptr);
    }
  }
  strategy_.end_load_owned(adam_steps);
  if (ep_) ep_->end_load(adam_steps);
}

}  // namespace mt
