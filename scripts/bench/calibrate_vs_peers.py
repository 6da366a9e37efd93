#!/usr/bin/env python3
"""Calibration benchmark: vlmopt vs llm-compressor `oneshot`, and vs a bare vlmopt forward pass.

For each model, in one run and on exactly the same samples (one HDF5 pack
written by `vlmopt datasets pack builtin:calib --limit N`, fed to every tool):

  * vlmopt bench forward              the pass with nothing observing (the floor)
  * vlmopt calibrate --observer minmax  W8A8 int8, static per-tensor inputs
  * vlmopt calibrate --observer entropy KL-entropy input ranges
  * llm-compressor oneshot             QuantizationModifier, the same W8A8 scheme:
        weights int8 symmetric per-channel (observer minmax), inputs int8
        symmetric per-tensor static with observer static_minmax (set
        explicitly: the default memoryless_minmax keeps only the last batch),
        vision tower / projector / lm_head ignored, the same batches (HF
        LlavaProcessor, the LLaVA-1.5 prompt template, left padding),
        once per calibration pipeline in --llmc-pipelines.

Every tool runs as its own child process (CPU, fp32, --threads threads), so wall
time includes interpreter/library start-up and peak RSS is the child's own
(os.wait4 rusage). llm-compressor's child also times its phases separately:
imports, model load, preprocessing, the oneshot call, save_pretrained.

    scripts/bench/calibrate_vs_peers.py --vlmopt build/apps/vlmopt/vlmopt \\
        [--models builtin,large] [--samples 128] [--large-samples 32] [--batch-size 8] \\
        [--out results.json]

Writes results.json (per model: seconds per tool, ratios, peak RSS, an
input_scale comparison between the tools' saved checkpoints) plus machine,
versions and the exact command, and prints a table. See scripts/bench/README.md.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPT_TEMPLATE = "USER: <image>\n{question} ASSISTANT:"  # LLaVA-1.5, as eval/session.hpp
LLMC_PIPELINES = ("basic", "sequential")
# Targets of the issue (docs/BENCHMARKS.md): speed-up over llm-compressor, overhead over the bare pass.
TARGET_SPEEDUP_VS_LLMC = 3.0
TARGET_MINMAX_OVER_FORWARD = 1.15
TARGET_ENTROPY_OVER_FORWARD = 1.5


# ----------------------------------------------------------------------------- child processes

def run_child(cmd: list[str], env: dict[str, str], log_path: Path) -> dict:
    """Runs `cmd`, returns {rc, wall_seconds, peak_rss_mib, stdout}; stderr goes to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as err, open(log_path.with_suffix(".stdout"), "w+") as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        # wait4 gives this child's own rusage (RUSAGE_CHILDREN would mix all children).
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        stdout = out.read()
    return {"rc": proc.returncode, "wall_seconds": wall, "peak_rss_mib": usage.ru_maxrss / 1024.0,
            "user_seconds": usage.ru_utime, "system_seconds": usage.ru_stime, "stdout": stdout,
            "log": str(log_path), "command": cmd}


def child_failed(what: str, res: dict) -> None:
    tail = Path(res["log"]).read_text(errors="replace")[-3000:]
    raise SystemExit(f"{what} failed (exit {res['rc']}): {shlex.join(res['command'])}\n--- stderr tail ---\n{tail}")


def last_json_object(text: str, what: str) -> dict:
    """The JSON object a `vlmopt --json` command prints (the last non-empty stdout line that parses)."""
    for line in reversed([ln for ln in text.splitlines() if ln.strip()]):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            return obj
    except json.JSONDecodeError:
        pass
    raise SystemExit(f"{what}: expected one JSON object on stdout, got: {text[-500:]!r}")


# ----------------------------------------------------------------------------- vlmopt side

def vlmopt_forward(args, model_dir: Path, pack: Path, n: int, work: Path, env) -> dict:
    cmd = [args.vlmopt, "--json", "bench", "forward", "--model", str(model_dir), "--data", str(pack),
           "--samples", str(n), "--batch-size", str(args.batch_size), *args.vlmopt_arg]
    res = run_child(cmd, env, work / "logs" / "vlmopt-forward.stderr")
    if res["rc"] != 0:
        child_failed("vlmopt bench forward", res)
    out = last_json_object(res.pop("stdout"), "vlmopt bench forward")
    return {**res, "json": out, "seconds": float(out["seconds"])}


def vlmopt_calibrate(args, model_dir: Path, pack: Path, n: int, observer: str, work: Path, env) -> dict:
    bundle = work / f"vlmopt-{observer}"
    cmd = [args.vlmopt, "--json", "calibrate", "--model", str(model_dir), "--data", str(pack),
           "--samples", str(n), "--batch-size", str(args.batch_size), "--observer", observer,
           "--out", str(bundle), *args.vlmopt_arg, *args.calibrate_arg]
    res = run_child(cmd, env, work / "logs" / f"vlmopt-calibrate-{observer}.stderr")
    if res["rc"] != 0:
        child_failed(f"vlmopt calibrate --observer {observer}", res)
    out = last_json_object(res.pop("stdout"), "vlmopt calibrate")
    report_path = bundle / "vlmopt" / "reports" / "calibration.json"
    timing = None
    if report_path.exists():
        report = json.loads(report_path.read_text())
        # Keep the report's timing fields only (the full report stays in the bundle).
        timing = {**(report.get("timing") or {}), "peak_rss_mib": report.get("peak_rss_mib")}
    return {**res, "json": out, "report_timing": timing, "bundle": str(bundle),
            "collect_seconds": float(out["collect_seconds"]), "seconds": float(out["seconds"])}


# ----------------------------------------------------------------------------- llm-compressor side

def llmc_run(args, model_dir: Path, pack: Path, n: int, pipeline: str, work: Path, env) -> dict:
    out_dir = work / f"llmc-{pipeline}"
    result_path = work / f"llmc-{pipeline}.json"
    result_path.unlink(missing_ok=True)
    spec = {"model": str(model_dir), "pack": str(pack), "samples": n, "batch_size": args.batch_size,
            "pipeline": pipeline, "threads": args.threads, "out": str(out_dir), "result": str(result_path)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--llmc-worker", json.dumps(spec)]
    res = run_child(cmd, env, work / "logs" / f"llmc-{pipeline}.stderr")
    res.pop("stdout")
    if res["rc"] != 0 or not result_path.exists():
        child_failed(f"llm-compressor oneshot ({pipeline} pipeline)", res)
    inner = json.loads(result_path.read_text())
    return {**res, **inner, "checkpoint": str(out_dir)}


def read_pack(path: Path, n: int):
    """The first n samples of a vlmopt HDF5 pack: RGB uint8 HWC arrays and question strings."""
    import h5py
    with h5py.File(path, "r") as f:
        total = f["images"].shape[0]
        if total < n:
            raise SystemExit(f"{path}: /images: expected at least {n} samples, got {total}")
        shapes = f["image_shapes"][:n]
        images = [f["images"][i, :int(h), :int(w), :] for i, (h, w, _) in enumerate(shapes)]
        dec = lambda v: v.decode() if isinstance(v, bytes) else str(v)
        questions = [dec(q) for q in f["questions"][:n]]
    return images, questions


def load_processor(model_dir: Path, config):
    """The checkpoint's LlavaProcessor, or one assembled from its tokenizer and vision config
    (test fixtures have no processor_config.json)."""
    from transformers import AutoProcessor, AutoTokenizer, CLIPImageProcessor, LlavaProcessor
    if (model_dir / "processor_config.json").exists():
        return AutoProcessor.from_pretrained(model_dir)
    vision = config.vision_config
    if (model_dir / "preprocessor_config.json").exists():
        image_processor = CLIPImageProcessor.from_pretrained(model_dir)
    else:
        image_processor = CLIPImageProcessor(size={"shortest_edge": vision.image_size},
                                             crop_size={"height": vision.image_size, "width": vision.image_size})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    has_cls = vision.model_type == "clip_vision_model"  # SigLIP has no class token
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
                          vision_feature_select_strategy=config.vision_feature_select_strategy,
                          num_additional_image_tokens=1 if has_cls else 0,
                          image_token=getattr(tokenizer, "image_token", None) or "<image>")


def prepare_batches(model_dir: Path, config, pack: Path, n: int, batch_size: int):
    """The HF side's calibration batches: LlavaProcessor on the pack's first n samples, left padding."""
    import torch
    processor = load_processor(model_dir, config)
    images, questions = read_pack(pack, n)
    processor.tokenizer.padding_side = "left"  # as vlmopt's session batches
    batches = []
    for s in range(0, len(images), batch_size):
        prompts = [PROMPT_TEMPLATE.format(question=q) for q in questions[s:s + batch_size]]
        enc = processor(images=images[s:s + batch_size], text=prompts, padding=True, return_tensors="pt")
        batches.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"],
                        "pixel_values": enc["pixel_values"].to(torch.float32)})
    return processor, batches


def llmc_worker(spec: dict) -> int:
    """Child process: load, preprocess, oneshot, save; phases timed separately."""
    t_start = time.perf_counter()
    import resource

    import torch
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from torch.utils.data import DataLoader
    from transformers import LlavaForConditionalGeneration

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    t_imported = time.perf_counter()

    torch.set_num_threads(spec["threads"])
    model_dir = Path(spec["model"])
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    t_loaded = time.perf_counter()

    bs = spec["batch_size"]
    processor, batches = prepare_batches(model_dir, model.config, Path(spec["pack"]), spec["samples"], bs)
    n_samples = sum(int(b["input_ids"].shape[0]) for b in batches)
    # batch_size=None: the loader yields our prebuilt batches unchanged, in order.
    loader = DataLoader(batches, batch_size=None, shuffle=False)
    t_prepared = time.perf_counter()

    int8 = dict(num_bits=8, type="int", symmetric=True, dynamic=False)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**int8, strategy="channel", observer="minmax"),
        input_activations=QuantizationArgs(**int8, strategy="tensor", observer="static_minmax"))
    # vlmopt's default: vision tower, projector and lm_head stay unquantized.
    ignore = ["re:.*vision_tower.*", "re:.*multi_modal_projector.*", "lm_head"]
    recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=ignore)
    decoder_layer = type(model.model.language_model.layers[0]).__name__
    oneshot(model=model, processor=processor, dataset=loader, recipe=recipe, pipeline=spec["pipeline"],
            batch_size=bs, num_calibration_samples=n_samples, shuffle_calibration_samples=False,
            sequential_targets=[decoder_layer],
            # Observe the float model's activations (what vlmopt does): no quantized
            # layer outputs fed forward in the sequential pipeline. This also skips
            # that pipeline's second pass, i.e. it is the faster setting for llm-compressor.
            propagate_error=False,
            output_dir=None)
    t_calibrated = time.perf_counter()

    model.save_pretrained(spec["out"], save_compressed=True)
    processor.save_pretrained(spec["out"])
    t_saved = time.perf_counter()

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    Path(spec["result"]).write_text(json.dumps({
        "pipeline": spec["pipeline"], "samples": n_samples, "batch_size": bs, "batches": len(batches),
        "max_sequence_length": max(int(b["input_ids"].shape[1]) for b in batches),
        "sequential_targets": [decoder_layer], "propagate_error": False,
        "import_seconds": t_imported - t_start, "load_seconds": t_loaded - t_imported,
        "preprocess_seconds": t_prepared - t_loaded, "oneshot_seconds": t_calibrated - t_prepared,
        "save_seconds": t_saved - t_calibrated, "in_process_seconds": t_saved - t_start,
        "in_process_peak_rss_mib": peak, "torch_threads": torch.get_num_threads()}, indent=1) + "\n")
    return 0


def reference_worker(spec: dict) -> int:
    """Child process: the same batches through plain HF, timed once bare (context only), then once
    with hooks on the decoder Linears' inputs. Writes per Linear the static min-max scale
    amax / 127.5 (compressed-tensors' symmetric int8 formula, reference.md §3) over all tokens and
    over non-padding tokens: which way the tools' input_scale values differ, and why
    (llm-compressor observes padding tokens, vlmopt does not)."""
    import torch
    from transformers import LlavaForConditionalGeneration

    torch.set_num_threads(spec["threads"])
    model_dir = Path(spec["model"])
    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    _, batches = prepare_batches(model_dir, model.config, Path(spec["pack"]), spec["samples"], spec["batch_size"])
    decoder = model.model.language_model
    amax_all: dict[str, float] = {}
    amax_text: dict[str, float] = {}
    mask_now: list = [None]  # [B,T] bool of the batch running, for the hooks

    def hook_for(name: str):
        def hook(_module, inputs):
            x = inputs[0].detach().abs()  # [B,T,in]
            per_token = x.amax(dim=-1)
            amax_all[name] = max(amax_all.get(name, 0.0), float(per_token.max()))
            kept = per_token[mask_now[0]]
            if kept.numel():
                amax_text[name] = max(amax_text.get(name, 0.0), float(kept.max()))
        return hook

    # Context for the timings (not a tool under test): the same batches through plain HF
    # (eager attention, as llm-compressor calibrates), once with nothing attached.
    with torch.no_grad():
        start = time.perf_counter()
        for b in batches:
            model(**b, use_cache=False)
        hf_forward_seconds = time.perf_counter() - start

    handles = [m.register_forward_pre_hook(hook_for(canonical_name("model.language_model." + n)))
               for n, m in decoder.named_modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        for b in batches:
            mask_now[0] = b["attention_mask"].bool()
            model(**b, use_cache=False)
    for h in handles:
        h.remove()
    Path(spec["result"]).write_text(json.dumps({
        "all_tokens": {k: v / 127.5 for k, v in amax_all.items()},
        "without_padding": {k: v / 127.5 for k, v in amax_text.items()},
        "hf_forward_seconds": hf_forward_seconds,
        "padding_tokens": int(sum(int((b["attention_mask"] == 0).sum()) for b in batches)),
        "tokens": int(sum(int(b["attention_mask"].numel()) for b in batches))}, indent=1) + "\n")
    return 0


def reference_scales(args, model_dir: Path, pack: Path, n: int, work: Path, env) -> dict:
    result_path = work / "reference-scales.json"
    result_path.unlink(missing_ok=True)
    spec = {"model": str(model_dir), "pack": str(pack), "samples": n, "batch_size": args.batch_size,
            "threads": args.threads, "result": str(result_path)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--reference-worker", json.dumps(spec)]
    res = run_child(cmd, env, work / "logs" / "reference-scales.stderr")
    if res["rc"] != 0 or not result_path.exists():
        child_failed("HF reference forward", res)
    return json.loads(result_path.read_text())


# ----------------------------------------------------------------------------- checkpoint comparison

def canonical_name(name: str) -> str:
    """Maps old (language_model.model.*) and new (model.language_model.*) HF layouts to one spelling."""
    for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                     ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector.")):
        if name.startswith(old):
            name = new + name[len(old):]
            break
    tower = "model.vision_tower."
    if name.startswith(tower) and not name.startswith(tower + "vision_model."):
        name = tower + "vision_model." + name[len(tower):]
    return name


def load_scales(checkpoint: Path) -> dict[str, dict]:
    """{canonical Linear name: {"input_scale": float32 ndarray, "weight_scale": ...}} over all shards."""
    from safetensors.numpy import load_file
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"{checkpoint}: expected model*.safetensors, found none")
    scales: dict[str, dict] = {}
    for f in files:
        if not f.name.startswith("model"):
            continue
        for name, value in load_file(str(f)).items():
            for kind in ("input_scale", "weight_scale"):
                if name.endswith("." + kind):
                    linear = canonical_name(name[:-len(kind) - 1])
                    scales.setdefault(linear, {})[kind] = value.astype("float32")
    return scales


def rel_diff_summary(a: dict, b: dict) -> dict:
    """Per name in both: max |a - b| / |b| over the tensor's elements; summarized over names."""
    import numpy as np
    rel = {}
    for name in sorted(a.keys() & b.keys()):
        x, y = np.asarray(a[name], dtype=np.float64).reshape(-1), np.asarray(b[name], dtype=np.float64).reshape(-1)
        if x.size != y.size:
            rel[name] = float("inf")
            continue
        rel[name] = float(np.max(np.abs(x - y) / np.maximum(np.abs(y), np.finfo(np.float32).tiny)))
    if not rel:
        return {"compared": 0}
    worst = max(rel, key=rel.get)
    values = sorted(rel.values())
    return {"compared": len(rel), "max_rel_diff": rel[worst], "worst_linear": worst,
            "median_rel_diff": values[len(values) // 2],
            "within_1e-3": sum(v <= 1e-3 for v in values), "within_1e-2": sum(v <= 1e-2 for v in values),
            "worst_values": [np.asarray(a[worst]).reshape(-1)[:4].tolist(), np.asarray(b[worst]).reshape(-1)[:4].tolist()]}


def compare_scales(vlmopt_dir: Path, llmc_dir: Path, reference: dict | None) -> dict:
    """Same quantized Linears? Relative differences of input_scale / weight_scale between the tools'
    checkpoints, and of each tool's input_scale against the HF reference (reported, not asserted)."""
    a, b = load_scales(vlmopt_dir), load_scales(llmc_dir)
    qa = {k for k, v in a.items() if "weight_scale" in v}
    qb = {k for k, v in b.items() if "weight_scale" in v}
    out = {"vlmopt_quantized_linears": len(qa), "llmc_quantized_linears": len(qb),
           "same_linears": qa == qb, "only_vlmopt": sorted(qa - qb)[:20], "only_llmc": sorted(qb - qa)[:20]}
    pick = lambda scales, kind: {k: v[kind] for k, v in scales.items() if kind in v}
    for kind in ("input_scale", "weight_scale"):
        out[kind] = rel_diff_summary(pick(a, kind), pick(b, kind))  # vlmopt relative to llm-compressor
    if reference:
        for tool, scales in (("vlmopt", a), ("llmc", b)):
            for which in ("all_tokens", "without_padding"):
                out[f"{tool}_vs_reference_{which}"] = rel_diff_summary(pick(scales, "input_scale"), reference[which])
    return out


# ----------------------------------------------------------------------------- orchestration

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu,
            "mem_total_gib": mem, "platform": platform.platform(), "python": platform.python_version(),
            "loadavg_at_start": list(os.getloadavg())}


def versions(vlmopt: str) -> dict:
    from importlib.metadata import PackageNotFoundError, version
    out = {}
    for pkg in ("torch", "transformers", "llmcompressor", "compressed-tensors", "safetensors", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    res = subprocess.run([vlmopt, "--version"], capture_output=True, text=True)
    out["vlmopt"] = (res.stdout or res.stderr).strip()
    return out


def resolve_model(name: str, args, work: Path, env) -> Path:
    if name == "builtin":
        return Path(args.builtin_dir).resolve()
    if name == "large":
        if args.large_dir:
            return Path(args.large_dir).resolve()
        target = work / "llava-large"
        if not (target / "config.json").exists():
            cmd = [sys.executable, str(Path(__file__).resolve().parent / "make_random_llava.py"),
                   "--like", str(Path(args.builtin_dir).resolve()), "--layers", "24", "--hidden", "1024",
                   "--intermediate", "2816", "--heads", "16", "--kv-heads", "8", "--seed", "0", "--out", str(target)]
            print(f"[bench] creating the large random checkpoint: {shlex.join(cmd)}", file=sys.stderr)
            subprocess.run(cmd, check=True, env=env)
        return target
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"--models: {name!r} is neither 'builtin', 'large' nor a model directory")
    return path.resolve()


def cpu_seconds(run: dict) -> float:
    return run["user_seconds"] + run["system_seconds"]


def best(runs: list[dict], key: str) -> dict:
    """The repeat with the smallest `key` (best-of-N: the least disturbed run on a shared machine)."""
    return min(runs, key=lambda r: r[key])


def bench_model(label: str, model_dir: Path, n: int, args, work_root: Path, env) -> dict:
    work = work_root / label
    work.mkdir(parents=True, exist_ok=True)
    pack = work / f"calib-{n}.h5"
    subprocess.run([args.vlmopt, "-q", "datasets", "pack", "builtin:calib", str(pack), "--limit", str(n)],
                   check=True, env=env)
    runs = {"forward": [], "minmax": [], "entropy": [], **{p: [] for p in args.llmc_pipelines}}
    for rep in range(args.repeats):
        tag = f"[bench] {label} ({n} samples, batch {args.batch_size}) repeat {rep + 1}/{args.repeats}:"
        print(f"{tag} vlmopt bench forward", file=sys.stderr)
        runs["forward"].append(vlmopt_forward(args, model_dir, pack, n, work, env))
        for observer in ("minmax", "entropy"):
            print(f"{tag} vlmopt calibrate --observer {observer}", file=sys.stderr)
            runs[observer].append(vlmopt_calibrate(args, model_dir, pack, n, observer, work, env))
        for pipeline in args.llmc_pipelines:
            print(f"{tag} llm-compressor oneshot ({pipeline} pipeline)", file=sys.stderr)
            runs[pipeline].append(llmc_run(args, model_dir, pack, n, pipeline, work, env))

    fwd, mm, ent = best(runs["forward"], "seconds"), best(runs["minmax"], "collect_seconds"), best(runs["entropy"], "collect_seconds")
    llmc = {p: best(runs[p], "oneshot_seconds") for p in args.llmc_pipelines}
    ratios = {
        "minmax_over_forward": mm["collect_seconds"] / fwd["seconds"],
        "entropy_over_forward": ent["collect_seconds"] / fwd["seconds"],
        "llmc_over_vlmopt_total": {p: r["wall_seconds"] / mm["wall_seconds"] for p, r in llmc.items()},
        "llmc_over_vlmopt_calibration": {p: r["oneshot_seconds"] / mm["collect_seconds"] for p, r in llmc.items()},
        "llmc_over_vlmopt_peak_rss": {p: r["peak_rss_mib"] / mm["peak_rss_mib"] for p, r in llmc.items()},
        # CPU seconds (user + system) of the whole child: less sensitive than wall time to other
        # load on a shared machine, but blind to idle waits and to unused cores.
        "llmc_over_vlmopt_total_cpu": {p: cpu_seconds(r) / cpu_seconds(mm) for p, r in llmc.items()},
    }
    # The headline is against llm-compressor's fastest pipeline (the conservative comparison).
    fastest = min(llmc, key=lambda p: llmc[p]["wall_seconds"])
    ratios["headline_pipeline"] = fastest
    targets = {
        f"llmc_over_vlmopt_total >= {TARGET_SPEEDUP_VS_LLMC}": ratios["llmc_over_vlmopt_total"][fastest] >= TARGET_SPEEDUP_VS_LLMC,
        f"minmax_over_forward <= {TARGET_MINMAX_OVER_FORWARD}": ratios["minmax_over_forward"] <= TARGET_MINMAX_OVER_FORWARD,
        f"entropy_over_forward <= {TARGET_ENTROPY_OVER_FORWARD}": ratios["entropy_over_forward"] <= TARGET_ENTROPY_OVER_FORWARD,
    }
    reference = None
    if args.reference_scales:
        print(f"[bench] {label}: HF reference forward for the input_scale check (untimed)", file=sys.stderr)
        reference = reference_scales(args, model_dir, pack, n, work, env)
    scales = {p: compare_scales(Path(mm["bundle"]), Path(r["checkpoint"]), reference) for p, r in llmc.items()}
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", {})
    return {
        "model_dir": str(model_dir), "samples": n, "batch_size": args.batch_size,
        "decoder": {k: text.get(k) for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                             "num_attention_heads", "num_key_value_heads")},
        "pack": str(pack), "pack_sha256": sha256_file(pack),
        "seconds": {
            "vlmopt_forward": {"pass": fwd["seconds"], "process_wall": fwd["wall_seconds"], "process_cpu": cpu_seconds(fwd)},
            **{f"vlmopt_{obs}": {"calibration": r["collect_seconds"], "command": r["seconds"],
                                 "process_wall": r["wall_seconds"], "process_cpu": cpu_seconds(r),
                                 # run_calibration's total: collect + plan (qparams, outliers, SQNR), before export
                                 "plan_total": (r["report_timing"] or {}).get("total_seconds"),
                                 "self_reported_peak_rss_mib": r["json"].get("peak_rss_mib")}
               for obs, r in (("minmax", mm), ("entropy", ent))},
            **{f"llmc_{p}": {"calibration": r["oneshot_seconds"], "process_wall": r["wall_seconds"],
                             "process_cpu": cpu_seconds(r),
                             "import": r["import_seconds"], "load": r["load_seconds"],
                             "preprocess": r["preprocess_seconds"], "save": r["save_seconds"]} for p, r in llmc.items()},
        },
        "peak_rss_mib": {"vlmopt_forward": fwd["peak_rss_mib"], "vlmopt_minmax": mm["peak_rss_mib"],
                         "vlmopt_entropy": ent["peak_rss_mib"],
                         **{f"llmc_{p}": r["peak_rss_mib"] for p, r in llmc.items()}},
        "ratios": ratios, "targets_met": targets, "input_scale_check": scales,
        "hf_reference": None if reference is None else {
            "padding_tokens": reference["padding_tokens"], "tokens": reference["tokens"],
            "hf_forward_seconds": reference["hf_forward_seconds"]},
        "runs": runs,
    }


def print_table(results: dict) -> None:
    for label, r in results["models"].items():
        s, rss, ra = r["seconds"], r["peak_rss_mib"], r["ratios"]
        print(f"\n== {label}: {r['model_dir']}  ({r['samples']} samples, batch {r['batch_size']}, "
              f"decoder {r['decoder']['num_hidden_layers']}x{r['decoder']['hidden_size']})")
        print(f"{'tool':<26}{'calib/pass s':>14}{'process s':>12}{'peak RSS MiB':>14}")
        print(f"{'vlmopt bench forward':<26}{s['vlmopt_forward']['pass']:>14.3f}{s['vlmopt_forward']['process_wall']:>12.3f}{rss['vlmopt_forward']:>14.0f}")
        for obs in ("minmax", "entropy"):
            k = f"vlmopt_{obs}"
            print(f"{'vlmopt calibrate ' + obs:<26}{s[k]['calibration']:>14.3f}{s[k]['process_wall']:>12.3f}{rss[k]:>14.0f}")
        for p in results["settings"]["llmc_pipelines"]:
            k = f"llmc_{p}"
            print(f"{'llm-compressor ' + p:<26}{s[k]['calibration']:>14.3f}{s[k]['process_wall']:>12.3f}{rss[k]:>14.0f}"
                  f"   (import {s[k]['import']:.1f}, load {s[k]['load']:.1f}, prep {s[k]['preprocess']:.1f}, save {s[k]['save']:.1f})")
        if r.get("hf_reference"):
            print(f"{'(HF eager forward, bare)':<26}{r['hf_reference']['hf_forward_seconds']:>14.3f}"
                  f"{'':>12}{'':>14}   (context: plain transformers, run after the tools)")
        print(f"vlmopt minmax / forward  = {ra['minmax_over_forward']:.3f}  (target <= {TARGET_MINMAX_OVER_FORWARD})")
        print(f"vlmopt entropy / forward = {ra['entropy_over_forward']:.3f}  (target <= {TARGET_ENTROPY_OVER_FORWARD})")
        for p in results["settings"]["llmc_pipelines"]:
            sc = r["input_scale_check"][p]
            isc = sc.get("input_scale", {})
            print(f"llm-compressor {p} / vlmopt minmax: total {ra['llmc_over_vlmopt_total'][p]:.2f}x, "
                  f"calibration {ra['llmc_over_vlmopt_calibration'][p]:.2f}x, "
                  f"total CPU {ra['llmc_over_vlmopt_total_cpu'][p]:.2f}x, peak RSS {ra['llmc_over_vlmopt_peak_rss'][p]:.2f}x"
                  f"  | same Linears: {sc['same_linears']} ({sc['vlmopt_quantized_linears']}/{sc['llmc_quantized_linears']}), "
                  f"input_scale max rel diff {isc.get('max_rel_diff', float('nan')):.2e} over {isc.get('compared', 0)}")
            for key in ("vlmopt_vs_reference_without_padding", "vlmopt_vs_reference_all_tokens",
                        "llmc_vs_reference_all_tokens", "llmc_vs_reference_without_padding"):
                if key in sc and sc[key].get("compared"):
                    print(f"    {key}: max rel diff {sc[key]['max_rel_diff']:.2e} over {sc[key]['compared']}")
        print("targets: " + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in r["targets_met"].items()))


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--llmc-worker":
        return llmc_worker(json.loads(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "--reference-worker":
        return reference_worker(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vlmopt", required=True, help="path to the vlmopt binary")
    ap.add_argument("--models", default="builtin,large",
                    help="comma-separated: builtin, large (random 24x1024 LLaVA), or model directories")
    ap.add_argument("--samples", type=int, default=128, help="calibration samples (builtin and directories)")
    ap.add_argument("--large-samples", type=int, default=32, help="calibration samples for the large model")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default="results.json")
    ap.add_argument("--builtin-dir", default=str(REPO / "models" / "builtin"), help="the builtin model's directory")
    ap.add_argument("--large-dir", default=None,
                    help="an existing large checkpoint (default: make_random_llava.py writes WORK/llava-large once)")
    ap.add_argument("--work", default=None, help="scratch directory for packs, bundles, logs (default: next to --out)")
    ap.add_argument("--llmc-pipelines", default=",".join(LLMC_PIPELINES),
                    help="llm-compressor calibration pipelines to time (basic: one whole-model pass; "
                         "sequential: oneshot's default for data-driven modifiers, layer by layer)")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads for every tool")
    ap.add_argument("--repeats", type=int, default=1, help="run every measurement N times, keep the fastest")
    ap.add_argument("--vlmopt-arg", action="append", default=[],
                    help="extra argument for vlmopt calibrate AND bench forward, e.g. --layerwise (repeatable)")
    ap.add_argument("--calibrate-arg", action="append", default=[],
                    help="extra argument for vlmopt calibrate only, e.g. --outlier-threshold=0 (repeatable)")
    ap.add_argument("--no-reference-scales", dest="reference_scales", action="store_false",
                    help="skip the untimed HF forward that explains input_scale differences")
    args = ap.parse_args()
    args.vlmopt = str(Path(args.vlmopt).resolve())
    args.llmc_pipelines = [p for p in args.llmc_pipelines.split(",") if p]
    for p in args.llmc_pipelines:
        if p not in LLMC_PIPELINES:
            raise SystemExit(f"--llmc-pipelines: expected some of {','.join(LLMC_PIPELINES)}, got {p!r}")
    if args.samples < 1 or args.large_samples < 1 or args.batch_size < 1 or args.repeats < 1:
        raise SystemExit("--samples, --large-samples, --batch-size and --repeats must be >= 1")

    out_path = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out_path.parent / (out_path.stem + ".work")
    work.mkdir(parents=True, exist_ok=True)
    threads = str(args.threads)
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TQDM_DISABLE": "1"}

    results = {
        "command": [sys.executable, *sys.argv], "cwd": os.getcwd(),
        "started_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "versions": versions(args.vlmopt),
        "settings": {"batch_size": args.batch_size, "threads": args.threads, "repeats": args.repeats,
                     "llmc_pipelines": args.llmc_pipelines, "device": "cpu", "dtype": "float32",
                     "prompt_template": PROMPT_TEMPLATE, "data": "builtin:calib (first N samples, one HDF5 pack per model)",
                     "vlmopt_extra_args": args.vlmopt_arg, "vlmopt_calibrate_extra_args": args.calibrate_arg,
                     "scheme": "W8A8 int8: weights symmetric per-channel (minmax), inputs symmetric per-tensor static "
                               "(vlmopt --observer minmax|entropy; llm-compressor static_minmax); vision tower, "
                               "projector, lm_head unquantized",
                     "definitions": {
                         "calibration": "vlmopt: collect_seconds (the pass with observers); llm-compressor: the oneshot() "
                                        "call on prebuilt batches (session init, observers, passes, qparams)",
                         "process_wall": "wall time of the tool's own child process, start-up to exit "
                                         "(vlmopt: load, pass, export; llm-compressor: imports, load, preprocess, oneshot, save)",
                         "forward": "vlmopt bench forward `seconds`: the same pass with nothing observing",
                         "llmc_over_vlmopt_total": "llm-compressor process_wall / vlmopt calibrate minmax process_wall",
                         "llmc_over_vlmopt_calibration": "llm-compressor oneshot seconds / vlmopt minmax collect_seconds",
                         "llmc_over_vlmopt_total_cpu": "the same as _total with the children's user+system CPU seconds",
                         "minmax_over_forward": "vlmopt minmax collect_seconds / bench forward seconds"}},
        "models": {},
    }
    for label in [m for m in args.models.split(",") if m]:
        model_dir = resolve_model(label, args, work, env)
        n = args.large_samples if label == "large" else args.samples
        results["models"][label] = bench_model(label, model_dir, n, args, work, env)
        results["finished_utc"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        # Written after every model so a later failure keeps the finished ones.
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        os.replace(tmp, out_path)
    print_table(results)
    print(f"\nwrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
