// LLaVA JSONL + image folder datasets (datasets/jsonl.hpp): a dataset built in
// a temp dir, path-escape refusal (also through symlinks), errors naming the line.
#include "test_support.hpp"
#include "datasets/jsonl.hpp"
#include "datasets/source.hpp"
#include "util/error.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>

#include <fstream>
#include <functional>
#include <random>

namespace {
using vlmopt::testing::TempDir;

namespace fs = std::filesystem;
using namespace vlmopt::datasets;

void write_text(const fs::path& path, std::string_view text) {
  std::ofstream out(path, std::ios::binary);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
}

// A solid BGR image with one marker pixel, written losslessly.
cv::Mat write_png(const fs::path& path, int width, int height, cv::Scalar bgr) {
  cv::Mat image(height, width, CV_8UC3, bgr);
  image.at<cv::Vec3b>(0, 0) = cv::Vec3b(1, 2, 3);
  REQUIRE(cv::imwrite(path.string(), image));
  return image;
}

std::string line(const std::string& id, const std::string& image, const std::string& question,
                 const std::string& answer) {
  nlohmann::json j = {{"id", id},
                      {"image", image},
                      {"conversations",
                       {{{"from", "human"}, {"value", question}}, {{"from", "gpt"}, {"value", answer}}}}};
  return j.dump() + "\n";
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const vlmopt::InputError& e) {
    return e.what();
  }
  FAIL("expected an InputError");
  return {};
}

}  // namespace

TEST_CASE("clean_question strips <image> and newlines") {
  CHECK(clean_question("<image>\nWhat is this?") == "What is this?");
  CHECK(clean_question("What is\nthis <image> thing?\n") == "What is this thing?");
  CHECK(clean_question("  a  \t b  ") == "a b");
  CHECK(clean_question("<image>") == "");
}

TEST_CASE("JSONL dataset: samples, RGB order, subfolders, blank lines") {
  TempDir dir;
  fs::create_directories(dir / "imgs");
  write_png(dir / "red.png", 40, 30, cv::Scalar(0, 0, 255));       // BGR red
  write_png(dir / "imgs/blue.png", 17, 23, cv::Scalar(255, 0, 0));  // BGR blue
  std::string text = line("a", "red.png", "<image>\nWhat color is it?", "Red.");
  text += "\n";  // blank line: skipped, but counts for line numbers
  text += line("b", "imgs/blue.png", "What color\nis it? <image>", " blue ");
  nlohmann::json extra = {{"image", "imgs/../red.png"},
                          {"question_type", "color"},
                          {"conversations",
                           {{{"from", "human"}, {"value", "<image>\nAgain?"}},
                            {{"from", "gpt"}, {"value", "yes"}},
                            {{"from", "human"}, {"value", "more?"}},
                            {{"from", "gpt"}, {"value", "no"}}}}};
  text += extra.dump() + "\n";
  write_text(dir / "data.jsonl", text);

  const auto source = open_dataset((dir / "data.jsonl").string());
  REQUIRE(source->size() == 3);
  CHECK(source->describe().find("3 LLaVA JSONL samples") != std::string::npos);

  const Sample a = source->get(0);
  CHECK(a.id == "a");
  CHECK(a.question == "What color is it?");
  CHECK(a.answer == "Red.");
  REQUIRE(a.image.type() == CV_8UC3);
  CHECK(a.image.size() == cv::Size(40, 30));
  CHECK(a.image.at<cv::Vec3b>(5, 5) == cv::Vec3b(255, 0, 0));  // RGB
  CHECK(a.image.at<cv::Vec3b>(0, 0) == cv::Vec3b(3, 2, 1));
  CHECK(a.meta.at("line") == 1);

  const Sample b = source->get(1);
  CHECK(b.question == "What color is it?");
  CHECK(b.answer == "blue");
  CHECK(b.image.size() == cv::Size(17, 23));
  CHECK(b.image.at<cv::Vec3b>(10, 10) == cv::Vec3b(0, 0, 255));
  CHECK(b.meta.at("line") == 3);
  CHECK(b.question_type.empty());

  const Sample c = source->get(2);
  CHECK(c.id == "data.jsonl:4");  // no id: file:line
  CHECK(c.answer == "yes");       // first gpt turn
  CHECK(c.question_type == "color");
  CHECK(c.image.size() == cv::Size(40, 30));
  CHECK_THROWS_AS(source->get(3), vlmopt::InputError);
}

TEST_CASE("JSONL dataset: image paths that leave the root are refused, also through symlinks") {
  TempDir outside;
  write_png(outside / "secret.png", 8, 8, cv::Scalar(9, 9, 9));
  TempDir dir;
  fs::create_directories(dir / "ok");
  write_png(dir / "ok/inside.png", 8, 8, cv::Scalar(1, 1, 1));
  fs::create_symlink(outside / "secret.png", dir / "link_out.png");
  fs::create_directory_symlink(outside.path(), dir / "dir_out");
  fs::create_symlink(dir / "ok/inside.png", dir / "link_in.png");

  const std::string relative_escape = (fs::path("..") / outside.path().filename() / "secret.png").string();
  for (const std::string& bad :
       {relative_escape, std::string("../../../../../../etc/hostname"), (outside / "secret.png").string(),
        std::string("link_out.png"), std::string("dir_out/secret.png"), std::string("ok/../../x.png")}) {
    write_text(dir / "data.jsonl", line("0", "ok/inside.png", "q", "a") + line("1", bad, "q", "a"));
    const std::string message = error_of([&] { JsonlSource source(dir / "data.jsonl"); });
    INFO(bad, " -> ", message);
    CHECK(message.find("data.jsonl:2") != std::string::npos);
    CHECK(message.find("leaves the dataset root") != std::string::npos);
  }
  // Symlinks that stay inside the root are fine.
  write_text(dir / "data.jsonl", line("0", "link_in.png", "q", "a"));
  JsonlSource source(dir / "data.jsonl");
  CHECK(source.get(0).image.size() == cv::Size(8, 8));
}

TEST_CASE("JSONL dataset: corrupt or missing images give an error naming the line") {
  TempDir dir;
  write_png(dir / "good.png", 8, 8, cv::Scalar(5, 6, 7));
  write_text(dir / "corrupt.png", "\x89PNG\r\n\x1a\n this is not really a PNG");
  write_text(dir / "data.jsonl", line("0", "good.png", "q", "a") + line("1", "good.png", "q", "a") +
                                     line("2", "corrupt.png", "q", "a") + line("3", "missing.jpg", "q", "a"));
  JsonlSource source(dir / "data.jsonl");
  REQUIRE(source.size() == 4);
  CHECK(source.get(1).image.size() == cv::Size(8, 8));
  const std::string corrupt = error_of([&] { source.get(2); });
  CHECK(corrupt.find("data.jsonl:3") != std::string::npos);
  CHECK(corrupt.find("corrupt.png") != std::string::npos);
  const std::string missing = error_of([&] { source.get(3); });
  CHECK(missing.find("data.jsonl:4") != std::string::npos);
  CHECK(missing.find("not found") != std::string::npos);
}

TEST_CASE("JSONL dataset: malformed lines name file, line and field") {
  TempDir dir;
  write_png(dir / "x.png", 4, 4, cv::Scalar(0, 0, 0));
  const std::string good = line("0", "x.png", "q", "a");
  struct Case {
    std::string text;
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"{not json\n", "invalid JSON"},
      {"[1, 2]\n", "expected a JSON object"},
      {R"({"conversations": []})" "\n", "field 'image'"},
      {R"({"image": 3, "conversations": []})" "\n", "field 'image'"},
      {R"({"image": "x.png"})" "\n", "field 'conversations'"},
      {R"({"image": "x.png", "conversations": [{"from": "human"}]})" "\n", "field 'conversations[0]'"},
      {R"({"image": "x.png", "conversations": [{"from": "human", "value": "q"}]})" "\n", "no 'gpt' turn"},
      {R"({"image": "x.png", "conversations": [{"from": "gpt", "value": "a"}]})" "\n", "no 'human' turn"},
      {R"({"id": [1], "image": "x.png", "conversations": []})" "\n", "field 'id'"},
  };
  for (const auto& c : cases) {
    write_text(dir / "bad.jsonl", good + c.text);
    const std::string message = error_of([&] { open_dataset((dir / "bad.jsonl").string()); });
    INFO(c.text, " -> ", message);
    CHECK(message.find("bad.jsonl:2") != std::string::npos);
    CHECK(message.find(c.expect) != std::string::npos);
  }
  CHECK(error_of([&] { open_dataset((dir / "none.jsonl").string()); }).find("none.jsonl") != std::string::npos);
}
