"""`pixeltriage bench cost`: the --json shape, the table, and the orderings the costs must obey."""
from __future__ import annotations

import json

import pytest

from pixeltriage.bench.models import prefill_cost
from pixeltriage.bench.models.flops import ANSWERING_SHAPES
from pixeltriage.cli import main


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["bench", "cost", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_exactly_the_documented_shape(capsys):
    code, out, _ = run(["--scenario", "dmv", "--answering", "qwen2.5-vl-7b", "--k", "1,2,3", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert list(report) == ["scenario", "answering", "system_one", "visual_tokens", "tflop"]
    assert (report["scenario"], report["answering"], report["system_one"]) == ("dmv", "qwen2.5-vl-7b", "2b")
    assert list(report["visual_tokens"]) == ["open_all", "ours"]
    assert list(report["tflop"]) == ["system_one", "open_all", "text_only", "ours"]
    assert list(report["visual_tokens"]["ours"]) == ["1", "2", "3"]
    assert list(report["tflop"]["ours"]) == ["1", "2", "3"]
    assert isinstance(report["visual_tokens"]["open_all"], int)
    assert all(isinstance(v, int) for v in report["visual_tokens"]["ours"].values())
    assert all(isinstance(report["tflop"][key], float) for key in ("system_one", "open_all", "text_only"))
    assert all(isinstance(v, float) for v in report["tflop"]["ours"].values())
    assert report["visual_tokens"]["open_all"] == 12000  # 10 x 1200 (1120x840 px, 28-px tokens)


def test_table_is_the_default_output(capsys):
    code, out, _ = run(["--scenario", "m3exam", "--answering", "qwen3.5-27b", "--k", "1"], capsys)
    assert code == 0
    assert "open all" in out and "ours@1" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


@pytest.mark.parametrize("scenario", ["dmv", "m3exam"])
@pytest.mark.parametrize("answering", sorted(ANSWERING_SHAPES))
def test_costs_are_ordered(scenario, answering):
    ks = [1, 2, 3, 4, 5, 10]
    report = prefill_cost.cost_report(scenario, answering, ks)
    tf, vis = report["tflop"], report["visual_tokens"]
    ours = [tf["ours"][str(k)] for k in ks]
    tokens = [vis["ours"][str(k)] for k in ks]
    min_images = min(len(r.image_sizes) for r in prefill_cost.SCENARIOS[scenario].retrievals)
    assert tf["text_only"] < tf["open_all"]
    assert ours[0] > tf["system_one"] + tf["text_only"] - 1e-6  # one image costs more than its proxy
    for k, lower, higher in zip(ks, ours, ours[1:]):
        assert higher >= lower
        if k < min_images:
            assert higher > lower
    for k, value, n_tokens in zip(ks, ours, tokens):
        if k < min_images:
            assert value < tf["open_all"]
            assert n_tokens < vis["open_all"]
    # past the number of retrieved images every image is open: open all plus System One
    assert tokens[-1] == vis["open_all"]
    assert ours[-1] == pytest.approx(tf["open_all"] + tf["system_one"], abs=2e-3)


def test_cached_vision_costs_less(capsys):
    _, plain, _ = run(["--scenario", "dmv", "--json"], capsys)
    _, cached, _ = run(["--scenario", "dmv", "--json", "--cached-vision"], capsys)
    plain, cached = json.loads(plain), json.loads(cached)
    assert cached["system_one"] == "2b+cached-vision"
    assert cached["tflop"]["system_one"] < plain["tflop"]["system_one"]
    for k in plain["tflop"]["ours"]:
        assert cached["tflop"]["ours"][k] < plain["tflop"]["ours"][k]
    assert cached["tflop"]["open_all"] == plain["tflop"]["open_all"]


def test_m3exam_averages_four_and_five_images():
    report = prefill_cost.cost_report("m3exam", "qwen2.5-vl-7b", [1])
    assert report["visual_tokens"]["open_all"] == round(4.2 * 884)
    assert report["visual_tokens"]["ours"]["1"] == 884


def test_custom_scenario(capsys):
    code, out, _ = run(["--scenario", "custom", "--answering", "qwen3.5-397b", "--image-sizes", "1024x768,800x600",
                        "--text-tokens", "500", "--k", "1,2", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["scenario"] == "custom"
    # 1024x768 -> 1024x768 (32x24 tokens), 800x600 -> 800x608 (25x19 tokens)
    assert report["visual_tokens"] == {"open_all": 768 + 475, "ours": {"1": 768, "2": 768 + 475}}


def test_custom_scenario_needs_its_inputs(capsys):
    code, _, err = run(["--scenario", "custom", "--text-tokens", "100"], capsys)
    assert code == 2 and "--image-sizes" in err


@pytest.mark.parametrize("argv", [["--k", "0"], ["--k", "a,b"], ["--scenario", "custom", "--image-sizes", "10x"]])
def test_bad_arguments_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "cost", *argv])
    assert exit_.value.code == 2 and "error:" in capsys.readouterr().err


def test_kept_proxy_costs_more_than_replaced():
    sizes = [(1024, 768)] * 3
    kept = prefill_cost.cost_report(prefill_cost.custom_scenario(sizes, 400, proxy_tokens=50, keep_proxy=True),
                                    "qwen2.5-vl-7b", [1])
    replaced = prefill_cost.cost_report(prefill_cost.custom_scenario(sizes, 400, proxy_tokens=50), "qwen2.5-vl-7b", [1])
    assert kept["tflop"]["ours"]["1"] > replaced["tflop"]["ours"]["1"]
    assert kept["tflop"]["text_only"] == replaced["tflop"]["text_only"]


def test_visual_tokens_are_the_deliverys():
    """bench cost prices a checkpoint's images with its model's rule in the registry, as the delivery does."""
    from pixeltriage.delivery.cost import visual_tokens
    from pixeltriage.delivery.profiles import CHECKPOINTS

    sizes = [(1920, 1080), (333, 517), (4000, 30)]
    for checkpoint, model in CHECKPOINTS.items():
        report = prefill_cost.cost_report(prefill_cost.custom_scenario(sizes, 100), checkpoint, [1, 2])
        want = [visual_tokens(s, model) for s in sizes]
        assert report["visual_tokens"] == {"open_all": sum(want), "ours": {"1": want[0], "2": want[0] + want[1]}}
