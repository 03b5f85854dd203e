// `meshtrain train`: parses the config and overrides, sets up a dry run or --auto, and runs the
// Trainer (train/trainer.h); errors end the whole job with a message naming the rank.
#include <cstdio>
#include <filesystem>
#include <string>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "checkpoint/checkpoint.h"
#include "comm/world.h"
#include "model/config/model_config.h"
#include "train/config.h"
#include "train/auto_plan.h"
#include "train/trainer.h"

namespace mt::cli {

namespace {

// Reports an error. In a multi-rank job the whole job is ended (MPI_Abort via World::abort, which
// names this rank and dumps its recent collectives) so no rank is left waiting in a collective.
int fail(const std::string& msg, int code) {
  if (comm::World::initialized() && comm::World::get().size() > 1 && !comm::World::get().is_meta())
    comm::World::get().abort("meshtrain train: " + msg, code);
  std::fprintf(stderr, "meshtrain train: %s\n", msg.c_str());
  return code;
}

void print_help() {
  std::printf(
      "usage: meshtrain train [--config FILE] [--section.key value ...]\n\n"
      "Trains a GPT-2 or Llama-style model. Run it directly for one process, or under mpirun\n"
      "(or `meshtrain launch -n N -- train ...`) where each process is one rank.\n"
      "The config is TOML with sections [model] [data] [train] [parallel] [lora] [log]; any key can be\n"
      "overridden on the command line as --section.key value or --section.key=value.\n"
      "--auto lets the planner choose parallel.strategy, dp_replicate / dp_shard, activation\n"
      "checkpointing and the micro-batch split for the ranks the job was given, keeping the global\n"
      "batch (micro_batch x grad_accum x ranks sequences).\n"
      "--dry-run --world N [--rank R] builds rank R (default 0) of an N-rank job on the count-only\n"
      "Meta backend - no MPI, no data files, no tensor memory - runs one training step, and prints\n"
      "(and with --log.metrics_out writes) that rank's exact memory by category and bytes by group:\n"
      "what a real run of the same config on N ranks reports for it. Any model size.\n\n"
      "keys (default value, meaning):\n%s\n"
      "model presets: ",
      RunConfig::keys_help().c_str());
  for (const auto& n : model_preset_names()) std::printf("%s ", n.c_str());
  std::printf("\n");
}

// The config file: a readable regular file.
void check_config_path(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return;
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw ConfigError("the config file " + path + " does not exist (configs/ holds examples: configs/quickstart.toml)");
  if (fs::is_directory(path, ec))
    throw ConfigError(path + " is a directory; --config takes a TOML file such as configs/quickstart.toml");
}

}  // namespace

int run_train_command(int argc, char** argv) {
  ArgParser ap({"config", "model.*", "data.*", "train.*", "parallel.*", "lora.*", "log.*", "world", "rank"},
               {"help", "auto", "dry-run"});
  if (auto done = cli_support::parse_args("train", ap, argc, argv, print_help)) return *done;
  try {
    check_config_path(ap.get("config"));
    RunConfig cfg = RunConfig::load(ap.get("config"), ap.dotted());
    if (ap.flag("dry-run")) {
      if (!ap.has("world")) throw ConfigError("--dry-run needs --world N (the job's number of ranks)");
      prepare_dry_run(cfg, static_cast<int>(ap.get_int("world", 0)), static_cast<int>(ap.get_int("rank", 0)));
    } else if (ap.has("world") || ap.has("rank")) {
      throw ConfigError("--world and --rank go with --dry-run (a real job's ranks come from mpirun)");
    }
    if (ap.flag("auto")) choose_layout(cfg);
    train(cfg);
  } catch (const JobConfigError& e) {
    // Every rank found it together: rank 0 says it once and the job ends without an abort.
    const bool world = comm::World::initialized() && !comm::World::get().is_meta();
    if (!world || comm::World::get().rank() == 0) std::fprintf(stderr, "meshtrain train: config error: %s\n", e.what());
    if (world) comm::World::get().finalize();
    return 2;
  } catch (const ConfigError& e) {
    return fail(std::string("config error: ") + e.what(), 2);
  } catch (const CheckpointModelMismatch& e) {
    return fail(std::string("config error: ") + e.what(), 2);
  } catch (const CheckpointBaseMismatch& e) {
    return fail(std::string("config error: ") + e.what(), 2);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
  if (comm::World::initialized()) comm::World::get().finalize();
  return 0;
}

}  // namespace mt::cli
