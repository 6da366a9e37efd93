#!/usr/bin/env bash
# Makes the install prefix that scripts/gpu_check.sh takes as DEPS_PREFIX, for a GPU machine whose
# image has a compiler, CUDA, torch and most of our libraries' -dev files (CLI11, nlohmann_json,
# fmt, spdlog, HDF5, OpenSSL, doctest) but no OpenCV and no ICU headers, and no way to fetch them:
#   - OpenCV core/imgproc/imgcodecs, built here from the opencv-python-headless source on PyPI as
#     static libraries with their own zlib/libpng/libjpeg (none of Debian's OpenCV dependency
#     tree: GDAL, GDCM, OpenEXR, ... which would be ~150 MB of shared libraries to carry);
#   - this machine's ICU as static libraries and headers (the other machine's ICU, if any, has
#     another version, and ICU's symbols carry it);
#   - OpenCV's digits sheet (Debian's opencv-doc), which the builtin datasets draw digits from:
#     PREFIX/share/vlmopt/digits.png, where gpu_check.sh points VLMOPT_DIGITS_PNG.
# Writes PREFIX and PREFIX.tar.xz (the file to carry; 16 MB).
#
#   scripts/gpu_deps.sh PREFIX [WORK_DIR]
set -euo pipefail
PREFIX=$(realpath -m "${1:?usage: scripts/gpu_deps.sh PREFIX [WORK_DIR]}")
WORK=$(realpath -m "${2:-/tmp/vlmopt-gpu-deps}")
OPENCV_VERSION=4.10.0.84
OPENCV_SHA256=f2017c6101d7c2ef8d7bc3b414c37ff7f54d64413a1847d89970b6b7069b4e1a
mkdir -p "$WORK"

sdist=$WORK/opencv-python-headless-$OPENCV_VERSION.tar.gz
if ! echo "$OPENCV_SHA256  $sdist" | sha256sum -c --status 2>/dev/null; then
  # The simple index names the sdist's URL; pip itself would try to build it to read its metadata.
  url=$(curl -fsSL https://pypi.org/simple/opencv-python-headless/ |
        grep -o "https://[^\"#]*opencv-python-headless-$OPENCV_VERSION.tar.gz" | head -1)
  curl -fsSL -o "$sdist" "$url"
  echo "$OPENCV_SHA256  $sdist" | sha256sum -c
fi
src=$WORK/opencv-python-headless-$OPENCV_VERSION/opencv
[ -d "$src" ] || tar xzf "$sdist" -C "$WORK" "opencv-python-headless-$OPENCV_VERSION/opencv"

off() { for o in "$@"; do printf -- '-DWITH_%s=OFF ' "$o"; done; }
# shellcheck disable=SC2046
cmake -S "$src" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$PREFIX" \
  -DBUILD_LIST=core,imgproc,imgcodecs -DBUILD_SHARED_LIBS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON \
  -DBUILD_ZLIB=ON -DBUILD_PNG=ON -DBUILD_JPEG=ON -DWITH_PNG=ON -DWITH_JPEG=ON \
  $(off TIFF WEBP OPENEXR JASPER OPENJPEG GDAL GDCM IPP ITT OPENCL LAPACK EIGEN TBB OPENMP CUDA PROTOBUF ADE \
        FFMPEG GSTREAMER GTK QT VTK 1394 V4L VA VA_INTEL OPENGL AVIF IMGCODEC_HDR IMGCODEC_SUNRASTER \
        IMGCODEC_PXM IMGCODEC_PFM CAROTENE KLEIDICV) \
  -DBUILD_TESTS=OFF -DBUILD_PERF_TESTS=OFF -DBUILD_EXAMPLES=OFF -DBUILD_opencv_apps=OFF -DBUILD_JAVA=OFF \
  -DBUILD_opencv_python3=OFF -DOPENCV_GENERATE_PKGCONFIG=OFF -DCPU_DISPATCH=AVX2 >"$WORK/opencv-configure.log"
cmake --build "$WORK/build" -j "$(nproc)" --target install >"$WORK/opencv-build.log"

mkdir -p "$PREFIX/lib" "$PREFIX/include"
arch_lib=/usr/lib/$(gcc -dumpmachine)
for lib in icuuc icui18n icudata; do cp "$arch_lib/lib$lib.a" "$PREFIX/lib/"; done
rm -rf "$PREFIX/include/unicode"
cp -r /usr/include/unicode "$PREFIX/include/"
mkdir -p "$PREFIX/share/vlmopt"
cp "${VLMOPT_DIGITS_PNG:-/usr/share/doc/opencv-doc/examples/data/digits.png}" "$PREFIX/share/vlmopt/digits.png"
tar -C "$(dirname "$PREFIX")" -cf - "$(basename "$PREFIX")" | xz -6 -T0 >"$PREFIX.tar.xz.tmp"
mv "$PREFIX.tar.xz.tmp" "$PREFIX.tar.xz"
du -sh "$PREFIX" "$PREFIX.tar.xz"
