#include "checkpoint/checkpoint_saver.h"

#include <cstdio>
#include <filesystem>
#include <stdexcept>

#include "runtime/clock.h"
#include "runtime/memory.h"

namespace fs = std::filesystem;

namespace mt {

std::string CheckpointSaver::rank_file_name(int rank) {
  char b[48];
  std::snprintf(b, sizeof b, "rank_%05d.safetensors", rank);
  return b;
}

CheckpointSaver::CheckpointSaver(ModelState& state, const Transformer& ref, comm::ProcessGroup& group, int rank,
                                 std::string root, bool async, RunRecord run, nlohmann::json layout,
                                 std::map<std::string, std::string> file_meta)
    : state_(state), ref_(ref), g_(group), rank_(rank), root_(std::move(root)), async_(async), run_(std::move(run)),
      layout_(std::move(layout)), file_meta_(std::move(file_meta)) {}

CheckpointSaver::~CheckpointSaver() {
  if (thread_.joinable()) thread_.join();
  if (staging_) mem_free(staging_, staging_size_, MemCategory::Workspace);
  if (pending_ && rank_ == 0 && !tmp_dir_.empty()) {
    std::error_code ec;
    fs::remove_all(tmp_dir_, ec);  // an uncommitted save (the job failed): nothing half-written stays
  }
}

void CheckpointSaver::write_file(const float* staging) {
  auto t0 = Clock::now();
  try {
    std::map<std::string, std::string> meta = file_meta_;
    meta["format"] = "meshtrain-sharded";
    meta["step"] = std::to_string(st_.step);
    meta["micro_batches"] = std::to_string(st_.micro_batches);
    const std::string name = rank_file_name(rank_);
    RankFileWriter w((fs::path(tmp_dir_) / name).string(), ref_, pieces_, meta);
    HostBuffer unit;
    const float* p = staging;
    for (int u = 0; u < ref_.num_units(); ++u) {
      const int64_t n = state_.owned_numel(u);
      if (n == 0) continue;
      const float* base = p;
      if (!staging) {  // synchronous: one unit's owned state at a time
        float* b = unit.reserve(static_cast<size_t>(3 * n));
        state_.snapshot_unit(u, b, b + n, b + 2 * n);
        base = b;
      } else {
        p += 3 * n;
      }
      w.write_unit(u, base, base + n, base + 2 * n);
    }
    RankFileResult r = w.finish();
    result_ = {{"name", name}, {"bytes", r.bytes}, {"crc32c", ""}, {"pieces", std::move(r.pieces)}};
    char crc[16];
    std::snprintf(crc, sizeof crc, "%08x", r.crc);
    result_["crc32c"] = crc;
  } catch (const std::exception& e) {
    error_ = std::string("writing its checkpoint file: ") + e.what();
  }
  write_ms_ = ms_since(t0);
  done_.store(true, std::memory_order_release);
}

void CheckpointSaver::save(const TrainerState& st) {
  finish();  // at most one save in flight
  auto t0 = Clock::now();
  st_ = st;
  tmp_dir_ = (fs::path(root_) / (".tmp-" + step_dir_name(st.step))).string();
  std::string err;
  if (rank_ == 0) {
    try {
      fs::create_directories(root_);
      fs::remove_all(tmp_dir_);
      fs::create_directories(tmp_dir_);
    } catch (const std::exception& e) {
      err = e.what();
    }
  }
  err = agree_on_error(g_, err);  // the directory exists before any rank writes into it
  if (!err.empty()) throw std::runtime_error("checkpoint of step " + std::to_string(st.step) + ": " + err);
  pieces_ = state_.owned_pieces();
  error_.clear();
  result_ = nlohmann::json();
  done_.store(false);
  pending_ = true;
  if (!async_) {
    write_file(nullptr);
    stats_.stall_ms += ms_since(t0);
    commit();
    return;
  }
  // Async: snapshot this rank's state into the staging buffer, write it in the background.
  size_t need = 0;
  for (int u = 0; u < ref_.num_units(); ++u) need += static_cast<size_t>(3 * state_.owned_numel(u));
  need *= sizeof(float);
  if (need > staging_size_) {
    if (staging_) mem_free(staging_, staging_size_, MemCategory::Workspace);
    staging_ = static_cast<float*>(mem_alloc(need, MemCategory::Workspace));
    staging_size_ = need;
  }
  stats_.staging_bytes = std::max<int64_t>(stats_.staging_bytes, static_cast<int64_t>(staging_size_));
  float* p = staging_;
  for (int u = 0; u < ref_.num_units(); ++u) {
    const int64_t n = state_.owned_numel(u);
    if (n == 0) continue;
    state_.snapshot_unit(u, p, p + n, p + 2 * n);
    p += 3 * n;
  }
  thread_ = std::thread([this] { write_file(staging_); });
  stats_.stall_ms += ms_since(t0);
}

void CheckpointSaver::poll() {
  if (!pending_) return;
  auto t0 = Clock::now();
  float busy = done_.load(std::memory_order_acquire) ? 0.0f : 1.0f;  // max over ranks: any still writing
  if (g_.size() > 1) g_.all_reduce(&busy, 1, DType::F32, comm::ReduceOp::Max)->wait();
  stats_.stall_ms += ms_since(t0);
  if (busy == 0.0f) commit();
}

void CheckpointSaver::finish(bool at_end) {
  if (!pending_) return;
  const double before = stats_.stall_ms;
  commit();
  if (at_end) {
    stats_.final_wait_ms += stats_.stall_ms - before;
    stats_.stall_ms = before;
  }
}

void CheckpointSaver::commit() {
  auto t0 = Clock::now();
  if (thread_.joinable()) thread_.join();
  stats_.write_ms += write_ms_;
  std::string err = agree_on_error(g_, error_);
  if (err.empty()) {
    const std::vector<std::string> all = all_gather_strings(g_, result_.dump());
    if (rank_ == 0) {
      try {
        std::vector<nlohmann::json> files;
        for (const auto& s : all) files.push_back(nlohmann::json::parse(s));
        commit_sharded(root_, tmp_dir_, st_.step, ref_, files, layout_, st_, run_);
      } catch (const std::exception& e) {
        err = std::string("committing: ") + e.what();
      }
    }
    err = agree_on_error(g_, err);  // every rank knows whether the checkpoint exists
  }
  if (err.empty()) {
    stats_.bytes_written += result_.value("bytes", int64_t{0});
    ++stats_.saves;
    pending_ = false;
  }
  stats_.stall_ms += ms_since(t0);
  if (!err.empty()) {
    if (rank_ == 0) {
      std::error_code ec;
      fs::remove_all(tmp_dir_, ec);
    }
    pending_ = false;
    throw std::runtime_error("checkpoint of step " + std::to_string(st_.step) + " failed: " + err +
                             " (the previous checkpoint is intact)");
  }
}

}  // namespace mt
