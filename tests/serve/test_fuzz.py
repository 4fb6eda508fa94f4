"""A schema fuzz of the live server's OpenAPI (schemathesis: valid and invalid bodies, bounded, derandomized):
no operation answers 5xx, whatever it is sent."""
import httpx
import pytest
from serving import API_KEY
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.generation.modes import GenerationMode  # noqa: E402

EXAMPLES = 25


@pytest.fixture(scope="module")
def operations(served):
    spec = httpx.get(served.url + "/openapi.json", headers={"authorization": f"Bearer {API_KEY}"}).json()
    return [result.ok() for result in schemathesis.openapi.from_dict(spec).get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_no_input_makes_a_5xx(served, indexed, operations, mode):
    headers = {"authorization": f"Bearer {API_KEY}"}
    seen = {}
    for operation in operations:
        # /v1/retrieve needs a region index, which only `indexed` has (the main server answers it 501 by design)
        url = indexed.url if operation.path == "/v1/retrieve" else served.url
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=url, headers=headers, timeout=60)
            seen.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(response.status_code)
            if response.status_code == 504 and _sets_timeout(case.body):
                assert response.json()["error_type"] == "deadline"      # the deadline it asked for: the design
                return
            assert response.status_code < 500, (case.path, case.body, response.text[:500])

        try:
            check()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE          # an operation without inputs has no invalid ones
    print(mode.name, {op: sorted(codes) for op, codes in seen.items()})
    assert len(seen) >= (8 if mode is GenerationMode.POSITIVE else 3)


def _sets_timeout(body) -> bool:
    """Whether a request asked for its own deadline (`timeout_s`, at the top or in a batch's questions)."""
    if not isinstance(body, dict):
        return False
    questions = body.get("questions") if isinstance(body.get("questions"), list) else []
    return body.get("timeout_s") is not None or any(isinstance(q, dict) and q.get("timeout_s") is not None
                                                     for q in questions)
