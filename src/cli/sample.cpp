// `meshtrain sample`: loads a checkpoint or safetensors weights and prints generated text
// (train/sampler.h generates).
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>

#include "checkpoint/checkpoint.h"
#include "cli/arg_parser.h"
#include "cli/cli_support.h"
#include "cli/commands.h"
#include "data/tokenizer.h"
#include "train/config.h"
#include "train/sampler.h"

namespace mt::cli {

namespace {

const char* const kSampleHelp =
    "usage: meshtrain sample --checkpoint DIR [--prompt S] [--tokens N] [--temperature T] [--top-k K]\n"
    "                        [--seed S] [--tokenizer byte|gpt2|hf] [--gpt2-dir DIR] [--tokenizer-file F]\n"
    "                        [--threads N]\n"
    "       meshtrain sample --weights FILE.safetensors --model PRESET [same options]\n\n"
    "Generates text from a checkpoint written by `meshtrain train` (a step_* directory, or the\n"
    "checkpoint_dir itself, which means its latest checkpoint), or from a safetensors file of weights\n"
    "with Hugging Face names (a checkpoint's model.safetensors, or e.g. Hugging Face's GPT-2\n"
    "model.safetensors with --model gpt2-124m --tokenizer gpt2).\n\n"
    "  --checkpoint DIR   checkpoint to load\n"
    "  --weights FILE     or: weights to load, for the model --model names (a preset)\n"
    "  --model PRESET     the model of --weights (see `meshtrain train --help` for the presets)\n"
    "  --prompt S         text to continue (default: a newline, or <|endoftext|> for gpt2)\n"
    "  --tokens N         tokens to generate (default 256)\n"
    "  --temperature T    softmax temperature; 0 = greedy (default 0.8)\n"
    "  --top-k K          sample among the K most likely tokens; 0 = all (default 40)\n"
    "  --seed S           sampling seed (default 42)\n"
    "  --tokenizer NAME   override the checkpoint's tokenizer (byte | gpt2 | gpt2:N | hf; with --weights the\n"
    "                     default is gpt2 for a vocabulary of 50257 or more, else byte)\n"
    "  --gpt2-dir DIR     where encoder.json and vocab.bpe are (gpt2; default: the repository's assets/gpt2)\n"
    "  --tokenizer-file F the tokenizer.json of --tokenizer hf (default: the checkpoint's data.tokenizer_file)\n";

}  // namespace

int run_sample_command(int argc, char** argv) {
  ArgParser ap({"checkpoint", "weights", "model", "prompt", "tokens", "temperature", "top-k", "seed", "tokenizer",
                "gpt2-dir", "tokenizer-file", "threads"},
               {"help"});
  if (auto done = cli_support::parse_args("sample", ap, argc, argv, [] { std::fputs(kSampleHelp, stdout); }))
    return *done;
  if (ap.has("checkpoint") == ap.has("weights") || ap.has("weights") != ap.has("model"))
    return cli_support::usage_error("sample", "give --checkpoint DIR, or --weights FILE with --model PRESET");
  try {
    ModelConfig mc;
    std::string tok_default, gdir_default, tfile_default;
    std::unique_ptr<Transformer> model;
    if (ap.has("checkpoint")) {
      std::string dir;
      try {
        if (!std::filesystem::exists(ap.get("checkpoint")))
          throw std::runtime_error("--checkpoint " + ap.get("checkpoint") +
                                   " does not exist (training writes one when train.checkpoint_dir is set; "
                                   "scripts/quickstart.sh writes data/kjv/checkpoint)");
        dir = resolve_checkpoint(ap.get("checkpoint"));
      } catch (const std::runtime_error& e) {
        std::fprintf(stderr, "meshtrain sample: %s\n", e.what());
        return 2;
      }
      const RunConfig rc = load_checkpoint_config(dir);
      mc = rc.model_config();
      model = std::make_unique<Transformer>(mc, DType::F32);
      load_checkpoint(dir, *model, model->weights().f32(), nullptr, nullptr);
      tok_default = rc.data.tokenizer;
      gdir_default = rc.data.gpt2_dir;
      tfile_default = rc.data.tokenizer_file;
    } else {
      mc = model_preset(ap.get("model"));
      mc.resolve();
      model = std::make_unique<Transformer>(mc, DType::F32);
      import_weights(ap.get("weights"), *model, model->weights().f32());
      tok_default = mc.vocab_size >= 50257 ? "gpt2" : "byte";
    }
    model->sync_compute_weights();
    std::string tok_name = ap.get("tokenizer", tok_default);
    std::string gdir = ap.get("gpt2-dir", gdir_default);
    auto tok = make_tokenizer(tok_name, gdir, ap.get("tokenizer-file", tfile_default));
    if (tok->vocab_size() > mc.vocab_size)
      throw std::runtime_error("tokenizer " + tok_name + " has " + std::to_string(tok->vocab_size()) +
                               " tokens but the model only " + std::to_string(mc.vocab_size));
    std::string prompt = ap.get("prompt", "");
    std::vector<int32_t> ids = tok->encode(prompt);
    if (ids.empty()) ids.push_back(tok->eot_token() >= 0 ? tok->eot_token() : static_cast<int32_t>('\n'));
    SampleOptions so;
    so.tokens = ap.get_int("tokens", 256);
    so.temperature = static_cast<float>(ap.get_double("temperature", 0.8));
    so.top_k = ap.get_int("top-k", 40);
    so.seed = static_cast<uint64_t>(ap.get_int("seed", 42));
    auto out = generate(*model, ids, so, tok->eot_token());
    std::cout << tok->decode(out) << std::endl;
  } catch (const CheckpointBaseMismatch& e) {  // the LoRA base is missing or other
    std::fprintf(stderr, "meshtrain sample: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "meshtrain sample: %s\n", e.what());
    return 1;
  }
  return 0;
}

}  // namespace mt::cli
