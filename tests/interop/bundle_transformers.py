#!/usr/bin/env python3
"""vlmopt bundles loaded by HF transformers + compressed-tensors, compared with vlmopt's runtime.

    VLMOPT_TESTS_BIN=build/tests/vlmopt_tests VLMOPT_BIN=build/apps/vlmopt/vlmopt \
        python tests/interop/bundle_transformers.py [--fixtures DIR] [--keep DIR]

Per parity fixture (tests/fixtures/*): exports a min-max W8A8 bundle with vlmopt
(the "bundle export driver" doctest case), then
  - loads it with LlavaForConditionalGeneration.from_pretrained (CPU, fp32, eager),
    failing on any logged warning about unexpected / missing / newly initialized keys,
  - checks that compressed-tensors parsed the config (its QuantizationConfig validates,
    decoder Linears carry a quantization scheme, ignored ones do not),
  - runs the fixture's reference inputs through HF and through vlmopt's runtime
    with use_mp_cache = false (what compressed-tensors computes), fake-quant and int8
    kernels: reports max |logit delta| and greedy answer agreement (>= 99 % required),
  - runs `vlmopt verify` and `vlmopt eval --bundle B --no-mp-cache` (smoke: exit 0, JSON).
Exits 1 with one line per failure.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ["clip_llama_old", "siglip_qwen2_new", "clip_llama_gqa_sharded"]
NEW_TOKENS = 8
# Same int8 arithmetic on both sides; differences are float summation order only.
LOGIT_ATOL = 1e-3
MIN_AGREEMENT = 0.99
BAD_LOAD_WORDS = ("unexpected", "missing", "newly initialized", "not used", "not initialized", "mismatch")


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env={**os.environ, **(env or {})}, capture_output=True, text=True)


def export_bundle(tests_bin: str, fixture: Path, out: Path) -> None:
    r = run([tests_bin, "--test-case=bundle export driver", "--no-colors=1"],
            {"VLMOPT_EXPORT_FROM": str(fixture), "VLMOPT_EXPORT_TO": str(out)})
    if r.returncode != 0 or not (out / "vlmopt" / "manifest.json").exists():
        raise RuntimeError(f"export of {fixture.name} failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")


def vlmopt_runtime(tests_bin: str, bundle: Path, inputs: Path, out: Path, kernels: str) -> dict[str, torch.Tensor]:
    r = run([tests_bin, "--test-case=bundle runtime driver", "--no-colors=1"],
            {"VLMOPT_RUNTIME_BUNDLE": str(bundle), "VLMOPT_RUNTIME_INPUTS": str(inputs),
             "VLMOPT_RUNTIME_OUT": str(out), "VLMOPT_RUNTIME_KERNELS": kernels,
             "VLMOPT_RUNTIME_MP_CACHE": "0", "VLMOPT_RUNTIME_NEW_TOKENS": str(NEW_TOKENS)})
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"vlmopt runtime on {bundle.name} failed: {r.stdout[-2000:]} {r.stderr[-2000:]}")
    return read_all(out)


def load_hf(bundle: Path):
    """from_pretrained with every warning and log record captured."""
    from transformers import LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_warning()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    root = hf_logging.get_logger()  # the "transformers" library logger
    root.addHandler(handler)
    ct_logger = logging.getLogger("compressed_tensors")
    ct_logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = LlavaForConditionalGeneration.from_pretrained(
                str(bundle), dtype=torch.float32, attn_implementation="eager", device_map="cpu")
    finally:
        root.removeHandler(handler)
        ct_logger.removeHandler(handler)
    messages = stream.getvalue().splitlines() + [str(w.message) for w in caught]
    return model.eval(), messages


def check_fixture(name: str, fixtures: Path, work: Path, tests_bin: str, vlmopt_bin: str | None,
                  errors: list[str]) -> str:
    fixture = fixtures / name
    bundle = work / f"bundle_{name}"
    export_bundle(tests_bin, fixture, bundle)

    model, messages = load_hf(bundle)
    bad = [m for m in messages if any(w in m.lower() for w in BAD_LOAD_WORDS)]
    for m in bad:
        errors.append(f"{name}: from_pretrained logged: {m.strip()[:300]}")

    # compressed-tensors parsed the config and applied it to the intended modules.
    from compressed_tensors.quantization import QuantizationConfig

    config = json.loads((bundle / "config.json").read_text())
    QuantizationConfig.model_validate(config["quantization_config"])
    ignore = set(config["quantization_config"]["ignore"])
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for n in ignore:
        if n not in linears:
            errors.append(f"{name}: ignore entry {n} is not a Linear of the HF model")
    for n, m in linears.items():
        has_scheme = getattr(m, "quantization_scheme", None) is not None
        if has_scheme == (n in ignore):
            errors.append(f"{name}: {n}: quantization scheme {'present' if has_scheme else 'absent'} "
                          f"but the module is {'ignored' if n in ignore else 'not ignored'}")

    ref = read_all(fixture / "reference.safetensors")
    inputs = dict(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"], pixel_values=ref["pixel_values"])
    inputs_path = work / f"inputs_{name}.safetensors"
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in inputs.items()}, str(inputs_path))
    with torch.no_grad():
        hf_logits = model(**inputs).logits.float()
        gen = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    hf_tokens = gen[:, inputs["input_ids"].shape[1]:]

    summary = []
    for kernels in ("fake", "int8"):
        ours = vlmopt_runtime(tests_bin, bundle, inputs_path, work / f"out_{name}_{kernels}.safetensors", kernels)
        delta = (ours["logits"] - hf_logits).abs().max().item()
        agree = (ours["generated"] == hf_tokens).float().mean().item()
        summary.append(f"{kernels}: max|dlogit| {delta:.2e}, tokens agree {agree:.1%}")
        if not delta <= LOGIT_ATOL:
            errors.append(f"{name} ({kernels}): max |logit delta| {delta:.3g} > {LOGIT_ATOL}")
        if agree < MIN_AGREEMENT:
            errors.append(f"{name} ({kernels}): greedy token agreement {agree:.1%} < {MIN_AGREEMENT:.0%}")

    if vlmopt_bin:
        r = run([vlmopt_bin, "verify", str(bundle), "--json"])
        if r.returncode != 0 or not json.loads(r.stdout)["ok"]:
            errors.append(f"{name}: vlmopt verify failed: {r.stdout.strip()} {r.stderr.strip()}")
        r = run([vlmopt_bin, "--json", "eval", "--bundle", str(bundle), "--no-mp-cache", "--data", "builtin:eval",
                 "--limit", "4", "--batch-size", "2"])
        if r.returncode != 0:
            errors.append(f"{name}: vlmopt eval --bundle failed ({r.returncode}): {r.stderr.strip()[:500]}")
        else:
            result = json.loads(r.stdout)
            summary.append(f"eval --bundle --no-mp-cache: n={result['n']}")
    return f"{name}: " + "; ".join(summary)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixtures", type=Path, default=REPO_ROOT / "tests" / "fixtures")
    parser.add_argument("--keep", type=Path, help="write bundles here instead of a temporary directory")
    args = parser.parse_args()
    tests_bin = os.environ.get("VLMOPT_TESTS_BIN")
    if not tests_bin:
        print("VLMOPT_TESTS_BIN must point at the vlmopt_tests binary", file=sys.stderr)
        return 2
    vlmopt_bin = os.environ.get("VLMOPT_BIN")
    torch.manual_seed(0)
    errors: list[str] = []
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in FIXTURES:
            lines.append(check_fixture(name, args.fixtures, work, tests_bin, vlmopt_bin, errors))
    for line in lines:
        print(line)
    for e in errors:
        print(f"FAIL {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
