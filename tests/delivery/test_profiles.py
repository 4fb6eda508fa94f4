"""Each answering model's visual-token rule against the model family's own processor (transformers 5, the PIL image
processors, which need no torchvision), on a grid of awkward image sizes: tiny, very thin, very wide, odd, and just
below / at / above each resize or tiling threshold of the family.

Each family's processor is built from a preprocessor config written here (no download), and the same config is read
back by `from_processor_config`, so the registry's rule, the config reader and the processor are compared together.
The expected count is the processing class's own expansion of one image placeholder (its `replace_image_token`,
called on the image processor's real output for a blank image of that size), counting the special tokens in it:
the convention of pixeltriage.delivery.rules. Phi-4-multimodal's image processor imports torchvision, so its rule is
checked against a transcription of the processor's source instead (docs/delivery.md says so).
"""
import json
import math
import re
from types import SimpleNamespace

import pytest
from PIL import Image

from pixeltriage.delivery.profiles import (ANSWERING_MODELS, CHECKPOINTS, DEFAULT_ANSWERING_MODEL,
                                           UnknownAnsweringModelError, answering_model, from_processor_config)
from pixeltriage.delivery.rules import AreaRule, GeminiTileRule, OpenAITileRule

# tiny, thin, wide, odd, ordinary photos, and a large one
AWKWARD = [(1, 1), (2, 1), (1, 2), (3, 3), (1, 150), (150, 1), (7, 1000), (1000, 7), (13, 17), (333, 517),
           (517, 333), (640, 480), (1023, 767), (1920, 1080), (1080, 1920), (2000, 21), (21, 2000), (2500, 1700)]


FAST = {"do_rescale": False, "do_normalize": False}   # leave pixel values alone: the counts do not depend on them


def blank(size):
    return Image.new("RGB", size)


def profile_from(tmp_path, config: dict, processor: dict | None = None):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    if processor is not None:
        (tmp_path / "processor_config.json").write_text(json.dumps(processor))
    return from_processor_config(tmp_path)


def kwargs_of(config: dict) -> dict:
    return {k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}


def count(text: str, *tokens: str, pattern: str | None = None) -> int:
    return sum(text.count(t) for t in tokens) + (len(re.findall(pattern, text)) if pattern else 0)


# ---- Qwen2.5-VL, Qwen3-VL, Qwen3.5 -------------------------------------------------------------------------------

QWEN25_CONFIG = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 3136, "max_pixels": 12845056,
                 "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}
QWEN3_CONFIG = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
# around the 28/32-px grid (round half), the pixel limits, and the 200:1 aspect limit
QWEN_EDGES = [(27, 27), (28, 28), (29, 29), (41, 41), (42, 42), (43, 43), (55, 57), (3600, 3584), (3584, 3585),
              (4096, 4096), (4097, 4095), (200, 1), (1, 200), (5600, 28), (28, 5600)]


@pytest.mark.parametrize("config, names", [(QWEN25_CONFIG, ["qwen2.5-vl"]), (QWEN3_CONFIG, ["qwen3-vl", "qwen3.5"])])
def test_qwen_grid_matches_processor(tmp_path, config, names):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    profile = profile_from(tmp_path, config)
    for name in names:
        assert ANSWERING_MODELS[name].rule == profile.rule
    hf = Qwen2VLImageProcessorPil(**kwargs_of(config))
    merge = hf.merge_size ** 2
    for w, h in AWKWARD + QWEN_EDGES:
        if max(w, h) / min(w, h) > 200:
            with pytest.raises(ValueError):
                hf.get_number_of_image_patches(h, w)
            with pytest.raises(ValueError):
                profile.tokens((w, h))
            continue
        assert profile.tokens((w, h)) == hf.get_number_of_image_patches(h, w) // merge, (w, h)
    for w, h in [(1, 1), (13, 17), (1000, 7), (1023, 767)]:       # the processor run on pixels: its image grid
        grid = hf.preprocess([blank((w, h))], **FAST)["image_grid_thw"]
        assert profile.tokens((w, h)) == int(grid[0][0] * grid[0][1] * grid[0][2]) // merge, (w, h)


# ---- InternVL 2.5 / 3 (GotOcr2 image processor + InternVLProcessor) ---------------------------------------------

INTERNVL_CONFIG = {"image_processor_type": "GotOcr2ImageProcessorFast", "processor_class": "InternVLProcessor",
                   "size": {"height": 448, "width": 448}, "crop_to_patches": False, "min_patches": 1,
                   "max_patches": 12}
# exact grid ratios and one pixel off, and the tie-break's area thresholds for 1:1 (2x2 from side 634, 3x3 from 951)
INTERNVL_EDGES = [(896, 448), (895, 448), (897, 448), (448, 1344), (633, 633), (634, 634), (950, 950), (951, 951),
                  (5376, 448), (448, 5376), (1344, 1343)]


def test_internvl_matches_processor(tmp_path):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    profile = profile_from(tmp_path, INTERNVL_CONFIG, {"image_seq_length": 256, "processor_class": "InternVLProcessor"})
    assert ANSWERING_MODELS["internvl3"].rule == profile.rule == ANSWERING_MODELS["internvl2.5"].rule
    hf = GotOcr2ImageProcessorPil(**kwargs_of(INTERNVL_CONFIG))
    processor = SimpleNamespace(image_seq_length=256, start_image_token="<img>", end_image_token="</img>",
                                image_token="<IMG_CONTEXT>")
    for w, h in AWKWARD + INTERNVL_EDGES:
        out = hf.preprocess([blank((w, h))], crop_to_patches=True, **FAST)   # InternVLProcessor's images_kwargs
        text = InternVLProcessor.replace_image_token(processor, out, 0)
        assert profile.tokens((w, h)) == count(text, "<img>", "</img>", "<IMG_CONTEXT>"), (w, h)


def test_internvl_config_for_another_processor_is_refused(tmp_path):
    with pytest.raises(UnknownAnsweringModelError, match="InternVLProcessor"):
        profile_from(tmp_path, dict(INTERNVL_CONFIG, processor_class="GotOcr2Processor"))


# ---- LLaVA-OneVision -----------------------------------------------------------------------------------------------

ONEVISION_CONFIG = {"image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": 384, "width": 384},
                    "image_grid_pinpoints": [[h, w] for h in range(384, 2305, 384) for w in range(384, 2305, 384)]}
ONEVISION_PROCESSOR = {"num_image_tokens": 729, "vision_feature_select_strategy": "full",
                       "vision_aspect_ratio": "anyres_max_9"}
# canvas boundaries (one 384-px step), the anyres_max_9 pooling (ratio > 1.1), and past the largest canvas
ONEVISION_EDGES = [(384, 384), (385, 384), (768, 384), (769, 385), (1152, 1152), (1153, 1153), (2304, 2304),
                   (2305, 1000), (3000, 500), (1536, 1152), (1152, 1536)]


def _onevision_processor(ip):
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    processor = SimpleNamespace(image_processor=ip, image_token="<image>", **ONEVISION_PROCESSOR)
    processor._get_unpadded_features = lambda *a: LlavaOnevisionProcessor._get_unpadded_features(processor, *a)
    processor._get_number_of_features = lambda *a: LlavaOnevisionProcessor._get_number_of_features(processor, *a)
    return processor, LlavaOnevisionProcessor.replace_image_token


def test_llava_onevision_matches_processor(tmp_path):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    profile = profile_from(tmp_path, ONEVISION_CONFIG, ONEVISION_PROCESSOR)
    assert ANSWERING_MODELS["llava-onevision"].rule == profile.rule
    hf = LlavaOnevisionImageProcessorPil(**kwargs_of(ONEVISION_CONFIG))
    processor, replace = _onevision_processor(hf)
    for w, h in AWKWARD + ONEVISION_EDGES:
        out = hf.preprocess([blank((w, h))], **FAST)
        assert profile.tokens((w, h)) == count(replace(processor, out, 0), "<image>"), (w, h)


def test_llava_onevision_several_images_in_one_prompt(tmp_path):
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil)

    profile = profile_from(tmp_path, ONEVISION_CONFIG, ONEVISION_PROCESSOR)
    hf = LlavaOnevisionImageProcessorPil(**kwargs_of(ONEVISION_CONFIG))
    processor, replace = _onevision_processor(hf)
    sizes = [(640, 480), (13, 2000), (1920, 1080)]
    out = hf.preprocess([[blank(s) for s in sizes]], **FAST)
    expected = [count(replace(processor, out, i), "<image>") for i in range(len(sizes))]
    assert profile.rule.prompt_tokens(sizes) == expected == [730] * 3
    assert profile.rule.prompt_tokens(sizes[:1]) == [profile.tokens(sizes[0])] != [730]


# ---- Gemma 3 ------------------------------------------------------------------------------------------------------

GEMMA3_CONFIG = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 896, "width": 896},
                 "do_pan_and_scan": None, "pan_and_scan_min_crop_size": None, "pan_and_scan_max_num_crops": None,
                 "pan_and_scan_min_ratio_to_activate": None}
# the 1.2 aspect ratio that turns pan-and-scan on, the 256-px minimum crop, and the 4-crop cap
GEMMA3_EDGES = [(1200, 1000), (1199, 1000), (1000, 1200), (511, 400), (510, 400), (400, 511), (2560, 256),
                (2561, 100), (5000, 1000), (256, 256)]


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_gemma3_matches_processor(tmp_path, pan_and_scan):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    defaults = {"do_pan_and_scan": pan_and_scan, "pan_and_scan_min_crop_size": 256, "pan_and_scan_max_num_crops": 4,
                "pan_and_scan_min_ratio_to_activate": 1.2}            # Gemma3Processor's images_kwargs
    profile = profile_from(tmp_path, dict(GEMMA3_CONFIG, do_pan_and_scan=pan_and_scan or None),
                           {"image_seq_length": 256})
    name = "gemma-3-pan-and-scan" if pan_and_scan else "gemma-3"
    assert ANSWERING_MODELS[name].rule == profile.rule
    hf = Gemma3ImageProcessorPil(size={"height": 896, "width": 896})
    sequence = "\n\n<start_of_image>" + "<image_soft_token>" * 256 + "<end_of_image>\n\n"
    processor = SimpleNamespace(full_image_sequence=sequence)
    for w, h in AWKWARD + GEMMA3_EDGES:
        out = hf.preprocess([blank((w, h))], **defaults, **FAST)
        text = Gemma3Processor.replace_image_token(processor, out, 0)
        assert profile.tokens((w, h)) == count(text, "<start_of_image>", "<image_soft_token>", "<end_of_image>"), \
            (w, h)


# ---- Llama 3.2 Vision (Mllama) ------------------------------------------------------------------------------------

MLLAMA_CONFIG = {"image_processor_type": "MllamaImageProcessor", "size": {"height": 560, "width": 560},
                 "max_image_tiles": 4}
# one tile exactly, a pixel over, the 2x2 canvas, long strips of 4 tiles
MLLAMA_EDGES = [(560, 560), (561, 560), (560, 561), (1120, 1120), (1121, 1121), (2240, 560), (2241, 560),
                (560, 2240), (100, 3000), (1680, 561)]


def test_llama32_vision_matches_processor(tmp_path):
    from transformers.models.mllama.configuration_mllama import MllamaVisionConfig
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    profile = profile_from(tmp_path, MLLAMA_CONFIG)
    assert ANSWERING_MODELS["llama-3.2-vision"].rule == profile.rule
    vision = MllamaVisionConfig(image_size=560, patch_size=14)
    per_tile = (vision.image_size // vision.patch_size) ** 2 + 1   # MllamaVisionModel.num_patches
    hf = MllamaImageProcessorPil(**kwargs_of(MLLAMA_CONFIG))
    for w, h in AWKWARD + MLLAMA_EDGES:
        tiles = hf.preprocess([[blank((w, h))]], **FAST)["num_tiles"][0][0]
        assert profile.tokens((w, h)) == tiles * per_tile, (w, h)


# ---- Idefics3 / SmolVLM -------------------------------------------------------------------------------------------

IDEFICS3_CONFIG = {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 1456},
                   "max_image_size": {"longest_edge": 364}, "do_image_splitting": True}
SMOLVLM_CONFIG = {"image_processor_type": "SmolVLMImageProcessor", "size": {"longest_edge": 2048},
                  "max_image_size": {"longest_edge": 512}, "do_image_splitting": True}
# the short side one pixel below / at / above a tile multiple once the long side is at longest_edge
SPLIT_EDGES = [(1456, 363), (1456, 364), (1456, 365), (1456, 727), (1456, 729), (364, 364), (2048, 511), (2048, 512),
               (2048, 513), (512, 1025), (1457, 1)]


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_split_families_match_processor(tmp_path, family):
    if family == "idefics3":
        from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil as Image_
        from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

        config, seq = IDEFICS3_CONFIG, 169
        processor = SimpleNamespace(fake_image_token="<fake_token_around_image>", global_image_tag="<global-img>",
                                    image_token="<image>", image_seq_len=seq)
        replace = Idefics3Processor.replace_image_token
    else:
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil as Image_
        from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

        config, seq = SMOLVLM_CONFIG, 64
        processor = SimpleNamespace(fake_image_token="<fake_token_around_image>", global_image_token="<global-img>",
                                    image_token="<image>", image_seq_len=seq)
        replace = SmolVLMProcessor.replace_image_token
    profile = profile_from(tmp_path, config, {"image_seq_len": seq})
    assert ANSWERING_MODELS[family].rule == profile.rule
    hf = Image_(**kwargs_of(config))
    for w, h in AWKWARD + SPLIT_EDGES:
        out = hf.preprocess([blank((w, h))], return_row_col_info=True, do_pad=False, **FAST)
        text = replace(processor, out, 0)
        expected = count(text, "<fake_token_around_image>", "<global-img>", "<image>", pattern=r"<row_\d+_col_\d+>")
        assert profile.tokens((w, h)) == expected, (w, h)


def test_split_config_the_registry_lacks(tmp_path):
    """An odd tile size that does not divide the long edge (no published checkpoint has one): the processor's even
    rounding of the resized short side, and its short side scaled with the long one up to a tile multiple, both
    change the tile count here."""
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    config = dict(IDEFICS3_CONFIG, size={"longest_edge": 1000}, max_image_size={"longest_edge": 365})
    profile = profile_from(tmp_path, config, {"image_seq_len": 81})
    hf = Idefics3ImageProcessorPil(**kwargs_of(config))
    processor = SimpleNamespace(fake_image_token="<fake_token_around_image>", global_image_tag="<global-img>",
                                image_token="<image>", image_seq_len=81)
    for w, h in [(1, 1), (2, 1), (999, 1000), (1000, 333), (1000, 340), (340, 1000), (1000, 667), (667, 1000),
                 (730, 731), (333, 517), (640, 480)]:
        out = hf.preprocess([blank((w, h))], return_row_col_info=True, do_pad=False, **FAST)
        text = Idefics3Processor.replace_image_token(processor, out, 0)
        expected = count(text, "<fake_token_around_image>", "<global-img>", "<image>", pattern=r"<row_\d+_col_\d+>")
        assert profile.tokens((w, h)) == expected, (w, h)


# ---- Phi-4-multimodal: the processor's source, transcribed (it imports torchvision) -------------------------------


def phi4_source_tokens(width: int, height: int, image_size=448, patch_size=14, max_num=36, min_num=1) -> int:
    """Phi4MultimodalImageProcessor.dynamic_preprocess and _preprocess's num_img_tokens, the lines that decide the
    count, with the same torch ops (transformers 5.24, models/phi4_multimodal/image_processing_phi4_multimodal.py)."""
    import torch

    mask_size = image_size // patch_size
    w_crop_num, h_crop_num = math.ceil(width / float(image_size)), math.ceil(height / float(image_size))
    if w_crop_num * h_crop_num > max_num:
        aspect_ratio = width / height
        target_ratios = sorted({(i, j) for n in range(min_num, max_num + 1) for i in range(1, n + 1)
                                for j in range(1, n + 1) if i * j <= max_num and i * j >= min_num},
                               key=lambda x: x[0] * x[1])
        best_ratio_diff, target_aspect_ratio, area = float("inf"), (1, 1), width * height
        for ratio in target_ratios:
            ratio_diff = abs(aspect_ratio - ratio[0] / ratio[1])
            if ratio_diff < best_ratio_diff:
                best_ratio_diff, target_aspect_ratio = ratio_diff, ratio
            elif ratio_diff == best_ratio_diff and area > 0.5 * image_size * image_size * ratio[0] * ratio[1]:
                target_aspect_ratio = ratio
        target_width, target_height = image_size * target_aspect_ratio[0], image_size * target_aspect_ratio[1]
    else:
        target_width, target_height = image_size * w_crop_num, image_size * h_crop_num
        target_aspect_ratio = (w_crop_num, h_crop_num)
    ratio_width, ratio_height = target_width / width, target_height / height
    if ratio_width < ratio_height:
        new_size = (target_width, int(height * ratio_width))
        padding_width, padding_height = 0, target_height - int(height * ratio_width)
    else:
        new_size = (int(width * ratio_height), target_height)
        padding_width, padding_height = target_width - int(width * ratio_height), 0
    attention_mask = torch.ones((int(mask_size * target_aspect_ratio[1]), int(mask_size * target_aspect_ratio[0])))
    if padding_width >= patch_size:
        attention_mask[:, -math.floor(padding_width / patch_size):] = 0
    if padding_height >= patch_size:
        attention_mask[-math.floor(padding_height / patch_size):, :] = 0
    if min(new_size[1], target_height) < 10 or min(new_size[0], target_width) < 10:
        raise ValueError(f"the aspect ratio is very extreme {new_size}")
    mask_height, mask_width = attention_mask.shape[-2:]
    reshaped = attention_mask.reshape(mask_height // mask_size, mask_size, mask_width // mask_size, mask_size)
    reshaped = reshaped.transpose(1, 2).reshape(-1, mask_size, mask_size).contiguous()
    down = reshaped[:, 0::2, 0::2]
    down = down.reshape(mask_height // mask_size, mask_width // mask_size, mask_size // 2 + mask_size % 2,
                        mask_size // 2 + mask_size % 2)
    down = down.transpose(1, 2)
    down = down.reshape(down.size(0) * down.size(1), down.size(2) * down.size(3))
    return 256 + 1 + int(down.sum().item()) + int(down[:, 0].sum().item()) + 16


PHI4_CONFIG = {"image_processor_type": "Phi4MultimodalImageProcessorFast", "size": {"height": 448, "width": 448},
               "patch_size": 14, "dynamic_hd": 36}
# crop multiples and one pixel off, padding below / at one patch, over 36 crops (the closest-ratio search)
PHI4_EDGES = [(448, 448), (449, 448), (448, 449), (896, 434), (896, 435), (896, 420), (2688, 2688), (2689, 2688),
              (6000, 500), (3000, 3000), (10, 10), (9, 1000)]


def test_phi4_multimodal_matches_processor_source(tmp_path):
    profile = profile_from(tmp_path, PHI4_CONFIG)
    assert ANSWERING_MODELS["phi-4-multimodal"].rule == profile.rule
    for w, h in AWKWARD + PHI4_EDGES:
        try:
            expected = phi4_source_tokens(w, h)
        except ValueError:
            with pytest.raises(ValueError, match="extreme"):
                profile.tokens((w, h))
            continue
        assert profile.tokens((w, h)) == expected, (w, h)


# ---- hosted models: the published formulas and their worked examples ---------------------------------------------


def test_gpt4o_published_examples():
    high, low = ANSWERING_MODELS["gpt-4o"], ANSWERING_MODELS["gpt-4o-low"]
    assert high.tokens((1024, 1024)) == 765    # scaled to 768 x 768: 4 tiles
    assert high.tokens((2048, 4096)) == 1105   # 1024 x 2048, then 768 x 1536: 6 tiles
    assert low.tokens((4096, 8192)) == 85
    assert high.tokens((512, 512)) == 255 and high.tokens((513, 512)) == 425   # not enlarged: 1 tile, then 2
    assert high.tokens((1, 1)) == 255
    assert OpenAITileRule().scaled((4000, 3000)) == (1024, 768)


def test_claude_formula():
    claude = ANSWERING_MODELS["claude"]            # width * height / 750, rounded up, under 1568 px / ~1600 tokens
    assert claude.tokens((200, 200)) == 54
    assert claude.tokens((1000, 1000)) == 1334
    assert claude.tokens((1092, 1092)) == 1590
    for size in [(1568, 1568), (8000, 100), (100, 8000), (4000, 3000)]:
        w, h = AreaRule().scaled(size)
        assert max(w, h) <= 1568 and claude.tokens(size) <= 1600 and abs(w / h - size[0] / size[1]) < 0.05 * w / h


def test_gemini_published_rule():
    gemini = ANSWERING_MODELS["gemini"]
    assert gemini.tokens((384, 384)) == gemini.tokens((1, 1)) == 258
    assert gemini.tokens((385, 384)) == 258
    assert gemini.tokens((1536, 768)) == 516 and gemini.tokens((1537, 768)) == 774
    assert GeminiTileRule().tokens((768 * 3, 768 * 2)) == 6 * 258


# ---- the registry -------------------------------------------------------------------------------------------------


def test_registry_names_sources_and_defaults():
    assert DEFAULT_ANSWERING_MODEL in ANSWERING_MODELS
    for name, model in ANSWERING_MODELS.items():
        assert model.name == name and model.source
        assert model.tokens((640, 480)) > 0
    for checkpoint, name in CHECKPOINTS.items():
        assert checkpoint in ANSWERING_MODELS[name].checkpoints
    assert answering_model() is ANSWERING_MODELS[DEFAULT_ANSWERING_MODEL]


def test_registry_names_import_nothing_heavy():
    import subprocess
    import sys

    probe = ("import sys; from pixeltriage.delivery.profiles import ANSWERING_MODEL_NAMES; "
             "print(sorted(m for m in ('torch', 'numpy', 'PIL', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_answering_model_by_directory(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN25_CONFIG))
    by_path, by_name = answering_model(tmp_path), answering_model(str(tmp_path))
    assert by_path.rule == by_name.rule == ANSWERING_MODELS["qwen2.5-vl"].rule
    assert str(tmp_path) in by_path.source


@pytest.mark.parametrize("config, match", [
    ({"image_processor_type": "SiglipImageProcessor"}, "SiglipImageProcessor"),
    ({"size": {"height": 1}}, "no image_processor_type"),
    ([1, 2], "JSON object"),
    ({"image_processor_type": "MllamaImageProcessor", "size": {"height": 560, "width": 448}}, "square"),
    ({"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 10, "max_pixels": 5}, "min_pixels"),
])
def test_bad_processor_configs(tmp_path, config, match):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownAnsweringModelError, match=match):
        from_processor_config(tmp_path)


def test_missing_or_unreadable_config(tmp_path):
    with pytest.raises(UnknownAnsweringModelError, match="no such file"):
        from_processor_config(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(UnknownAnsweringModelError, match="JSON"):
        from_processor_config(tmp_path)
    with pytest.raises(UnknownAnsweringModelError, match="unknown answering model"):
        answering_model("gpt-5-vision")
    with pytest.raises(ValueError):          # the error is also a ValueError, as the registry's callers expect
        answering_model("nope")
