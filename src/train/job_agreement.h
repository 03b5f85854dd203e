// Every rank runs the same job. On a multi-node job each node reads its own copy of the config
// and the data; a rank that got another micro-batch, learning rate or data shard trains a wrong
// average with collectives of equal sizes (no desync check can see it). At start-up every rank
// describes its job as (key, value) items - the resolved configuration except the keys that are
// legitimately per rank, the meshtrain build, every data shard's name, size and header - and the
// ranks compare a digest of them; when digests differ they compare the items and the job stops
// before the first step, naming the key and the value on each disagreeing rank.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "comm/process_group.h"
#include "model/config/model_config.h"
#include "train/config.h"

namespace mt {

using JobItems = std::vector<std::pair<std::string, std::string>>;

// The items of this rank's job (with_data: also the data shards' digests; a file that cannot be
// read becomes an item saying so, so the ranks still meet in the comparison).
JobItems job_items(const RunConfig& cfg, const ModelConfig& model, bool with_data);
// The build: git commit at configure time and compiler.
std::string build_id();
// Collective over `g`: throws ConfigError naming the first key whose value differs between ranks
// and each rank's value (ranks grouped by value) unless every rank passed the same items. `what`
// names the check in the message ("configuration", "resumed checkpoint").
void verify_same_job(comm::ProcessGroup& g, const JobItems& items, const std::string& what);

}  // namespace mt
