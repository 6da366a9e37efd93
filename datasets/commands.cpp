#include "datasets/commands.hpp"

#include "datasets/hdf5_pack.hpp"
#include "datasets/scenes.hpp"
#include "datasets/source.hpp"
#include "io/atomic_file.hpp"
#include "io/hash.hpp"
#include "util/error.hpp"

#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cmath>
#include <span>

namespace vlmopt::datasets {

namespace fs = std::filesystem;

nlohmann::json show(const ShowOptions& options) {
  const auto source = open_dataset(options.spec);
  if (options.dump_dir) {
    std::error_code ec;
    fs::create_directories(*options.dump_dir, ec);
    if (ec) throw_file_error(*options.dump_dir, "cannot create the dump directory: {}", ec.message());
  }
  nlohmann::json samples = nlohmann::json::array();
  const std::size_t count = std::min(options.limit, source->size());
  for (std::size_t i = 0; i < count; ++i) {
    const Sample sample = source->get(i);
    nlohmann::json entry = {{"index", i},
                            {"id", sample.id},
                            {"width", sample.image.cols},
                            {"height", sample.image.rows},
                            {"frames", sample.frames.size()},
                            {"question", sample.question},
                            {"answer", sample.answer},
                            {"question_type", sample.question_type},
                            {"meta", sample.meta}};
    if (options.dump_dir) {
      const auto write_png = [&](const cv::Mat& rgb, const std::string& name) {
        cv::Mat bgr;
        cv::cvtColor(rgb, bgr, cv::COLOR_RGB2BGR);
        std::vector<uint8_t> png;
        if (!cv::imencode(".png", bgr, png)) throw Error(ExitCode::kFailure, fmt::format("cannot encode sample {} as PNG", i));
        const fs::path file = *options.dump_dir / name;
        io::write_file_atomic(file, std::as_bytes(std::span(png)));
        return file.string();
      };
      entry["image_file"] = write_png(sample.image, fmt::format("sample_{:06d}.png", i));
      if (!sample.frames.empty()) {
        // Frame 0 is the image above; later frames get their frame number.
        nlohmann::json frame_files = nlohmann::json::array();
        for (size_t f = 0; f < sample.frames.size(); ++f)
          frame_files.push_back(write_png(sample.frames[f], fmt::format("sample_{:06d}_frame{}.png", i, f + 1)));
        entry["frame_files"] = std::move(frame_files);
      }
    }
    samples.push_back(std::move(entry));
  }
  return {{"spec", options.spec},
          {"description", source->describe()},
          {"size", source->size()},
          {"samples", std::move(samples)}};
}

std::string format_show(const nlohmann::json& result) {
  std::string out = fmt::format("{}\n{} samples\n", result.at("description").get<std::string>(),
                                result.at("size").get<std::size_t>());
  for (const auto& s : result.at("samples")) {
    const std::string type = s.at("question_type").get<std::string>();
    out += fmt::format("\n[{}] {}  {}x{}{}{}\n", s.at("index").get<std::size_t>(), s.at("id").get<std::string>(),
                       s.at("width").get<int>(), s.at("height").get<int>(), type.empty() ? "" : "  type=", type);
    if (const auto frames = s.at("frames").get<std::size_t>(); frames > 0) {
      const auto& meta = s.at("meta");
      out += fmt::format("    frames: {} more", frames);
      if (meta.contains("frame_times_ms")) out += fmt::format(", times {} ms", meta.at("frame_times_ms").dump());
      if (meta.contains("event_frame")) out += fmt::format(", event at frame {}", meta.at("event_frame").dump());
      out += "\n";
    }
    out += fmt::format("    Q: {}\n    A: {}\n", s.at("question").get<std::string>(), s.at("answer").get<std::string>());
    if (s.contains("image_file")) out += fmt::format("    image: {}\n", s.at("image_file").get<std::string>());
  }
  return out;
}

nlohmann::json pack(const PackOptions& options) {
  const auto started = std::chrono::steady_clock::now();
  const auto source = open_dataset(options.spec);
  const std::size_t count = options.limit ? std::min(*options.limit, source->size()) : source->size();
  if (count == 0) {
    throw InputError(fmt::format("dataset spec '{}': nothing to pack ({} samples, --limit {})", options.spec,
                                 source->size(), options.limit.value_or(0)));
  }
  if (options.deflate_level < 0 || options.deflate_level > 9) {
    throw InputError(fmt::format("pack: deflate level must be 0..9 (got {})", options.deflate_level));
  }
  spdlog::info("packing {} of {} samples from {} into {}", count, source->size(), source->describe(),
               options.output.string());
  PackWriter writer(options.output, count, source->describe(), options.deflate_level);
  for (std::size_t i = 0; i < count; ++i) {
    writer.append(source->get(i));
    if ((i + 1) % 5000 == 0) spdlog::info("packed {}/{}", i + 1, count);
  }
  writer.commit();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return {{"spec", options.spec},
          {"description", source->describe()},
          {"output", options.output.string()},
          {"samples", count},
          {"bytes", fs::file_size(options.output)},
          {"sha256", io::sha256_file(options.output)},
          {"seconds", std::round(seconds * 1000.0) / 1000.0}};
}

std::string format_pack(const nlohmann::json& result) {
  return fmt::format("wrote {} ({} samples, {} bytes, sha256 {}) from {}\n", result.at("output").get<std::string>(),
                     result.at("samples").get<std::size_t>(), result.at("bytes").get<uint64_t>(),
                     result.at("sha256").get<std::string>(), result.at("description").get<std::string>());
}

nlohmann::json vocab() {
  nlohmann::json answers = nlohmann::json::object();
  for (const auto& type : builtin_question_types()) answers[type] = builtin_answers(type);
  return {{"words", builtin_vocabulary()}, {"question_types", builtin_question_types()}, {"answers", answers}};
}

std::string format_vocab(const nlohmann::json& result) {
  std::string out;
  for (const auto& word : result.at("words")) out += word.get<std::string>() + "\n";
  return out;
}

}  // namespace vlmopt::datasets
