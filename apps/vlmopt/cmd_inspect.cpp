// `vlmopt inspect PATH`: binds the path and prints bundle::inspect's summary.
#include "app.hpp"

#include "bundle/inspect.hpp"
#include "util/paths.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_inspect(CLI::App& root, const GlobalOptions& globals) {
  auto path = std::make_shared<std::string>();
  auto* cmd = root.add_subcommand("inspect", "Summarize a model directory, a .safetensors file or an MP-Cache file");
  cmd->add_option("path", *path, "HF model directory (or 'builtin') or .safetensors file")->required();
  cmd->callback([path, &globals] {
    const auto summary = bundle::inspect(*path == "builtin" ? vlmopt::builtin_model_dir() : std::filesystem::path(*path));
    if (globals.json) {
      std::puts(summary.dump().c_str());
    } else {
      std::fputs(bundle::format_inspect(summary).c_str(), stdout);
    }
  });
}

}  // namespace vlmopt::app
