"""A delivery decision as a report: which memories open, their scores, the visual tokens (for `pixeltriage score` and
the scoring service)."""
from __future__ import annotations

import os
import sys

from pixeltriage.delivery.cost import Model, delivery_cost
from pixeltriage.delivery.profiles import DEFAULT_ANSWERING_MODEL, answering_model
from pixeltriage.delivery.policy import RateGate, by_gain, token_budget, top_k
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


def delivery(scores: Scores, k: int | None, gate: RateGate | None, sizes: list[tuple[int, int] | None],
             answering: Model = DEFAULT_ANSWERING_MODEL, budget: int | None = None) -> dict:
    """Which memories open for one scored question: {"open": [bool per memory], "gate_open": bool}, and
    "visual_tokens" ({"model", "open_all", "delivery"}) when every image's size in `sizes` is known.

    k: open the k highest gains (None: no cap). budget: open by descending gain while the answering model's visual
    tokens fit (`token_budget`; at most k of them when k is given); it needs every size. Each image is priced alone in
    its prompt, which for LLaVA-OneVision (cheaper per image when a prompt holds several) keeps within the budget.
    gate: a closed gate opens nothing (the question's p_vis joins the gate's window either way).
    answering: a registry name, a processor config directory or an AnsweringModel (pixeltriage.delivery.profiles)."""
    model = answering_model(answering)
    n = len(scores.gains)
    known = all(s is not None for s in sizes)
    if budget is None:
        opened = top_k(scores, n if k is None else k)
    else:
        if not known:
            raise ValueError("a token budget needs every image's size")
        opened = token_budget(scores, budget, [model.tokens(s) for s in sizes])
        if k is not None:
            capped = set([i for i in by_gain(scores.gains) if opened[i]][:k])
            opened = [i in capped for i in range(n)]
    gate_open = gate.opens(scores.p_vis) if gate is not None else True
    if not gate_open:
        opened = [False] * n
    out = {"open": opened, "gate_open": gate_open}
    if known:
        out["visual_tokens"] = {"model": model.name, "open_all": delivery_cost([True] * n, sizes, model),
                                "delivery": delivery_cost(opened, sizes, model)}
    return out


def decision_report(question: str, memories: list[Memory], scores: Scores, k: int, gate: RateGate | None,
                    answering: Model = DEFAULT_ANSWERING_MODEL, cache=None) -> dict:
    """The decision for one scored question as a JSON-able dict: p_vis, whether the gate opened, and per memory
    (numbered from 1) its scores, whether it opens, its date, note and image; visual tokens of open-all and of
    this delivery when every image's size is known."""
    decided = delivery(scores, k, gate, [image_size(m, i, cache) for i, m in enumerate(memories)], answering)
    report = {
        "question": question,
        "p_vis": scores.p_vis,
        "gate_open": decided["gate_open"],
        "k": k,
        "memories": [
            {"index": i + 1, "gain": g, "relevance": r, "open": o, "date": m.date, "note": shown_note(m, cache),
             **image_reference(m)}
            for i, (m, g, r, o) in enumerate(zip(memories, scores.gains, scores.relevance, decided["open"]))
        ],
        "relevance_none": scores.relevance_none,
    }
    if "visual_tokens" in decided:
        report["visual_tokens"] = decided["visual_tokens"]
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
