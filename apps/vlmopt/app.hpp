// Shared CLI plumbing: global options and the registration hook each
// cmd_<verb>.cpp provides. Subcommands bind an options struct and call a library.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

namespace vlmopt::eval {
struct PruneOptions;
}

namespace vlmopt::app {

struct GlobalOptions {
  int verbosity = 0;        // -v / -q
  bool json = false;        // machine-readable result on stdout
  std::string device = "cpu";
};

// The pruning options eval and bench share: --no-prune, --prune-config, --scenario and the
// ad-hoc single-step plan (--prune-rule/-layer/-cut/-keep/-threshold/-floor/-seed/-batch-keep).
void add_prune_options(CLI::App& cmd, eval::PruneOptions& prune);

// Each subcommand registers itself: adds a CLI11 subcommand and its callback.
using Register = void (*)(CLI::App& root, const GlobalOptions& globals);
void register_inspect(CLI::App& root, const GlobalOptions& globals);
void register_datasets(CLI::App& root, const GlobalOptions& globals);
void register_eval(CLI::App& root, const GlobalOptions& globals);
void register_pipeline(CLI::App& root, const GlobalOptions& globals);
void register_verify(CLI::App& root, const GlobalOptions& globals);
void register_calibrate(CLI::App& root, const GlobalOptions& globals);
void register_compensate(CLI::App& root, const GlobalOptions& globals);
void register_bench(CLI::App& root, const GlobalOptions& globals);
void register_diagnose_align(CLI::App& root, const GlobalOptions& globals);
void register_prune_fit(CLI::App& root, const GlobalOptions& globals);

}  // namespace vlmopt::app
