// Builtin synthetic clips (datasets/clips.hpp): determinism, frame timestamps,
// the event frame differing from the previous one exactly where the event
// object is, answers re-derived from the meta and from the pixels, closed
// vocabulary, balance, spec and index errors.
#include "datasets/clips.hpp"
#include "datasets/commands.hpp"
#include "datasets/scenes.hpp"
#include "datasets/source.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <opencv2/core.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <sstream>

namespace {

using namespace vlmopt::datasets;

std::vector<std::string> words_of(const std::string& text) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string w; in >> w;) words.push_back(w);
  return words;
}

bool same_pixels(const cv::Mat& a, const cv::Mat& b) {
  return a.size() == b.size() && a.type() == b.type() && cv::norm(a, b, cv::NORM_INF) == 0.0;
}

// The nominal RGB of the builtin colour names (docs/datasets.md), written out
// here so the test reads colours from pixels without the generator's table.
const std::map<std::string, cv::Vec3i> kNominal = {{"red", {215, 40, 40}},     {"green", {40, 160, 60}},
                                                   {"blue", {40, 80, 215}},    {"yellow", {235, 200, 30}},
                                                   {"purple", {140, 60, 190}}, {"orange", {245, 135, 30}}};

std::string nearest_color_name(const cv::Vec3b& rgb) {
  std::string best;
  double best_d = 1e18;
  for (const auto& [name, c] : kNominal) {
    const double d = std::hypot(rgb[0] - c[0], rgb[1] - c[1], rgb[2] - c[2]);
    if (d < best_d) best_d = d, best = name;
  }
  return best;
}

}  // namespace

TEST_CASE("builtin:clips: spec, size, description and index errors") {
  const auto source = open_dataset("builtin:clips");
  CHECK(source->size() == kClipCount);
  CHECK(source->describe().find("builtin:clips") != std::string::npos);
  try {
    (void)source->get(kClipCount);
    FAIL("expected an InputError");
  } catch (const vlmopt::InputError& e) {
    const std::string message = e.what();
    CHECK(message.find("builtin:clips") != std::string::npos);
    CHECK(message.find(std::to_string(kClipCount)) != std::string::npos);
  }
  CHECK_THROWS_AS(open_dataset("builtin:clip"), vlmopt::InputError);
}

TEST_CASE("builtin:clips samples are deterministic and differ between indices") {
  const ClipSource source;
  for (const size_t i : {size_t{0}, size_t{7}, size_t{255}}) {
    const auto a = source.get(i), b = source.get(i);
    CHECK(a.id == b.id);
    CHECK(a.question == b.question);
    CHECK(a.answer == b.answer);
    CHECK(a.meta == b.meta);
    CHECK(same_pixels(a.image, b.image));
    REQUIRE(a.frames.size() == b.frames.size());
    for (size_t f = 0; f < a.frames.size(); ++f) CHECK(same_pixels(a.frames[f], b.frames[f]));
  }
  // Different clips have different scenes (compare the event frames).
  std::set<std::string> ids;
  int identical = 0;
  for (size_t i = 0; i + 1 < 16; ++i) {
    const auto a = source.get(i), b = source.get(i + 1);
    ids.insert(a.id);
    identical += same_pixels(a.image, b.image);
  }
  CHECK(identical == 0);
  CHECK(ids.size() == 15);
}

TEST_CASE("builtin:clips: frames, timestamps, and the event frame differs exactly at the event object") {
  const ClipSource source;
  std::map<int, int> event_frames;
  for (size_t i = 0; i < 64; ++i) {
    CAPTURE(i);
    const auto s = source.get(i);
    REQUIRE(s.frames.size() == static_cast<size_t>(kClipFrames - 1));
    std::vector<cv::Mat> frames = {s.image};
    frames.insert(frames.end(), s.frames.begin(), s.frames.end());
    for (const auto& f : frames) {
      CHECK(f.type() == CV_8UC3);
      CHECK(f.rows == kSceneSize);
      CHECK(f.cols == kSceneSize);
      CHECK(f.isContinuous());
    }
    const auto times = s.meta.at("frame_times_ms").get<std::vector<int>>();
    REQUIRE(times.size() == frames.size());
    for (size_t f = 0; f < times.size(); ++f) CHECK(times[f] == static_cast<int>(f) * kFrameIntervalMs);
    const int k = s.meta.at("event_frame").get<int>();
    REQUIRE(k >= 1);
    REQUIRE(k < kClipFrames);
    ++event_frames[k];
    CHECK(s.meta.at("event_time_ms").get<int>() == times[static_cast<size_t>(k)]);

    // Every frame but k shows the same static scene.
    for (size_t f = 0; f < frames.size(); ++f)
      if (static_cast<int>(f) != k) CHECK(same_pixels(frames[f], frames[0]));
    // Frame k differs from frame k-1, only inside the event object's box, and
    // clearly at its centre.
    const auto& obj = s.meta.at("event_object");
    const int cx = obj.at("cx").get<int>(), cy = obj.at("cy").get<int>(), r = obj.at("radius").get<int>();
    cv::Mat diff;
    cv::absdiff(frames[static_cast<size_t>(k)], frames[static_cast<size_t>(k - 1)], diff);
    std::vector<cv::Mat> channels;
    cv::split(diff, channels);
    const cv::Mat changed = (channels[0] > 0) | (channels[1] > 0) | (channels[2] > 0);
    const int reach = static_cast<int>(std::ceil(1.3 * r)) + 2;  // the largest outline (star 1.15 r) plus rim
    int outside = 0, inside = 0;
    for (int y = 0; y < kSceneSize; ++y)
      for (int x = 0; x < kSceneSize; ++x) {
        if (!changed.at<uint8_t>(y, x)) continue;
        (std::abs(x - cx) <= reach && std::abs(y - cy) <= reach ? inside : outside) += 1;
      }
    CHECK(outside == 0);
    CHECK(inside > r * r);  // at least a solid blob, not a few stray pixels
    const auto centre = frames[static_cast<size_t>(k)].at<cv::Vec3b>(cy, cx);
    CHECK(nearest_color_name(centre) == obj.at("color").get<std::string>());
  }
  CHECK(event_frames[1] > 16);
  CHECK(event_frames[2] > 16);
}

TEST_CASE("builtin:clips: answers follow from the event object, questions are unambiguous and in the vocabulary") {
  const ClipSource source;
  const auto& vocab = builtin_vocabulary();
  const auto in_vocab = [&](const std::string& w) { return std::binary_search(vocab.begin(), vocab.end(), w); };
  std::map<std::string, int> types;
  std::set<std::string> color_answers, shape_answers;
  for (size_t i = 0; i < kClipCount; ++i) {
    CAPTURE(i);
    const auto s = source.get(i);
    for (const auto& w : words_of(s.question)) CHECK_MESSAGE(in_vocab(w), w);
    CHECK(in_vocab(s.answer));
    CHECK(s.question.back() == '?');
    CHECK(s.question.find("<image>") == std::string::npos);
    ++types[s.question_type];
    const auto& event = s.meta.at("event_object");
    const auto event_shape = event.at("shape").get<std::string>(), event_color = event.at("color").get<std::string>();
    REQUIRE(s.meta.at("objects").size() >= 1);
    if (s.question_type == "color") {
      CHECK(s.question == "what color is the " + event_shape + " ?");
      CHECK(s.answer == event_color);
      for (const auto& o : s.meta.at("objects")) CHECK(o.at("shape").get<std::string>() != event_shape);
      color_answers.insert(s.answer);
    } else {
      REQUIRE(s.question_type == "shape");
      CHECK(s.question == "what shape is the " + event_color + " object ?");
      CHECK(s.answer == event_shape);
      for (const auto& o : s.meta.at("objects")) CHECK(o.at("color").get<std::string>() != event_color);
      shape_answers.insert(s.answer);
    }
  }
  CHECK(types["color"] == static_cast<int>(kClipCount / 2));
  CHECK(types["shape"] == static_cast<int>(kClipCount / 2));
  CHECK(color_answers.size() == builtin_colors().size());
  CHECK(shape_answers.size() == builtin_shapes().size());
}

TEST_CASE("datasets show builtin:clips reports the frames and their times") {
  ShowOptions options;
  options.spec = "builtin:clips";
  options.limit = 2;
  const auto result = show(options);
  CHECK(result.at("size").get<size_t>() == kClipCount);
  REQUIRE(result.at("samples").size() == 2);
  CHECK(result.at("samples")[0].at("frames").get<size_t>() == static_cast<size_t>(kClipFrames - 1));
  const auto text = format_show(result);
  CHECK(text.find("frames: 2 more") != std::string::npos);
  CHECK(text.find("event at frame") != std::string::npos);
}
