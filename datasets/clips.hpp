// Builtin synthetic clips (docs/datasets.md §Builtin clips): short frame
// sequences where one event happens at a known frame, for the temporal delay
// Δt_sem of `vlmopt diagnose-align` (docs/align.md).
//
// A clip is kClipFrames 96x96 RGB frames kFrameIntervalMs apart over a static
// scene (background and 1-3 objects). At the event frame k (1 or 2) one more
// object flashes into view: it is drawn in frame k only, so the question about
// it ("what color is the star ?", "what shape is the red object ?") is
// answerable from that frame alone. Questions and answers use only
// builtin_vocabulary() words; every clip is a pure function of its index.
#pragma once

#include "datasets/source.hpp"

#include <cstddef>
#include <string>

namespace vlmopt::datasets {

inline constexpr std::string_view kClipsSpec = "builtin:clips";
inline constexpr std::size_t kClipCount = 256;
inline constexpr int kClipFrames = 3;            // Sample::image + 2 Sample::frames
inline constexpr int kFrameIntervalMs = 400;     // frame f is shown at f * 400 ms

// Clip `index`: image = frame 0, frames = frames 1..2, question_type "color" or
// "shape". meta: {"split": "clips", "index", "seed", "background",
//  "frame_times_ms": [0, 400, 800], "event": "appear", "event_frame": k, "event_time_ms": k * 400,
//  "objects": [{"shape","color","cx","cy","radius"}] (in every frame),
//  "event_object": {"shape","color","cx","cy","radius"} (frame k only)}.
// Throws InputError for index >= kClipCount.
Sample generate_clip_sample(std::size_t index);

class ClipSource final : public DatasetSource {
 public:
  std::size_t size() const override { return kClipCount; }
  Sample get(std::size_t i) const override { return generate_clip_sample(i); }
  std::string describe() const override;
};

}  // namespace vlmopt::datasets
