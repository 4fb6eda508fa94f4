"""The decision report and the delivery decision price images with the answering model asked for: a registry name,
a processor config directory, or the default."""
import json

import pytest
from PIL import Image

from pixeltriage.delivery.cost import visual_tokens
from pixeltriage.delivery.profiles import ANSWERING_MODELS, DEFAULT_ANSWERING_MODEL, answering_model
from pixeltriage.delivery.decision import decide
from pixeltriage.delivery.report import decision_report
from pixeltriage.engine.types import Memory, Scores

SIZES = [(1920, 1080), (640, 480), (300, 2000)]
SCORES = Scores(p_vis=0.7, gains=[0.9, 0.2, 0.5], relevance=[0.5, 0.1, 0.3], relevance_none=0.1)


@pytest.fixture
def memories(tmp_path):
    paths = []
    for i, size in enumerate(SIZES):
        paths.append(tmp_path / f"m{i}.png")
        Image.new("RGB", size).save(paths[-1])
    return [Memory(image=str(p), note=f"memory {i}") for i, p in enumerate(paths)]


@pytest.mark.parametrize("model", sorted(ANSWERING_MODELS))
def test_report_counts_the_models_tokens(memories, model):
    report = decision_report("q", memories, SCORES, 2, None, model)
    taus = [visual_tokens(s, model) for s in SIZES]
    vt = report["visual_tokens"]
    assert vt["model"] == model
    assert vt["delivery"] == sum(ANSWERING_MODELS[model].rule.prompt_tokens([SIZES[0], SIZES[2]]))
    if model != "llava-onevision":            # priced together, its images cost less than alone
        assert vt["open_all"] == sum(taus) and vt["delivery"] == taus[0] + taus[2]


def test_report_defaults_to_the_default_model(memories):
    assert decision_report("q", memories, SCORES, 1, None)["visual_tokens"]["model"] == DEFAULT_ANSWERING_MODEL


@pytest.mark.parametrize("model", sorted(ANSWERING_MODELS))
def test_token_budget_opens_what_fits(model):
    taus = [visual_tokens(s, model) for s in SIZES]
    budget = taus[0] + taus[1]
    decided = decide(SCORES, None, None, SIZES, model, budget)
    expected, left = [False] * 3, budget
    for i in (0, 2, 1):                       # by descending gain
        if taus[i] <= left:
            expected[i], left = True, left - taus[i]
    assert decided.open == expected
    assert decided.visual_tokens.delivery <= budget


def test_a_processor_config_directory_prices_like_its_registry_entry(tmp_path, memories):
    folder = tmp_path / "InternVL3-8B-hf"
    folder.mkdir()
    (folder / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessorFast", "size": {"height": 448, "width": 448},
        "crop_to_patches": False, "min_patches": 1, "max_patches": 12}))
    by_dir = decision_report("q", memories, SCORES, 2, None, str(folder))
    by_name = decision_report("q", memories, SCORES, 2, None, "internvl3")
    assert by_dir["visual_tokens"]["model"] == "InternVL3-8B-hf"
    assert {k: v for k, v in by_dir["visual_tokens"].items() if k != "model"} == \
        {k: v for k, v in by_name["visual_tokens"].items() if k != "model"}
    assert answering_model(folder).rule == ANSWERING_MODELS["internvl3"].rule


def test_unknown_model_is_refused(memories):
    with pytest.raises(ValueError, match="unknown answering model"):
        decision_report("q", memories, SCORES, 2, None, "gpt-5")
