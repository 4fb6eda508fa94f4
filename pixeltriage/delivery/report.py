"""A delivery decision as a report: which memories open, their scores, the visual tokens (for `pixeltriage score`);
the images' sizes and notes as the decision and the report read them (the scoring service's too)."""
from __future__ import annotations

import dataclasses
import os
import sys

from pixeltriage.delivery.cost import Model
from pixeltriage.delivery.decision import decide
from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL
from pixeltriage.delivery.policy import RateGate
from pixeltriage.engine.types import Memory, Scores
from pixeltriage.errors import CacheMissError
from pixeltriage.media.image import display_size


def image_size(memory: Memory, index: int, cache=None) -> tuple[int, int] | None:
    """The original image's displayed (width, height), from its header or, for a cache-key memory, from the
    cache; None when unknown."""
    if memory.image is None:
        if cache is None:
            return None
        try:
            return cache.size(memory.key)
        except CacheMissError:
            return None
    return display_size(memory.image, index)


def shown_note(memory: Memory, cache=None) -> str:
    """The note the state was built with: the memory's own, or for a cache-key memory with note=None the cached
    one ("" when there is none)."""
    if memory.note is not None:
        return memory.note
    if memory.key is None or cache is None:
        return ""
    try:
        return cache.note(memory.key)
    except CacheMissError:
        return ""


def image_reference(memory: Memory) -> dict:
    """How the memory named its image: {"image": path} for a file, {"key": ...} for a cache key, {} otherwise."""
    if memory.key is not None:
        return {"key": memory.key}
    if isinstance(memory.image, (str, os.PathLike)):
        return {"image": os.fspath(memory.image)}
    return {}


def decision_report(question: str, memories: list[Memory], scores: Scores, k: int, gate: RateGate | None,
                    answering: Model = DEFAULT_ANSWERING_MODEL, cache=None) -> dict:
    """The decision for one scored question as a JSON-able dict: p_vis, whether the gate opened, and per memory
    (numbered from 1) its scores, whether it opens, its date, note and image; visual tokens of open-all and of
    this delivery when every image's size is known."""
    decided = decide(scores, k, gate, [image_size(m, i, cache) for i, m in enumerate(memories)], answering)
    report = {
        "question": question,
        "p_vis": scores.p_vis,
        "gate_open": decided.gate_open,
        "k": k,
        "memories": [
            {"index": i + 1, "gain": g, "relevance": r, "open": o, "date": m.date, "note": shown_note(m, cache),
             **image_reference(m)}
            for i, (m, g, r, o) in enumerate(zip(memories, scores.gains, scores.relevance, decided.open))
        ],
        "relevance_none": scores.relevance_none,
    }
    if decided.visual_tokens is not None:
        report["visual_tokens"] = dataclasses.asdict(decided.visual_tokens)
    return report


def print_report(report: dict, out=None) -> None:
    out = sys.stdout if out is None else out
    print(f"question: {report['question']}", file=out)
    gate = "" if report["gate_open"] else "   (rate gate closed: answer from text)"
    print(f"p_vis = {report['p_vis']:.4f}{gate}", file=out)
    print(f"{'#':>3}  {'gain':>7}  {'relev.':>7}  {'open@' + str(report['k']):>7}  {'date':<11} note", file=out)
    for m in report["memories"]:
        note = m["note"] if len(m["note"]) <= 48 else m["note"][:45] + "..."
        print(f"{m['index']:>3}  {m['gain']:7.4f}  {m['relevance']:7.4f}  {'pixels' if m['open'] else 'text':>7}  "
              f"{m['date']:<11} {note}", file=out)
    print(f"none (relevance) = {report['relevance_none']:.4f}", file=out)
    if "visual_tokens" in report:
        vt = report["visual_tokens"]
        share = vt["delivery"] / vt["open_all"] if vt["open_all"] else 0.0
        print(f"visual tokens ({vt['model']}): open-all {vt['open_all']}, this delivery {vt['delivery']} "
              f"({100 * share:.1f}%)", file=out)
