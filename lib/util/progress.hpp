// A progress bar on stderr for long loops, drawn only when stderr is a terminal
// and logging is not quiet (CI logs stay clean); always cheap to update.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace vlmopt {

class ProgressBar {
 public:
  // `total` units of work (e.g. samples); `label` is printed before the bar.
  ProgressBar(std::string label, int64_t total);
  ~ProgressBar();  // finishes the line if anything was drawn
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;

  void advance(int64_t units = 1);
  void finish();
  bool enabled() const { return enabled_; }

 private:
  void draw(bool force);
  std::string label_;
  int64_t total_;
  int64_t done_ = 0;
  bool enabled_;
  bool drawn_ = false;
  std::chrono::steady_clock::time_point start_, last_draw_;
};

}  // namespace vlmopt
