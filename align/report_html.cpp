#include "align/report_html.hpp"

#include "util/error.hpp"

#include <fmt/format.h>
#include <opencv2/imgcodecs.hpp>
#include <opencv2/imgproc.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace vlmopt::align {

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A JSON number as double, NaN for null / absent.
double number_or_nan(const nlohmann::json& j, const char* key) {
  const auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : kNaN;
}

std::string fmt_number(double v, int digits = 4) {
  return std::isfinite(v) ? fmt::format("{:.{}f}", v, digits) : std::string("&ndash;");
}

struct Series {
  std::string name;
  std::string color;
  std::vector<double> values;  // one per layer; NaN = no point
};

// An inline SVG line chart over decoder layers (x = layer index).
std::string line_chart(const std::string& title, const std::string& unit, const std::vector<Series>& series,
                       double threshold = kNaN) {
  constexpr double width = 440, height = 240, left = 56, right = 12, top = 40, bottom = 36;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  size_t points = 0;
  for (const auto& s : series) {
    points = std::max(points, s.values.size());
    for (const double v : s.values)
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  }
  if (std::isfinite(threshold)) lo = std::min(lo, threshold), hi = std::max(hi, threshold);
  if (!std::isfinite(lo)) lo = 0.0, hi = 1.0;
  if (hi - lo < 1e-9) lo -= 0.5, hi += 0.5;
  const double pad = 0.08 * (hi - lo);
  // Non-negative metrics (mass, entropy, divergence) keep 0 as the floor of the axis.
  lo = lo >= 0.0 ? std::max(0.0, lo - pad) : lo - pad;
  hi += pad;
  const double plot_w = width - left - right, plot_h = height - top - bottom;
  const auto x_of = [&](size_t i) { return left + (points > 1 ? plot_w * static_cast<double>(i) / static_cast<double>(points - 1) : plot_w / 2); };
  const auto y_of = [&](double v) { return top + plot_h * (hi - v) / (hi - lo); };

  std::string svg = fmt::format(
      R"(<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" role="img">)"
      R"(<title>{2}</title><text x="{3}" y="16" class="ctitle">{2}</text>)",
      width, height, html_escape(title), left);
  svg += fmt::format(R"(<rect x="{}" y="{}" width="{}" height="{}" class="plot"/>)", left, top, plot_w, plot_h);
  for (int k = 0; k <= 4; ++k) {
    const double v = lo + (hi - lo) * k / 4.0;
    svg += fmt::format(R"(<line x1="{0}" x2="{1}" y1="{2:.1f}" y2="{2:.1f}" class="grid"/><text x="{3}" y="{4:.1f}" class="ylab">{5}</text>)",
                       left, left + plot_w, y_of(v), left - 4, y_of(v) + 4, fmt_number(v, 3));
  }
  for (size_t i = 0; i < points; ++i)
    svg += fmt::format(R"(<text x="{:.1f}" y="{}" class="xlab">{}</text>)", x_of(i), top + plot_h + 14, i);
  svg += fmt::format(R"(<text x="{}" y="{}" class="xlab">decoder layer{}</text>)", left + plot_w / 2, height - 4,
                     unit.empty() ? "" : " &middot; " + html_escape(unit));
  if (std::isfinite(threshold))
    svg += fmt::format(R"(<line x1="{0}" x2="{1}" y1="{2:.1f}" y2="{2:.1f}" class="threshold"/>)", left, left + plot_w,
                       y_of(threshold));
  double legend_x = left + 4;
  for (const auto& s : series) {
    std::string path;
    for (size_t i = 0; i < s.values.size(); ++i) {
      if (!std::isfinite(s.values[i])) continue;
      path += fmt::format("{}{:.1f},{:.1f} ", path.empty() ? "M" : "L", x_of(i), y_of(s.values[i]));
      svg += fmt::format(R"(<circle cx="{:.1f}" cy="{:.1f}" r="3" fill="{}"><title>{} layer {}: {}</title></circle>)",
                         x_of(i), y_of(s.values[i]), s.color, html_escape(s.name), i, fmt_number(s.values[i]));
    }
    if (!path.empty()) svg += fmt::format(R"(<path d="{}" stroke="{}" class="line"/>)", path, s.color);
    svg += fmt::format(R"(<text x="{:.1f}" y="{}" fill="{}" class="legend">{}</text>)", legend_x, top - 6, s.color,
                       html_escape(s.name));
    legend_x += 9.0 * static_cast<double>(s.name.size()) + 16.0;
  }
  return svg + "</svg>";
}

// Layer x head grid of one per-head metric, coloured from white (low) to blue (high).
std::string head_grid(const std::string& title, const nlohmann::json& layers, const char* key) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  size_t heads = 0;
  for (const auto& l : layers) {
    const auto& v = l["heads"][key];
    heads = std::max(heads, v.size());
    for (const auto& x : v) lo = std::min(lo, x.get<double>()), hi = std::max(hi, x.get<double>());
  }
  if (heads == 0) return "";
  if (hi - lo < 1e-12) hi = lo + 1.0;
  constexpr int cell = 26, left = 60, top = 28;
  const int width = std::max(left + cell * static_cast<int>(heads) + 8, 7 * static_cast<int>(title.size()) + 12);
  const int height = top + cell * static_cast<int>(layers.size()) + 22;
  std::string svg = fmt::format(
      R"(<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" role="img">)"
      R"(<title>{2}</title><text x="4" y="16" class="ctitle">{2}</text>)",
      width, height, html_escape(title));
  for (size_t l = 0; l < layers.size(); ++l) {
    svg += fmt::format(R"(<text x="{}" y="{}" class="ylab">layer {}</text>)", left - 4, top + cell * static_cast<int>(l) + 17, l);
    const auto& v = layers[l]["heads"][key];
    for (size_t h = 0; h < v.size(); ++h) {
      const double x = v[h].get<double>();
      const double t = (x - lo) / (hi - lo);
      const int r = static_cast<int>(255 - 200 * t), g = static_cast<int>(255 - 140 * t);
      svg += fmt::format(R"svg(<rect x="{}" y="{}" width="{}" height="{}" fill="rgb({},{},255)"><title>layer {} head {}: {}</title></rect>)svg",
                         left + cell * static_cast<int>(h), top + cell * static_cast<int>(l), cell - 2, cell - 2, r, g, l, h,
                         fmt_number(x));
    }
  }
  for (size_t h = 0; h < heads; ++h)
    svg += fmt::format(R"(<text x="{}" y="{}" class="xlab">h{}</text>)", left + cell * static_cast<int>(h) + cell / 2 - 1,
                       top + cell * static_cast<int>(layers.size()) + 12, h);
  return svg + "</svg>";
}

std::vector<double> layer_series(const nlohmann::json& layers, const char* key) {
  std::vector<double> v;
  for (const auto& l : layers) v.push_back(number_or_nan(l, key));
  return v;
}

constexpr const char* kStyle = R"CSS(
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#1d2330;background:#fafbfc}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d8dde6;padding-bottom:4px}
.meta{color:#5a6475;font-size:13px}
table{border-collapse:collapse;font-size:13px;background:#fff}
th,td{border:1px solid #d8dde6;padding:3px 8px;text-align:left}th{background:#eef1f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.pass{color:#17692f;font-weight:600}.fail{color:#b3261e;font-weight:600}
tr.flagged td{background:#fff1f0}
.charts{display:flex;flex-wrap:wrap;gap:12px}
svg.chart{background:#fff;border:1px solid #d8dde6}
.ctitle{font-size:13px;font-weight:600;fill:#1d2330}.ylab{font-size:10px;text-anchor:end;fill:#5a6475}
.xlab{font-size:10px;text-anchor:middle;fill:#5a6475}.legend{font-size:11px;font-weight:600}
.plot{fill:none;stroke:#c3cad6}.grid{stroke:#eef1f6}.line{fill:none;stroke-width:2}
.threshold{stroke:#b3261e;stroke-dasharray:5 4}
.figs{display:flex;flex-wrap:wrap;gap:14px}
figure{margin:0;background:#fff;border:1px solid #d8dde6;padding:6px;max-width:210px}
figure img{display:block;width:192px;height:192px;image-rendering:pixelated}
figcaption{font-size:11px;color:#3a4252;word-wrap:break-word}
#render-status{color:#5a6475;font-size:11px;margin-top:24px}
)CSS";

// Marks the page for automated checks: every <img> decoded and no script errors.
constexpr const char* kScript = R"JS(
(function(){
  var errors = 0;
  window.addEventListener('error', function(){ errors += 1; });
  window.addEventListener('load', function(){
    var imgs = document.getElementsByTagName('img');
    var decoded = 0;
    for (var i = 0; i < imgs.length; i++) {
      if (imgs[i].complete && imgs[i].naturalWidth > 0) decoded += 1;
    }
    var status = document.getElementById('render-status');
    status.setAttribute('data-images', String(imgs.length));
    status.setAttribute('data-decoded', String(decoded));
    status.setAttribute('data-errors', String(errors));
    status.textContent = 'render check: ' + decoded + '/' + imgs.length + ' images decoded, ' + errors + ' script errors' +
        (decoded === imgs.length && errors === 0 ? ' [render-ok]' : ' [render-failed]');
  });
})();
)JS";

}  // namespace

std::string base64_encode(std::span<const unsigned char> bytes) {
  static constexpr char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t v = (uint32_t{bytes[i]} << 16) | (uint32_t{bytes[i + 1]} << 8) | bytes[i + 2];
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += kAlphabet[(v >> 6) & 63];
    out += kAlphabet[v & 63];
  }
  const size_t rest = bytes.size() - i;
  if (rest > 0) {
    const uint32_t v = (uint32_t{bytes[i]} << 16) | (rest == 2 ? uint32_t{bytes[i + 1]} << 8 : 0u);
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += rest == 2 ? kAlphabet[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

std::vector<unsigned char> heatmap_png(const cv::Mat& rgb, std::span<const double> map, int size) {
  VLMOPT_CHECK(rgb.type() == CV_8UC3 && !rgb.empty(), "heatmap image type {}", rgb.type());
  VLMOPT_CHECK(size > 0, "heatmap size {}", size);
  auto weights = map;
  auto side = static_cast<int>(std::lround(std::sqrt(static_cast<double>(weights.size()))));
  if (static_cast<size_t>(side) * static_cast<size_t>(side) != weights.size() && !weights.empty()) {
    weights = weights.subspan(1);  // "full" feature strategy: a class token before the patch grid
    side = static_cast<int>(std::lround(std::sqrt(static_cast<double>(weights.size()))));
  }
  if (side == 0 || static_cast<size_t>(side) * static_cast<size_t>(side) != weights.size()) return {};

  cv::Mat grid(side, side, CV_64F);
  for (int r = 0; r < side; ++r)
    for (int c = 0; c < side; ++c) grid.at<double>(r, c) = weights[static_cast<size_t>(r * side + c)];
  double lo = 0.0, hi = 0.0;
  cv::minMaxLoc(grid, &lo, &hi);
  cv::Mat grey;
  grid.convertTo(grey, CV_8U, hi > lo ? 255.0 / (hi - lo) : 0.0, hi > lo ? -255.0 * lo / (hi - lo) : 0.0);
  cv::Mat upscaled, colored;
  cv::resize(grey, upscaled, cv::Size(size, size), 0, 0, cv::INTER_NEAREST);  // one block per patch
  cv::applyColorMap(upscaled, colored, cv::COLORMAP_JET);                     // BGR

  // Center crop to a square, as the CLIP processor does after its shortest-edge resize.
  const int crop = std::min(rgb.rows, rgb.cols);
  const cv::Rect square((rgb.cols - crop) / 2, (rgb.rows - crop) / 2, crop, crop);
  cv::Mat resized, bgr, blended;
  cv::resize(rgb(square), resized, cv::Size(size, size), 0, 0, cv::INTER_AREA);
  cv::cvtColor(resized, bgr, cv::COLOR_RGB2BGR);
  cv::addWeighted(bgr, 0.55, colored, 0.45, 0.0, blended);
  std::vector<unsigned char> png;
  VLMOPT_CHECK(cv::imencode(".png", blended, png), "PNG encoding of a {}x{} heatmap failed", size, size);
  return png;
}

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

std::string render_report_html(const nlohmann::json& report, const std::vector<HeatmapFigure>& heatmaps) {
  const auto& summary = report["summary"];
  const auto& config = report["config"];
  const auto& layers = report["layers"];
  std::string h;
  h += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">";
  // Nothing may be fetched: only inline styles/scripts and data: images.
  h += "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; img-src data:; "
       "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">";
  h += "<title>vlmopt diagnose-align report</title><style>";
  h += kStyle;
  h += "</style></head><body>\n";
  h += "<h1>vlmopt diagnose-align</h1>";
  h += fmt::format("<div class=\"meta\">model <b>{}</b>{} &middot; data <b>{}</b> &middot; {} &middot; schema {} &middot; vlmopt {}</div>\n",
                   html_escape(report["model"]["dir"].get<std::string>()),
                   config["bundle"].is_string() ? " vs bundle <b>" + html_escape(config["bundle"].get<std::string>()) + "</b>" : "",
                   html_escape(config["data"].get<std::string>()), html_escape(config["dataset"].get<std::string>()),
                   html_escape(report["schema"].get<std::string>()), html_escape(report["vlmopt_version"].get<std::string>()));

  // --- summary ---
  h += "<h2>Summary</h2><table>";
  h += fmt::format("<tr><th>samples</th><td class=\"num\">{}</td></tr>", summary["samples"].get<int64_t>());
  h += fmt::format("<tr><th>flagged (tau_align &gt; {} nats, &Delta;t<sub>sem</sub> over its threshold, or a gate)</th><td class=\"num\">{} ({:.1f} %)</td></tr>",
                   summary["tau_threshold"].get<double>(), summary["flagged"].get<int64_t>(),
                   100.0 * summary["flagged_fraction"].get<double>());
  h += fmt::format("<tr><th>answer accuracy (exact match)</th><td class=\"num\">{:.4f}</td></tr>", summary["accuracy"].get<double>());
  h += fmt::format("<tr><th>decoder layers &times; heads, visual tokens</th><td class=\"num\">{} &times; {}, {}</td></tr></table>\n",
                   report["model"]["layers"].get<int64_t>(), report["model"]["heads"].get<int64_t>(),
                   report["model"]["visual_tokens"].get<int64_t>());
  h += "<h2>Metrics over samples</h2><table><tr><th>metric</th><th>n</th><th>mean</th><th>median</th><th>p95</th><th>min</th><th>max</th></tr>";
  for (const auto& [name, st] : summary["metrics"].items()) {
    h += fmt::format("<tr><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>"
                     "<td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                     html_escape(name), st.value("n", 0), fmt_number(number_or_nan(st, "mean")),
                     fmt_number(number_or_nan(st, "median")), fmt_number(number_or_nan(st, "p95")),
                     fmt_number(number_or_nan(st, "min")), fmt_number(number_or_nan(st, "max")));
  }
  h += "</table>\n";
  if (!summary["gates"].empty()) {
    h += "<h2>Gates</h2><table><tr><th>gate</th><th>result</th><th>violating</th><th>samples</th><th>fraction</th><th>allowed</th></tr>";
    for (const auto& g : summary["gates"]) {
      const bool passed = g["passed"].get<bool>();
      h += fmt::format("<tr><td><code>{}</code></td><td class=\"{}\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>"
                       "<td class=\"num\">{:.1f} %</td><td class=\"num\">{:.1f} %</td></tr>",
                       html_escape(g["expression"].get<std::string>()), passed ? "pass" : "fail", passed ? "passed" : "FAILED",
                       g["violating"].get<int64_t>(), g["samples"].get<int64_t>(), 100.0 * g["fraction"].get<double>(),
                       100.0 * g["max_fraction"].get<double>());
    }
    h += "</table>\n";
  }
  if (report["compare"].is_object()) {
    const auto& c = report["compare"];
    h += "<h2>Original vs optimized bundle</h2><table>";
    h += fmt::format("<tr><th>bundle</th><td>{}</td></tr>", html_escape(c["bundle"].get<std::string>()));
    h += fmt::format("<tr><th>JS divergence of text&rarr;visual maps (bits, mean over layers and samples)</th><td class=\"num\">{}</td></tr>",
                     fmt_number(number_or_nan(c["cmp_js"], "mean")));
    h += fmt::format("<tr><th>projector output cosine (mean over tokens and samples)</th><td class=\"num\">{}</td></tr></table>\n",
                     fmt_number(number_or_nan(c["cmp_projector_cos"], "mean")));
  }

  // --- per-layer charts ---
  h += "<h2>Per layer (mean over samples)</h2><div class=\"charts\">";
  h += line_chart("Text→visual attention mass", "share of attention",
                  {{"text rows", "#1f6feb", layer_series(layers, "attn_mass")},
                   {"last row", "#d97706", layer_series(layers, "last_attn_mass")}});
  h += line_chart("tau_align: entropy of text→visual attention", "nats",
                  {{"text rows", "#1f6feb", layer_series(layers, "tau_align")},
                   {"last row", "#d97706", layer_series(layers, "last_tau_align")}},
                  summary["tau_threshold"].get<double>());
  h += line_chart("Top-k mass and positional bias", "",
                  {{"top-k mass", "#1f6feb", layer_series(layers, "topk_mass")},
                   {"Spearman", "#7c3aed", layer_series(layers, "pos_bias")}});
  std::vector<Series> drift = {{"JS to next layer", "#0f766e", layer_series(layers, "js_to_next")}};
  if (report["compare"].is_object()) drift.push_back({"JS vs bundle", "#b3261e", layer_series(layers, "cmp_js")});
  h += line_chart("Semantic drift (JS divergence)", "bits", drift);
  h += head_grid("Visual attention mass per head", layers, "attn_mass");
  h += head_grid("tau_align per head (nats)", layers, "tau_align");
  h += "</div>\n";

  // --- heatmaps ---
  h += "<h2>Attention heatmaps (text&rarr;visual, all layers and heads)</h2><div class=\"figs\">";
  for (const auto& fig : heatmaps) {
    h += fmt::format("<figure><img alt=\"attention heatmap {}\" width=\"192\" height=\"192\" src=\"data:image/png;base64,{}\">"
                     "<figcaption>{}</figcaption></figure>",
                     html_escape(fig.sample_id), base64_encode(fig.png), html_escape(fig.caption));
  }
  h += "</div>\n";

  // --- frame sequences: per-frame attention of the answer row and Δt_sem ---
  if (summary.contains("dt_sem") && summary["dt_sem"]["samples"].get<int64_t>() > 0) {
    const auto& dt = summary["dt_sem"];
    h += "<h2>Frame sequences: &Delta;t<sub>sem</sub></h2><table>";
    h += fmt::format("<tr><th>clip samples</th><td class=\"num\">{}</td></tr>", dt["samples"].get<int64_t>());
    h += fmt::format("<tr><th>flagged (&Delta;t<sub>sem</sub> &gt; {} ms)</th><td class=\"num\">{} ({:.1f} %)</td></tr>",
                     dt["threshold_ms"].get<double>(), dt["flagged"].get<int64_t>(),
                     100.0 * dt["flagged_fraction"].get<double>());
    h += fmt::format("<tr><th>mean &Delta;t<sub>sem</sub> (ms)</th><td class=\"num\">{}</td></tr></table>\n",
                     fmt_number(number_or_nan(dt, "mean_ms"), 1));
    h += "<table><tr><th>id</th><th>attention mass per frame (answer row; event frame outlined)</th><th>attended frame</th>"
         "<th>event (ms)</th><th>&Delta;t<sub>sem</sub> (ms)</th></tr>";
    for (const auto& s : report["samples"]) {
      const auto& d = s["dt_sem"];
      if (!d.is_object() || !d.contains("dt_sem_ms")) continue;
      const auto mass = d["frame_mass"].get<std::vector<double>>();
      const auto times = d["frame_times_ms"].get<std::vector<double>>();
      const double event = d["event_time_ms"].get<double>();
      const double peak = std::max(1e-12, *std::max_element(mass.begin(), mass.end()));
      constexpr int kBarWidth = 28, kBarGap = 6, kBarHeight = 30;
      const int width = static_cast<int>(mass.size()) * (kBarWidth + kBarGap);
      std::string bars = fmt::format("<svg width=\"{}\" height=\"{}\" role=\"img\">", width, kBarHeight + 12);
      for (size_t f = 0; f < mass.size(); ++f) {
        const int bar = static_cast<int>(std::lround(kBarHeight * mass[f] / peak));
        const int x = static_cast<int>(f) * (kBarWidth + kBarGap);
        const bool is_event = times[f] == event;
        bars += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"#1f6feb\"{}><title>frame {} ({} ms): mass {:.4f}</title></rect>",
                            x, kBarHeight - bar, kBarWidth, std::max(bar, 1),
                            is_event ? " stroke=\"#b3261e\" stroke-width=\"2\"" : "", f, times[f], mass[f]);
        bars += fmt::format("<text x=\"{}\" y=\"{}\" font-size=\"10\">{:.3f}</text>", x, kBarHeight + 11, mass[f]);
      }
      bars += "</svg>";
      h += fmt::format("<tr class=\"{}\"><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
                       d["flagged"].get<bool>() ? "flagged" : "", html_escape(s["id"].get<std::string>()), bars,
                       d["attended_frame"].get<int64_t>(), fmt_number(event, 0), fmt_number(d["dt_sem_ms"].get<double>(), 0));
    }
    h += "</table>\n";
  }

  // --- samples ---
  const auto sample_row = [&](const nlohmann::json& s) {
    const auto& m = s["metrics"];
    std::string flags;
    for (const auto& f : s["flags"]) flags += (flags.empty() ? "" : ", ") + html_escape(f.get<std::string>());
    return fmt::format("<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td>"
                       "<td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td></tr>",
                       s["flagged"].get<bool>() ? "flagged" : "", html_escape(s["id"].get<std::string>()),
                       html_escape(s["question"].get<std::string>()), html_escape(s["answer"].get<std::string>()),
                       html_escape(s["prediction"].get<std::string>()), fmt_number(number_or_nan(m, "tau_align"), 3),
                       fmt_number(number_or_nan(m, "attn_mass"), 3), fmt_number(number_or_nan(m, "js_drift"), 3),
                       fmt_number(number_or_nan(m, "modality_gap"), 3), fmt_number(number_or_nan(m, "knockout_delta"), 3), flags);
  };
  const std::string header =
      "<table><tr><th>id</th><th>question</th><th>answer</th><th>prediction</th><th>tau_align</th><th>attn_mass</th>"
      "<th>js_drift</th><th>modality_gap</th><th>knockout_delta</th><th>flags</th></tr>";
  h += fmt::format("<h2>Flagged samples ({})</h2>", summary["flagged"].get<int64_t>());
  h += header;
  for (const auto& s : report["samples"])
    if (s["flagged"].get<bool>()) h += sample_row(s);
  h += "</table>\n<h2>All samples</h2>" + header;
  for (const auto& s : report["samples"]) h += sample_row(s);
  h += "</table>\n<div id=\"render-status\">render check pending</div>\n<script>";
  h += kScript;
  h += "</script></body></html>\n";
  return h;
}

}  // namespace vlmopt::align
