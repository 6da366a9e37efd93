// Builtin synthetic visual-QA scenes (docs/datasets.md §Builtin scenes).
//
// 96x96 RGB images with 1-6 coloured shapes on a plain or lightly textured
// background, optionally with boxes holding real handwritten digits, and one
// templated question per image. Every sample is a pure function of (split,
// index): no state, no files besides OpenCV's digit sheet.
//
// Questions are lowercase words from builtin_vocabulary() separated by single
// spaces, ending with the word "?"; answers are one word from the answer set
// of the question type, so a WordLevel tokenizer with WhitespaceSplit encodes
// both. Each question is answerable from the image alone and unambiguous
// (e.g. "what color is the circle ?" only when there is exactly one circle).
#pragma once

#include "datasets/digits.hpp"
#include "datasets/rng.hpp"
#include "datasets/source.hpp"

#include <array>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::datasets {

inline constexpr int kSceneSize = 96;  // pixels, square

enum class BuiltinSplit { kTrain, kCalib, kEval, kStress };

struct BuiltinSplitInfo {
  std::string_view name;    // "train", ...
  std::size_t size;         // virtual samples
  DigitSplit digits;        // which digit images its scenes use
};

// train 50 000, calib 512, eval 2000, stress 500 (eval-like; stress transforms go on top).
const BuiltinSplitInfo& builtin_split_info(BuiltinSplit split);
std::optional<BuiltinSplit> parse_builtin_split(std::string_view name);

// Question type tags, in the fixed order used for stratification:
// color shape count exist position relation size digit.
const std::vector<std::string>& builtin_question_types();
// The closed answer set of one question type; InputError for unknown types.
const std::vector<std::string>& builtin_answers(std::string_view question_type);
// Every word any builtin question or answer can contain (sorted, unique; includes "?").
const std::vector<std::string>& builtin_vocabulary();

// The closed attribute sets the scenes draw from (singular nouns; plurals add "s"/"es").
const std::vector<std::string>& builtin_shapes();   // circle square triangle star cross
const std::vector<std::string>& builtin_colors();   // red green blue yellow purple orange
const std::vector<std::string>& builtin_sizes();    // small large

// Sample `index` of `split`. meta holds the full scene description:
// {"split", "index", "seed", "variant", "background",
//  "objects": [{"shape","color","size","cx","cy","radius","rgb":[r,g,b]}],
//  "digits":  [{"sheet_index","label","x","y","side"}]}  (x, y: top-left of the box, pixels)
// Throws InputError for index >= split size or when the digit sheet is missing.
Sample generate_builtin_sample(BuiltinSplit split, std::size_t index);

// --- Drawing primitives shared with the other synthetic generators (datasets/clips.hpp) ---

// One coloured shape as the scenes draw it. shape / color index builtin_shapes() /
// builtin_colors(); radius in px (scenes use 7-9 small, 13-16 large); rotation in radians.
struct ShapeSprite {
  int shape = 0;
  int color = 0;
  int cx = 0, cy = 0;       // centre pixel
  int radius = 8;
  double rotation = 0.0;
  std::array<int, 3> rgb{};  // fill colour (the named colour, optionally jittered)
};

// The named colour's RGB with the scenes' per-channel jitter (+-12) drawn from rng.
std::array<int, 3> jittered_color_rgb(Rng& rng, int color);
// Half side in px of the sprite's axis-aligned bounding box, anti-aliased rim included.
int sprite_half_extent(const ShapeSprite& sprite);
// Fills the sprite (darker anti-aliased rim) into an RGB uint8 image.
void draw_sprite(cv::Mat& rgb_image, const ShapeSprite& sprite);
// Fills an RGB uint8 image with one of the scene backgrounds drawn from rng; returns
// its name ("plain", "noise" or "gradient").
std::string draw_scene_background(Rng& rng, cv::Mat& rgb_image);

class BuiltinSource final : public DatasetSource {
 public:
  explicit BuiltinSource(BuiltinSplit split);
  std::size_t size() const override;
  Sample get(std::size_t i) const override;
  std::string describe() const override;

 private:
  BuiltinSplit split_;
};

}  // namespace vlmopt::datasets
