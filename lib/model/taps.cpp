#include "model/taps.hpp"

#include <algorithm>

namespace vlmopt::model {

bool Taps::matches(std::string_view pattern, std::string_view name) {
  if (!pattern.empty() && pattern.back() == '*') {
    return name.starts_with(pattern.substr(0, pattern.size() - 1));
  }
  return pattern == name;
}

int Taps::subscribe(std::string pattern, Callback callback) {
  const int id = next_id_++;
  subscriptions_.push_back(Subscription{id, std::move(pattern), std::move(callback)});
  return id;
}

void Taps::unsubscribe(int id) {
  std::erase_if(subscriptions_, [id](const Subscription& s) { return s.id == id; });
}

bool Taps::wants(std::string_view name) const {
  return std::any_of(subscriptions_.begin(), subscriptions_.end(),
                     [name](const Subscription& s) { return matches(s.pattern, name); });
}

void Taps::emit(std::string_view name, const torch::Tensor& tensor, const TapContext& context) const {
  for (const auto& s : subscriptions_) {
    if (matches(s.pattern, name)) s.callback(name, tensor, context);
  }
}

}  // namespace vlmopt::model
