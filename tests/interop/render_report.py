#!/usr/bin/env python3
"""diagnose-align's report.html rendered by headless Chromium (Debian's `chromium`).

    VLMOPT_BIN=build/apps/vlmopt/vlmopt python tests/interop/render_report.py [--model DIR] [--keep DIR]

Writes a report with `vlmopt diagnose-align` (default: the tiny clip_llama_old
fixture on builtin:eval, 4 samples, so it runs in seconds), then loads it in
headless Chromium with --dump-dom and console logging on stderr, and checks:
  - the page loads and its inline script ran: the #render-status element carries
    data-images / data-decoded / data-errors written on the window load event,
  - every <img> decoded (naturalWidth > 0), and there is at least one,
  - no script errors and no console error lines (uncaught exceptions, CSP refusals,
    failed loads: the page may not fetch anything).
Two negative controls prove the check can fail: a copy with one corrupted PNG
must report fewer decoded images, a copy with a throwing script must report the error.
Exits 1 with one line per failure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(os.environ.get("VLMOPT_SOURCE_DIR", Path(__file__).resolve().parents[2]))
CONSOLE_ERROR = re.compile(r"CONSOLE.*(Uncaught|Error|Refused|Failed|error)|ERR_", re.IGNORECASE)


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def render(chromium: str, html: Path, profile: Path) -> tuple[dict[str, str], list[str], str]:
    """Returns (#render-status attributes, console error lines, the dumped DOM)."""
    cmd = [chromium, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", html.as_uri()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if r.returncode != 0:
        raise RuntimeError(f"chromium exited {r.returncode}: {r.stderr[-2000:]}")
    dom = r.stdout
    m = re.search(r'<div id="render-status"([^>]*)>', dom)
    attrs = dict(re.findall(r'(data-[a-z]+)="([^"]*)"', m.group(1))) if m else {}
    errors = [line for line in r.stderr.splitlines() if CONSOLE_ERROR.search(line) and html.name in line or "Uncaught" in line]
    return attrs, errors, dom


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(REPO_ROOT / "tests" / "fixtures" / "clip_llama_old"))
    ap.add_argument("--data", default="builtin:eval")
    ap.add_argument("--limit", default="4")
    ap.add_argument("--keep", type=Path, help="write the report here instead of a temp dir")
    args = ap.parse_args()

    vlmopt = os.environ.get("VLMOPT_BIN", str(REPO_ROOT / "build" / "apps" / "vlmopt" / "vlmopt"))
    chromium = find_chromium()
    if chromium is None:
        print("FAIL: chromium is not installed (scripts/setup.sh installs Debian's chromium)")
        return 1

    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="render_report_") as tmp_name:
        tmp = Path(tmp_name)
        out = args.keep or tmp / "diag"
        r = subprocess.run([vlmopt, "-q", "diagnose-align", "--model", args.model, "--data", args.data, "--limit",
                            args.limit, "--knockout-limit", "1", "--heatmaps", "4", "--max-new-tokens", "3",
                            "--out", str(out)], capture_output=True, text=True)
        if r.returncode != 0:
            print(f"FAIL: vlmopt diagnose-align exited {r.returncode}: {r.stderr.strip()}")
            return 1
        html = out / "report.html"
        page = html.read_text()
        expected_images = page.count("<img ")

        attrs, errors, dom = render(chromium, html, tmp / "profile")
        print(f"report: {html} ({len(page)} bytes, {expected_images} images); status {attrs}")
        if not attrs:
            failures.append("the page did not run its load script (#render-status has no data attributes)")
        else:
            if int(attrs.get("data-images", "0")) != expected_images or expected_images == 0:
                failures.append(f"images in the DOM {attrs.get('data-images')} vs {expected_images} in the file")
            if attrs.get("data-decoded") != attrs.get("data-images"):
                failures.append(f"only {attrs.get('data-decoded')} of {attrs.get('data-images')} images decoded")
            if attrs.get("data-errors") != "0":
                failures.append(f"{attrs.get('data-errors')} script errors")
        if "Attention heatmaps" not in dom or "<svg" not in dom:
            failures.append("the DOM lacks the heatmap section or the SVG charts")
        failures += [f"console: {line}" for line in errors]

        # Negative controls: the same checks must notice a broken image and a throwing script.
        broken_img = tmp / "broken_image.html"
        broken_img.write_text(page.replace("base64,", "base64,AAAAbroken", 1))
        attrs_img, _, _ = render(chromium, broken_img, tmp / "profile")
        if not attrs_img or attrs_img.get("data-decoded") == attrs_img.get("data-images"):
            failures.append(f"control: a corrupted PNG went unnoticed ({attrs_img})")
        broken_js = tmp / "broken_script.html"
        broken_js.write_text(page.replace("</body>", "<script>undefinedFunctionForTheRenderTest();</script></body>", 1))
        attrs_js, errors_js, _ = render(chromium, broken_js, tmp / "profile")
        if not errors_js and attrs_js.get("data-errors", "0") == "0":
            failures.append("control: a throwing script went unnoticed")
        print(f"controls: corrupted PNG -> {attrs_img}; throwing script -> {attrs_js}, {len(errors_js)} console error line(s)")

    for f in failures:
        print(f"FAIL: {f}")
    if not failures:
        print("OK: report.html renders in headless Chromium with all images decoded and no console errors")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
