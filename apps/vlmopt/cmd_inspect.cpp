#include "app.hpp"
namespace vlmopt::app {
void register_inspect(CLI::App& root, const GlobalOptions&) { root.add_subcommand("inspect", "Summarize a model, checkpoint or vlmopt file"); }
}
