#include "util/progress.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <unistd.h>

namespace vlmopt {

ProgressBar::ProgressBar(std::string label, int64_t total)
    : label_(std::move(label)),
      total_(std::max<int64_t>(total, 1)),
      enabled_(::isatty(STDERR_FILENO) == 1 && spdlog::get_level() <= spdlog::level::info),
      start_(std::chrono::steady_clock::now()),
      last_draw_(start_) {}

ProgressBar::~ProgressBar() { finish(); }

void ProgressBar::advance(int64_t units) {
  done_ = std::min(total_, done_ + units);
  if (enabled_) draw(done_ == total_);
}

void ProgressBar::finish() {
  if (!enabled_ || !drawn_) return;
  draw(true);
  std::fputc('\n', stderr);
  drawn_ = false;
  enabled_ = false;
}

void ProgressBar::draw(bool force) {
  const auto now = std::chrono::steady_clock::now();
  // At most ~10 redraws per second: a tight loop must not be slowed by the terminal.
  if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  constexpr int kWidth = 30;
  const double fraction = static_cast<double>(done_) / static_cast<double>(total_);
  const int filled = static_cast<int>(fraction * kWidth);
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = done_ > 0 ? elapsed * static_cast<double>(total_ - done_) / static_cast<double>(done_) : 0.0;
  std::fputs(fmt::format("\r{} [{}{}] {}/{} {:.0f}s eta {:.0f}s ", label_, std::string(filled, '#'),
                         std::string(kWidth - filled, '.'), done_, total_, elapsed, eta)
                 .c_str(),
             stderr);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace vlmopt
