// `vlmopt verify B [--json]`: checks a bundle; exit 4 (GateError) naming the first problem.
#include "app.hpp"

#include "bundle/verify.hpp"
#include "util/error.hpp"

#include <cstdio>

namespace vlmopt::app {

void register_verify(CLI::App& root, const GlobalOptions& globals) {
  auto bundle = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  auto* cmd = root.add_subcommand("verify", "Check a bundle: manifest hashes, config, tensor shapes and dtypes");
  cmd->add_option("bundle", *bundle, "Bundle directory")->required();
  cmd->add_flag("--json", *json, "Print {\"ok\": ..., \"problems\": [...]} on stdout");
  cmd->callback([bundle, json, &globals] {
    const auto result = bundle::verify_bundle(*bundle);
    if (*json || globals.json) {
      std::puts(result.to_json().dump().c_str());
    } else if (result.ok()) {
      std::printf("%s: ok\n", bundle->c_str());
    } else {
      for (const auto& p : result.problems) std::printf("problem: %s\n", p.c_str());
    }
    if (!result.ok())
      throw GateError(fmt::format("{}: {} problem(s), first: {}", *bundle, result.problems.size(), result.problems.front()));
  });
}

}  // namespace vlmopt::app
