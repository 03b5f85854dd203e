// `meshtrain compare`: runs one config twice (child processes of this binary, through `launch` on
// several ranks) and compares their losses and gradient norms step by step
// (train/report_compare.h).

#include <cstdio>
#include <filesystem>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "runtime/process.h"
#include "train/config.h"
#include "train/report_compare.h"


namespace mt::cli {

namespace {

const char* kCompareHelp =
    "usage: meshtrain compare --config FILE --a \"OVERRIDES\" --b \"OVERRIDES\" [--ranks N] [--steps N]\n"
    "                         [--dir DIR]\n\n"
    "Trains the config twice, once with each set of overrides (\"--parallel.strategy FULL_SHARD\" or\n"
    "\"parallel.strategy=FULL_SHARD\", several separated by spaces), on the same ranks, and compares\n"
    "the loss and the gradient norm of every step, then the final weights (each run saves a checkpoint\n"
    "in DIR, exported to safetensors). The tolerance follows train.dtype: fp32 runs may\n"
    "differ only by the order of sums (relative 1e-4 + absolute 1e-6), bf16 runs by bf16 rounding\n"
    "(relative 2e-2 + absolute 1e-3); the final weights ten times the relative part, against each\n"
    "tensor's largest value (Adam turns a rounding difference in a near-zero gradient into a step of\n"
    "up to the learning rate). Exit 0 when every step and the weights agree, 1 when not (the first\n"
    "diverging step is named), 2 on bad options or a run that fails.\n\n"
    "  --config FILE  the run's TOML config (docs/training.md)\n"
    "  --a, --b       overrides of run A and run B\n"
    "  --ranks N      ranks of each run (default 1; > 1 runs through `meshtrain launch`)\n"
    "  --steps N      train.steps of each run (default: the config's)\n"
    "  --dir DIR      where the runs' metrics and output go (default: a new directory under /tmp)\n";

// "--k v k2=v2" -> {"--k", "v", "--k2", "v2"}.
std::vector<std::string> override_args(const std::string& text, const char* which) {
  std::istringstream in(text);
  std::vector<std::string> out;
  for (std::string tok; in >> tok;) {
    const size_t eq = tok.find('=');
    if (tok.rfind("--", 0) == 0 || out.size() % 2 == 1) {
      out.push_back(tok);
    } else if (eq != std::string::npos) {
      out.push_back("--" + tok.substr(0, eq));
      out.push_back(tok.substr(eq + 1));
    } else {
      throw ArgError(std::string("--") + which + ": '" + tok + "' is neither --section.key VALUE nor section.key=VALUE");
    }
  }
  if (out.size() % 2) throw ArgError(std::string("--") + which + ": '" + out.back() + "' needs a value");
  return out;
}

std::vector<std::pair<std::string, std::string>> as_pairs(const std::vector<std::string>& args) {
  std::vector<std::pair<std::string, std::string>> p;
  for (size_t i = 0; i + 1 < args.size(); i += 2) p.emplace_back(args[i].substr(2), args[i + 1]);
  return p;
}

int compare_body(int argc, char** argv) {
  ArgParser ap({"config", "a", "b", "ranks", "steps", "dir"}, {});
  try {
    ap.parse(argc, argv);
    if (!ap.positional().empty()) throw ArgError("unexpected argument '" + ap.positional()[0] + "'");
    if (ap.get("config").empty()) throw ArgError("--config FILE is required");
    if (!ap.has("a") || !ap.has("b")) throw ArgError("--a \"OVERRIDES\" and --b \"OVERRIDES\" are required");
  } catch (const ArgError& e) {
    return cli_support::usage_error("compare", e.what());
  }
  const long long ranks = ap.get_int("ranks", 1), steps = ap.get_int("steps", 0);
  if (ranks < 1) return cli_support::usage_error("compare", "--ranks must be at least 1");
  std::vector<std::string> ov[2];
  std::string dtype[2];
  for (int i = 0; i < 2; ++i) {
    const char* which = i ? "b" : "a";
    try {
      ov[i] = override_args(ap.get(which), which);
    } catch (const ArgError& e) {
      return cli_support::usage_error("compare", e.what());
    }
    if (steps > 0) ov[i].insert(ov[i].end(), {"--train.steps", std::to_string(steps)});
    dtype[i] = RunConfig::load(ap.get("config"), as_pairs(ov[i])).train.dtype;  // config errors: exit 2
  }
  const Tolerance tol = tolerance_for(dtype[0] == "bf16" || dtype[1] == "bf16" ? "bf16" : "fp32");
  std::string dir = ap.get("dir");
  if (dir.empty()) {
    char tmpl[] = "/tmp/meshtrain_compare_XXXXXX";
    if (!mkdtemp(tmpl)) throw std::runtime_error("cannot create a directory under /tmp");
    dir = tmpl;
  }
  std::filesystem::create_directories(dir);
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  RunMetrics runs[2];
  for (int i = 0; i < 2; ++i) {
    const std::string name = i ? "b" : "a", metrics = dir + "/" + name + ".jsonl", log = dir + "/" + name + ".log";
    std::vector<std::string> cmd{self};
    if (ranks > 1) cmd.insert(cmd.end(), {"launch", "-n", std::to_string(ranks), "--"});
    cmd.insert(cmd.end(), {"train", "--config", ap.get("config")});
    cmd.insert(cmd.end(), ov[i].begin(), ov[i].end());
    const std::string ckpt = dir + "/" + name + ".ckpt";
    std::filesystem::remove_all(ckpt);  // never resume from an earlier comparison's checkpoint
    cmd.insert(cmd.end(), {"--log.metrics_out", metrics, "--train.checkpoint_dir", ckpt, "--train.checkpoint_every", "0",
                           "--train.sample_tokens", "0"});
    std::fprintf(stderr, "run %s: %s (output in %s)\n", name.c_str(), ap.get(name.c_str()).c_str(), log.c_str());
    const int rc = run_logged(cmd, log);
    if (rc != 0) {
      std::fprintf(stderr, "meshtrain compare: run %s failed (exit %d); its output is in %s\n", name.c_str(), rc,
                   log.c_str());
      return 2;
    }
    runs[i] = read_run_metrics(metrics, name);
    const std::string step_dir = resolve_checkpoint(ckpt);
    export_checkpoint(step_dir, load_checkpoint_config(step_dir).model_config(), dir + "/" + name + ".hf",
                      std::numeric_limits<int64_t>::max());
  }
  Comparison c = compare_runs(runs[0], runs[1], tol);
  c.weight_tol = weight_tolerance(tol);
  c.weights = compare_weights(dir + "/a.hf/model.safetensors", dir + "/b.hf/model.safetensors", c.weight_tol);
  std::fputs(c.text(tol, ap.get("a"), ap.get("b")).c_str(), stdout);
  return c.equal() ? 0 : 1;
}

}  // namespace

int run_compare_command(int argc, char** argv) {
  return cli_support::run("compare", kCompareHelp, compare_body, argc, argv);
}

}  // namespace mt::cli
