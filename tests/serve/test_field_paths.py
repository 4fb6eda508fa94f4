"""Every 422 names the request's own field, on every route: the walk below is derived from the route table (`ROUTES`)
and each route's request model. Every field of the model (and of the models nested in it, list items included) is
sent with a value of the wrong type, null, left out and out of its range (each where the model refuses it), and the
server's answer names that field's path (`query`, `documents[1].image`, `policy.k`) in `field` and at the start of
the message. One valid example body per route starts the walk; a model field that no example reaches fails the
test, so a new field is walked the day it is added."""
import json
import typing

import annotated_types
import pytest
from pydantic import BaseModel, ValidationError
from serving import b64, image_bytes

from pixeltriage.serve.app import BODY_ROUTES, ROUTES
from pixeltriage.serve.schemas import DOCUMENT_TAGS, TEXT_LIMIT

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

PNG = b64(image_bytes((32, 24)))
KEY = "a" * 64
DOCUMENTS = ["plain text", {"text": "t", "image": PNG, "dialogue": "d", "date": "2026-01-01"},
             {"content": [{"type": "text", "text": "t"}, {"type": "image_url", "image_url": {"url": PNG}}]}]
POLICY = {"k": 1, "token_budget": 100, "gate_rate": 0.5, "gate_stream": "s", "answering_model": "qwen2.5-vl"}
RERANK = {"model": "m", "query": "q", "documents": DOCUMENTS, "top_n": 2, "return_documents": True,
          "max_tokens_per_doc": 10, "max_chunks_per_doc": 1, "truncate": True, "raw_scores": False, "policy": POLICY,
          "pixeltriage_score": "gain", "strict": False, "timeout_s": 1.0}
MEMORIES = [{"key": KEY, "note": "n"}, {"image": PNG, "note": "n", "dialogue": "d", "date": "2026-01-01"},
            {"path": "photos/mug.png"}]
EXAMPLES = {
    "/v1/score": {"question": "q", "memories": MEMORIES, "policy": POLICY, "id": "i", "timeout_s": 1.0,
                  "priority": 1},
    "/v1/score/batch": {"questions": [{"question": "q", "memories": MEMORIES, "policy": POLICY, "id": "i"}],
                        "policy": POLICY, "timeout_s": 1.0, "priority": 1},
    "/v1/rerank": RERANK,
    "/v2/rerank": RERANK,
    "/rerank": {**{k: v for k, v in RERANK.items() if k != "documents"}, "texts": ["t", KEY],
                "truncation_direction": "Right", "return_text": False},
    "/v1/memories": {"image": PNG, "note": "n"},
    "/v1/retrieve": {"question": "q", "top": 3, "whole_image": False},
}
WRONG_TYPES = (12345, "text", 1.5, True, [], {})


def _models(annotation) -> list[type[BaseModel]]:
    """The request models inside an annotation (through Optional, Annotated, unions and lists)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _constraints(info) -> list:
    """A field's constraints, its own and those of the annotation's Annotated parts."""
    found = list(info.metadata)

    def inner(annotation):
        if typing.get_origin(annotation) is typing.Annotated:
            for meta in typing.get_args(annotation)[1:]:
                found.extend(getattr(meta, "metadata", []) or [meta])
        if typing.get_origin(annotation) is not list:
            for arg in typing.get_args(annotation):
                inner(arg)

    inner(info.annotation)
    return found


def _literals(annotation) -> tuple:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    return next((found for arg in typing.get_args(annotation) if (found := _literals(arg))), ())


def _out_of_range(info) -> list:
    """Values past each bound of a field (numbers, lengths, a pattern, the choices of a Literal)."""
    values = []
    for c in _constraints(info):
        if isinstance(c, annotated_types.Ge):
            values.append(c.ge - 1)
        elif isinstance(c, annotated_types.Gt):
            values.append(c.gt)
        elif isinstance(c, annotated_types.Le):
            values.append(c.le + 1)
        elif isinstance(c, annotated_types.Lt):
            values.append(c.lt)
        elif isinstance(c, annotated_types.MinLen):
            values.append([] if _models(info.annotation) or typing.get_origin(info.annotation) is list else "")
        elif isinstance(c, annotated_types.MaxLen) and c.max_length <= TEXT_LIMIT:
            values.append("x" * (c.max_length + 1))
        elif getattr(c, "pattern", None):
            values.append("not what the pattern takes!")
    if _literals(info.annotation):
        values.append("none-of-the-choices")
    return values


def _set(body, path: tuple, value):
    target = body
    for part in path[:-1]:
        target = target[part]
    if value is _MISSING:
        del target[path[-1]]
    else:
        target[path[-1]] = value


_MISSING = object()


def _name(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def _walk(model: type[BaseModel], value: dict, path: tuple):
    """(path, kind, mutation) for every field of `model` (at `path` of the body, holding `value`) and below."""
    for name, info in model.model_fields.items():
        here = (*path, name)
        yield from ((here, "wrong type", v) for v in WRONG_TYPES)
        yield here, "null", None
        if info.is_required():
            yield here, "missing", _MISSING
        yield from ((here, "out of range", v) for v in _out_of_range(info))
        nested, given = _models(info.annotation), value.get(name)
        if nested and isinstance(given, dict):
            yield from _walk(nested[0], given, here)
        elif nested and isinstance(given, list) and given:
            last = len(given) - 1                      # the last item: a field path with an index past 0
            yield from (((*here, last), "wrong type", v) for v in WRONG_TYPES)
            objects = [i for i, item in enumerate(given) if isinstance(item, dict)]
            if objects:
                yield from _walk(nested[0], given[objects[-1]], (*here, objects[-1]))


def _local_error(model: type[BaseModel], body: dict) -> str | None:
    """The path of the first error `model` finds in `body` (union branches and validators left out), None: valid."""
    try:
        model.model_validate_json(json.dumps(body))
    except ValidationError as e:
        loc = [p for p in e.errors()[0]["loc"] if p not in DOCUMENT_TAGS and not str(p).startswith("function-")]
        return _name(tuple(loc)) or None
    return None


def cases():
    """Each route's refused mutations: (path, field walked, kind, body, the field the answer must name)."""
    out, walked = [], set()
    for path, route in BODY_ROUTES.items():
        example = EXAMPLES[path]
        assert _local_error(route.body, example) is None, f"{path}: the example body is not valid"
        seen_types = set()
        for field, kind, value in _walk(route.body, example, ()):
            if kind == "wrong type" and field in seen_types:
                continue
            body = json.loads(json.dumps(example))         # no part shared between two places
            _set(body, field, value)
            named = _local_error(route.body, body)
            if named is None:
                continue                                  # accepted (null of an optional field, ...)
            if kind == "wrong type":
                seen_types.add(field)
            # the field itself, or (a validator of the object holding it) that object
            assert _name(field).startswith(named), (path, field, kind, named)
            out.append(pytest.param(path, body, named, id=f"{path}:{_name(field)}:{kind}"))
            walked.add((route.body.__name__, field))
    return out, walked


CASES, WALKED = cases()


def test_every_field_of_every_request_model_is_walked():
    def fields(model, seen):
        for name, info in model.model_fields.items():
            seen.add((model.__name__, name))
            for nested in _models(info.annotation):
                if (nested.__name__, "") not in seen:
                    seen.add((nested.__name__, ""))
                    fields(nested, seen)
        return seen

    declared = {pair for route in BODY_ROUTES.values() for pair in fields(route.body, set()) if pair[1]}
    walked = set()
    for path, route in BODY_ROUTES.items():
        for field, _, _ in _walk(route.body, EXAMPLES[path], ()):
            models = [route.body]
            for part in field[:-1]:
                if isinstance(part, str):
                    models.append(_models(models[-1].model_fields[part].annotation)[0])
            walked.add((models[-1].__name__, field[-1]))
    assert declared - walked == set(), "fields no example body reaches: add them to EXAMPLES"
    assert {r.path for r in ROUTES if r.body is not None} == set(EXAMPLES)


@pytest.mark.parametrize("path, body, field", CASES)
def test_a_refused_field_is_named_in_field_and_message(http, path, body, field):
    response = http.post(path, json=body)
    assert response.status_code == 422, response.text
    error = response.json()
    assert error["field"] == field and error["error"].startswith(f"{field}: "), error


def test_a_path_parameter_is_named_too(http):
    template = next(r.path for r in ROUTES if "{" in r.path)
    name = template.split("{", 1)[1].rstrip("}")
    response = http.get(template.replace("{" + name + "}", "not-a-key"))
    assert response.status_code == 422 and response.json()["field"] == name
    assert response.json()["error"].startswith(f"{name}: ")
