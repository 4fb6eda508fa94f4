"""Packing one question and its retrieved memories into System One's single fixed-order state.

Order: prefix -> question -> per memory (retrieval order): date, dialogue, note, thumbnail
(<|vision_start|> + image pads + <|vision_end|>), marker -> the three decision questions with their
candidates -> suffix -> one decision segment per question.

Every template field is a segment tokenized on its own and concatenated, so tokens never merge
across segments; a marker, candidate or decision position is the last token of its segment.
Inside a segment, special tokens written in the template are control tokens, while user text
(question, date, dialogue, note) is always tokenized as plain text.
"""
from __future__ import annotations

import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from tokenizers import Tokenizer

from pixeltriage.config import ImageConfig, ModelConfig, TriageConfig
from pixeltriage.engine.patches import preprocess, preprocess_thumbnail
from pixeltriage.engine.types import memory_list, user_text
from pixeltriage.errors import CheckpointError, StateTooLongError

# user text is tokenized from a prefix of about this many characters per token of its budget, doubled while the
# budget's tokens are not settled (`TextEncoder._truncate`)
PREFIX_CHARS_PER_TOKEN = 8
PREFIX_MIN = 256
PREFIX_MARGIN = 16
# a pre-token longer than the prefix (10 MB of one letter): its prefix grows to at most this many times the characters
# that the budget's tokens can cover (budget + 1 tokens of the vocabulary's longest entry), `TextEncoder._truncate`
RUN_CAP_FACTOR = 4
DATE_TOKENS = 32  # per-memory budget for the session date; the rest goes to note and dialogue
# rows the head reads besides one marker per memory (`State.head_positions`, after the markers): the 3 decision
# rows, then the true, false and two `none` candidates
DECISION_ROWS, BINARY_ROWS, NONE_ROWS = 3, 2, 2
EXTRA_HEAD_ROWS = DECISION_ROWS + BINARY_ROWS + NONE_ROWS


class Kept(NamedTuple):
    """A user text cut to its token budget: the kept prefix, its token count, whether anything was cut away."""
    text: str
    tokens: int
    cut: bool


@dataclass(frozen=True)
class TextCuts:
    """What `StatePacker.pack` cut to its token budgets: whether the question was cut, and for each memory the names
    of its texts that were ("date", "note", "dialogue"; a note given in `notes` counts as the memory's note)."""

    question: bool = False
    memories: tuple[frozenset[str], ...] = ()


class HeadRows(NamedTuple):
    """Where a state's head rows sit among the rows gathered for the head (`State.head_positions` order, from
    `base`): its markers, the 3 decision rows, the true and false candidates, the two `none` candidates."""
    markers: torch.Tensor      # [n]
    decision: torch.Tensor     # [3]
    binary: torch.Tensor       # [2] true, false
    none: torch.Tensor         # [2] gain none, relevance none

    @classmethod
    def at(cls, base: int, num_memories: int) -> "HeadRows":
        first = base + num_memories                                  # the first row after the markers
        return cls(torch.arange(base, first), torch.arange(first, first + DECISION_ROWS),
                   torch.arange(first + DECISION_ROWS, first + DECISION_ROWS + BINARY_ROWS),
                   torch.arange(first + DECISION_ROWS + BINARY_ROWS, first + EXTRA_HEAD_ROWS))


@dataclass
class State:
    """A packed state (tensors only, CPU). T tokens, n memories, P patches."""

    input_ids: torch.Tensor            # [T] long
    position_ids: torch.Tensor         # [3, T] long (M-RoPE: temporal, height, width)
    pixel_values: torch.Tensor         # [P, channels * temporal * patch^2] float32
    image_grid_thw: torch.Tensor       # [n, 3] long, in patches
    marker_positions: torch.Tensor     # [n] long
    decision_positions: torch.Tensor   # [3] long: q1 p_vis, q2 gains, q3 relevance
    true_position: int
    false_position: int
    gain_none_position: int
    relevance_none_position: int
    image_keys: list[str | None] = field(default_factory=list)  # write-time cache key per memory, if any
    text_cuts: TextCuts = field(default_factory=TextCuts)      # which user texts were cut to their budgets

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_memories(self) -> int:
        return int(self.marker_positions.shape[0])

    def head_positions(self) -> torch.Tensor:
        """Every row the head reads: markers, decision rows, candidates."""
        return torch.cat([self.marker_positions, self.decision_positions, torch.tensor(
            [self.true_position, self.false_position, self.gain_none_position, self.relevance_none_position])])


class TextEncoder:
    """The checkpoint's tokenizer, twice: template text (special tokens parsed) and user text (never parsed)."""

    def __init__(self, tokenizer_file: Path | None = None, *, json_text: str | None = None, source: str = ""):
        """From a tokenizer.json file, or from its text (`json_text`, e.g. embedded in a packed checkpoint)."""
        if (tokenizer_file is None) == (json_text is None):
            raise TypeError("TextEncoder needs exactly one of tokenizer_file or json_text")
        source = source or str(tokenizer_file)
        try:
            if json_text is None:
                json_text = Path(tokenizer_file).read_text(encoding="utf-8")
            self.control, self.plain = Tokenizer.from_str(json_text), Tokenizer.from_str(json_text)
        except Exception as e:  # an unreadable file, or tokenizers' bare Exception on malformed JSON
            raise CheckpointError(f"{source}: cannot load tokenizer ({e})") from None
        self.plain.encode_special_tokens = True
        added = self.control.get_added_tokens_decoder()
        self.special = {t.content: i for i, t in added.items() if t.special}
        # the most characters one token of plain text can cover: its longest vocabulary entry (bytes, for a byte-level
        # vocabulary; added tokens are never plain text's)
        contents = {t.content for t in added.values()}
        self.token_chars = max((len(t) for t in self.plain.get_vocab(with_added_tokens=False) if t not in contents),
                               default=1)
        names = sorted(self.special, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(n) for n in names)) if names else None

    def token_id(self, token: str) -> int:
        if token not in self.special:
            raise CheckpointError(f"tokenizer has no special token {token!r}")
        return self.special[token]

    def encode_plain(self, text: str) -> list[int]:
        return self.plain.encode(text, add_special_tokens=False).ids if text else []

    def truncate(self, text: str, max_tokens: int) -> str:
        """The longest prefix of `text` that is at most `max_tokens` tokens on its own (cut at a token edge)."""
        return self._truncate(text, max_tokens)[0]

    def cut(self, text: str, max_tokens: int) -> tuple[str, bool]:
        """`truncate`, and whether anything was cut away."""
        kept, count = self._truncate(text, max_tokens)
        return kept, count is None

    def truncate_counted(self, text: str, max_tokens: int) -> Kept:
        """`truncate`, with the token count of the kept text (encoded again only when it was cut: a prefix cut at a
        token edge may tokenize differently on its own) and whether it was cut."""
        kept, count = self._truncate(text, max_tokens)
        return Kept(kept, len(self.encode_plain(kept)), True) if count is None else Kept(kept, count, False)

    def run_cap(self, max_tokens: int) -> int:
        """The longest prefix `_truncate` tokenizes for a text whose last pre-token outgrows its prefixes:
        RUN_CAP_FACTOR times the characters that `max_tokens` + 1 tokens can cover at most, or PREFIX_MIN."""
        return max(PREFIX_MIN, RUN_CAP_FACTOR * (max_tokens + 1) * self.token_chars)

    def _truncate(self, text: str, max_tokens: int, first_prefix: int | None = None) -> tuple[str, int | None]:
        """(kept prefix, its token count when nothing was cut, else None): `_truncate_whole`'s result, from the
        tokens of a prefix of `text` only, so that the cost follows the budget, not the length of the text.

        The tokenizer splits text into pre-tokens (words, runs of spaces, of digits, of punctuation) and merges
        inside each one only, so a prefix's tokens equal the whole text's in every pre-token that ends before the
        prefix's last two (the pre-tokenizer reads at most a few characters past a pre-token to end it) and more
        than PREFIX_MARGIN characters before the prefix's end. The prefix is doubled from `first_prefix`
        characters until token `max_tokens` (the first one cut away) lies in such a settled pre-token: the tokens
        kept and the cut are then the whole text's (exact).

        A pre-token that fills half the prefix or more (10 MB of one letter, of spaces, one unbroken word) never
        settles that way: BPE merges inside a pre-token by rank, so in principle a merge near its far end can change
        the tokens before the cut. Such a text is cut from a prefix when (a) doubling the prefix left its first
        `max_tokens` + 1 tokens as they were, all ending `_run_margin` characters before the shorter prefix's end,
        or (b) the prefix reached `run_cap(max_tokens)` characters (at least RUN_CAP_FACTOR times what those tokens
        can cover). What is given up: exactness for a pre-token longer than the prefix whose merges near the cut
        depend on characters past both prefixes of (a), or past the cap in (b). Not proven: none of the tokenizers
        tested merges that way (tests/engine/test_state.py compares both rules with the whole text's cut on long
        runs of every kind, under three tokenizers). The characters handed to the
        tokenizer are then at most about 4 x `run_cap`, whatever the text's length."""
        if not text:
            return text, 0
        length = first_prefix or max(PREFIX_MIN, (max_tokens + 1) * PREFIX_CHARS_PER_TOKEN)
        cap, margin = self.run_cap(max_tokens), self._run_margin()
        shorter = None                      # the previous prefix's encoding and length, while one pre-token fills it
        while 2 * length < len(text):       # past half the text, the whole one costs at most twice as much
            enc = self.plain.encode(text[:length], add_special_tokens=False)
            if _settled(enc, length, max_tokens):
                return _cut(text, enc, max_tokens), None
            last_word = enc.word_ids[-1]
            if last_word is not None and enc.word_to_chars(last_word)[0] <= length // 2:   # one long pre-token
                if shorter is not None and _unchanged(*shorter, enc, max_tokens, margin):
                    return _cut(text, enc, max_tokens), None
                if length >= cap and _covers(enc, length, max_tokens, margin):
                    return _cut(text, enc, max_tokens), None
                shorter = enc, length
            else:
                shorter = None
            length *= 2
        return self._truncate_whole(text, max_tokens)

    def _run_margin(self) -> int:
        """How far before a prefix's end the kept tokens of one long pre-token must end: two of the longest tokens
        and PREFIX_MARGIN (the normalizer and pre-tokenizer's reach)."""
        return 2 * self.token_chars + PREFIX_MARGIN

    def _truncate_whole(self, text: str, max_tokens: int) -> tuple[str, int | None]:
        """The reference of `_truncate`: the whole text tokenized, then cut."""
        if not text:
            return text, 0
        enc = self.plain.encode(text, add_special_tokens=False)
        if len(enc.ids) <= max_tokens:
            return text, len(enc.ids)
        return _cut(text, enc, max_tokens), None

    def segment(self, template: str, values: dict[str, str]) -> list[int]:
        """Render one template field: literal specials -> control ids; everything else plain text."""
        ids: list[int] = []
        buffer: list[str] = []

        def flush():
            if buffer:
                ids.extend(self.encode_plain("".join(buffer)))
                buffer.clear()

        for literal, name, _, _ in string.Formatter().parse(template):
            pos = 0
            for m in self._special_re.finditer(literal) if self._special_re else ():
                buffer.append(literal[pos:m.start()])
                flush()
                ids.append(self.special[m.group()])
                pos = m.end()
            buffer.append(literal[pos:])
            if name is not None:
                buffer.append(values[name])
        flush()
        return ids


def _settled(enc, length: int, max_tokens: int) -> bool:
    """Whether the tokens of a `length`-character prefix, up to token `max_tokens` included, are the whole text's:
    that token lies in a pre-token (word) before the prefix's last two, ending PREFIX_MARGIN characters before the
    prefix's end (word ids and offsets never decrease along an encoding)."""
    words = enc.word_ids
    if len(words) <= max_tokens or None in words[: max_tokens + 1]:
        return False
    return words[max_tokens] < words[-1] - 1 and enc.offsets[max_tokens][1] <= length - PREFIX_MARGIN


def _unchanged(shorter, shorter_length: int, enc, max_tokens: int, margin: int) -> bool:
    """Whether the first `max_tokens` + 1 tokens of a prefix and of the one twice as long are the same tokens at the
    same places, ending `margin` characters before the shorter one's end."""
    if not _covers(shorter, shorter_length, max_tokens, margin) or len(enc.ids) <= max_tokens:
        return False
    return (shorter.ids[: max_tokens + 1] == enc.ids[: max_tokens + 1]
            and shorter.offsets[: max_tokens + 1] == enc.offsets[: max_tokens + 1])


def _covers(enc, length: int, max_tokens: int, margin: int) -> bool:
    """Whether a prefix's token `max_tokens` ends `margin` characters before the prefix's end."""
    return len(enc.ids) > max_tokens and enc.offsets[max_tokens][1] <= length - margin


def _cut(text: str, enc, max_tokens: int) -> str:
    """`text` up to the end of the encoding's token `max_tokens` - 1 (the budget's last token)."""
    return text[: enc.offsets[max_tokens - 1][1]] if max_tokens > 0 else ""


class StatePacker:
    """Builds `State`s for one checkpoint (its tokenizer, image rules and template)."""

    def __init__(self, encoder: TextEncoder, model_cfg: ModelConfig, image_cfg: ImageConfig, triage_cfg: TriageConfig):
        self.encoder = encoder
        self.image_cfg = image_cfg
        self.cfg = triage_cfg
        self.tpl = triage_cfg.templates
        self.merge_unit = model_cfg.vision.merge_unit
        self.merge = model_cfg.vision.spatial_merge_size
        self.max_tokens = min(triage_cfg.max_state_tokens, model_cfg.text.max_position_embeddings)
        self.image_id = model_cfg.image_token_id
        for token, expected in (("<|vision_start|>", model_cfg.vision_start_token_id),
                                ("<|vision_end|>", model_cfg.vision_end_token_id),
                                ("<|image_pad|>", model_cfg.image_token_id)):
            if encoder.token_id(token) != expected:
                raise CheckpointError(f"tokenizer id of {token} is {encoder.token_id(token)}, config.json says {expected}")
        self.vision_start = model_cfg.vision_start_token_id
        self.vision_end = model_cfg.vision_end_token_id
        # Segments that never change are tokenized once.
        self._fixed = {key: encoder.segment(self.tpl[key], {}) for key in (
            "prefix", "q1", "q1_true", "q1_false", "q2", "q2_none", "q3", "q3_none", "suffix",
            "decision_1", "decision_2", "decision_3")}
        for key in ("q1_true", "q1_false", "q2_none", "q3_none", "decision_1", "decision_2", "decision_3"):
            if not self._fixed[key]:
                raise CheckpointError(f"pixeltriage.json: template['{key}'] tokenizes to nothing")

    def cut_date(self, date, index: int | None = None) -> Kept:
        """A memory's date cut to its DATE_TOKENS."""
        return self.encoder.truncate_counted(user_text(date, "date", index), DATE_TOKENS)

    def text_budget(self, date: Kept) -> int:
        """The tokens a memory's note and dialogue share: its text budget less its (cut) date's tokens. The note
        gets at most half of them, the dialogue the rest."""
        return self.cfg.max_memory_text_tokens - date.tokens

    def client_cut(self, date, note: str | None, dialogue: str, max_tokens: int) -> tuple[str | None, str, bool]:
        """A memory's note, then its dialogue, cut to a caller's own budget of `max_tokens` shared (a rerank's
        max_tokens_per_doc) where that is below the library's `text_budget` for the memory: -> (note, dialogue,
        whether this cut anything), the texts unchanged where not. A note of None (one a cache holds, the server's
        own) stays None; the dialogue gets what the caller's budget leaves of it. `pack` cuts the result again to
        the library's budgets."""
        if max_tokens >= self.text_budget(self.cut_date(date)):
            return note, dialogue, False
        kept_note = self.encoder.truncate_counted(note or "", max_tokens)
        kept_dialogue, dialogue_cut = self.encoder.cut(dialogue, max_tokens - kept_note.tokens)
        if not (kept_note.cut or dialogue_cut):
            return note, dialogue, False
        return (kept_note.text if note is not None else None), kept_dialogue, True

    def images(self, memories, thumbnails=None) -> list[tuple[torch.Tensor, tuple[int, int, int]]]:
        """Preprocess each memory's image (or its cached thumbnail) -> (pixel_values, grid_thw)."""
        out = []
        for i, m in enumerate(memories):
            if thumbnails is not None and thumbnails[i] is not None:        # made by the same recipe already
                out.append(preprocess_thumbnail(thumbnails[i], self.image_cfg, index=i))
            else:
                out.append(preprocess(m.image, self.image_cfg, self.cfg.thumbnail_size, index=i))
        return out

    def pack(self, question: str, memories, images=None, notes=None, keys=None) -> State:
        """question + memories -> State. `images`: preprocessed images (default: from memory.image);
        `notes`: per-memory notes overriding memory.note (used for cached notes); `keys`: each image's write-time
        cache key (default: memory.key; the scorer passes the keys of images it put into its cache)."""
        question = user_text(question, "question", None)
        memories = memory_list(memories)
        if images is None:
            images = self.images(memories)
        enc, fixed, tpl = self.encoder, self._fixed, self.tpl
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        next_pos = 0

        def text(segment: list[int]) -> int:
            nonlocal next_pos
            ids.extend(segment)
            positions.append(torch.arange(next_pos, next_pos + len(segment)).expand(3, -1))
            next_pos += len(segment)
            return len(ids) - 1

        text(fixed["prefix"])
        q, question_cut = enc.cut(question, self.cfg.max_question_tokens)
        text(enc.segment(tpl["question"], {"question": q}))
        markers, cuts = [], []
        for i, m in enumerate(memories):
            note = notes[i] if notes is not None and notes[i] is not None else m.note
            date = self.cut_date(m.date, i)
            budget = self.text_budget(date)
            note = enc.truncate_counted(user_text(note, "note", i), max(budget // 2, 0))
            dialogue, dialogue_cut = enc.cut(user_text(m.dialogue, "dialogue", i), max(budget - note.tokens, 0))
            cuts.append(frozenset(name for name, cut in (("date", date.cut), ("note", note.cut),
                                                         ("dialogue", dialogue_cut)) if cut))
            text(enc.segment(tpl["memory"], {"index": str(i + 1), "date": date.text, "dialogue": dialogue,
                                             "note": note.text}))
            _, (t, h, w) = images[i]
            text([self.vision_start])
            gh, gw = h // self.merge, w // self.merge
            n_img = t * gh * gw
            ids.extend([self.image_id] * n_img)
            tt = torch.arange(t).view(-1, 1, 1).expand(t, gh, gw).reshape(-1)
            hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw).reshape(-1)
            ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw).reshape(-1)
            positions.append(torch.stack([tt, hh, ww]) + next_pos)
            next_pos += max(gh, gw)
            text([self.vision_end])
            markers.append(text(enc.segment(tpl["marker"], {"index": str(i + 1)})))
        text(fixed["q1"])
        true_pos = text(fixed["q1_true"])
        false_pos = text(fixed["q1_false"])
        text(fixed["q2"])
        gain_none = text(fixed["q2_none"])
        text(fixed["q3"])
        rel_none = text(fixed["q3_none"])
        text(fixed["suffix"])
        decisions = [text(fixed["decision_1"]), text(fixed["decision_2"]), text(fixed["decision_3"])]
        if len(ids) > self.max_tokens:
            raise StateTooLongError(
                f"state has {len(ids)} tokens for {len(memories)} memories; the model accepts at most "
                f"{self.max_tokens}. Score fewer memories per question (the decision questions are never truncated)")
        pixel_values = (torch.cat([pv for pv, _ in images]) if images
                        else torch.zeros(0, self.image_cfg.temporal_patch_size * 3 * self.image_cfg.patch_size ** 2))
        return State(
            input_ids=torch.tensor(ids, dtype=torch.long),
            position_ids=torch.cat(positions, dim=1).long(),
            pixel_values=pixel_values,
            image_grid_thw=torch.tensor([g for _, g in images], dtype=torch.long).view(-1, 3),
            marker_positions=torch.tensor(markers, dtype=torch.long),
            decision_positions=torch.tensor(decisions, dtype=torch.long),
            true_position=true_pos,
            false_position=false_pos,
            gain_none_position=gain_none,
            relevance_none_position=rel_none,
            image_keys=[m.key for m in memories] if keys is None else list(keys),
            text_cuts=TextCuts(question=question_cut, memories=tuple(cuts)),
        )
