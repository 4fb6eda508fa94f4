"""Byte-level BPE tokenizer for demo checkpoints, trained on a small built-in English corpus.

The special tokens are Qwen's, at consecutive ids starting at `first_special_id` (Qwen's real ids
for full-size vocabularies, the top of the vocabulary for tiny ones). They are registered as special
added tokens: `encode(text, add_special_tokens=False)` turns "<|im_start|>" into one control id,
while a tokenizer with `encode_special_tokens = True` splits the same string as plain text.
"""
from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from pixeltriage.config import DEFAULT_TEMPLATE

# Qwen's special tokens in id order; Qwen3.5 puts the first at 248044.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
)
QWEN_FIRST_SPECIAL_ID = 248044
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

_CORPUS_SEED = 0
_NAMES = ["Alice", "Bob", "Maya", "Tom", "Lena", "Omar", "Priya", "Jonas", "Sofia", "Ken", "Mom", "Dad"]
_PLACES = ["the beach", "the park", "the office", "the kitchen", "Paris", "the lake", "the station",
           "the garden", "the museum", "the market", "the airport", "school", "the gym", "home"]
_THINGS = ["photo", "receipt", "whiteboard", "menu", "ticket", "map", "screenshot", "recipe", "poster",
           "sign", "chart", "slide", "note", "label", "invoice", "car", "dog", "cake", "jacket", "bike"]
_COLORS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple", "grey", "brown"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_QUESTIONS = [
    "What color was the {thing} at {place}?", "When did {name} go to {place}?",
    "How much was the total on the {thing}?", "Which {thing} did {name} show me last week?",
    "Where did we leave the {color} {thing}?", "What did the {thing} say about {place}?",
    "Who was with {name} at {place} on {day}?", "Can you remember the number on the {thing}?",
    "Is the {thing} from {month} still on the table?", "Why was {name} late to {place}?",
]
_DIALOGUE = [
    "{name}: Did you see the {thing} from {place}? {name2}: Yes, it was {color}.",
    "{name}: I'll meet you at {place} at {hour}:{minute}. {name2}: Sounds good, see you then!",
    "{name}: Can you send me the {thing}? {name2}: Sure, one second.",
    "{name}: We paid {amount} dollars for the {thing}. {name2}: That's a lot.",
    "{name}: Don't forget the {color} {thing} on {day}. {name2}: I won't, thanks.",
    "{name}: How was {place}? {name2}: Great, we stayed until {hour} pm.",
    "{name}: The code is {digits}. {name2}: Got it, I wrote it down.",
]
_NOTES = [
    "A {color} {thing} photographed at {place}.", "Screenshot of a chat with {name} about {place}.",
    "Receipt from {place}, total {amount} dollars, paid by card.", "{name} holding a {thing} near {place}.",
    "Whiteboard with {digits} written in the corner.", "Blurry picture of the {thing}; text hard to read.",
    "Ticket for {day}, {month} {date}, seat {digits}.",
]


def _sample_fields(rng: random.Random) -> dict[str, str]:
    name, name2 = rng.sample(_NAMES, 2)
    return {
        "name": name, "name2": name2, "place": rng.choice(_PLACES), "thing": rng.choice(_THINGS),
        "color": rng.choice(_COLORS), "day": rng.choice(_DAYS), "month": rng.choice(_MONTHS),
        "date": str(rng.randint(1, 28)), "hour": str(rng.randint(1, 12)), "minute": f"{rng.randint(0, 59):02d}",
        "amount": f"{rng.randint(1, 400)}.{rng.randint(0, 99):02d}", "digits": str(rng.randint(0, 10 ** rng.randint(1, 8))),
    }


def _date(rng: random.Random) -> str:
    year, month, day = rng.randint(2015, 2026), rng.randint(1, 12), rng.randint(1, 28)
    styles = (f"{year}-{month:02d}-{day:02d}", f"{_MONTHS[month - 1]} {day}, {year}",
              f"{_DAYS[rng.randrange(7)]} {day} {_MONTHS[month - 1][:3]} {year}")
    return rng.choice(styles)


def corpus(num_memories: int = 300) -> list[str]:
    """The training text: filled state templates plus dates, dialogue, notes and digits (fixed)."""
    rng = random.Random(_CORPUS_SEED)
    control = re.compile(r"<\|[a-z_]+\|>")
    texts = [control.sub("", value) for value in DEFAULT_TEMPLATE.values()]
    for index in range(num_memories):
        fields = _sample_fields(rng)
        texts.append(DEFAULT_TEMPLATE["question"].format(question=rng.choice(_QUESTIONS).format(**fields)))
        texts.append(DEFAULT_TEMPLATE["memory"].format(
            index=index % 64, date=_date(rng), dialogue=rng.choice(_DIALOGUE).format(**fields),
            note=rng.choice(_NOTES).format(**fields)))
        texts.append(DEFAULT_TEMPLATE["marker"].format(index=index % 64))
    return texts


def build_tokenizer(bpe_vocab_size: int, first_special_id: int) -> Tokenizer:
    """Train the BPE (deterministic: fixed corpus, no randomness) and add the special tokens.

    bpe_vocab_size: merged tokens plus the 256 byte symbols; ids [0, bpe_vocab_size).
    first_special_id: id of "<|endoftext|>"; the others follow in `SPECIAL_TOKENS` order.
    """
    if first_special_id < bpe_vocab_size:
        raise ValueError(f"special ids start at {first_special_id}, inside the BPE vocabulary of {bpe_vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    # Added tokens always take the next free id; placing them in the model's vocabulary first pins
    # their ids (possibly far above the BPE ids, as in Qwen's 248,320-row embedding).
    spec = json.loads(tokenizer.to_str())
    for offset, token in enumerate(SPECIAL_TOKENS):
        spec["model"]["vocab"][token] = first_special_id + offset
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def save_tokenizer(tokenizer: Tokenizer, directory: str | os.PathLike, model_max_length: int) -> None:
    """Write tokenizer.json and a minimal tokenizer_config.json into `directory`."""
    directory = Path(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
