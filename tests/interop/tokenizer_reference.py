#!/usr/bin/env python3
"""Reference outputs for vlmopt's C++ tokenizer (tests/test_tokenizer_interop.cpp).

Builds tokenizers with the HF `tokenizers` library (WordLevel, WordPiece, LLaMA-style BPE
with byte fallback in its Metaspace and legacy Prepend+Replace forms, GPT-2 and Qwen2-style
byte-level BPE), writes each as a tokenizer.json, and records what `tokenizers` makes of
many strings: ids with and without special tokens, and the decoded text. It also saves an
HF LLaVA processor directory and the input_ids LlavaProcessor makes for prompts with
<image> placeholders.

Usage: tokenizer_reference.py --out DIR   (writes DIR/cases.json and the tokenizer files)
"""

import argparse
import json
import os
import random
import sys
import unicodedata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is riding a red bicycle down the street, next to a bus.",
    "What color is the cat sitting on the sofa? The cat is black and white.",
    "Describe the image in detail: two children are playing with a ball in the park.",
    "There are 3 apples, 12 oranges and 7 bananas on the wooden table!",
    "USER: How many people are in the picture? ASSISTANT: There are four people.",
    "lower lowest newer newest wider widest, the lowest and the newest.",
    "She said: \"it's fine\" -- but it wasn't; they'd left at 10:30 am.",
    "Vision language models read images and text; tokens flow through the decoder.",
    "A photo of a dog, a photo of a cat, a photo of a horse in a field.",
    "Is there a traffic light? Yes, there is a traffic light at the corner.",
    "The sign reads STOP in large white letters on a red octagon.",
]

# Strings chosen to hit the corners: Unicode classes, normalization forms, whitespace
# kinds, added tokens at every position, byte fallback.
HANDPICKED = [
    "",
    " ",
    "   ",
    "\t\n",
    "Hello world",
    "hello  world",
    " leading space",
    " The quick brown fox",  # a left Strip before Metaspace(first): "The", not "▁The"
    "   A photo of a dog",
    "<image> The dog",
    "trailing space ",
    "  both  ",
    "The quick brown fox jumps over the lazy dog.",
    "UPPER lower MiXeD",
    "numbers 123 4567 89.5 1,000,000",
    "punctuation!!! ... ??? ;:, -- ()[]{}",
    "a-b_c.d/e\\f|g~h^i`j",
    "don't won't they'd I'm we've you're it's",
    "e-mail: someone@example.com, url: https://example.com/a?b=c&d=e",
    "café naïve résumé coöperate",
    "cafe\u0301 nai\u0308ve",  # decomposed accents (NFC composes them)
    "ﬁne ﬂoor ｆｕｌｌｗｉｄｔｈ ①②③",  # compatibility characters
    "Straße GROSSE",
    "İstanbul ıi",
    "ΟΔΥΣΣΕΥΣ Σίσυφος",
    "Привет, мир! Как дела?",
    "日本語のテキストです。",
    "中文字符和English混合",
    "한국어 문장입니다",
    "مرحبا بالعالم",
    "שלום עולם",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧",
    "zero\u200bwidth\u200djoiner\u200c",
    "no\u00a0break\u3000ideographic\u2003em",
    "line\u2028separator\u2029para",
    "tab\there\nnewline\r\ncrlf",
    "\u0085next line\u000bvertical tab\u000cform feed",
    "control\u0001chars\u007f",
    "replacement \ufffd char",
    "combining x\u0301\u0302\u0303 marks",
    "<image>",
    "<image><image>",
    "<image>\nUSER: What is this?",
    "USER: <image>\nWhat is shown? ASSISTANT:",
    "text<image>text",
    "a <image> b",
    "  <image>  ",
    "<s>",
    "<s> hello </s>",
    "hello</s>",
    "[WORD]",
    "a [WORD] b",
    "a[WORD]b",
    "x [WORD]",
    "[WORD]x",
    "<mask>",
    "a   <mask>   b",
    "a<mask>b",
    "Yesterday",
    "I read a book Yesterday and yesterday",
    "YESTERDAY!",
    "<|im_start|>user\nhi<|im_end|>",
    "▁ already has the meta space ▁▁",
    "<0x41> looks like a byte token",
    "unknownwordxyzzy qwertyuiop",
    "lower lowest newest widest",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z",
    "  multiple   internal    spaces  ",
    "!",
    "?!",
    "....",
    "12345678901234567890",
    "½ ¾ Ⅻ ٣ ߂ 𝟙",
    "math: ∑ ∫ √ ∞ ≤ ≥ ≠ → ←",
    "currency: $5 €10 £3 ¥100 ₹50",
    "quotes: “smart” ‘single’ «guillemets» „low”",
    "dashes: – — ‐ ‒",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝓼𝓬𝓻𝓲𝓹𝓽",
    "ǅ ǈ ǋ titlecase",
    "ÅΩK ÅΩK",  # singleton decompositions: angstrom, ohm, kelvin
    "각 가",  # conjoining jamo vs syllable
]

ADDED_TOKEN_TEXTS = ["<image>", "<s>", "</s>", "[WORD]", "<mask>", "Yesterday", "<|im_start|>", "<|im_end|>"]


def generated_strings(count, seed=1234):
    """Random mixtures of words, Unicode fragments, spaces and added tokens."""
    rng = random.Random(seed)
    words = " ".join(CORPUS).split()
    fragments = [s for s in HANDPICKED if s] + ADDED_TOKEN_TEXTS
    spaces = [" ", "  ", "\t", "\n", "", " \n ", "\u00a0", "\u3000"]
    out = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 9)):
            r = rng.random()
            if r < 0.55:
                word = rng.choice(words)
                if rng.random() < 0.2:
                    word = word.upper()
                parts.append(word)
            elif r < 0.8:
                parts.append(rng.choice(fragments))
            else:
                parts.append("".join(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FF),
                                                    rng.randint(0x370, 0x3FF), rng.randint(0x4E00, 0x4E50),
                                                    rng.randint(0x1F600, 0x1F640)]))
                                     for _ in range(rng.randint(1, 6))))
            parts.append(rng.choice(spaces))
        out.append("".join(parts))
    return out


def test_strings():
    strings = list(HANDPICKED) + generated_strings(260)
    # Also the NFD and upper-case forms of some, to exercise normalizers.
    strings += [unicodedata.normalize("NFD", s) for s in HANDPICKED[16:30]]
    strings += [s.upper() for s in HANDPICKED[8:20]]
    return strings


def common_added_tokens():
    return [
        AddedToken("<image>", special=True, normalized=False),
        AddedToken("<s>", special=True, normalized=False),
        AddedToken("</s>", special=True, normalized=False),
        AddedToken("[WORD]", special=False, normalized=False, single_word=True),
        AddedToken("<mask>", special=True, normalized=False, lstrip=True, rstrip=True),
        AddedToken("Yesterday", special=False, normalized=True),
    ]


def build_wordlevel():
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Lowercase(), normalizers.Strip()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    trainer = trainers.WordLevelTrainer(vocab_size=400, special_tokens=["[UNK]", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(common_added_tokens())
    s_id = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", s_id)])
    return tok


def build_wordlevel_plain():
    """WhitespaceSplit + Digits, no normalizer, a Sequence of Punctuation behaviors."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Punctuation(behavior="merged_with_previous"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    trainer = trainers.WordLevelTrainer(vocab_size=500, special_tokens=["[UNK]"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    return tok


def build_wordpiece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]", max_input_chars_per_word=20))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]", "[SEP]", "[PAD]"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return tok


def llama_bpe_model():
    """A BPE model trained on the corpus, with LLaMA's layout: <unk> <s> </s>, the 256 byte
    tokens, then the learned pieces (so unseen characters fall back to bytes)."""
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=["<unk>"], limit_alphabet=60)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    return vocab, merges


def llama_decoder():
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])


def build_llama_metaspace(vocab, merges):
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False),
                                     decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens(common_added_tokens())
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return tok


def build_llama_legacy(vocab, merges):
    """llava-1.5's tokenizer.json layout: Prepend+Replace normalizer, no pre-tokenizer."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = llama_decoder()
    tok.add_tokens(common_added_tokens())
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return tok


def build_llama_split(vocab, merges):
    """Metaspace that splits, prepends always, and an end-of-sequence token in the template."""
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=False))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = llama_decoder()
    tok.add_tokens(common_added_tokens())
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A $B </s>",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    return tok


def build_gpt2():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False),
                    AddedToken("<|im_start|>", special=True, normalized=False),
                    AddedToken("<|im_end|>", special=True, normalized=False)])
    return tok


QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_qwen2():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                    AddedToken("<|im_end|>", special=True, normalized=False),
                    AddedToken("<image>", special=True, normalized=False)])
    return tok


def build_clip_like():
    """CLIP's layout: NFC, whitespace runs squeezed, lowercase, a regex Split (invert), byte-level,
    BPE with an end-of-word suffix, BPEDecoder."""
    clip_pattern = r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
    tok = Tokenizer(models.BPE(end_of_word_suffix="</w>", unk_token="<|endoftext|>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(clip_pattern), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|startoftext|>", "<|endoftext|>"],
                                  end_of_word_suffix="</w>", initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.decoder = decoders.BPEDecoder(suffix="</w>")
    tok.post_processor = processors.RobertaProcessing(("<|endoftext|>", tok.token_to_id("<|endoftext|>")),
                                                      ("<|startoftext|>", tok.token_to_id("<|startoftext|>")),
                                                      add_prefix_space=False, trim_offsets=False)
    return tok


def build_strip_first():
    """A left Strip before Metaspace(first): the stripped text no longer starts the input,
    so `tokenizers` does not prepend the marker. Plus accents stripped, digits replaced,
    splits merged with the previous / contiguous, a Metaspace decoder."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Strip(left=True, right=False), normalizers.NFKD(),
                                           normalizers.StripAccents(), normalizers.Replace(Regex(r"[0-9]+"), "0")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[,;:]"), behavior="merged_with_previous"),
        pre_tokenizers.Split("-", behavior="contiguous"),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.WordLevelTrainer(vocab_size=600, special_tokens=["<unk>"])
    tok.train_from_iterator(CORPUS + [" " + line for line in CORPUS], trainer)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False),
                    AddedToken("[WORD]", special=False, normalized=True, lstrip=True)])
    return tok


def build_bert_fixed():
    """BertNormalizer without accent stripping, NFKC and Nmt, then character-delimiter,
    digit and fixed-length splits; CTC decoder."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([
        normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=False, lowercase=False),
        normalizers.NFKC(), normalizers.Nmt()])
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.CharDelimiterSplit(" "), pre_tokenizers.Digits(individual_digits=False),
        pre_tokenizers.FixedLength(length=4)])
    tok.decoder = decoders.CTC(pad_token="[UNK]", word_delimiter_token="|", cleanup=True)
    trainer = trainers.WordLevelTrainer(vocab_size=800, special_tokens=["[UNK]"])
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens([AddedToken("<image>", special=True, normalized=False)])
    return tok


def merges_as_strings(path):
    """Rewrites a BPE tokenizer.json with its merges in the older "a b" form."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    doc["model"]["merges"] = [" ".join(pair) for pair in doc["model"]["merges"]]
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False)


def record(tok, path, strings, rng):
    cases = []
    for text in strings:
        with_special = tok.encode(text, add_special_tokens=True).ids
        without = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "text": text,
            "ids": with_special,
            "ids_no_special": without,
            "decoded": tok.decode(with_special, skip_special_tokens=True),
            "decoded_with_special": tok.decode(with_special, skip_special_tokens=False),
        })
    # Decoding arbitrary ids (byte tokens out of order, specials anywhere, unknown ids).
    size = tok.get_vocab_size(with_added_tokens=True)
    decodes = []
    for _ in range(40):
        ids = [rng.randrange(size) for _ in range(rng.randint(0, 12))]
        if rng.random() < 0.3:
            ids.append(size + 5)  # no such id: skipped
        decodes.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True),
                        "decoded_with_special": tok.decode(ids, skip_special_tokens=False)})
    vocab = tok.get_vocab(with_added_tokens=True)
    return {"file": os.path.basename(path), "vocab_size": size, "cases": cases, "decodes": decodes,
            "vocab_sample": sorted(vocab.items(), key=lambda kv: kv[1])[:: max(1, len(vocab) // 50)]}


def llava_processor_cases(out_dir, tok, name, prompts):
    """Saves an HF LLaVA processor around `tok` and records LlavaProcessor's input_ids."""
    import numpy as np
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token=tok.model.unk_token
                                     if hasattr(tok.model, "unk_token") else None)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=hf_tok, patch_size=4,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    directory = os.path.join(out_dir, name)
    processor.save_pretrained(directory)
    image = np.zeros((40, 48, 3), dtype=np.uint8)
    cases = []
    for prompt in prompts:
        n_images = prompt.count("<image>")
        inputs = processor(images=[image] * n_images if n_images else None, text=prompt)
        ids = inputs["input_ids"][0]
        cases.append({"prompt": prompt, "ids": list(map(int, ids))})
    image_seq_length = (32 // 4) * (32 // 4) + 1 - 1  # patches, + CLS, - CLS dropped by "default"
    specials = {"bos": hf_tok.bos_token_id, "eos": hf_tok.eos_token_id, "unk": hf_tok.unk_token_id,
                "pad": hf_tok.pad_token_id}
    return {"dir": name, "image_token_id": int(processor.image_token_id), "image_seq_length": image_seq_length,
            "specials": specials, "cases": cases}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = random.Random(99)
    strings = test_strings()

    vocab, merges = llama_bpe_model()
    builders = {
        "wordlevel.json": build_wordlevel,
        "wordlevel_plain.json": build_wordlevel_plain,
        "wordpiece.json": build_wordpiece,
        "llama_metaspace.json": lambda: build_llama_metaspace(vocab, merges),
        "llama_legacy.json": lambda: build_llama_legacy(vocab, merges),
        "llama_split.json": lambda: build_llama_split(vocab, merges),
        "gpt2.json": build_gpt2,
        "qwen2.json": build_qwen2,
        "clip_like.json": build_clip_like,
        "strip_first.json": build_strip_first,
        "bert_fixed.json": build_bert_fixed,
    }
    tokenizers_out = []
    for name, build in builders.items():
        tok = build()
        path = os.path.join(args.out, name)
        tok.save(path)
        if name == "llama_legacy.json":
            merges_as_strings(path)  # the C++ side then reads the "a b" form
            tok = Tokenizer.from_file(path)
        tokenizers_out.append(record(tok, path, strings, rng))

    prompts = [
        "<image>\nUSER: What is in the picture?\nASSISTANT:",
        "USER: <image>\nDescribe the image in detail. ASSISTANT:",
        "USER: compare <image> and <image> please ASSISTANT:",
        "no image at all, the dog is lazy",
        "<image><image>",
    ]
    llava = [
        llava_processor_cases(args.out, build_wordlevel(), "llava_wordlevel", prompts),
        llava_processor_cases(args.out, build_llama_legacy(vocab, merges), "llava_llama", prompts),
    ]
    import tokenizers
    import transformers
    with open(os.path.join(args.out, "cases.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizers_version": tokenizers.__version__, "transformers_version": transformers.__version__,
                   "tokenizers": tokenizers_out, "llava": llava}, f, ensure_ascii=False)
    print(f"wrote {sum(len(t['cases']) for t in tokenizers_out)} encode cases for {len(tokenizers_out)} tokenizers "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
