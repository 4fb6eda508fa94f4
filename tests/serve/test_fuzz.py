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
def test_no_input_makes_a_5xx(served, operations, mode):
    headers = {"authorization": f"Bearer {API_KEY}"}
    seen = {}
    for operation in operations:
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def check(case):
            response = case.call(base_url=served.url, headers=headers, timeout=60)
            seen.setdefault(f"{operation.method.upper()} {operation.path}", set()).add(response.status_code)
            assert response.status_code < 500, (case.path, case.body, response.text[:500])

        try:
            check()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE          # an operation without inputs has no invalid ones
    print(mode.name, {op: sorted(codes) for op, codes in seen.items()})
    assert len(seen) >= (8 if mode is GenerationMode.POSITIVE else 3)
