// vlmopt entry point: global options, subcommand registration, and the one
// place where errors become a single stderr line and an exit code (docs/cli.md).
#include "app.hpp"

#include "util/error.hpp"
#include "util/log.hpp"
#include "util/version.hpp"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  using vlmopt::ExitCode;
  vlmopt::app::GlobalOptions globals;
  CLI::App root{"vlmopt: optimize vision-language model checkpoints into deployable bundles"};
  root.name("vlmopt");
  root.require_subcommand(1);
  root.fallthrough();
  root.set_version_flag("--version", std::string("vlmopt ") + vlmopt::kVersion);
  root.add_flag_function("-v,--verbose", [&](std::int64_t n) { globals.verbosity += static_cast<int>(n); },
                         "More diagnostics on stderr (repeat for trace)");
  root.add_flag_function("-q,--quiet", [&](std::int64_t) { globals.verbosity = -1; }, "Only warnings and errors on stderr");
  root.add_flag("--json", globals.json, "Print the result as one JSON object on stdout");
  root.add_option("--device", globals.device, "Compute device")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  root.parse_complete_callback([&] { vlmopt::log::init(globals.verbosity); });

  using namespace vlmopt::app;
  for (auto reg : {register_inspect, register_datasets, register_calibrate, register_compensate, register_eval, register_verify,
                   register_bench, register_diagnose_align, register_prune_fit, register_pipeline})
    reg(root, globals);

  try {
    root.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help / --version print and exit 0; every usage error is one line and exit 2.
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return root.exit(e);
    std::fprintf(stderr, "vlmopt: usage error: %s (see --help)\n", e.what());
    return static_cast<int>(ExitCode::kUsage);
  } catch (const vlmopt::Error& e) {
    std::fprintf(stderr, "vlmopt: error: %s\n", e.what());
    return static_cast<int>(e.code());
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "vlmopt: error: %s\n", e.what_without_backtrace());
    return static_cast<int>(ExitCode::kFailure);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vlmopt: error: %s\n", e.what());
    return static_cast<int>(ExitCode::kFailure);
  }
  return 0;
}
