// `meshtrain export` (a checkpoint as a Hugging Face model directory) and `meshtrain model-info`
// (what the engine makes of a preset or a Hugging Face config.json): argv and printing over
// checkpoint/export.h.
#include <cstdio>
#include <exception>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/export.h"
#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "train/config.h"

namespace mt::cli {

namespace {

const char* const kExportHelp =
    "usage: meshtrain export --checkpoint DIR --out DIR [--max-shard-mb N] [--adapter]\n\n"
    "Writes a checkpoint as a Hugging Face model directory that transformers loads\n"
    "(AutoModelForCausalLM.from_pretrained(DIR)): config.json (GPT2LMHeadModel or LlamaForCausalLM,\n"
    "with the norm epsilon, rope_theta, rope_scaling, tied head and position-table size of the\n"
    "model) and the fp32 weights under Hugging Face names, in model.safetensors - or, above\n"
    "--max-shard-mb, in model-00001-of-0000N.safetensors shards with model.safetensors.index.json.\n\n"
    "  --checkpoint DIR   a step_* checkpoint, or a checkpoint_dir (its latest)\n"
    "  --out DIR          output directory (created; existing files of the same names replaced)\n"
    "  --max-shard-mb N   largest safetensors file in MB (default 5000, as transformers' 5GB)\n"
    "  --adapter          a LoRA run's adapters only, in PEFT's layout (adapter_config.json,\n"
    "                     adapter_model.safetensors) for peft.PeftModel.from_pretrained on the base;\n"
    "                     without it a LoRA checkpoint exports merged weights (W + alpha/rank B A)\n";

const char* const kModelInfoHelp =
    "usage: meshtrain model-info (--hf-config config.json | --model PRESET) [--seq-len N] [--json]\n\n"
    "Prints the model the engine builds from a Hugging Face config.json (as model.hf_config does)\n"
    "or a preset: architecture, dimensions, norm epsilon, rope_theta and rope scaling with the\n"
    "resulting rotary inverse frequencies, tied head, position-table rows, parameter count; or\n"
    "the error that refuses the config.\n";

}  // namespace

int run_export_command(int argc, char** argv) {
  ArgParser ap({"checkpoint", "out", "max-shard-mb"}, {"help", "adapter"});
  if (auto done = cli_support::parse_args("export", ap, argc, argv, [] { std::fputs(kExportHelp, stdout); }))
    return *done;
  if (!ap.has("checkpoint") || !ap.has("out"))
    return cli_support::usage_error("export", "--checkpoint DIR and --out DIR are required");
  try {
    const double mb = ap.get_double("max-shard-mb", 5000);
    const auto max_bytes = static_cast<int64_t>(mb * 1e6);
    if (!(mb > 0) || max_bytes <= 0) {
      std::fprintf(stderr, "meshtrain export: --max-shard-mb must be positive\n");
      return 1;
    }
    const std::string dir = resolve_checkpoint(ap.get("checkpoint"));
    if (ap.flag("adapter")) {
      ExportResult r = export_adapter(dir, load_checkpoint_config(dir).model_config(), ap.get("out"));
      std::printf("exported %lld adapter tensors (%.1f MB) in adapter_model.safetensors and adapter_config.json to %s\n",
                  static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / 1e6, ap.get("out").c_str());
      return 0;
    }
    ExportResult r = export_checkpoint(dir, load_checkpoint_config(dir).model_config(), ap.get("out"), max_bytes);
    std::printf("exported %lld tensors (%.1f MB) in %d safetensors file%s and config.json to %s\n",
                static_cast<long long>(r.tensors), static_cast<double>(r.bytes) / 1e6, r.files, r.files == 1 ? "" : "s",
                ap.get("out").c_str());
  } catch (const CheckpointBaseMismatch& e) {  // the LoRA base is missing or other
    std::fprintf(stderr, "meshtrain export: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain export: %s\n", e.what());
    return 1;
  }
  return 0;
}

int run_model_info_command(int argc, char** argv) {
  ArgParser ap({"hf-config", "model", "seq-len"}, {"help", "json"});
  if (auto done = cli_support::parse_args("model-info", ap, argc, argv, [] { std::fputs(kModelInfoHelp, stdout); }))
    return *done;
  if (ap.has("hf-config") == ap.has("model"))
    return cli_support::usage_error("model-info", "give --hf-config FILE or --model PRESET");
  try {
    std::vector<std::pair<std::string, std::string>> ov;
    if (ap.has("hf-config")) ov.push_back({"model.hf_config", ap.get("hf-config")});
    else ov.push_back({"model.preset", ap.get("model")});
    if (ap.has("seq-len")) ov.push_back({"model.seq_len", ap.get("seq-len")});
    const nlohmann::json j = model_info_json(RunConfig::load("", ov).model_config());
    if (ap.flag("json")) {
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      for (auto it = j.begin(); it != j.end(); ++it)
        if (it.key() != "rope_inv_freq") std::printf("%-16s %s\n", it.key().c_str(), it.value().dump().c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain model-info: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace mt::cli
