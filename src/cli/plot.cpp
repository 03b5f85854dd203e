// `meshtrain plot`: metrics files in, one SVG out (train/metrics_plot.h draws it).
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "train/metrics_plot.h"

namespace mt::cli {

namespace {

const char* kPlotHelp =
    "usage: meshtrain plot --metrics FILE[,FILE...] [--labels A[,B...]] [--out FILE.svg] [--title TEXT]\n\n"
    "Draws loss (validation loss as dots), global tokens/s and exposed communication ms against the\n"
    "step from JSON-lines metrics files (train --log.metrics_out) into one SVG; several files are\n"
    "overlaid in different colours (e.g. the same model under two strategies). Prints a one-line\n"
    "summary per run.\n\n"
    "  --metrics FILES  comma-separated metrics files\n"
    "  --labels NAMES   legend names, comma-separated (default: the file names)\n"
    "  --out FILE       SVG to write (default metrics.svg)\n"
    "  --title TEXT     title (default \"meshtrain metrics\")\n";

double mean_after_first(const std::vector<double>& v) {
  if (v.size() < 2) return v.empty() ? 0.0 : v[0];
  double s = 0;
  for (size_t i = 1; i < v.size(); ++i) s += v[i];
  return s / static_cast<double>(v.size() - 1);
}

}  // namespace

int run_plot_command(int argc, char** argv) {
  if (cli_support::wants_help(argc, argv)) {
    std::fputs(kPlotHelp, stdout);
    return 0;
  }
  try {
    ArgParser ap({"metrics", "labels", "out", "title"}, {});
    ap.parse(argc, argv);
    if (!ap.positional().empty()) throw ArgError("unexpected argument '" + ap.positional()[0] + "'");
    const std::vector<std::string> files = split_list(ap.get("metrics"));
    if (files.empty()) throw ArgError("--metrics FILE[,FILE...] is required");
    std::vector<std::string> labels = split_list(ap.get("labels"));
    if (!labels.empty() && labels.size() != files.size())
      throw ArgError("--labels has " + std::to_string(labels.size()) + " names for " + std::to_string(files.size()) +
                     " metrics files");
    std::vector<MetricsSeries> runs;
    for (size_t i = 0; i < files.size(); ++i) {
      std::string label = labels.empty() ? files[i].substr(files[i].find_last_of('/') + 1) : labels[i];
      runs.push_back(read_metrics_series(files[i], label));
      const MetricsSeries& r = runs.back();
      std::printf("%s: %zu steps (%g..%g), loss %.4f -> %.4f", label.c_str(), r.step.size(), r.step.front(),
                  r.step.back(), r.loss.front(), r.loss.back());
      if (!r.val_loss.empty()) std::printf(", last val %.4f", r.val_loss.back());
      std::printf(", %.0f tokens/s (mean after the first step), exposed comm %.1f ms/step\n",
                  mean_after_first(r.tokens_per_s), mean_after_first(r.exposed_comm_ms));
    }
    const std::string out = ap.get("out", "metrics.svg");
    std::ofstream f(out, std::ios::trunc);
    f << metrics_svg(runs, ap.get("title", "meshtrain metrics"));
    f.flush();
    if (!f) throw std::runtime_error("cannot write " + out);
    std::printf("wrote %s\n", out.c_str());
    return 0;
  } catch (const ArgError& e) {
    return cli_support::usage_error("plot", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain plot: %s\n", e.what());
    return 1;
  }
}

}  // namespace mt::cli
