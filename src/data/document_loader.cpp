#include "data/document_loader.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "model/rng.h"

namespace mt {

namespace {
uint64_t mix(uint64_t seed, uint64_t epoch, uint64_t what) {
  return seed ^ (0xD1B54A32D192ED03ull * (epoch + 1)) ^ (0x8CB92BA72F3D8DD7ull * (what + 1));
}
}  // namespace

DocumentLoader::DocumentLoader(const TokenDataset& dataset, const DocumentBatching& opt) : data_(dataset), o_(opt) {
  if (o_.B <= 0 || o_.T <= 0 || o_.accum <= 0)
    throw std::invalid_argument("document loader: B, T and accum must be positive");
  if (o_.dp_world <= 0 || o_.dp_rank < 0 || o_.dp_rank >= o_.dp_world)
    throw std::invalid_argument("document loader: need 0 <= dp_rank < dp_world");
  if (o_.separator < 0) throw std::invalid_argument("document loader: no document separator");
  if (o_.multiple < 0 || o_.window < 1)
    throw std::invalid_argument("document loader: multiple must be >= 0 and window >= 1");
  for (size_t s = 0; s < data_.num_shards(); ++s) {
    const TokenShard& sh = data_.shard(s);
    const auto n = static_cast<int64_t>(sh.size());
    const auto sep = static_cast<uint32_t>(o_.separator);
    int64_t start = 0;
    auto add = [&](int64_t end) {  // inputs [start, end)
      if (end > start)
        docs_.push_back({static_cast<uint32_t>(s), start, std::min<int64_t>(end - start, o_.T)});
    };
    for (int64_t i = 1; i < n; ++i)
      if (sh[static_cast<size_t>(i)] == sep) {
        add(i);
        start = i;
      }
    add(n - 1);
  }
  const int64_t G = int64_t{o_.dp_world} * o_.accum * o_.B;
  steps_per_epoch_ = static_cast<int64_t>(docs_.size()) / G;
  if (steps_per_epoch_ == 0)
    throw std::runtime_error("data '" + data_.pattern() + "' holds " + std::to_string(docs_.size()) +
                             " documents, fewer than one global batch of " + std::to_string(G) +
                             " (data-parallel ranks x grad_accum x micro_batch): add data or lower the batch");
  reset();
}

std::vector<int64_t> DocumentLoader::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(docs_.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  if (o_.shuffle) shuffle_with_seed(order, mix(o_.seed, static_cast<uint64_t>(epoch), ~0ull));
  const int64_t G = int64_t{o_.dp_world} * o_.accum * o_.B;
  order.resize(static_cast<size_t>(steps_per_epoch_ * G));
  if (!o_.group_by_length) return order;
  const int64_t mega = o_.window * G;
  std::vector<int64_t> out;
  out.reserve(order.size());
  for (int64_t a = 0, k = 0; a < static_cast<int64_t>(order.size()); a += mega, ++k) {
    const auto first = order.begin() + a;
    const auto last = order.begin() + std::min<int64_t>(a + mega, static_cast<int64_t>(order.size()));
    std::vector<int64_t> mb(first, last);
    std::stable_sort(mb.begin(), mb.end(), [&](int64_t x, int64_t y) {
      return docs_[static_cast<size_t>(x)].len > docs_[static_cast<size_t>(y)].len;
    });
    std::vector<int64_t> batches(mb.size() / static_cast<size_t>(G));
    std::iota(batches.begin(), batches.end(), int64_t{0});
    shuffle_with_seed(batches, mix(o_.seed ^ 0x6C656E67ull, static_cast<uint64_t>(epoch), static_cast<uint64_t>(k)));
    for (int64_t b : batches) out.insert(out.end(), mb.begin() + b * G, mb.begin() + (b + 1) * G);
  }
  return out;
}

int64_t DocumentLoader::chunk(int rank, int m) const {
  if (!o_.group_by_length) return int64_t{rank} * o_.accum + m;
  const int r = m % 2 == 0 ? rank : o_.dp_world - 1 - rank;
  return int64_t{m} * o_.dp_world + r;
}

std::vector<int64_t> DocumentLoader::micro_batch(int64_t epoch, int64_t k, int rank, int m) const {
  const std::vector<int64_t> order = epoch == epoch_ ? order_ : epoch_order(epoch);
  const int64_t G = int64_t{o_.dp_world} * o_.accum * o_.B;
  const int64_t at = k * G + chunk(rank, m) * o_.B;
  return {order.begin() + at, order.begin() + at + o_.B};
}

int64_t DocumentLoader::padded_length(const std::vector<int64_t>& docs) const {
  if (o_.multiple == 0) return o_.T;
  int64_t L = 0;
  for (int64_t d : docs) L = std::max(L, docs_[static_cast<size_t>(d)].len);
  L = (L + o_.multiple - 1) / o_.multiple * o_.multiple;
  return std::min<int64_t>(L, o_.T);
}

int64_t DocumentLoader::next(int32_t* inputs, int32_t* targets, int64_t* real_tokens) {
  const int64_t G = int64_t{o_.dp_world} * o_.accum * o_.B;
  const int64_t at = step_ * G + chunk(o_.dp_rank, static_cast<int>(m_)) * o_.B;
  const std::vector<int64_t> mine(order_.begin() + at, order_.begin() + at + o_.B);
  const int64_t L = padded_length(mine);
  const int64_t BT = int64_t{o_.B} * o_.T;
  std::fill(inputs, inputs + BT, 0);
  std::fill(targets, targets + BT, -1);
  int64_t real = 0;
  for (int b = 0; b < o_.B; ++b) {
    const Doc& d = docs_[static_cast<size_t>(mine[static_cast<size_t>(b)])];
    const TokenShard& sh = data_.shard(d.shard);
    sh.copy(static_cast<size_t>(d.start), static_cast<size_t>(d.len), inputs + b * L);
    sh.copy_targets(static_cast<size_t>(d.start + 1), static_cast<size_t>(d.len), targets + b * L);
    real += d.len;
  }
  if (real_tokens) *real_tokens = real;
  if (++m_ == o_.accum) {
    m_ = 0;
    if (++step_ == steps_per_epoch_) {
      step_ = 0;
      ++epoch_;
      order_ = epoch_order(epoch_);
    }
  }
  return L;
}

void DocumentLoader::reset() {
  epoch_ = step_ = m_ = 0;
  order_ = epoch_order(0);
}

}  // namespace mt
