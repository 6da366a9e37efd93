#include "model/prune_config.hpp"

#include "io/atomic_file.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <set>

namespace vlmopt::model {

namespace {

using json = nlohmann::json;

std::string type_name(const json& j) { return j.type_name(); }

// Object fields of `j` must be among `known`; `where` names the object.
void reject_unknown(const json& j, const std::string& where, std::initializer_list<const char*> known) {
  for (const auto& [key, value] : j.items()) {
    const bool ok = std::any_of(known.begin(), known.end(), [&](const char* k) { return key == k; });
    VLMOPT_CHECK_INPUT(ok, "{}: {}: unknown field (expected one of: {})", where, key, fmt::join(known, ", "));
  }
}

const json& require(const json& j, const std::string& where, const char* key) {
  const auto it = j.find(key);
  VLMOPT_CHECK_INPUT(it != j.end(), "{}: {}: expected a value, got nothing (missing)", where, key);
  return *it;
}

double number_in(const json& j, const std::string& where, const std::string& field, double lo, double hi) {
  VLMOPT_CHECK_INPUT(j.is_number(), "{}: {}: expected a number, got {}", where, field, type_name(j));
  const double v = j.get<double>();
  VLMOPT_CHECK_INPUT(std::isfinite(v) && v >= lo && v <= hi, "{}: {}: expected a number in [{}, {}], got {}", where,
                     field, lo, hi, v);
  return v;
}

double optional_number(const json& j, const std::string& where, const char* key, double fallback, double lo,
                       double hi) {
  const auto it = j.find(key);
  return it == j.end() ? fallback : number_in(*it, where, key, lo, hi);
}

PruneStep parse_step(const json& j, const std::string& where) {
  VLMOPT_CHECK_INPUT(j.is_object(), "{}: expected an object, got {}", where, type_name(j));
  reject_unknown(j, where, {"after_layer", "threshold", "keep_ratio", "cut"});
  PruneStep step;
  const auto& layer = require(j, where, "after_layer");
  VLMOPT_CHECK_INPUT(layer.is_number_integer() && layer.get<int64_t>() >= 0 && layer.get<int64_t>() < 100000,
                     "{}: after_layer: expected a layer index >= 0, got {}", where, layer.dump());
  step.after_layer = layer.get<int64_t>();
  step.threshold = optional_number(j, where, "threshold", 1.0, 0.0, 1e9);
  step.keep_ratio = optional_number(j, where, "keep_ratio", 1.0, 0.0, 1.0);
  if (const auto it = j.find("cut"); it != j.end()) {
    VLMOPT_CHECK_INPUT(it->is_string(), "{}: cut: expected a string, got {}", where, type_name(*it));
    step.cut = parse_prune_cut(it->get<std::string>(), where + ": cut");
  }
  return step;
}

json step_json(const PruneStep& s) {
  return {{"after_layer", s.after_layer},
          {"threshold", s.threshold},
          {"keep_ratio", s.keep_ratio},
          {"cut", std::string(prune_cut_name(s.cut))}};
}

}  // namespace

double KeepPolicy::cap(double mem_pressure, double l2_miss_rate) const {
  return std::clamp(std::max(floor, 1.0 - a * mem_pressure - b * l2_miss_rate), 0.0, 1.0);
}

PrunePlan PruneConfig::plan(const std::string& scenario, const HardwareState* hw) const {
  const std::string name = scenario.empty() ? default_scenario : scenario;
  const auto it = scenarios.find(name);
  if (it == scenarios.end()) {
    std::vector<std::string> names;
    for (const auto& [n, s] : scenarios) names.push_back(n);
    throw InputError(fmt::format("prune.json: scenarios: expected one of {}, got '{}'", fmt::join(names, ", "), name));
  }
  const auto& state = hw != nullptr ? *hw : hardware;
  PrunePlan out;
  out.rule = rule;
  out.steps = it->second.steps;
  out.min_keep = policy.floor;
  out.max_keep = policy.cap(state.mem_pressure, state.l2_miss_rate);
  out.batch_keep = policy.batch_keep;
  out.seed = seed;
  return out;
}

nlohmann::json PruneConfig::to_json() const {
  json scen = json::object();
  for (const auto& [name, s] : scenarios) {
    json steps = json::array();
    for (const auto& step : s.steps) steps.push_back(step_json(step));
    scen[name] = {{"steps", steps}};
  }
  return {{"format", kPruneFormat},
          {"version", kPruneVersion},
          {"rule", std::string(prune_rule_name(rule))},
          {"policy",
           {{"floor", policy.floor},
            {"a", policy.a},
            {"b", policy.b},
            {"batch_keep", std::string(batch_keep_name(policy.batch_keep))}}},
          {"hardware", {{"mem_pressure", hardware.mem_pressure}, {"l2_miss_rate", hardware.l2_miss_rate}}},
          {"default_scenario", default_scenario},
          {"scenarios", scen},
          {"seed", seed},
          {"fit", fit}};
}

PruneConfig prune_config_from_json(const nlohmann::json& j, const std::string& where) {
  VLMOPT_CHECK_INPUT(j.is_object(), "{}: expected a JSON object, got {}", where, type_name(j));
  reject_unknown(j, where,
                 {"format", "version", "rule", "policy", "hardware", "default_scenario", "scenarios", "seed", "fit"});
  const auto& format = require(j, where, "format");
  VLMOPT_CHECK_INPUT(format.is_string() && format.get<std::string>() == kPruneFormat, "{}: format: expected \"{}\", got {}",
                     where, kPruneFormat, format.dump());
  const auto& version = require(j, where, "version");
  VLMOPT_CHECK_INPUT(version.is_number_integer() && version.get<int64_t>() == kPruneVersion,
                     "{}: version: expected {}, got {}", where, kPruneVersion, version.dump());
  PruneConfig c;
  const auto& rule = require(j, where, "rule");
  VLMOPT_CHECK_INPUT(rule.is_string(), "{}: rule: expected a string, got {}", where, type_name(rule));
  c.rule = parse_prune_rule(rule.get<std::string>(), where + ": rule");
  if (const auto it = j.find("policy"); it != j.end()) {
    const std::string w = where + ": policy";
    VLMOPT_CHECK_INPUT(it->is_object(), "{}: expected an object, got {}", w, type_name(*it));
    reject_unknown(*it, w, {"floor", "a", "b", "batch_keep"});
    c.policy.floor = optional_number(*it, w, "floor", c.policy.floor, 0.0, 1.0);
    c.policy.a = optional_number(*it, w, "a", c.policy.a, 0.0, 1e3);
    c.policy.b = optional_number(*it, w, "b", c.policy.b, 0.0, 1e3);
    if (const auto mode = it->find("batch_keep"); mode != it->end()) {
      VLMOPT_CHECK_INPUT(mode->is_string(), "{}: batch_keep: expected a string, got {}", w, type_name(*mode));
      c.policy.batch_keep = parse_batch_keep(mode->get<std::string>(), w + ": batch_keep");
    }
  }
  if (const auto it = j.find("hardware"); it != j.end()) {
    const std::string w = where + ": hardware";
    VLMOPT_CHECK_INPUT(it->is_object(), "{}: expected an object, got {}", w, type_name(*it));
    reject_unknown(*it, w, {"mem_pressure", "l2_miss_rate"});
    c.hardware.mem_pressure = optional_number(*it, w, "mem_pressure", 0.0, 0.0, 1.0);
    c.hardware.l2_miss_rate = optional_number(*it, w, "l2_miss_rate", 0.0, 0.0, 1.0);
  }
  const auto& scenarios = require(j, where, "scenarios");
  VLMOPT_CHECK_INPUT(scenarios.is_object() && !scenarios.empty(), "{}: scenarios: expected a non-empty object, got {}",
                     where, scenarios.is_object() ? "an empty object" : type_name(scenarios));
  for (const auto& [name, s] : scenarios.items()) {
    const std::string w = fmt::format("{}: scenarios.{}", where, name);
    VLMOPT_CHECK_INPUT(s.is_object(), "{}: expected an object, got {}", w, type_name(s));
    reject_unknown(s, w, {"steps"});
    const auto& steps = require(s, w, "steps");
    VLMOPT_CHECK_INPUT(steps.is_array(), "{}: steps: expected an array, got {}", w, type_name(steps));
    Scenario scenario;
    for (size_t i = 0; i < steps.size(); ++i)
      scenario.steps.push_back(parse_step(steps[i], fmt::format("{}.steps[{}]", w, i)));
    for (size_t i = 1; i < scenario.steps.size(); ++i) {
      // Each step must cut later than the one before (an input cut at l+1 follows an output cut at l).
      const auto& prev = scenario.steps[i - 1];
      const auto& step = scenario.steps[i];
      VLMOPT_CHECK_INPUT(step.first_pruned_layer() > prev.first_pruned_layer(),
                         "{}.steps[{}]: after_layer: expected a cut after the previous step's ({} cut at layer {}), "
                         "got the {} cut at layer {}",
                         w, i, prune_cut_name(prev.cut), prev.after_layer, prune_cut_name(step.cut), step.after_layer);
    }
    c.scenarios[name] = std::move(scenario);
  }
  if (const auto it = j.find("default_scenario"); it != j.end()) {
    VLMOPT_CHECK_INPUT(it->is_string(), "{}: default_scenario: expected a string, got {}", where, type_name(*it));
    c.default_scenario = it->get<std::string>();
  }
  VLMOPT_CHECK_INPUT(c.scenarios.count(c.default_scenario) == 1,
                     "{}: default_scenario: expected the name of a scenario, got '{}'", where, c.default_scenario);
  if (const auto it = j.find("seed"); it != j.end()) {
    VLMOPT_CHECK_INPUT(it->is_number_unsigned(), "{}: seed: expected an unsigned integer, got {}", where, it->dump());
    c.seed = it->get<uint64_t>();
  }
  if (const auto it = j.find("fit"); it != j.end()) {
    VLMOPT_CHECK_INPUT(it->is_object(), "{}: fit: expected an object, got {}", where, type_name(*it));
    c.fit = *it;
  }
  return c;
}

PruneConfig read_prune_config(const std::filesystem::path& path) {
  const auto text = io::read_whole_file(path, 16u << 20);
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    throw_file_error(path, "not valid JSON ({})", e.what());
  }
  return prune_config_from_json(j, path.string());
}

void write_prune_config(const std::filesystem::path& path, const PruneConfig& config) {
  // Round-trip through the reader so a writer bug cannot produce a file the runtime rejects.
  (void)prune_config_from_json(config.to_json(), path.string());
  io::write_file_atomic(path, config.to_json().dump(2) + "\n");
}

}  // namespace vlmopt::model
