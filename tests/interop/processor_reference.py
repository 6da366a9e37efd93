#!/usr/bin/env python3
"""Reference pixel_values from HF transformers' image processors for
tests/test_datasets_processor_parity.cpp.

For every --config NAME=DIR (a folder holding a preprocessor_config.json) it
builds the processor exactly as a user would, with AutoImageProcessor, and runs
it on every image opened with PIL (Image.open(...).convert("RGB"), which
ignores EXIF orientation). Writes one safetensors file with

    decoded/<i>   uint8 [H, W, 3]   the RGB pixels PIL decoded for image i
    <NAME>/<i>    float32 [3, h, w] the processor's pixel_values for image i

and metadata: the processor class and backend per config, library versions.

Usage: processor_reference.py --out OUT.safetensors --config NAME=DIR [...] IMAGE [...]
"""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import PIL
import transformers
from PIL import Image
from safetensors.numpy import save_file

# transformers 5.17 exposes `transformers.AutoImageProcessor` as a placeholder
# that demands torchvision; the class in its module is the real factory and
# picks the backend itself (torchvision when installed, else PIL).
from transformers.models.auto.image_processing_auto import AutoImageProcessor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", action="append", default=[], help="NAME=DIR with DIR/preprocessor_config.json")
    ap.add_argument("images", nargs="+")
    args = ap.parse_args()

    tensors: dict[str, np.ndarray] = {}
    metadata = {"format": "pt", "transformers": transformers.__version__, "pillow": PIL.__version__, "numpy": np.__version__}
    pil_images = []
    for i, path in enumerate(args.images):
        with Image.open(path) as im:
            rgb = im.convert("RGB")
        pil_images.append(rgb)
        tensors[f"decoded/{i}"] = np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8))

    for spec in args.config:
        name, _, directory = spec.partition("=")
        if not name or not directory:
            ap.error(f"--config expects NAME=DIR, got {spec!r}")
        processor = AutoImageProcessor.from_pretrained(directory)
        metadata[f"class.{name}"] = type(processor).__name__
        metadata[f"backend.{name}"] = str(getattr(processor, "backend", "unknown"))
        for i, image in enumerate(pil_images):
            pixels = processor(images=image, return_tensors="np")["pixel_values"]
            tensors[f"{name}/{i}"] = np.ascontiguousarray(pixels[0].astype(np.float32))

    save_file(tensors, args.out, metadata=metadata)
    print(f"wrote {len(tensors)} tensors to {args.out}: {metadata}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
