"""A rerank's `truncated` and `query_truncated` are the packer's own report (`State.text_cuts`), read by
`Infer.prepare_rerank` in process: the same as packing the same texts in the library, a cached note's cut never
reported or refused, the client's `max_tokens_per_doc` cut first, and with `truncate: false` the first text the
library cut refused (the query first)."""
import base64
import io

import pytest
from PIL import Image

from pixeltriage import Memory
from pixeltriage.serve.config import ServeConfig
from pixeltriage.serve.inputs import rerank_doc
from pixeltriage.serve.schemas import DocumentIn, Policy
from pixeltriage.serve.infer import FieldError
from pixeltriage.serve.service import ModelSpec, Service

LONG = "word " * 2000
LONG_DATE = "word " * 50                 # within the 256 characters of a date, past its 32 tokens


def png(width: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, 64), (width % 255, 90, 40)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def service(tiny_checkpoint, tmp_path_factory):
    spec = ModelSpec(str(tiny_checkpoint), cache=str(tmp_path_factory.mktemp("cuts") / "cache.db"))
    service = Service(ServeConfig(max_batch_tokens=1024, trim_idle_s=None), spec.load)
    service.load()
    yield service
    service.close()


def prepared(service, query, documents, truncate=True, max_tokens=None):
    docs = [rerank_doc(d if isinstance(d, str) else DocumentIn.model_validate(d), "documents", j)
            for j, d in enumerate(documents)]
    state, (_, query_cut, cuts) = service.infer.prepare_rerank(query, docs, Policy(k=2), truncate, max_tokens, "query")()
    return state, query_cut, cuts


def image_doc(width, **texts):
    return {"image": base64.b64encode(png(width)).decode(), **texts}


def test_what_is_reported_cut_is_what_the_library_cut(service):
    documents = [image_doc(64, note=LONG), image_doc(96, note="a red mug", dialogue="hi"),
                 image_doc(128, dialogue=LONG, date="2026-01-02"), image_doc(160, date=LONG_DATE)]
    for query in ("which mug?", LONG):
        state, query_cut, cuts = prepared(service, query, documents)
        memories = [Memory(image=png(w), note=d.get("note"), dialogue=d.get("dialogue"), date=d.get("date"))
                    for w, d in zip((64, 96, 128, 160), documents)]
        library = service.scorer.pack(query, memories).text_cuts
        assert query_cut is library.question is (query == LONG)
        assert cuts == [bool(c) for c in library.memories] == [True, False, True, True]
        assert state.text_cuts == library


def test_a_cached_note_is_never_reported_but_takes_its_share(service):
    """A key document's note is the server's: cut to its budget without a report or a refusal. A dialogue that fits
    the budget alone but not beside the cached note is cut, and reported: the share the state used."""
    packer = service.scorer.packer
    key = service.scorer.cache.put(png(200), note=LONG)
    state, _, cuts = prepared(service, "q", [key])
    assert cuts == [False] and state.text_cuts.memories == (frozenset({"note"}),)
    assert prepared(service, "q", [key], truncate=False)[2] == [False]
    budget = packer.text_budget(packer.cut_date(None))
    dialogue = packer.encoder.truncate(LONG, budget - 8)          # fits alone, not beside half a budget of note
    assert packer.encoder.cut(dialogue, budget) == (dialogue, False)
    _, _, cuts = prepared(service, "q", [{"key": key, "dialogue": dialogue}])
    assert cuts == [True]


def test_truncate_false_refuses_the_first_text_cut_the_query_first(service):
    documents = [image_doc(64, note="short"), image_doc(96, dialogue=LONG)]
    with pytest.raises(FieldError) as refused:
        prepared(service, LONG, documents, truncate=False)
    assert refused.value.field == "query" and "512 tokens" in str(refused.value.error)
    with pytest.raises(FieldError) as refused:
        prepared(service, "which?", documents, truncate=False)
    assert refused.value.field == "documents[1]" and "256 tokens" in str(refused.value.error)
    assert prepared(service, "which?", documents[:1], truncate=False)[2] == [False]


def test_the_clients_max_tokens_cut_comes_first(service):
    encoder = service.scorer.packer.encoder
    note = "a long note about the red mug on the desk " * 20
    state, _, cuts = prepared(service, "q", [image_doc(64, note=note), image_doc(96, note="mug")], max_tokens=8)
    assert cuts == [True, False]
    kept = encoder.truncate(note, 8)
    want = service.scorer.pack("q", [Memory(image=png(64), note=kept), Memory(image=png(96), note="mug")])
    assert state.input_ids.tolist() == want.input_ids.tolist()
