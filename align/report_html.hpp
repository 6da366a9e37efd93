// The self-contained HTML report of diagnose-align: one file with inline CSS,
// JS and SVG charts; images are PNG data: URIs (no network, no other files).
#pragma once

#include <nlohmann/json.hpp>
#include <opencv2/core.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace vlmopt::align {

// Standard base64 (RFC 4648, with '=' padding).
std::string base64_encode(std::span<const unsigned char> bytes);

// An attention heatmap over an image: `map` holds one non-negative weight per
// visual token in row-major patch order (a square grid, or a grid plus one
// leading class token, which is dropped). The image (RGB uint8) is center-cropped
// to a square, resized to `size` x `size`, and blended with the JET-coloured map.
// Returns PNG bytes; empty when the map is not a square grid.
std::vector<unsigned char> heatmap_png(const cv::Mat& rgb, std::span<const double> map, int size = 192);

struct HeatmapFigure {
  std::string sample_id;
  std::string caption;  // one line under the image
  std::vector<unsigned char> png;
};

// HTML-escapes text for element content and attribute values.
std::string html_escape(std::string_view text);

// The whole report page from align.json's contents and the heatmaps.
std::string render_report_html(const nlohmann::json& report, const std::vector<HeatmapFigure>& heatmaps);

}  // namespace vlmopt::align
