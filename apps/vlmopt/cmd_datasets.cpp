// `vlmopt datasets show|pack|vocab`: binds options, calls datasets/commands.hpp, prints.
#include "app.hpp"

#include "datasets/commands.hpp"

#include <cstdio>
#include <memory>

namespace vlmopt::app {

namespace {

void print(const GlobalOptions& globals, const nlohmann::json& result, std::string (*format)(const nlohmann::json&)) {
  const std::string text = globals.json ? result.dump() + "\n" : format(result);
  std::fwrite(text.data(), 1, text.size(), stdout);
}

}  // namespace

void register_datasets(CLI::App& root, const GlobalOptions& globals) {
  CLI::App* datasets = root.add_subcommand("datasets", "Inspect dataset specs and freeze them into HDF5 packs");
  datasets->require_subcommand(1);
  datasets->footer(
      "Dataset specs: builtin:train|calib|eval|stress|clips, a LLaVA .jsonl file (images relative to its folder), "
      "or a .h5 pack. See docs/datasets.md.");

  auto show_options = std::make_shared<datasets::ShowOptions>();
  CLI::App* show = datasets->add_subcommand("show", "Print a dataset's size and its first samples");
  show->add_option("spec", show_options->spec, "Dataset spec")->required();
  show->add_option("--limit", show_options->limit, "Samples to print")->capture_default_str();
  show->add_option("--dump-dir", show_options->dump_dir, "Also write those samples' images as PNG into this folder");
  show->callback([show_options, &globals] { print(globals, datasets::show(*show_options), datasets::format_show); });

  auto pack_options = std::make_shared<datasets::PackOptions>();
  CLI::App* pack = datasets->add_subcommand("pack", "Write a dataset spec into an HDF5 pack (atomically)");
  pack->add_option("spec", pack_options->spec, "Dataset spec")->required();
  pack->add_option("output", pack_options->output, "Pack file to write (.h5)")->required();
  pack->add_option("--limit", pack_options->limit, "Pack only the first N samples");
  pack->add_option("--deflate", pack_options->deflate_level, "Image compression level, 0 (off) to 9")
      ->check(CLI::Range(0, 9))
      ->capture_default_str();
  pack->callback([pack_options, &globals] { print(globals, datasets::pack(*pack_options), datasets::format_pack); });

  CLI::App* vocab = datasets->add_subcommand("vocab", "Print the closed vocabulary of the builtin questions and answers");
  vocab->callback([&globals] { print(globals, datasets::vocab(), datasets::format_vocab); });
}

}  // namespace vlmopt::app
