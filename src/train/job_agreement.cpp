#include "train/job_agreement.h"

#include <sys/stat.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "checkpoint/sharded_checkpoint.h"
#include "data/data_loader.h"
#include "runtime/crc32c.h"

#ifndef MT_GIT_COMMIT
#define MT_GIT_COMMIT "unknown"
#endif

namespace mt {

namespace {

// Keys whose values may differ between ranks: threads (per node), where rank 0 writes its logs,
// and file paths (each node's copy may live elsewhere: their contents are compared instead).
const std::set<std::string> kPerRank = {"train.threads", "log.metrics_out", "log.trace_out", "log.print_every",
                                        "data.train",    "data.val",        "data.gpt2_dir", "data.tokenizer_file",
                                        "model.hf_config"};

std::string hex32(uint32_t v) {
  char b[16];
  std::snprintf(b, sizeof b, "%08x", v);
  return b;
}

void add_data_items(const std::string& key, const std::string& spec, JobItems* out) {
  std::vector<std::string> patterns;
  try {
    if (is_blend_spec(spec)) {
      for (const BlendEntry& e : parse_blend(spec, key)) {
        patterns.push_back(e.pattern);
        char w[32];
        std::snprintf(w, sizeof w, "%.17g", e.weight);
        out->push_back({key + " weight of " + std::filesystem::path(e.pattern).filename().string(), w});
      }
    } else {
      patterns.push_back(spec);
    }
    int i = 0;
    for (const std::string& p : patterns)
      for (const std::string& f : expand_file_pattern(p)) {
        std::string v = std::filesystem::path(f).filename().string();
        struct stat sb;
        if (::stat(f.c_str(), &sb) != 0) {
          v += ": cannot read";
        } else {
          char head[1024] = {};
          std::ifstream in(f, std::ios::binary);
          in.read(head, sizeof head);
          v += ", " + std::to_string(sb.st_size) + " bytes, header crc32c " +
               hex32(crc32c(0, head, static_cast<size_t>(in.gcount())));
        }
        out->push_back({key + " file " + std::to_string(i++), v});
      }
    out->push_back({key + " files", std::to_string(i)});
  } catch (const std::exception& e) {
    out->push_back({key, std::string("error: ") + e.what()});
  }
}

}  // namespace

std::string build_id() { return std::string("meshtrain ") + MT_GIT_COMMIT + ", compiler " + __VERSION__; }

JobItems job_items(const RunConfig& cfg, const ModelConfig& m, bool with_data) {
  JobItems out;
  std::istringstream toml(cfg.to_toml());
  std::string line, section;
  while (std::getline(toml, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') {
      section = line.substr(1, line.find(']') - 1);
      continue;
    }
    const size_t eq = line.find(" = ");
    if (eq == std::string::npos) continue;
    const std::string key = (section.empty() ? "" : section + ".") + line.substr(0, eq);
    if (!kPerRank.count(key)) out.push_back({key, line.substr(eq + 3)});
  }
  out.push_back({"model (resolved)", arch_name(m.arch) + std::string(" n_layer ") + std::to_string(m.n_layer) +
                                         " n_head " + std::to_string(m.n_head) + " n_kv_head " +
                                         std::to_string(m.n_kv_head) + " n_embd " + std::to_string(m.n_embd) +
                                         " ffn " + std::to_string(m.ffn_hidden) + " vocab " + std::to_string(m.vocab_size) +
                                         " seq " + std::to_string(m.seq_len) + " params " + std::to_string(m.num_params())});
  out.push_back({"build", build_id()});
  if (with_data) {
    add_data_items("data.train", cfg.data.train, &out);
    if (!cfg.data.val.empty() && cfg.train.eval_every > 0) add_data_items("data.val", cfg.data.val, &out);
  }
  return out;
}

void verify_same_job(comm::ProcessGroup& g, const JobItems& items, const std::string& what) {
  if (g.size() == 1) return;
  uint32_t d = 0;
  for (const auto& [k, v] : items) {
    d = crc32c(d, k.data(), k.size() + 1);  // with the terminating NUL: keys and values stay apart
    d = crc32c(d, v.data(), v.size() + 1);
  }
  const std::vector<std::string> digests = all_gather_strings(g, hex32(d));
  bool same = true;
  for (const auto& x : digests) same = same && x == digests[0];
  if (same) return;
  nlohmann::json mine = nlohmann::json::array();
  for (const auto& [k, v] : items) mine.push_back({k, v});
  const std::vector<std::string> all = all_gather_strings(g, mine.dump());
  std::vector<std::map<std::string, std::string>> per(all.size());
  std::vector<std::string> order;
  std::set<std::string> seen;
  for (size_t r = 0; r < all.size(); ++r)
    for (const auto& kv : nlohmann::json::parse(all[r])) {
      const std::string k = kv.at(0).get<std::string>();
      per[r][k] = kv.at(1).get<std::string>();
      if (seen.insert(k).second) order.push_back(k);
    }
  for (const std::string& k : order) {
    std::map<std::string, std::vector<int>> by_value;
    for (size_t r = 0; r < per.size(); ++r) {
      auto it = per[r].find(k);
      by_value[it == per[r].end() ? std::string("(not set)") : "'" + it->second + "'"].push_back(static_cast<int>(r));
    }
    if (by_value.size() < 2) continue;
    std::string msg = "ranks disagree on the " + what + ": " + k + " is";
    bool first = true;
    for (const auto& [v, ranks] : by_value) {
      std::string rs;
      for (size_t i = 0; i < ranks.size() && i < 8; ++i) rs += (i ? "," : "") + std::to_string(ranks[i]);
      if (ranks.size() > 8) rs += ",... (" + std::to_string(ranks.size()) + " ranks)";
      msg += std::string(first ? " " : "; ") + v + " on rank" + (ranks.size() > 1 ? "s " : " ") + rs;
      first = false;
    }
    throw ConfigError(msg + " (every rank must run the same job: same config, build and data)");
  }
  throw ConfigError("ranks disagree on the " + what + " (digests differ, items equal?)");
}

}  // namespace mt
