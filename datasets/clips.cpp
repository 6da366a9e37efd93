#include "datasets/clips.hpp"

#include "datasets/rng.hpp"
#include "datasets/scenes.hpp"
#include "util/error.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numbers>
#include <optional>
#include <vector>

namespace vlmopt::datasets {

namespace {

constexpr int kEdgeMargin = 2;    // px kept free along the border
constexpr int kMinClearance = 3;  // px between the bounding boxes of two sprites
constexpr int kPlaceTries = 200;
constexpr int kComposeTries = 64;

struct Placed {
  ShapeSprite sprite;
  int half = 0;
};

bool clear_of(const Placed& a, const Placed& b) {
  const int dx = std::abs(a.sprite.cx - b.sprite.cx) - a.half - b.half;
  const int dy = std::abs(a.sprite.cy - b.sprite.cy) - a.half - b.half;
  return std::max(dx, dy) >= kMinClearance;
}

// Puts `sprite` at a random position clear of `placed`; appends it on success.
bool place(Rng& rng, ShapeSprite sprite, std::vector<Placed>& placed) {
  Placed p{sprite, sprite_half_extent(sprite)};
  const int lo = kEdgeMargin + p.half, hi = kSceneSize - kEdgeMargin - p.half - 1;
  if (lo > hi) return false;
  for (int t = 0; t < kPlaceTries; ++t) {
    p.sprite.cx = rng.uniform_int(lo, hi);
    p.sprite.cy = rng.uniform_int(lo, hi);
    if (std::all_of(placed.begin(), placed.end(), [&](const Placed& q) { return clear_of(p, q); })) {
      placed.push_back(p);
      return true;
    }
  }
  return false;
}

ShapeSprite make_sprite(Rng& rng, int shape, int color, bool large) {
  ShapeSprite s;
  s.shape = shape;
  s.color = color;
  s.radius = large ? rng.uniform_int(12, 15) : rng.uniform_int(7, 9);
  constexpr double deg = std::numbers::pi / 180.0;
  s.rotation = rng.uniform(-10.0, 10.0) * deg;
  s.rgb = jittered_color_rgb(rng, color);
  return s;
}

nlohmann::json sprite_json(const ShapeSprite& s) {
  return {{"shape", builtin_shapes()[static_cast<size_t>(s.shape)]},
          {"color", builtin_colors()[static_cast<size_t>(s.color)]},
          {"cx", s.cx},
          {"cy", s.cy},
          {"radius", s.radius}};
}

}  // namespace

Sample generate_clip_sample(std::size_t index) {
  check_index(index, kClipCount, std::string(kClipsSpec));
  const int shapes = static_cast<int>(builtin_shapes().size());
  const int colors = static_cast<int>(builtin_colors().size());

  // Stratified: question type, event frame and answer cycle through a fixed
  // permutation of the indices, so any large prefix is balanced.
  const uint64_t key = hash_name("vlmopt.clips.v1");
  const uint64_t slot = IndexPermutation(kClipCount, key ^ 0xC11B5ULL)(index);
  const bool color_question = slot % 2 == 0;
  const int event_frame = 1 + static_cast<int>((slot / 2) % (kClipFrames - 1));
  const int answers = color_question ? colors : shapes;
  const int answer = static_cast<int>((slot / 2 / (kClipFrames - 1)) % static_cast<uint64_t>(answers));

  const uint64_t seed = mix64(key ^ mix64(index));
  Rng rng(seed);
  const int event_shape = color_question ? static_cast<int>(rng.below(static_cast<uint64_t>(shapes))) : answer;
  const int event_color = color_question ? answer : static_cast<int>(rng.below(static_cast<uint64_t>(colors)));

  // The event object is placed first (it is the one that must fit), then the
  // static objects; none of those shares the attribute the question names.
  std::vector<Placed> placed;
  for (int attempt = 0; attempt < kComposeTries && placed.empty(); ++attempt) {
    if (!place(rng, make_sprite(rng, event_shape, event_color, true), placed)) continue;
    const int statics = rng.uniform_int(1, 3);
    for (int k = 0; k < statics && !placed.empty(); ++k) {
      int shape = static_cast<int>(rng.below(static_cast<uint64_t>(shapes)));
      int color = static_cast<int>(rng.below(static_cast<uint64_t>(colors)));
      if (color_question && shape == event_shape) shape = (shape + 1 + static_cast<int>(rng.below(static_cast<uint64_t>(shapes - 1)))) % shapes;
      if (!color_question && color == event_color) color = (color + 1 + static_cast<int>(rng.below(static_cast<uint64_t>(colors - 1)))) % colors;
      if (!place(rng, make_sprite(rng, shape, color, rng.chance(0.35)), placed)) placed.clear();
    }
  }
  VLMOPT_CHECK(!placed.empty(), "could not compose {} clip {}", kClipsSpec, index);

  cv::Mat background(kSceneSize, kSceneSize, CV_8UC3);
  const std::string background_kind = draw_scene_background(rng, background);
  nlohmann::json objects = nlohmann::json::array();
  for (size_t k = 1; k < placed.size(); ++k) {
    draw_sprite(background, placed[k].sprite);
    objects.push_back(sprite_json(placed[k].sprite));
  }
  std::vector<cv::Mat> frames;
  std::vector<int> times_ms;
  for (int f = 0; f < kClipFrames; ++f) {
    cv::Mat frame = background.clone();
    if (f == event_frame) draw_sprite(frame, placed.front().sprite);
    frames.push_back(std::move(frame));
    times_ms.push_back(f * kFrameIntervalMs);
  }

  const auto& shape_names = builtin_shapes();
  const auto& color_names = builtin_colors();
  Sample sample;
  sample.id = fmt::format("{}/{:06d}", kClipsSpec, index);
  sample.image = std::move(frames.front());
  sample.frames.assign(std::make_move_iterator(frames.begin() + 1), std::make_move_iterator(frames.end()));
  if (color_question) {
    sample.question = fmt::format("what color is the {} ?", shape_names[static_cast<size_t>(event_shape)]);
    sample.answer = color_names[static_cast<size_t>(event_color)];
    sample.question_type = "color";
  } else {
    sample.question = fmt::format("what shape is the {} object ?", color_names[static_cast<size_t>(event_color)]);
    sample.answer = shape_names[static_cast<size_t>(event_shape)];
    sample.question_type = "shape";
  }
  sample.meta = {{"split", "clips"},
                 {"index", index},
                 {"seed", seed},
                 {"background", background_kind},
                 {"frame_times_ms", times_ms},
                 {"event", "appear"},
                 {"event_frame", event_frame},
                 {"event_time_ms", times_ms[static_cast<size_t>(event_frame)]},
                 {"objects", std::move(objects)},
                 {"event_object", sprite_json(placed.front().sprite)}};
  return sample;
}

std::string ClipSource::describe() const {
  return fmt::format("{} ({} synthetic clips, {} frames of {}x{} RGB {} ms apart, one event each)", kClipsSpec,
                     kClipCount, kClipFrames, kSceneSize, kSceneSize, kFrameIntervalMs);
}

}  // namespace vlmopt::datasets
