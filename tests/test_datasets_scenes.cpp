// Builtin synthetic VQA scenes (datasets/scenes.hpp): determinism, answers
// re-derived from the scene description by an independent answerer, rendering
// consistent with that description, closed vocabulary, answer balance, digit
// split disjointness.
#include "datasets/digits.hpp"
#include "datasets/scenes.hpp"
#include "datasets/source.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <opencv2/imgproc.hpp>

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

struct ObjectFact {
  std::string shape, color, size;
  int cx = 0, cy = 0, radius = 0;
  std::array<int, 3> rgb{};
};

struct BoxFact {
  int sheet_index = 0, label = 0, x = 0, y = 0, side = 0;
};

std::vector<ObjectFact> objects_of(const Sample& s) {
  std::vector<ObjectFact> out;
  for (const auto& o : s.meta.at("objects")) {
    out.push_back({o.at("shape"), o.at("color"), o.at("size"), o.at("cx"), o.at("cy"), o.at("radius"), o.at("rgb")});
  }
  return out;
}

std::vector<BoxFact> boxes_of(const Sample& s) {
  std::vector<BoxFact> out;
  for (const auto& b : s.meta.at("digits")) {
    out.push_back({b.at("sheet_index"), b.at("label"), b.at("x"), b.at("y"), b.at("side")});
  }
  return out;
}

const std::vector<std::string> kNumbers = {"zero", "one", "two", "three", "four",
                                           "five", "six", "seven", "eight", "nine"};

bool is_shape(const std::string& w) {
  const auto& s = builtin_shapes();
  return std::find(s.begin(), s.end(), w) != s.end();
}
bool is_color(const std::string& w) {
  const auto& c = builtin_colors();
  return std::find(c.begin(), c.end(), w) != c.end();
}

// Objects matching optional colour / shape / size words.
std::vector<ObjectFact> matching(const std::vector<ObjectFact>& objects, const std::string& color,
                                 const std::string& shape, const std::string& size = "") {
  std::vector<ObjectFact> out;
  for (const auto& o : objects) {
    if ((color.empty() || o.color == color) && (shape.empty() || o.shape == shape) && (size.empty() || o.size == size))
      out.push_back(o);
  }
  return out;
}

// The one object a definite description ("the red circle") refers to; the
// question must make it unique.
ObjectFact the(const std::vector<ObjectFact>& objects, const std::string& color, const std::string& shape,
               const std::string& size, const std::string& question) {
  const auto found = matching(objects, color, shape, size);
  INFO("question: ", question);
  REQUIRE(found.size() == 1);
  return found.front();
}

double point_to_box(const ObjectFact& o, const BoxFact& b) {
  const double dx = std::max({0.0, b.x - static_cast<double>(o.cx), o.cx - (b.x + b.side - 1.0)});
  const double dy = std::max({0.0, b.y - static_cast<double>(o.cy), o.cy - (b.y + b.side - 1.0)});
  return std::hypot(dx, dy);
}

// Answers a builtin question from the scene description alone, checking on
// the way that the question is unambiguous. Written from the question
// grammar, not from the generator's code.
std::string answer_from_meta(const Sample& s) {
  const auto w = words_of(s.question);
  const auto objects = objects_of(s);
  const auto boxes = boxes_of(s);
  REQUIRE(w.size() >= 4);
  REQUIRE(w.back() == "?");
  const std::string q = s.question;
  constexpr double centre = (96 - 1) / 2.0;  // pixel-centre coordinate of the image middle

  if (w[0] == "what" && w[1] == "color") {  // what color is the [size] shape ?
    const bool sized = w.size() == 7;
    return the(objects, "", w[w.size() - 2], sized ? w[4] : "", q).color;
  }
  if (w[0] == "what" && w[1] == "shape") {  // what shape is the color object ?
    return the(objects, w[4], "", "", q).shape;
  }
  if (w[0] == "how" && w[1] == "many") {  // how many plural are there ? | how many color objects are there ?
    std::size_t n = 0;
    if (is_color(w[2])) {
      n = matching(objects, w[2], "").size();
    } else {
      for (const auto& shape : builtin_shapes()) {
        if (w[2] == shape + "s" || w[2] == shape + "es") n = matching(objects, "", shape).size();
      }
    }
    REQUIRE(n < kNumbers.size());
    return kNumbers[n];
  }
  if (w[0] == "is" && w[1] == "there") {  // is there a|an [color] [shape|object] ?
    CHECK((w[2] == "a" || w[2] == "an"));
    CHECK((w[2] == "an") == (std::string("aeiou").find(w[3][0]) != std::string::npos));
    std::string color, shape;
    for (std::size_t i = 3; i + 1 < w.size(); ++i) {
      if (is_color(w[i])) color = w[i];
      if (is_shape(w[i])) shape = w[i];
    }
    return matching(objects, color, shape).empty() ? "no" : "yes";
  }
  if (w[0] == "is" && w[1] == "the") {
    const ObjectFact a = the(objects, w[2], w[3], "", q);
    if (w[4] == "on") {  // on the left or the right ?
      CHECK(std::abs(a.cx - centre) >= 8.0);
      return a.cx < centre ? "left" : "right";
    }
    if (w[4] == "at") {  // at the top or the bottom ?
      CHECK(std::abs(a.cy - centre) >= 8.0);
      return a.cy < centre ? "top" : "bottom";
    }
    if (w[4] == "small") return a.size;  // small or large ?
    // relation: is the A left of|right of|above|below the B ?
    const std::size_t rel_end = (w[4] == "left" || w[4] == "right") ? 6 : 5;
    REQUIRE(w[rel_end] == "the");
    const ObjectFact b = the(objects, w[rel_end + 1], w[rel_end + 2], "", q);
    const int dx = b.cx - a.cx, dy = b.cy - a.cy;
    const int d = (w[4] == "left" || w[4] == "right") ? dx : dy;
    CHECK(std::abs(d) >= 8);  // never a near tie
    bool holds = false;
    if (w[4] == "left") holds = dx > 0;
    if (w[4] == "right") holds = dx < 0;
    if (w[4] == "above") holds = dy > 0;
    if (w[4] == "below") holds = dy < 0;
    return holds ? "yes" : "no";
  }
  if (w[0] == "which" && w[1] == "digit") {
    if (w[3] == "in" && w[5] == "box") {  // which digit is in the box ?
      REQUIRE(boxes.size() == 1);
      return kNumbers[static_cast<std::size_t>(boxes[0].label)];
    }
    if (w[3] == "in") {  // which digit is in the left|right box ?
      REQUIRE(boxes.size() == 2);
      auto sorted = boxes;
      std::sort(sorted.begin(), sorted.end(), [](const BoxFact& x, const BoxFact& y) { return x.x < y.x; });
      CHECK(sorted[0].x + sorted[0].side < sorted[1].x);  // side by side, no horizontal overlap
      return kNumbers[static_cast<std::size_t>(w[5] == "left" ? sorted[0].label : sorted[1].label)];
    }
    // which digit is next to the color shape ?
    REQUIRE(w[3] == "next");
    const ObjectFact a = the(objects, w[6], w[7], "", q);
    REQUIRE(boxes.size() >= 2);
    std::vector<std::pair<double, int>> by_distance;
    for (const auto& b : boxes) by_distance.emplace_back(point_to_box(a, b), b.label);
    std::sort(by_distance.begin(), by_distance.end());
    CHECK(by_distance[1].first - by_distance[0].first >= 2.0);  // clearly the nearest box
    return kNumbers[static_cast<std::size_t>(by_distance[0].second)];
  }
  FAIL("unrecognised question: ", q);
  return {};
}

const std::map<std::string, std::array<int, 3>> kPalette = {
    {"red", {215, 40, 40}},  {"green", {40, 160, 60}},   {"blue", {40, 80, 215}},
    {"yellow", {235, 200, 30}}, {"purple", {140, 60, 190}}, {"orange", {245, 135, 30}}};

std::string nearest_palette_color(const cv::Vec3b& rgb) {
  std::string best;
  double best_d = 1e9;
  for (const auto& [name, c] : kPalette) {
    const double d = std::hypot(rgb[0] - c[0], rgb[1] - c[1], rgb[2] - c[2]);
    if (d < best_d) {
      best_d = d;
      best = name;
    }
  }
  return best;
}

// The rendering agrees with the description: each object's centre pixel has
// its colour, objects do not overlap, digit boxes have a dark frame and ink.
void check_rendering(const Sample& s) {
  REQUIRE(s.image.type() == CV_8UC3);
  REQUIRE(s.image.rows == kSceneSize);
  REQUIRE(s.image.cols == kSceneSize);
  const auto objects = objects_of(s);
  const auto boxes = boxes_of(s);
  CHECK(objects.size() <= 6);
  CHECK(objects.size() + boxes.size() >= 1);
  for (std::size_t i = 0; i < objects.size(); ++i) {
    const auto& o = objects[i];
    const cv::Vec3b px = s.image.at<cv::Vec3b>(o.cy, o.cx);
    INFO(s.id, " object ", i, " ", o.color, " ", o.shape, " pixel ", int(px[0]), ",", int(px[1]), ",", int(px[2]));
    CHECK(nearest_palette_color(px) == o.color);
    CHECK(((o.size == "small" && o.radius >= 6 && o.radius <= 10) || (o.size == "large" && o.radius >= 12)));
    for (std::size_t j = i + 1; j < objects.size(); ++j) {
      const auto& p = objects[j];
      CHECK(std::max(std::abs(o.cx - p.cx), std::abs(o.cy - p.cy)) >= o.radius + p.radius + 1);
    }
    for (const auto& b : boxes) {  // object centres are outside every box
      CHECK(!(o.cx >= b.x && o.cx < b.x + b.side && o.cy >= b.y && o.cy < b.y + b.side));
    }
  }
  for (const auto& b : boxes) {
    REQUIRE(b.x >= 0);
    REQUIRE(b.y >= 0);
    REQUIRE(b.x + b.side <= kSceneSize);
    REQUIRE(b.y + b.side <= kSceneSize);
    CHECK(digit_label_of(b.sheet_index) == b.label);
    const cv::Mat roi = s.image(cv::Rect(b.x, b.y, b.side, b.side));
    const cv::Vec3b corner = roi.at<cv::Vec3b>(0, 0);
    CHECK(corner[0] < 80);  // the frame
    cv::Mat gray;
    cv::cvtColor(roi(cv::Rect(1, 1, b.side - 2, b.side - 2)), gray, cv::COLOR_RGB2GRAY);
    const int ink = cv::countNonZero(gray < 100);
    const int paper = cv::countNonZero(gray > 200);
    CHECK(ink >= 6);  // the faintest sheet digit at 24 px still has 8
    CHECK(paper > ink);
  }
}

}  // namespace

TEST_CASE("builtin splits: sizes, specs and errors") {
  CHECK(open_dataset("builtin:train")->size() == 50'000);
  CHECK(open_dataset("builtin:calib")->size() == 512);
  CHECK(open_dataset("builtin:eval")->size() == 2'000);
  CHECK(open_dataset("builtin:stress")->size() == 500);
  CHECK(open_dataset("builtin:eval")->describe().find("builtin:eval") != std::string::npos);
  try {
    open_dataset("builtin:tain");
    FAIL("expected an InputError");
  } catch (const vlmopt::InputError& e) {
    CHECK(std::string(e.what()).find("builtin:tain") != std::string::npos);
  }
  CHECK_THROWS_AS(open_dataset(""), vlmopt::InputError);
  CHECK_THROWS_AS(open_dataset("no/such/file.txt"), vlmopt::InputError);
  const auto calib = open_dataset("builtin:calib");
  CHECK_THROWS_AS(calib->get(512), vlmopt::InputError);
}

TEST_CASE("builtin samples are deterministic per (split, index) and differ between them") {
  const auto eval = open_dataset("builtin:eval");
  for (std::size_t i : {0u, 1u, 977u, 1999u}) {
    const Sample a = eval->get(i);
    const Sample b = generate_builtin_sample(BuiltinSplit::kEval, i);
    CHECK(a.id == b.id);
    CHECK(a.question == b.question);
    CHECK(a.answer == b.answer);
    CHECK(a.question_type == b.question_type);
    CHECK(a.meta == b.meta);
    REQUIRE(a.image.size() == b.image.size());
    CHECK(cv::norm(a.image, b.image, cv::NORM_INF) == 0.0);
  }
  // Calling in a different order gives the same samples (no hidden state).
  const Sample late_first = eval->get(1999);
  const Sample zero = eval->get(0);
  CHECK(cv::norm(zero.image, eval->get(0).image, cv::NORM_INF) == 0.0);
  CHECK(cv::norm(late_first.image, zero.image, cv::NORM_INF) > 0.0);
  // The same index in another split is another scene.
  const Sample stress0 = generate_builtin_sample(BuiltinSplit::kStress, 0);
  CHECK(cv::norm(stress0.image, zero.image, cv::NORM_INF) > 0.0);
}

TEST_CASE("builtin answers follow from the scene description, and the rendering matches it") {
  std::size_t checked = 0;
  for (auto [split, count] : {std::pair{BuiltinSplit::kEval, std::size_t{2000}}, std::pair{BuiltinSplit::kTrain, std::size_t{600}},
                              std::pair{BuiltinSplit::kCalib, std::size_t{512}}, std::pair{BuiltinSplit::kStress, std::size_t{200}}}) {
    for (std::size_t i = 0; i < count; ++i) {
      const Sample s = generate_builtin_sample(split, i);
      INFO(s.id, ": ", s.question, " -> ", s.answer);
      CHECK(answer_from_meta(s) == s.answer);
      check_rendering(s);
      ++checked;
    }
  }
  CHECK(checked == 3312);
}

TEST_CASE("builtin questions and answers use only the closed vocabulary") {
  const auto& vocabulary = builtin_vocabulary();
  const std::set<std::string> vocab(vocabulary.begin(), vocabulary.end());
  CHECK(vocab.size() == vocabulary.size());                      // unique
  CHECK(std::is_sorted(vocabulary.begin(), vocabulary.end()));   // stable order for tokenizers
  CHECK(vocab.count("?") == 1);
  const auto& types = builtin_question_types();
  CHECK(types == std::vector<std::string>{"color", "shape", "count", "exist", "position", "relation", "size", "digit"});
  for (const auto& type : types) {
    for (const auto& answer : builtin_answers(type)) CHECK(vocab.count(answer) == 1);
  }
  CHECK_THROWS_AS(builtin_answers("colour"), vlmopt::InputError);

  std::set<std::string> seen_words;
  for (auto split : {BuiltinSplit::kEval, BuiltinSplit::kTrain}) {
    for (std::size_t i = 0; i < 2000; ++i) {
      const Sample s = generate_builtin_sample(split, i);
      INFO(s.id, ": '", s.question, "' -> '", s.answer, "'");
      // Single spaces, lowercase words, the final "?" a word of its own.
      CHECK(s.question.find("  ") == std::string::npos);
      CHECK(s.question.ends_with(" ?"));
      CHECK(s.question.front() != ' ');
      for (const auto& word : words_of(s.question)) {
        CHECK(vocab.count(word) == 1);
        CHECK(std::none_of(word.begin(), word.end(), [](char c) { return std::isupper(static_cast<unsigned char>(c)); }));
        seen_words.insert(word);
      }
      const auto& answers = builtin_answers(s.question_type);
      CHECK(std::find(answers.begin(), answers.end(), s.answer) != answers.end());
      CHECK(words_of(s.answer).size() == 1);
    }
  }
  // The templates really use the vocabulary (no dead words besides answers).
  CHECK(seen_words.size() >= vocabulary.size() - 12);
}

TEST_CASE("builtin question types and answers are balanced") {
  // Full eval split and a prefix of train: per type, each answer's count is
  // within 4 binomial standard deviations of uniform (eval is stratified, so tighter).
  for (auto [split, count, exact] :
       {std::tuple{BuiltinSplit::kEval, std::size_t{2000}, true}, std::tuple{BuiltinSplit::kTrain, std::size_t{2400}, false}}) {
    std::map<std::string, std::map<std::string, int>> by_type;
    for (std::size_t i = 0; i < count; ++i) {
      const Sample s = generate_builtin_sample(split, i);
      ++by_type[s.question_type][s.answer];
    }
    REQUIRE(by_type.size() == builtin_question_types().size());
    for (const auto& [type, answers] : by_type) {
      int total = 0;
      for (const auto& [a, n] : answers) total += n;
      const double expected_type = static_cast<double>(count) / builtin_question_types().size();
      INFO(type, " total ", total);
      CHECK(std::abs(total - expected_type) <= (exact ? 1.0 : 4.0 * std::sqrt(expected_type)));
      const auto& answer_set = builtin_answers(type);
      CHECK(answers.size() == answer_set.size());  // every answer occurs
      const double p = 1.0 / answer_set.size();
      const double expected = total * p;
      const double sigma = std::sqrt(total * p * (1 - p));
      for (const auto& [a, n] : answers) {
        INFO(type, "/", a, ": ", n, " of ", total);
        CHECK(std::abs(n - expected) <= (exact ? 1.0 : 4.0 * sigma));
      }
    }
  }
}

TEST_CASE("digit sheet: split rule, pools, and splits that never share a digit image") {
  const DigitSheet& sheet = DigitSheet::shared();
  std::array<std::size_t, 3> totals{};
  for (int label = 0; label < 10; ++label) {
    CHECK(sheet.pool(DigitSplit::kTrain, label).size() == 300);  // 60 columns x 5 rows
    CHECK(sheet.pool(DigitSplit::kCalib, label).size() == 75);
    CHECK(sheet.pool(DigitSplit::kEval, label).size() == 125);
    for (auto split : {DigitSplit::kTrain, DigitSplit::kCalib, DigitSplit::kEval}) {
      for (int index : sheet.pool(split, label)) {
        CHECK(digit_label_of(index) == label);
        CHECK(digit_split_of(index) == split);
        ++totals[static_cast<int>(split)];
      }
    }
  }
  CHECK(totals == std::array<std::size_t, 3>{3000, 750, 1250});
  CHECK(sheet.cell(0).size() == cv::Size(20, 20));

  // Digit images actually used by the scenes, by split.
  std::map<BuiltinSplit, std::set<int>> used;
  for (auto [split, count] : {std::pair{BuiltinSplit::kTrain, 4000}, std::pair{BuiltinSplit::kCalib, 512},
                              std::pair{BuiltinSplit::kEval, 2000}, std::pair{BuiltinSplit::kStress, 500}}) {
    for (int i = 0; i < count; ++i) {
      const Sample s = generate_builtin_sample(split, static_cast<std::size_t>(i));
      for (const auto& d : s.meta.at("digits")) used[split].insert(d.at("sheet_index").get<int>());
    }
    CHECK(used[split].size() > 20);
  }
  const auto disjoint = [](const std::set<int>& a, const std::set<int>& b) {
    return std::none_of(a.begin(), a.end(), [&](int x) { return b.count(x) > 0; });
  };
  CHECK(disjoint(used[BuiltinSplit::kTrain], used[BuiltinSplit::kCalib]));
  CHECK(disjoint(used[BuiltinSplit::kTrain], used[BuiltinSplit::kEval]));
  CHECK(disjoint(used[BuiltinSplit::kTrain], used[BuiltinSplit::kStress]));
  CHECK(disjoint(used[BuiltinSplit::kCalib], used[BuiltinSplit::kEval]));
  CHECK(disjoint(used[BuiltinSplit::kCalib], used[BuiltinSplit::kStress]));
  for (int index : used[BuiltinSplit::kTrain]) CHECK(digit_split_of(index) == DigitSplit::kTrain);
  for (int index : used[BuiltinSplit::kCalib]) CHECK(digit_split_of(index) == DigitSplit::kCalib);
  for (int index : used[BuiltinSplit::kEval]) CHECK(digit_split_of(index) == DigitSplit::kEval);
}

TEST_CASE("a missing digit sheet is a clear InputError") {
  try {
    DigitSheet::load("/nonexistent/digits.png");
    FAIL("expected an InputError");
  } catch (const vlmopt::InputError& e) {
    CHECK(std::string(e.what()).find("/nonexistent/digits.png") != std::string::npos);
  }
}
