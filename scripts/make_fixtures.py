#!/usr/bin/env python3
"""Build tiny random LLaVA checkpoints plus reference outputs from HF transformers.

The C++ model (lib/model) is tested for numerical parity against these files;
tests/fixtures/README.md documents every file, tensor name and shape.

    python scripts/make_fixtures.py [--out DIR] [--variant NAME ...]

Everything runs on the CPU in fp32 with eager attention, offline, from fixed
seeds, so the same transformers/torch versions reproduce the same bytes
(tests/interop/regen_and_compare.py checks this). No pickle is read or written.
"""

from __future__ import annotations

import os

# Offline and CPU only; set before transformers is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    GenerationConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2Config,
    SiglipVisionConfig,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures"

BATCH = 2
MAX_NEW_TOKENS = 8
# Greedy decoding must not hinge on float noise: every generated step needs at
# least this gap between the best and second-best logit (logits are O(1)).
MIN_TOP2_GAP = 1e-3

UNK, BOS, EOS = "<unk>", "<s>", "</s>"
IMAGE = "<image>"

CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


class FixtureError(RuntimeError):
    """A generated fixture failed one of its own consistency checks."""


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    seed: int
    description: str
    # "old" | "new" rewrite model.safetensors to that key layout;
    # "native" keeps exactly what save_pretrained wrote (see README).
    layout: str
    vision: Callable[[], Any]
    text: Callable[[], Any]
    llava: dict
    image_token_id: int
    # number of text words before the image block in each batch row; the
    # rows get different offsets so the merge is tested off the diagonal.
    prefix_words: tuple[int, int]
    suffix_words: tuple[int, int]
    max_shard_size: int | None = None  # bytes; set => sharded checkpoint


# Init scales: transformers' defaults (0.02) give near-uniform logits and
# greedy ties at the 1e-6 level; 0.3 gives O(1) logit gaps.
TEXT_INIT = 0.3


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in [
        Variant(
            name="clip_llama_old",
            seed=1244,
            description=(
                "CLIP vision (quick_gelu, class token, vision_feature_layer -2, strategy default) "
                "+ LLaMA MHA decoder, projector with bias; old on-disk key layout "
                "(language_model.model.*, language_model.lm_head.weight, vision_tower.vision_model.*, "
                "multi_modal_projector.*)"
            ),
            layout="old",
            vision=lambda: CLIPVisionConfig(
                image_size=8, patch_size=2, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=37, hidden_act="quick_gelu",
            ),
            text=lambda: LlamaConfig(
                vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, intermediate_size=37, initializer_range=TEXT_INIT,
                max_position_embeddings=512,
            ),
            llava=dict(
                vision_feature_layer=-2, vision_feature_select_strategy="default",
                multimodal_projector_bias=True, projector_hidden_act="gelu",
            ),
            image_token_id=3,
            prefix_words=(2, 5),
            suffix_words=(6, 3),
        ),
        Variant(
            name="siglip_qwen2_new",
            seed=2053,
            description=(
                "SigLIP vision (gelu_pytorch_tanh, no class token, vision_feature_layer -1, strategy full) "
                "+ Qwen2 decoder with GQA (4 heads, 2 kv heads), q/k/v biases, rope_theta 1e6, "
                "tied word embeddings (no lm_head tensor on disk); new on-disk key layout "
                "(model.language_model.*, model.vision_tower.vision_model.*, model.multi_modal_projector.*)"
            ),
            layout="new",
            vision=lambda: SiglipVisionConfig(
                image_size=12, patch_size=4, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=37, hidden_act="gelu_pytorch_tanh",
            ),
            text=lambda: Qwen2Config(
                vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=37, initializer_range=TEXT_INIT,
                tie_word_embeddings=True, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            ),
            llava=dict(
                vision_feature_layer=-1, vision_feature_select_strategy="full",
                multimodal_projector_bias=True, projector_hidden_act="gelu",
                tie_word_embeddings=True,
            ),
            image_token_id=98,
            prefix_words=(4, 1),
            suffix_words=(3, 6),
        ),
        Variant(
            name="clip_llama_gqa_sharded",
            seed=89,
            description=(
                "CLIP vision (image 16, patch 4, vision_feature_layer [-2, -1] concatenated, strategy default) "
                "+ LLaMA GQA decoder (4 heads, 2 kv heads, attention_bias true, 3 layers, rms_norm_eps 1e-5, "
                "rope_theta 5e5); sharded checkpoint (2 shards + model.safetensors.index.json) in the key "
                "layout save_pretrained writes natively (language_model.model.*, language_model.lm_head.weight, "
                "vision_tower.* WITHOUT vision_model., multi_modal_projector.*)"
            ),
            layout="native",
            vision=lambda: CLIPVisionConfig(
                image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                num_attention_heads=4, intermediate_size=37, hidden_act="quick_gelu",
            ),
            text=lambda: LlamaConfig(
                vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=37, initializer_range=TEXT_INIT,
                attention_bias=True, rms_norm_eps=1e-5, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            ),
            llava=dict(
                vision_feature_layer=[-2, -1], vision_feature_select_strategy="default",
                multimodal_projector_bias=True, projector_hidden_act="gelu",
            ),
            image_token_id=50,
            prefix_words=(3, 7),
            suffix_words=(5, 1),
            max_shard_size=120_000,
        ),
    ]
}


# --------------------------------------------------------------------------
# key layouts
# --------------------------------------------------------------------------

def _replace_prefix(key: str, table: list[tuple[str, str]]) -> str:
    for src, dst in table:
        if key.startswith(src):
            return dst + key[len(src):]
    raise FixtureError(f"unexpected parameter name {key!r}")


# In-memory names (transformers 5.x) -> on-disk names.
_OLD_LAYOUT = [
    ("model.vision_tower.", "vision_tower.vision_model."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]
_NEW_LAYOUT = [
    ("model.vision_tower.", "model.vision_tower.vision_model."),
    ("model.multi_modal_projector.", "model.multi_modal_projector."),
    ("model.language_model.", "model.language_model."),
    ("lm_head.", "lm_head."),
]
# What LlavaForConditionalGeneration.save_pretrained writes in transformers
# 5.17 (save_original_format=True): old prefixes, but the vision tower keys
# lack "vision_model." because 5.x CLIP/SigLIP vision models no longer have
# that submodule and the reverse conversion does not add it back.
_NATIVE_LAYOUT = [
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
]
LAYOUTS = {"old": _OLD_LAYOUT, "new": _NEW_LAYOUT, "native": _NATIVE_LAYOUT}


def on_disk_state_dict(model: LlavaForConditionalGeneration, layout: str) -> dict[str, torch.Tensor]:
    """The model's weights under `layout` names; a tied lm_head is left out, as save_pretrained does."""
    tied = model.config.tie_word_embeddings
    out = {}
    for name, tensor in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        out[_replace_prefix(name, LAYOUTS[layout])] = tensor.detach().clone().contiguous()
    return out


def read_safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    """All weight tensors of a (possibly sharded) checkpoint directory."""
    index = path / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(path / file), framework="pt") as f:
            for key in f.keys():
                if key in tensors:
                    raise FixtureError(f"{path / file}: duplicate tensor {key}")
                tensors[key] = f.get_tensor(key)
    return tensors


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.int64: "I64"}


def save_reference(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file byte-for-byte reproducibly.

    safetensors.torch.save_file keeps __metadata__ in a Rust HashMap, so its
    key order (and the file's bytes) changes from run to run; committed
    fixtures should not churn, so the header is written here with sorted keys
    and checked by reading it back with the safetensors library.
    """
    if sys.byteorder != "little":
        raise FixtureError("safetensors data is little-endian; this writer assumes a little-endian host")
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    chunks, offset = [], 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous()
        data = tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(len(header_bytes).to_bytes(8, "little"))
        f.write(header_bytes)
        for chunk in chunks:
            f.write(chunk)
    with safe_open(str(path), framework="pt") as f:
        if f.metadata() != metadata or set(f.keys()) != set(tensors):
            raise FixtureError(f"{path}: safetensors reads back different names or metadata")
        for name in tensors:
            if not torch.equal(f.get_tensor(name), tensors[name]):
                raise FixtureError(f"{path}: tensor {name} reads back differently")


# --------------------------------------------------------------------------
# tokenizer / processor
# --------------------------------------------------------------------------

def build_vocab(vocab_size: int, image_token_id: int) -> dict[str, int]:
    specials = {UNK: 0, BOS: 1, EOS: 2, IMAGE: image_token_id}
    if image_token_id in (0, 1, 2) or not 0 <= image_token_id < vocab_size:
        raise FixtureError(f"image_token_id {image_token_id} collides with <unk>/<s>/</s> or is out of range")
    vocab = dict(specials)
    for token_id in range(vocab_size):
        if token_id not in specials.values():
            vocab[f"w{token_id}"] = token_id
    return vocab


def write_tokenizer(out: Path, vocab: dict[str, int]) -> None:
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # Already in the vocab, so they keep their ids; marking them special makes
    # them split out before pre-tokenization and skippable when decoding.
    tok.add_special_tokens([UNK, BOS, EOS, IMAGE])
    for token, token_id in vocab.items():
        if tok.token_to_id(token) != token_id:
            raise FixtureError(f"tokenizer gave {token!r} id {tok.token_to_id(token)}, want {token_id}")
    # Written directly (not via transformers' save_pretrained, which would add
    # a no-op TemplateProcessing post-processor): no normalizer, no
    # post-processor, no decoder. Prompts carry <s> themselves.
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": UNK,
        "image_token": IMAGE,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_preprocessor_config(out: Path, vision_config) -> None:
    size = vision_config.image_size
    if vision_config.model_type == "clip_vision_model":
        cfg = {
            "image_processor_type": "CLIPImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"shortest_edge": size},
            "resample": 3,  # PIL bicubic
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
        }
    elif vision_config.model_type == "siglip_vision_model":
        cfg = {
            "image_processor_type": "SiglipImageProcessor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"height": size, "width": size},
            "resample": 3,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
        }
    else:
        raise FixtureError(f"no processor for {vision_config.model_type}")
    (out / "preprocessor_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def check_processor_files(out: Path, variant: Variant, prompts: list[str], input_ids: torch.Tensor) -> None:
    """The tokenizer and image processor files load in transformers and agree with our ids/shapes."""
    tok = AutoTokenizer.from_pretrained(str(out))
    for row, prompt in enumerate(prompts):
        for add_special_tokens in (False, True):  # True must not add a second <s>
            ids = tok(prompt, add_special_tokens=add_special_tokens)["input_ids"]
            if ids != input_ids[row].tolist():
                raise FixtureError(f"AutoTokenizer encodes prompt {row} differently: {ids}")
    if tok.convert_tokens_to_ids(IMAGE) != variant.image_token_id:
        raise FixtureError(f"tokenizer maps {IMAGE} to {tok.convert_tokens_to_ids(IMAGE)}")
    # AutoImageProcessor insists on torchvision, which is not installed; the
    # PIL-backed classes read the same preprocessor_config.json.
    from PIL import Image
    from transformers import CLIPImageProcessorPil, SiglipImageProcessorPil

    declared = json.loads((out / "preprocessor_config.json").read_text())["image_processor_type"]
    pil_class = {"CLIPImageProcessor": CLIPImageProcessorPil, "SiglipImageProcessor": SiglipImageProcessorPil}[declared]
    processor = pil_class.from_pretrained(str(out))
    image = Image.new("RGB", (23, 17), (200, 30, 90))
    pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    size = variant.vision().image_size
    if tuple(pixels.shape) != (1, 3, size, size):
        raise FixtureError(f"image processor gave shape {tuple(pixels.shape)}")


# --------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------

def build_config(variant: Variant) -> LlavaConfig:
    vision = variant.vision()
    # Image tokens per image: one per patch, plus CLIP's class token, minus
    # the first token when the strategy is "default".
    tokens = (vision.image_size // vision.patch_size) ** 2
    tokens += 1 if vision.model_type == "clip_vision_model" else 0
    tokens -= 1 if variant.llava["vision_feature_select_strategy"] == "default" else 0
    config = LlavaConfig(
        vision_config=vision,
        text_config=variant.text(),
        image_token_index=variant.image_token_id,
        image_seq_length=tokens,
        **variant.llava,
    )
    config._attn_implementation = "eager"
    return config


def build_model(variant: Variant) -> LlavaForConditionalGeneration:
    torch.manual_seed(variant.seed)
    model = LlavaForConditionalGeneration(build_config(variant)).eval()
    # transformers initialises norms to 1 and most biases to 0, which would let
    # a C++ port that drops a bias or a norm weight still match; perturb every
    # constant parameter so each one matters.
    gen = torch.Generator().manual_seed(variant.seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():  # tied parameters appear once
            if param.numel() > 1 and torch.all(param == param.flatten()[0]):
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def load_model(path: Path) -> LlavaForConditionalGeneration:
    model, info = LlavaForConditionalGeneration.from_pretrained(
        str(path), attn_implementation="eager", dtype=torch.float32, output_loading_info=True
    )
    problems = {k: v for k, v in info.items() if v}
    if problems:
        raise FixtureError(f"{path}: transformers reported loading problems {problems}")
    return model.eval()


def make_inputs(variant: Variant, config: LlavaConfig, vocab: dict[str, int]):
    """Random pixel values and two prompts `<s> words <image>*N words`, same length T."""
    gen = torch.Generator().manual_seed(variant.seed + 2)
    vision = config.vision_config
    pixel_values = torch.randn(BATCH, 3, vision.image_size, vision.image_size, generator=gen)
    words = [w for w, i in vocab.items() if w.startswith("w")]
    lengths = [p + s for p, s in zip(variant.prefix_words, variant.suffix_words)]
    if len(set(lengths)) != 1:
        raise FixtureError(f"rows must have the same number of words, got {lengths}")
    prompts = []
    for prefix, suffix in zip(variant.prefix_words, variant.suffix_words):
        picks = torch.randint(len(words), (prefix + suffix,), generator=gen).tolist()
        tokens = [BOS] + [words[i] for i in picks[:prefix]] + [IMAGE] * config.image_seq_length
        tokens += [words[i] for i in picks[prefix:]]
        prompts.append(" ".join(tokens))
    input_ids = torch.tensor([[vocab[t] for t in p.split(" ")] for p in prompts], dtype=torch.int64)
    attention_mask = torch.ones_like(input_ids)
    return pixel_values, input_ids, attention_mask, prompts


def select_vision_features(config: LlavaConfig, hidden_states) -> torch.Tensor:
    """LLaVA's choice of vision hidden states, recomputed here to cross-check get_image_features."""
    layers = config.vision_feature_layer
    layers = [layers] if isinstance(layers, int) else list(layers)
    picked = [hidden_states[k] for k in layers]
    if config.vision_feature_select_strategy == "default":
        picked = [h[:, 1:] for h in picked]
    return torch.cat(picked, dim=-1)


@torch.no_grad()
def greedy_reference(model, pixel_values, input_ids, forbidden: set[int]):
    """Greedy decode by full recomputation each step, with the top-2 gap check."""
    ids = input_ids
    min_gap = float("inf")
    for step in range(MAX_NEW_TOKENS):
        logits = model(
            input_ids=ids, pixel_values=pixel_values, attention_mask=torch.ones_like(ids)
        ).logits[:, -1, :]
        top2 = logits.topk(2, dim=-1)
        gap = (top2.values[:, 0] - top2.values[:, 1]).min().item()
        min_gap = min(min_gap, gap)
        if gap <= MIN_TOP2_GAP:
            raise FixtureError(
                f"greedy step {step}: top-2 logit gap {gap:.3g} <= {MIN_TOP2_GAP}; choose another seed"
            )
        next_ids = top2.indices[:, 0:1]
        bad = forbidden.intersection(next_ids.flatten().tolist())
        if bad:
            raise FixtureError(
                f"greedy step {step} produced special id(s) {sorted(bad)} (eos/image/bos/unk); choose another seed"
            )
        ids = torch.cat([ids, next_ids], dim=1)
    return ids, min_gap


@torch.no_grad()
def compute_reference(model, pixel_values, input_ids, attention_mask):
    config = model.config
    out = model(
        input_ids=input_ids,
        pixel_values=pixel_values,
        attention_mask=attention_mask,
        output_hidden_states=True,
    )
    image_features = torch.cat(
        list(model.get_image_features(pixel_values=pixel_values).pooler_output), dim=0
    )
    vision_out = model.model.vision_tower(pixel_values, output_hidden_states=True)
    vision_hidden = vision_out.hidden_states

    # Independent cross-checks of what we dump.
    if not torch.equal(image_features, out.image_hidden_states):
        raise FixtureError("get_image_features differs from the forward pass's image_hidden_states")
    projected = model.model.multi_modal_projector(select_vision_features(config, vision_hidden))
    if not torch.equal(projected.flatten(0, 1), image_features):
        raise FixtureError("projector(selected vision hidden states) differs from get_image_features")
    image_mask = input_ids == config.image_token_id
    if not torch.equal(out.hidden_states[0][image_mask], image_features):
        raise FixtureError("image tokens of text_hidden_states.0 are not the image features in order")
    if not torch.allclose(model.lm_head(out.hidden_states[-1]), out.logits, atol=1e-6, rtol=0):
        raise FixtureError("lm_head(last text hidden state) != logits; the final norm is not where expected")

    generation_config = GenerationConfig(
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        min_new_tokens=0,
        eos_token_id=None,  # never stop early; greedy_reference also forbids eos
        pad_token_id=0,
        bos_token_id=None,
    )
    generated = model.generate(
        input_ids=input_ids,
        pixel_values=pixel_values,
        attention_mask=attention_mask,
        generation_config=generation_config,
    )
    text_cfg = config.text_config
    forbidden = {0, 1, 2, config.image_token_id}
    forbidden |= {i for i in (text_cfg.eos_token_id, text_cfg.bos_token_id) if isinstance(i, int)}
    expected, min_gap = greedy_reference(model, pixel_values, input_ids, forbidden)
    if generated.shape != (BATCH, input_ids.shape[1] + MAX_NEW_TOKENS) or not torch.equal(generated, expected):
        raise FixtureError(f"generate() gave {generated.tolist()}, full recomputation gave {expected.tolist()}")

    tensors = {
        "pixel_values": pixel_values,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "logits": out.logits,
        "image_features": image_features,
        "generated_ids": generated,
    }
    for k, h in enumerate(vision_hidden):
        tensors[f"vision_hidden_states.{k}"] = h
    for k, h in enumerate(out.hidden_states):
        tensors[f"text_hidden_states.{k}"] = h
    return {k: v.detach().contiguous() for k, v in tensors.items()}, min_gap


def assert_layouts_load_identically(model, inputs) -> None:
    """Every layout written from `model` loads in transformers to bitwise-identical logits."""
    pixel_values, input_ids, attention_mask = inputs
    with torch.no_grad():
        want = model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask).logits
    with tempfile.TemporaryDirectory(prefix="vlmopt_layouts_") as tmp:
        native = Path(tmp) / "native"
        model.save_pretrained(str(native))
        native_weights = read_safetensors_dir(native)
        expected_native = on_disk_state_dict(model, "native")
        if native_weights.keys() != expected_native.keys():
            diff = set(native_weights) ^ set(expected_native)
            raise FixtureError(f"save_pretrained's key layout changed; differing keys: {sorted(diff)[:8]}")
        if any(not torch.equal(native_weights[k], expected_native[k]) for k in native_weights):
            raise FixtureError("save_pretrained wrote weights that differ from the model's")
        for layout in LAYOUTS:
            path = Path(tmp) / layout
            if layout != "native":
                shutil.copytree(native, path)
                (path / "model.safetensors").unlink()
                save_file(on_disk_state_dict(model, layout), str(path / "model.safetensors"), metadata={"format": "pt"})
            with torch.no_grad():
                got = load_model(path)(
                    input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask
                ).logits
            if not torch.equal(got, want):
                raise FixtureError(
                    f"layout {layout} reloads to different logits "
                    f"(max diff {(got - want).abs().max().item():.3g})"
                )


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------

def write_checkpoint(model, variant: Variant, out: Path) -> None:
    if variant.max_shard_size is not None:
        model.save_pretrained(str(out), max_shard_size=variant.max_shard_size)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        if len(shards) != 2:
            raise FixtureError(f"expected 2 shards, save_pretrained wrote {shards}")
    else:
        model.save_pretrained(str(out))
    if variant.layout == "native":
        return
    (out / "model.safetensors").unlink()
    save_file(on_disk_state_dict(model, variant.layout), str(out / "model.safetensors"), metadata={"format": "pt"})


def make_variant(variant: Variant, out_root: Path) -> tuple[Path, float]:
    """Build one variant into <out_root>/<name>/; returns that path and the smallest greedy top-2 gap."""
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # summation order independent of the machine's core count
    final = out_root / variant.name
    out_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{variant.name}.", dir=out_root))
    try:
        model = build_model(variant)
        config = model.config
        vocab = build_vocab(config.text_config.vocab_size, variant.image_token_id)
        pixel_values, input_ids, attention_mask, prompts = make_inputs(variant, config, vocab)

        assert_layouts_load_identically(model, (pixel_values, input_ids, attention_mask))

        write_checkpoint(model, variant, staging)
        write_tokenizer(staging, vocab)
        write_preprocessor_config(staging, config.vision_config)
        check_processor_files(staging, variant, prompts, input_ids)

        # References come from the files on disk, not the in-memory model.
        reloaded = load_model(staging)
        on_disk = read_safetensors_dir(staging)
        expected = on_disk_state_dict(model, variant.layout)
        if on_disk.keys() != expected.keys() or any(not torch.equal(on_disk[k], expected[k]) for k in on_disk):
            raise FixtureError("weights on disk differ from the in-memory model's")
        tensors, min_gap = compute_reference(reloaded, pixel_values, input_ids, attention_mask)

        metadata = {
            "format": "pt",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "variant": variant.name,
            "max_new_tokens": str(MAX_NEW_TOKENS),
            # "native" has old-style prefixes; its vision keys lack "vision_model." (see README)
            "layout": "new" if variant.layout == "new" else "old",
            "description": variant.description,
            "prompts": json.dumps(prompts),
        }
        save_reference(tensors, staging / "reference.safetensors", metadata)

        # mkdtemp and safetensors create owner-only files; fixtures are shared.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return final, min_gap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output root (default {DEFAULT_OUT})")
    parser.add_argument("--variant", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS),
                        help="variants to build (default all)")
    parser.add_argument("--quiet", action="store_true", help="print only errors")
    args = parser.parse_args(argv)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        for name in args.variant:
            path, min_gap = make_variant(VARIANTS[name], args.out)
            if not args.quiet:
                print(f"{name}: wrote {path} (min top-2 logit gap over generated steps {min_gap:.3g})")
    except FixtureError as err:
        print(f"make_fixtures: {name}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
