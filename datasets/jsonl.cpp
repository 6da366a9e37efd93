#include "datasets/jsonl.hpp"

#include "util/error.hpp"

#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include <algorithm>
#include <fstream>

namespace vlmopt::datasets {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kImagePlaceholder = "<image>";

bool is_human(const std::string& role) { return role == "human" || role == "user"; }
bool is_assistant(const std::string& role) { return role == "gpt" || role == "assistant"; }

std::string json_type(const nlohmann::json& value) { return value.type_name(); }

std::string trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r\n");
  return std::string(text.substr(first, last - first + 1));
}

}  // namespace

std::string clean_question(std::string_view human_value) {
  std::string without_placeholder;
  without_placeholder.reserve(human_value.size());
  for (std::size_t pos = 0; pos < human_value.size();) {
    if (human_value.substr(pos, kImagePlaceholder.size()) == kImagePlaceholder) {
      without_placeholder.push_back(' ');
      pos += kImagePlaceholder.size();
    } else {
      without_placeholder.push_back(human_value[pos++]);
    }
  }
  std::string out;
  bool pending_space = false;
  for (char c : without_placeholder) {
    if (c == ' ' || c == '\n' || c == '\r' || c == '\t') {
      pending_space = !out.empty();
      continue;
    }
    if (pending_space) out.push_back(' ');
    pending_space = false;
    out.push_back(c);
  }
  return out;
}

std::optional<fs::path> resolve_inside(const fs::path& canonical_root, const fs::path& relative) {
  std::error_code ec;
  const fs::path candidate = fs::weakly_canonical(canonical_root / relative, ec);
  if (ec) return std::nullopt;
  // Component-wise prefix test ("/data/a" must not accept "/data/ab/x").
  auto root_it = canonical_root.begin();
  auto cand_it = candidate.begin();
  for (; root_it != canonical_root.end(); ++root_it, ++cand_it) {
    if (root_it->empty()) continue;  // trailing separator of the root
    if (cand_it == candidate.end() || *root_it != *cand_it) return std::nullopt;
  }
  return candidate;
}

cv::Mat decode_image_rgb(const fs::path& path) {
  // IGNORE_ORIENTATION: transformers users feed PIL images, which do not apply EXIF rotation.
  cv::Mat bgr = cv::imread(path.string(), cv::IMREAD_COLOR | cv::IMREAD_IGNORE_ORIENTATION);
  if (bgr.empty()) return {};
  cv::Mat rgb;
  cv::cvtColor(bgr, rgb, cv::COLOR_BGR2RGB);
  return rgb;
}

JsonlSource::JsonlSource(const fs::path& jsonl_path) : JsonlSource(jsonl_path, jsonl_path.parent_path()) {}

JsonlSource::JsonlSource(const fs::path& jsonl_path, const fs::path& image_root) : file_(jsonl_path) {
  std::error_code ec;
  if (!fs::is_regular_file(file_, ec)) throw_file_error(file_, "no such JSONL file");
  const fs::path root = image_root.empty() ? fs::path(".") : image_root;
  root_ = fs::canonical(root, ec);
  if (ec || !fs::is_directory(root_)) throw_file_error(root, "dataset root is not a readable directory");

  std::ifstream in(file_, std::ios::binary);
  if (!in) throw_file_error(file_, "cannot open for reading");
  std::string text;
  std::size_t line_number = 0;
  while (std::getline(in, text)) {
    ++line_number;
    if (trim(text).empty()) continue;  // blank lines (e.g. a trailing newline) are not samples
    Entry entry;
    entry.line = line_number;
    const std::string at = fmt::format("{}:{}", file_.string(), line_number);

    nlohmann::json object;
    try {
      object = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      throw InputError(fmt::format("{}: invalid JSON at byte {} ({})", at, e.byte, e.what()));
    }
    if (!object.is_object()) throw InputError(fmt::format("{}: expected a JSON object, got {}", at, json_type(object)));

    if (const auto id = object.find("id"); id != object.end()) {
      if (id->is_string()) {
        entry.id = id->get<std::string>();
      } else if (id->is_number_integer()) {
        entry.id = id->dump();
      } else {
        throw InputError(fmt::format("{}: field 'id': expected a string or integer, got {}", at, json_type(*id)));
      }
    } else {
      entry.id = fmt::format("{}:{}", file_.filename().string(), line_number);
    }

    const auto image = object.find("image");
    if (image == object.end()) {
      throw InputError(fmt::format("{}: field 'image' is missing (text-only samples are not supported)", at));
    }
    if (!image->is_string() || image->get_ref<const std::string&>().empty()) {
      throw InputError(fmt::format("{}: field 'image': expected a non-empty string (one image path), got {}", at,
                                   image->is_string() ? "an empty string" : json_type(*image)));
    }
    entry.image = image->get<std::string>();

    const auto conversations = object.find("conversations");
    if (conversations == object.end() || !conversations->is_array()) {
      throw InputError(fmt::format("{}: field 'conversations': expected an array, got {}", at,
                                   conversations == object.end() ? "nothing" : json_type(*conversations)));
    }
    bool have_question = false, have_answer = false;
    for (std::size_t turn = 0; turn < conversations->size(); ++turn) {
      const auto& message = (*conversations)[turn];
      const auto from = message.is_object() ? message.find("from") : message.end();
      const auto value = message.is_object() ? message.find("value") : message.end();
      if (!message.is_object() || from == message.end() || !from->is_string() || value == message.end() ||
          !value->is_string()) {
        throw InputError(fmt::format(
            "{}: field 'conversations[{}]': expected {{\"from\": string, \"value\": string}}, got {}", at, turn,
            message.dump()));
      }
      const auto& role = from->get_ref<const std::string&>();
      if (!have_question && is_human(role)) {
        entry.question = clean_question(value->get_ref<const std::string&>());
        have_question = true;
      } else if (have_question && !have_answer && is_assistant(role)) {
        entry.answer = trim(value->get_ref<const std::string&>());
        have_answer = true;
      }
    }
    if (!have_question) throw InputError(fmt::format("{}: field 'conversations': no 'human' turn", at));
    if (!have_answer) throw InputError(fmt::format("{}: field 'conversations': no 'gpt' turn after the question", at));

    if (const auto type = object.find("question_type"); type != object.end()) {
      if (!type->is_string()) {
        throw InputError(fmt::format("{}: field 'question_type': expected a string, got {}", at, json_type(*type)));
      }
      entry.question_type = type->get<std::string>();
    }
    resolve(entry);  // refuse escaping paths now, before any consumer starts
    entries_.push_back(std::move(entry));
  }
  if (in.bad()) throw_file_error(file_, "read error");
}

std::string JsonlSource::where(const Entry& entry) const { return fmt::format("{}:{}", file_.string(), entry.line); }

fs::path JsonlSource::resolve(const Entry& entry) const {
  auto resolved = resolve_inside(root_, fs::path(entry.image));
  if (!resolved) {
    throw InputError(fmt::format("{}: field 'image': path '{}' leaves the dataset root {} (refused)", where(entry),
                                 entry.image, root_.string()));
  }
  return *resolved;
}

Sample JsonlSource::get(std::size_t i) const {
  check_index(i, entries_.size(), file_.string());
  const Entry& entry = entries_[i];
  const fs::path path = resolve(entry);  // again: the tree may have changed since opening
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw InputError(fmt::format("{}: image '{}' not found (resolved to {})", where(entry), entry.image, path.string()));
  }
  cv::Mat rgb = decode_image_rgb(path);
  if (rgb.empty()) {
    throw InputError(
        fmt::format("{}: cannot decode image '{}' (unreadable, corrupt or not an image)", where(entry), entry.image));
  }
  Sample sample;
  sample.id = entry.id;
  sample.image = std::move(rgb);
  sample.question = entry.question;
  sample.answer = entry.answer;
  sample.question_type = entry.question_type;
  sample.meta = {{"source", file_.string()}, {"line", entry.line}, {"image", entry.image}};
  return sample;
}

std::string JsonlSource::describe() const {
  return fmt::format("{} ({} LLaVA JSONL samples, images under {})", file_.string(), entries_.size(), root_.string());
}

}  // namespace vlmopt::datasets
