#include "datasets/scenes.hpp"

#include "datasets/rng.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <opencv2/imgproc.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <limits>
#include <numbers>
#include <set>

namespace vlmopt::datasets {

namespace {

// ---------------------------------------------------------------------------
// Closed vocabularies

constexpr int kNumShapes = 5;
constexpr int kNumColors = 6;
constexpr std::array<const char*, kNumShapes> kShapeNames = {"circle", "square", "triangle", "star", "cross"};
constexpr std::array<const char*, kNumShapes> kShapePlurals = {"circles", "squares", "triangles", "stars", "crosses"};
enum Shape { kCircle = 0, kSquare, kTriangle, kStar, kCross };

struct ColorDef {
  const char* name;
  int r, g, b;
};
// Saturated colours far apart in RGB (closest pair orange/yellow: 66 units),
// so +-12 jitter per channel never makes one look like another.
constexpr std::array<ColorDef, kNumColors> kColors = {{
    {"red", 215, 40, 40},
    {"green", 40, 160, 60},
    {"blue", 40, 80, 215},
    {"yellow", 235, 200, 30},
    {"purple", 140, 60, 190},
    {"orange", 245, 135, 30},
}};
constexpr int kColorJitter = 12;

enum QuestionType { kColorQ = 0, kShapeQ, kCountQ, kExistQ, kPositionQ, kRelationQ, kSizeQ, kDigitQ, kNumTypes };

const std::vector<std::string> kNumberWords = {"zero", "one", "two", "three", "four",
                                               "five", "six", "seven", "eight", "nine"};

std::vector<std::string> shape_list() { return {kShapeNames.begin(), kShapeNames.end()}; }
std::vector<std::string> color_list() {
  std::vector<std::string> out;
  for (const auto& c : kColors) out.emplace_back(c.name);
  return out;
}

// Answer sets in the order the stratified answer index maps to.
const std::array<std::vector<std::string>, kNumTypes>& answer_sets() {
  static const std::array<std::vector<std::string>, kNumTypes> sets = {
      color_list(),
      shape_list(),
      std::vector<std::string>(kNumberWords.begin(), kNumberWords.begin() + 6),  // zero..five
      std::vector<std::string>{"yes", "no"},
      std::vector<std::string>{"left", "right", "top", "bottom"},
      std::vector<std::string>{"yes", "no"},
      std::vector<std::string>{"small", "large"},
      kNumberWords,  // the digit 0..9 as a word
  };
  return sets;
}

// Every word the question templates below use besides attribute names and
// answers. A unit test checks that generated questions use nothing else.
const std::vector<std::string> kTemplateWords = {
    "what", "color", "is",    "the",   "shape", "object", "objects", "how",   "many", "are",  "there",
    "a",    "an",    "on",    "or",    "at",    "left",   "right",   "top",   "bottom", "of", "above",
    "below", "small", "large", "which", "digit", "in",    "box",     "next",  "to",   "?"};

// ---------------------------------------------------------------------------
// Scene model

struct Rect {
  int x0, y0, x1, y1;  // half-open pixel rectangle
};

// Euclidean clearance between two rectangles (0 when they touch or overlap).
double gap(const Rect& a, const Rect& b) {
  const int dx = std::max({0, a.x0 - b.x1, b.x0 - a.x1});
  const int dy = std::max({0, a.y0 - b.y1, b.y0 - a.y1});
  return std::hypot(static_cast<double>(dx), static_cast<double>(dy));
}

struct Object {
  int shape = 0;
  int color = 0;
  bool large = false;
  int cx = 0, cy = 0;           // centre pixel
  int radius = 0;               // nominal size in pixels (circle radius)
  double rotation = 0;          // radians
  std::array<int, 3> rgb{};     // jittered fill colour
  std::vector<cv::Point2d> outline;  // polygon vertices relative to the centre (empty for circles)
  int half = 0;                 // half extent of the bounding box incl. anti-aliasing

  Rect rect() const { return {cx - half, cy - half, cx + half + 1, cy + half + 1}; }
};

struct DigitBox {
  int sheet_index = 0;
  int label = 0;
  int x = 0, y = 0;  // top-left
  int side = 0;      // outer side incl. the 1-px border
  Rect rect() const { return {x, y, x + side, y + side}; }
};

constexpr int kEdgeMargin = 2;   // px kept free along the image border
constexpr int kMinClearance = 3; // px between any two items
constexpr int kClearMargin = 14; // px from the centre line for "left"/"right"/"top"/"bottom"
constexpr int kRelationMargin = 16;  // px between centres for "left of"/"above"
constexpr int kPlaceTries = 120;
constexpr int kComposeTries = 64;

std::vector<cv::Point2d> shape_outline(int shape, double r, double rotation) {
  std::vector<cv::Point2d> pts;
  auto polar = [&](double radius, double angle) {
    pts.emplace_back(radius * std::cos(angle + rotation), radius * std::sin(angle + rotation));
  };
  constexpr double pi = std::numbers::pi;
  switch (shape) {
    case kCircle: break;
    case kSquare:  // half side 0.82 r: about the area of the circle of radius r
      for (int k = 0; k < 4; ++k) polar(0.82 * r * std::numbers::sqrt2, pi / 4 + k * pi / 2);
      break;
    case kTriangle:  // equilateral, pointing up, centroid at the centre
      for (int k = 0; k < 3; ++k) polar(1.2 * r, -pi / 2 + k * 2 * pi / 3);
      break;
    case kStar:  // five points
      for (int k = 0; k < 10; ++k) polar(k % 2 == 0 ? 1.15 * r : 0.5 * 1.15 * r, -pi / 2 + k * pi / 5);
      break;
    case kCross: {
      const double arm = r, w = 0.36 * r;
      const double local[12][2] = {{w, -arm}, {w, -w}, {arm, -w}, {arm, w},  {w, w},     {w, arm},
                                   {-w, arm}, {-w, w}, {-arm, w}, {-arm, -w}, {-w, -w}, {-w, -arm}};
      for (const auto& p : local) {
        const double c = std::cos(rotation), s = std::sin(rotation);
        pts.emplace_back(p[0] * c - p[1] * s, p[0] * s + p[1] * c);
      }
      break;
    }
    default: VLMOPT_CHECK(false, "unknown shape {}", shape);
  }
  return pts;
}

// Constraints on an item's position (centre for objects, top-left for boxes).
struct Region {
  int x_lo = std::numeric_limits<int>::min();
  int x_hi = std::numeric_limits<int>::max();
  int y_lo = std::numeric_limits<int>::min();
  int y_hi = std::numeric_limits<int>::max();
};

struct Composition {
  std::string question;
  std::string answer;
  std::string variant;  // which template produced it
};

using AttributeFilter = std::function<bool(int shape, int color)>;

class Composer {
 public:
  Composer(Rng& rng, const DigitSheet& sheet, DigitSplit digit_split)
      : rng_(rng), sheet_(sheet), digit_split_(digit_split) {}

  std::vector<Object> objects;
  std::vector<DigitBox> boxes;

  void reset() {
    objects.clear();
    boxes.clear();
  }

  std::optional<Composition> compose(int type, int answer_index) {
    switch (type) {
      case kColorQ: return compose_color(answer_index);
      case kShapeQ: return compose_shape(answer_index);
      case kCountQ: return compose_count(answer_index);
      case kExistQ: return compose_exist(answer_index);
      case kPositionQ: return compose_position(answer_index);
      case kRelationQ: return compose_relation(answer_index);
      case kSizeQ: return compose_size(answer_index);
      case kDigitQ: return compose_digit(answer_index);
      default: VLMOPT_CHECK(false, "unknown question type {}", type);
    }
    return std::nullopt;
  }

 private:
  // --- item creation and placement -----------------------------------------

  Object make_object(int shape, int color, bool large) {
    Object o;
    o.shape = shape;
    o.color = color;
    o.large = large;
    o.radius = large ? rng_.uniform_int(13, 16) : rng_.uniform_int(7, 9);
    constexpr double deg = std::numbers::pi / 180.0;
    if (shape == kStar) {
      o.rotation = rng_.uniform(0.0, 72.0) * deg;
    } else if (shape != kCircle) {
      o.rotation = rng_.uniform(-10.0, 10.0) * deg;
    }
    const auto& base = kColors[color];
    o.rgb = {std::clamp(base.r + rng_.uniform_int(-kColorJitter, kColorJitter), 0, 255),
             std::clamp(base.g + rng_.uniform_int(-kColorJitter, kColorJitter), 0, 255),
             std::clamp(base.b + rng_.uniform_int(-kColorJitter, kColorJitter), 0, 255)};
    o.outline = shape_outline(shape, o.radius, o.rotation);
    double extent = o.radius;
    for (const auto& p : o.outline) extent = std::max({extent, std::abs(p.x), std::abs(p.y)});
    o.half = static_cast<int>(std::ceil(extent)) + 1;  // +1: anti-aliased outline
    return o;
  }

  Object random_object(const AttributeFilter& allowed, double large_probability = 0.35) {
    for (int tries = 0; tries < 1000; ++tries) {
      const int shape = static_cast<int>(rng_.below(kNumShapes));
      const int color = static_cast<int>(rng_.below(kNumColors));
      if (!allowed || allowed(shape, color)) return make_object(shape, color, rng_.chance(large_probability));
    }
    VLMOPT_CHECK(false, "no shape/colour combination satisfies the filter");
    return {};
  }

  int other_than(int value, int count) {
    const int offset = 1 + static_cast<int>(rng_.below(static_cast<uint64_t>(count - 1)));
    return (value + offset) % count;
  }

  bool clear_of_all(const Rect& r, const Object* except_object = nullptr) const {
    for (const auto& o : objects) {
      if (&o != except_object && gap(r, o.rect()) < kMinClearance) return false;
    }
    for (const auto& b : boxes) {
      if (gap(r, b.rect()) < kMinClearance) return false;
    }
    return true;
  }

  // Places `o` at a random free position whose centre lies in `region`; on
  // success appends it to `objects`.
  bool place(Object o, const Region& region = {}, const std::function<bool(const Object&)>& accept = {}) {
    const int x_lo = std::max(region.x_lo, kEdgeMargin + o.half);
    const int x_hi = std::min(region.x_hi, kSceneSize - kEdgeMargin - o.half - 1);
    const int y_lo = std::max(region.y_lo, kEdgeMargin + o.half);
    const int y_hi = std::min(region.y_hi, kSceneSize - kEdgeMargin - o.half - 1);
    if (x_lo > x_hi || y_lo > y_hi) return false;
    for (int t = 0; t < kPlaceTries; ++t) {
      o.cx = rng_.uniform_int(x_lo, x_hi);
      o.cy = rng_.uniform_int(y_lo, y_hi);
      if (clear_of_all(o.rect()) && (!accept || accept(o))) {
        objects.push_back(std::move(o));
        return true;
      }
    }
    return false;
  }

  bool add_distractors(int count, const AttributeFilter& allowed, double large_probability = 0.35) {
    for (int k = 0; k < count; ++k) {
      if (!place(random_object(allowed, large_probability))) return false;
    }
    return true;
  }

  DigitBox make_box(int label) {
    DigitBox box;
    const auto& pool = sheet_.pool(digit_split_, label);
    box.sheet_index = rng_.pick(pool);
    box.label = label;
    box.side = rng_.uniform_int(24, 30) + 2;  // digit scaled from 20 px to 24-30 px, plus border
    return box;
  }

  bool in_bounds(const Rect& r) const {
    return r.x0 >= kEdgeMargin && r.y0 >= kEdgeMargin && r.x1 <= kSceneSize - kEdgeMargin &&
           r.y1 <= kSceneSize - kEdgeMargin;
  }

  bool place_box(DigitBox box, const Region& region = {}) {
    const int x_lo = std::max(region.x_lo, kEdgeMargin);
    const int x_hi = std::min(region.x_hi, kSceneSize - kEdgeMargin - box.side);
    const int y_lo = std::max(region.y_lo, kEdgeMargin);
    const int y_hi = std::min(region.y_hi, kSceneSize - kEdgeMargin - box.side);
    if (x_lo > x_hi || y_lo > y_hi) return false;
    for (int t = 0; t < kPlaceTries; ++t) {
      box.x = rng_.uniform_int(x_lo, x_hi);
      box.y = rng_.uniform_int(y_lo, y_hi);
      if (clear_of_all(box.rect())) {
        boxes.push_back(box);
        return true;
      }
    }
    return false;
  }

  // Puts `box` right beside `anchor` (1-3 px away) on a random side, at least
  // `far` px away from every other object.
  bool place_box_beside(DigitBox box, const Object& anchor, double far) {
    std::array<int, 4> sides = {0, 1, 2, 3};
    for (int i = 3; i > 0; --i) std::swap(sides[i], sides[rng_.below(static_cast<uint64_t>(i) + 1)]);
    const Rect a = anchor.rect();
    for (int side : sides) {
      for (int t = 0; t < 12; ++t) {
        const int g = rng_.uniform_int(1, 3);
        const int slide = rng_.uniform_int(-4, 4);
        switch (side) {
          case 0: box.x = a.x1 + g; box.y = anchor.cy - box.side / 2 + slide; break;        // right
          case 1: box.x = a.x0 - g - box.side; box.y = anchor.cy - box.side / 2 + slide; break;  // left
          case 2: box.y = a.y1 + g; box.x = anchor.cx - box.side / 2 + slide; break;        // below
          default: box.y = a.y0 - g - box.side; box.x = anchor.cx - box.side / 2 + slide; break;  // above
        }
        const Rect r = box.rect();
        if (!in_bounds(r) || !clear_of_all(r, &anchor)) continue;
        bool isolated = true;
        for (const auto& o : objects) {
          if (&o != &anchor && gap(r, o.rect()) < far) isolated = false;
        }
        if (!isolated) continue;
        boxes.push_back(box);
        return true;
      }
    }
    return false;
  }

  // --- phrases ---------------------------------------------------------------

  static std::string article_for(const std::string& next_word) {
    return std::string("aeiou").find(next_word.front()) != std::string::npos ? "an" : "a";
  }
  static std::string shape_word(int s) { return kShapeNames[s]; }
  static std::string color_word(int c) { return kColors[c].name; }
  static std::string described(int color, int shape) { return color_word(color) + " " + shape_word(shape); }

  // --- question templates ----------------------------------------------------

  std::optional<Composition> compose_color(int answer_index) {
    const int color = answer_index;
    const int shape = static_cast<int>(rng_.below(kNumShapes));
    const bool large = rng_.chance(0.5);
    const bool qualify_size = rng_.chance(0.3);
    if (!place(make_object(shape, color, large))) return std::nullopt;
    int extra = 0;
    if (qualify_size && rng_.chance(0.7)) {  // same shape, other size: only the size word disambiguates
      if (!place(make_object(shape, other_than(color, kNumColors), !large))) return std::nullopt;
      extra = 1;
    }
    if (!add_distractors(rng_.uniform_int(0, 3 - extra), [&](int s, int) { return s != shape; })) return std::nullopt;
    if (qualify_size) {
      return Composition{fmt::format("what color is the {} {} ?", large ? "large" : "small", shape_word(shape)),
                         color_word(color), "color_of_sized_shape"};
    }
    return Composition{fmt::format("what color is the {} ?", shape_word(shape)), color_word(color), "color_of_shape"};
  }

  std::optional<Composition> compose_shape(int answer_index) {
    const int shape = answer_index;
    const int color = static_cast<int>(rng_.below(kNumColors));
    if (!place(make_object(shape, color, rng_.chance(0.5)))) return std::nullopt;
    if (!add_distractors(rng_.uniform_int(0, 3), [&](int, int c) { return c != color; })) return std::nullopt;
    return Composition{fmt::format("what shape is the {} object ?", color_word(color)), shape_word(shape),
                       "shape_of_color"};
  }

  std::optional<Composition> compose_count(int answer_index) {
    const int n = answer_index;
    const bool by_shape = rng_.chance(0.5);
    const int distractors = rng_.uniform_int(n == 0 ? 1 : 0, std::min(3, 6 - n));
    const double large_p = n + distractors >= 5 ? 0.15 : 0.35;  // crowded scenes: mostly small objects
    const int shape = static_cast<int>(rng_.below(kNumShapes));
    const int color = static_cast<int>(rng_.below(kNumColors));
    for (int k = 0; k < n; ++k) {
      const Object o = by_shape ? make_object(shape, static_cast<int>(rng_.below(kNumColors)), rng_.chance(large_p))
                                : make_object(static_cast<int>(rng_.below(kNumShapes)), color, rng_.chance(large_p));
      if (!place(o)) return std::nullopt;
    }
    if (by_shape) {
      if (!add_distractors(distractors, [&](int s, int) { return s != shape; }, large_p)) return std::nullopt;
      return Composition{fmt::format("how many {} are there ?", kShapePlurals[shape]), kNumberWords[n],
                         "count_shape"};
    }
    if (!add_distractors(distractors, [&](int, int c) { return c != color; }, large_p)) return std::nullopt;
    return Composition{fmt::format("how many {} objects are there ?", color_word(color)), kNumberWords[n],
                       "count_color"};
  }

  std::optional<Composition> compose_exist(int answer_index) {
    const bool yes = answer_index == 0;
    const int variant = static_cast<int>(rng_.below(4));  // 0,1: colour+shape, 2: shape, 3: colour
    const int shape = static_cast<int>(rng_.below(kNumShapes));
    const int color = static_cast<int>(rng_.below(kNumColors));
    const std::string answer = yes ? "yes" : "no";
    if (variant <= 1) {
      if (yes && !place(make_object(shape, color, rng_.chance(0.5)))) return std::nullopt;
      // Lures share one attribute, so "no" needs binding colour to shape.
      if (rng_.chance(0.6) && !place(make_object(other_than(shape, kNumShapes), color, rng_.chance(0.35))))
        return std::nullopt;
      if (rng_.chance(0.6) && !place(make_object(shape, other_than(color, kNumColors), rng_.chance(0.35))))
        return std::nullopt;
      const int min_extra = objects.empty() ? 1 : 0;
      if (!add_distractors(rng_.uniform_int(min_extra, 2), [&](int s, int c) { return s != shape || c != color; }))
        return std::nullopt;
      const std::string desc = described(color, shape);
      return Composition{fmt::format("is there {} {} ?", article_for(desc), desc), answer, "exist_color_shape"};
    }
    if (variant == 2) {
      const int matching = yes ? rng_.uniform_int(1, 2) : 0;
      for (int k = 0; k < matching; ++k) {
        if (!place(make_object(shape, static_cast<int>(rng_.below(kNumColors)), rng_.chance(0.35))))
          return std::nullopt;
      }
      if (!add_distractors(rng_.uniform_int(yes ? 0 : 1, 3), [&](int s, int) { return s != shape; }))
        return std::nullopt;
      const std::string word = shape_word(shape);
      return Composition{fmt::format("is there {} {} ?", article_for(word), word), answer, "exist_shape"};
    }
    const int matching = yes ? rng_.uniform_int(1, 2) : 0;
    for (int k = 0; k < matching; ++k) {
      if (!place(make_object(static_cast<int>(rng_.below(kNumShapes)), color, rng_.chance(0.35)))) return std::nullopt;
    }
    if (!add_distractors(rng_.uniform_int(yes ? 0 : 1, 3), [&](int, int c) { return c != color; }))
      return std::nullopt;
    const std::string word = color_word(color);
    return Composition{fmt::format("is there {} {} object ?", article_for(word), word), answer, "exist_color"};
  }

  std::optional<Composition> compose_position(int answer_index) {
    const int shape = static_cast<int>(rng_.below(kNumShapes));
    const int color = static_cast<int>(rng_.below(kNumColors));
    constexpr int centre = kSceneSize / 2;
    Region region;
    switch (answer_index) {
      case 0: region.x_hi = centre - kClearMargin; break;  // left
      case 1: region.x_lo = centre + kClearMargin; break;  // right
      case 2: region.y_hi = centre - kClearMargin; break;  // top
      default: region.y_lo = centre + kClearMargin; break; // bottom
    }
    if (!place(make_object(shape, color, rng_.chance(0.5)), region)) return std::nullopt;
    if (!add_distractors(rng_.uniform_int(0, 3), [&](int s, int c) { return s != shape || c != color; }))
      return std::nullopt;
    const std::string& answer = answer_sets()[kPositionQ][answer_index];
    if (answer_index <= 1) {
      return Composition{fmt::format("is the {} on the left or the right ?", described(color, shape)), answer,
                         "position_horizontal"};
    }
    return Composition{fmt::format("is the {} at the top or the bottom ?", described(color, shape)), answer,
                       "position_vertical"};
  }

  std::optional<Composition> compose_relation(int answer_index) {
    const bool yes = answer_index == 0;
    const int relation = static_cast<int>(rng_.below(4));  // left of, right of, above, below
    static constexpr std::array<const char*, 4> kRelationWords = {"left of", "right of", "above", "below"};
    const int shape_a = static_cast<int>(rng_.below(kNumShapes));
    const int color_a = static_cast<int>(rng_.below(kNumColors));
    int shape_b = static_cast<int>(rng_.below(kNumShapes));
    int color_b = static_cast<int>(rng_.below(kNumColors));
    if (shape_b == shape_a && color_b == color_a) color_b = other_than(color_a, kNumColors);
    if (!place(make_object(shape_a, color_a, rng_.chance(0.4)))) return std::nullopt;
    // "A left of B" holds when B's centre is clearly right of A's; "no" scenes
    // have the opposite relation clearly, never a near tie.
    const int truth_sign = (relation == 0 || relation == 2) ? 1 : -1;
    const int want = yes ? truth_sign : -truth_sign;
    const bool horizontal = relation <= 1;
    const auto satisfied = [&](const Object& b) {
      const Object& a = objects.front();
      const int d = horizontal ? b.cx - a.cx : b.cy - a.cy;
      return d * want >= kRelationMargin;
    };
    if (!place(make_object(shape_b, color_b, rng_.chance(0.4)), {}, satisfied)) return std::nullopt;
    if (!add_distractors(rng_.uniform_int(0, 2), [&](int s, int c) {
          return (s != shape_a || c != color_a) && (s != shape_b || c != color_b);
        }))
      return std::nullopt;
    return Composition{fmt::format("is the {} {} the {} ?", described(color_a, shape_a), kRelationWords[relation],
                                   described(color_b, shape_b)),
                       yes ? "yes" : "no", fmt::format("relation_{}", relation <= 1 ? "horizontal" : "vertical")};
  }

  std::optional<Composition> compose_size(int answer_index) {
    const bool large = answer_index == 1;
    const int shape = static_cast<int>(rng_.below(kNumShapes));
    const int color = static_cast<int>(rng_.below(kNumColors));
    if (!place(make_object(shape, color, large))) return std::nullopt;
    if (!add_distractors(rng_.uniform_int(0, 3), [&](int s, int c) { return s != shape || c != color; }))
      return std::nullopt;
    return Composition{fmt::format("is the {} small or large ?", described(color, shape)), large ? "large" : "small",
                       "size"};
  }

  std::optional<Composition> compose_digit(int answer_index) {
    const int label = answer_index;
    const int variant = static_cast<int>(rng_.below(10));  // 0-3 single box, 4-6 left/right, 7-9 next to
    const std::string answer = kNumberWords[label];
    if (variant <= 3) {
      if (!place_box(make_box(label))) return std::nullopt;
      if (!add_distractors(rng_.uniform_int(0, 3), {})) return std::nullopt;
      return Composition{"which digit is in the box ?", answer, "digit_single"};
    }
    const int other_label = other_than(label, 10);
    if (variant <= 6) {
      const bool target_left = rng_.chance(0.5);
      DigitBox left = make_box(target_left ? label : other_label);
      DigitBox right = make_box(target_left ? other_label : label);
      constexpr int kSeparation = 6;  // px between the boxes: clearly side by side
      Region left_region;
      left_region.x_hi = kSceneSize - kEdgeMargin - right.side - kSeparation - left.side;
      if (!place_box(left, left_region)) return std::nullopt;
      Region right_region;
      right_region.x_lo = boxes.back().x + left.side + kSeparation;
      if (!place_box(right, right_region)) return std::nullopt;
      if (!add_distractors(rng_.uniform_int(0, 2), {})) return std::nullopt;
      return Composition{fmt::format("which digit is in the {} box ?", target_left ? "left" : "right"), answer,
                         "digit_left_right"};
    }
    // Two objects, each with a box beside it; the question names one object.
    const int shape_a = static_cast<int>(rng_.below(kNumShapes));
    const int color_a = static_cast<int>(rng_.below(kNumColors));
    int shape_b = static_cast<int>(rng_.below(kNumShapes));
    const int color_b = static_cast<int>(rng_.below(kNumColors));
    if (shape_b == shape_a && color_b == color_a) shape_b = other_than(shape_a, kNumShapes);
    constexpr double kFar = 12.0;  // px: the other object/box is clearly not "next to"
    if (!place(make_object(shape_a, color_a, false))) return std::nullopt;
    if (!place(make_object(shape_b, color_b, false), {},
               [&](const Object& b) { return gap(b.rect(), objects.front().rect()) >= 40.0; }))
      return std::nullopt;
    if (!place_box_beside(make_box(label), objects[0], kFar)) return std::nullopt;
    if (!place_box_beside(make_box(other_label), objects[1], kFar)) return std::nullopt;
    if (gap(boxes[1].rect(), objects[0].rect()) < kFar) return std::nullopt;
    return Composition{fmt::format("which digit is next to the {} ?", described(color_a, shape_a)), answer,
                       "digit_next_to"};
  }

  Rng& rng_;
  const DigitSheet& sheet_;
  DigitSplit digit_split_;
};

// ---------------------------------------------------------------------------
// Rendering

cv::Vec3b light_color(Rng& rng) {
  const int gray = rng.uniform_int(200, 245);
  auto channel = [&] { return static_cast<uint8_t>(std::clamp(gray + rng.uniform_int(-8, 8), 0, 255)); };
  const uint8_t r = channel(), g = channel(), b = channel();
  return {r, g, b};
}

std::string render_background(Rng& rng, cv::Mat& image) {
  const int kind = static_cast<int>(rng.below(3));
  const cv::Vec3b base = light_color(rng);
  image.setTo(cv::Scalar(base[0], base[1], base[2]));
  if (kind == 1) {  // light per-pixel noise, +-10 levels
    for (int y = 0; y < image.rows; ++y) {
      auto* row = image.ptr<cv::Vec3b>(y);
      for (int x = 0; x < image.cols; ++x) {
        for (int c = 0; c < 3; ++c) row[x][c] = static_cast<uint8_t>(std::clamp(row[x][c] + rng.uniform_int(-10, 10), 0, 255));
      }
    }
    return "noise";
  }
  if (kind == 2) {  // linear gradient between two light colours along a random direction
    const cv::Vec3b other = light_color(rng);
    const double angle = rng.uniform(0.0, 2.0 * std::numbers::pi);
    const double ux = std::cos(angle), uy = std::sin(angle);
    const double half_span = (std::abs(ux) + std::abs(uy)) * (kSceneSize - 1) / 2.0;
    for (int y = 0; y < image.rows; ++y) {
      auto* row = image.ptr<cv::Vec3b>(y);
      for (int x = 0; x < image.cols; ++x) {
        const double proj = (x - (kSceneSize - 1) / 2.0) * ux + (y - (kSceneSize - 1) / 2.0) * uy;
        const double t = 0.5 + 0.5 * proj / half_span;
        for (int c = 0; c < 3; ++c) row[x][c] = static_cast<uint8_t>(std::lround(base[c] * (1 - t) + other[c] * t));
      }
    }
    return "gradient";
  }
  return "plain";
}

constexpr int kShiftBits = 4;  // OpenCV drawing with 1/16-pixel precision
constexpr double kShiftScale = 1 << kShiftBits;

cv::Point fixed_point(double x, double y) {
  return {static_cast<int>(std::lround(x * kShiftScale)), static_cast<int>(std::lround(y * kShiftScale))};
}

void draw_object(cv::Mat& image, const Object& o) {
  const cv::Scalar fill(o.rgb[0], o.rgb[1], o.rgb[2]);
  const cv::Scalar edge(o.rgb[0] * 0.6, o.rgb[1] * 0.6, o.rgb[2] * 0.6);  // darker rim keeps yellow visible
  if (o.shape == kCircle) {
    const cv::Point centre = fixed_point(o.cx, o.cy);
    const int r = static_cast<int>(std::lround(o.radius * kShiftScale));
    cv::circle(image, centre, r, fill, cv::FILLED, cv::LINE_AA, kShiftBits);
    cv::circle(image, centre, r, edge, 1, cv::LINE_AA, kShiftBits);
    return;
  }
  std::vector<cv::Point> poly;
  for (const auto& p : o.outline) poly.push_back(fixed_point(o.cx + p.x, o.cy + p.y));
  const std::vector<std::vector<cv::Point>> polys = {poly};
  cv::fillPoly(image, polys, fill, cv::LINE_AA, kShiftBits);
  cv::polylines(image, polys, true, edge, 1, cv::LINE_AA, kShiftBits);
}

void draw_box(cv::Mat& image, const DigitBox& box, const DigitSheet& sheet) {
  const int inner = box.side - 2;
  // Stretch the strokes to full contrast first: a few sheet digits are faint
  // (peak 190 of 255) and upscaling blurs thin strokes further.
  const cv::Mat cell = sheet.cell(box.sheet_index);
  double peak = 0;
  cv::minMaxLoc(cell, nullptr, &peak);
  cv::Mat stretched;
  cell.convertTo(stretched, CV_8U, peak > 0 ? 255.0 / peak : 1.0);
  cv::Mat scaled;
  cv::resize(stretched, scaled, cv::Size(inner, inner), 0, 0, cv::INTER_LINEAR);
  cv::Mat paper = 255 - scaled;  // dark ink on white paper
  cv::Mat paper_rgb;
  cv::cvtColor(paper, paper_rgb, cv::COLOR_GRAY2RGB);
  image(cv::Rect(box.x, box.y, box.side, box.side)).setTo(cv::Scalar(45, 45, 45));
  paper_rgb.copyTo(image(cv::Rect(box.x + 1, box.y + 1, inner, inner)));
}

const std::array<BuiltinSplitInfo, 4> kSplits = {{
    {"train", 50'000, DigitSplit::kTrain},
    {"calib", 512, DigitSplit::kCalib},
    {"eval", 2'000, DigitSplit::kEval},
    {"stress", 500, DigitSplit::kEval},
}};

}  // namespace

const BuiltinSplitInfo& builtin_split_info(BuiltinSplit split) { return kSplits[static_cast<std::size_t>(split)]; }

std::optional<BuiltinSplit> parse_builtin_split(std::string_view name) {
  for (std::size_t i = 0; i < kSplits.size(); ++i) {
    if (kSplits[i].name == name) return static_cast<BuiltinSplit>(i);
  }
  return std::nullopt;
}

const std::vector<std::string>& builtin_question_types() {
  static const std::vector<std::string> types = {"color", "shape", "count", "exist",
                                                 "position", "relation", "size", "digit"};
  return types;
}

const std::vector<std::string>& builtin_answers(std::string_view question_type) {
  const auto& types = builtin_question_types();
  const auto it = std::find(types.begin(), types.end(), question_type);
  if (it == types.end()) {
    throw InputError(fmt::format("unknown builtin question type '{}' (expected one of: {})", question_type,
                                 fmt::join(types, ", ")));
  }
  return answer_sets()[static_cast<std::size_t>(it - types.begin())];
}

const std::vector<std::string>& builtin_shapes() {
  static const std::vector<std::string> shapes = shape_list();
  return shapes;
}

const std::vector<std::string>& builtin_colors() {
  static const std::vector<std::string> colors = color_list();
  return colors;
}

const std::vector<std::string>& builtin_sizes() {
  static const std::vector<std::string> sizes = {"small", "large"};
  return sizes;
}

const std::vector<std::string>& builtin_vocabulary() {
  static const std::vector<std::string> vocabulary = [] {
    std::set<std::string> words(kTemplateWords.begin(), kTemplateWords.end());
    words.insert(kShapeNames.begin(), kShapeNames.end());
    words.insert(kShapePlurals.begin(), kShapePlurals.end());
    for (const auto& c : kColors) words.insert(c.name);
    for (const auto& set : answer_sets()) words.insert(set.begin(), set.end());
    return std::vector<std::string>(words.begin(), words.end());
  }();
  return vocabulary;
}

Sample generate_builtin_sample(BuiltinSplit split, std::size_t index) {
  const BuiltinSplitInfo& info = builtin_split_info(split);
  const std::string spec = fmt::format("builtin:{}", info.name);
  check_index(index, info.size, spec);
  const DigitSheet& sheet = DigitSheet::shared();

  // Stratified question type and answer: a fixed permutation of the indices
  // spreads them evenly, so every split (and any large prefix) is balanced.
  const uint64_t split_key = hash_name(fmt::format("vlmopt.scenes.v1/{}", info.name));
  const IndexPermutation permutation(info.size, split_key ^ 0x51A7E5C0FFEEULL);
  const uint64_t slot = permutation(index);
  const int type = static_cast<int>(slot % kNumTypes);
  const auto& answers = answer_sets()[static_cast<std::size_t>(type)];
  const int answer_index = static_cast<int>((slot / kNumTypes) % answers.size());

  const uint64_t seed = mix64(split_key ^ mix64(index));
  Rng rng(seed);
  Composer composer(rng, sheet, info.digits);
  std::optional<Composition> composition;
  for (int attempt = 0; attempt < kComposeTries && !composition; ++attempt) {
    composer.reset();
    composition = composer.compose(type, answer_index);
  }
  VLMOPT_CHECK(composition.has_value(), "could not compose a scene for {} sample {}", spec, index);

  cv::Mat image(kSceneSize, kSceneSize, CV_8UC3);
  const std::string background = render_background(rng, image);
  nlohmann::json objects = nlohmann::json::array();
  for (const auto& o : composer.objects) {
    draw_object(image, o);
    objects.push_back({{"shape", kShapeNames[o.shape]},
                       {"color", kColors[o.color].name},
                       {"size", o.large ? "large" : "small"},
                       {"cx", o.cx},
                       {"cy", o.cy},
                       {"radius", o.radius},
                       {"rgb", o.rgb}});
  }
  nlohmann::json digits = nlohmann::json::array();
  for (const auto& b : composer.boxes) {
    draw_box(image, b, sheet);
    digits.push_back({{"sheet_index", b.sheet_index}, {"label", b.label}, {"x", b.x}, {"y", b.y}, {"side", b.side}});
  }

  Sample sample;
  sample.id = fmt::format("{}/{:06d}", spec, index);
  sample.image = std::move(image);
  sample.question = std::move(composition->question);
  sample.answer = std::move(composition->answer);
  sample.question_type = builtin_question_types()[static_cast<std::size_t>(type)];
  sample.meta = {{"split", info.name},       {"index", index},          {"seed", seed},
                 {"variant", composition->variant}, {"background", background}, {"objects", std::move(objects)},
                 {"digits", std::move(digits)}};
  return sample;
}

std::array<int, 3> jittered_color_rgb(Rng& rng, int color) {
  VLMOPT_CHECK(color >= 0 && color < kNumColors, "colour index {}", color);
  const auto& base = kColors[static_cast<std::size_t>(color)];
  return {std::clamp(base.r + rng.uniform_int(-kColorJitter, kColorJitter), 0, 255),
          std::clamp(base.g + rng.uniform_int(-kColorJitter, kColorJitter), 0, 255),
          std::clamp(base.b + rng.uniform_int(-kColorJitter, kColorJitter), 0, 255)};
}

namespace {

Object object_of(const ShapeSprite& sprite) {
  VLMOPT_CHECK(sprite.shape >= 0 && sprite.shape < kNumShapes, "shape index {}", sprite.shape);
  Object o;
  o.shape = sprite.shape;
  o.color = sprite.color;
  o.cx = sprite.cx;
  o.cy = sprite.cy;
  o.radius = sprite.radius;
  o.rotation = sprite.rotation;
  o.rgb = sprite.rgb;
  o.outline = shape_outline(sprite.shape, sprite.radius, sprite.rotation);
  double extent = o.radius;
  for (const auto& p : o.outline) extent = std::max({extent, std::abs(p.x), std::abs(p.y)});
  o.half = static_cast<int>(std::ceil(extent)) + 1;  // +1: anti-aliased outline
  return o;
}

}  // namespace

int sprite_half_extent(const ShapeSprite& sprite) { return object_of(sprite).half; }

void draw_sprite(cv::Mat& rgb_image, const ShapeSprite& sprite) {
  VLMOPT_CHECK(rgb_image.type() == CV_8UC3, "sprite target image type {}", rgb_image.type());
  draw_object(rgb_image, object_of(sprite));
}

std::string draw_scene_background(Rng& rng, cv::Mat& rgb_image) {
  VLMOPT_CHECK(rgb_image.type() == CV_8UC3, "background image type {}", rgb_image.type());
  return render_background(rng, rgb_image);
}

BuiltinSource::BuiltinSource(BuiltinSplit split) : split_(split) {
  DigitSheet::shared();  // fail now, not at the first digit question
}

std::size_t BuiltinSource::size() const { return builtin_split_info(split_).size; }

Sample BuiltinSource::get(std::size_t i) const { return generate_builtin_sample(split_, i); }

std::string BuiltinSource::describe() const {
  const auto& info = builtin_split_info(split_);
  return fmt::format("builtin:{} ({} synthetic VQA scenes, {}x{} RGB, {} question types, {} digits)", info.name,
                     info.size, kSceneSize, kSceneSize, builtin_question_types().size(),
                     digit_split_name(info.digits));
}

}  // namespace vlmopt::datasets
