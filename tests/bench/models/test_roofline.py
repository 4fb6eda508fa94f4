"""`pixeltriage bench roofline`: its FLOPs are the FLOP model's, its weight bytes a checkpoint's parameters, its
scaling in questions and memories behaves, --json round-trips, bad flags are one-line usage errors."""
from __future__ import annotations

import json
import re

import pytest
import torch

from pixeltriage.bench.models import roofline as R
from pixeltriage.bench.models.flops import StateShape, shape_from_config, system_one_config, system_one_flops
from pixeltriage.cli import main
from pixeltriage.config import ModelConfig
from pixeltriage.engine.state import EXTRA_HEAD_ROWS
from pixeltriage.weights.reader import tensor_numels

MODEL = system_one_config("2b")
SPEC = R.device_spec("h100")


def stage_of_tensor(name: str, model: ModelConfig) -> str | None:
    """The roofline stage that reads a checkpoint tensor (transformers' names); None for the LM head, unread."""
    if name == "lm_head.weight":
        return None
    if name.startswith("model.visual."):
        return "vision"
    if name in ("model.language_model.norm.weight",) or name.startswith("head."):
        return "head"
    if name == "model.language_model.embed_tokens.weight":
        return "embed"
    layer = re.match(r"model\.language_model\.layers\.(\d+)\.(\w+)\.", name)
    assert layer, name
    index, part = int(layer.group(1)), layer.group(2)
    if part in ("mlp", "post_attention_layernorm"):            # the engine's "mlp" stage runs the post norm
        return "ffn"
    assert part in ("linear_attn", "self_attn", "input_layernorm"), name
    return "full_attention" if model.text.layer_types[index] == "full_attention" else "linear_attention"


def grouped(numels: dict[str, int], model: ModelConfig) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, n in numels.items():
        stage = stage_of_tensor(name, model)
        if stage is not None:
            out[stage] = out.get(stage, 0) + n
    return out


def test_weight_bytes_are_the_tiny_checkpoints_parameters(tiny_checkpoint):
    """Counted from the written checkpoint's tensor shapes (safetensors headers): every stage's parameters, and the
    bytes a forward reads of them in the checkpoint's dtype."""
    model = ModelConfig.from_file(tiny_checkpoint / "config.json")
    numels = {}
    for file in tiny_checkpoint.glob("*.safetensors"):
        numels.update(tensor_numels(file))
    head_dim = numels["head.decision.weight"] // model.text.hidden_size
    params = R.weight_parameters(model, head_dim)
    assert params == grouped(numels, model)
    state = StateShape(text_tokens=40, image_grids=((1, 4, 4), (1, 4, 6)))
    fwd = R.Forward(1, state.num_tokens(4), state.image_tokens(4), 40, 2 + EXTRA_HEAD_ROWS)
    itemsize = torch.float32.itemsize                              # the tiny preset is stored in float32
    traffic = R.stage_traffic(model, head_dim, fwd, weight_bytes=itemsize)
    for stage in ("vision", "linear_attention", "full_attention", "ffn", "head"):
        assert traffic[stage].weights == params[stage] * itemsize, stage
    assert traffic["embed"].weights == fwd.tokens * model.text.hidden_size * itemsize   # the tokens' rows only


def test_weight_parameters_match_the_2b_demo_checkpoints_shapes():
    """The 2b demo checkpoint's tensors (names and shapes as its writer makes them, on the meta device: nothing
    written) against the analytic count, stage by stage; 2 bytes each in bf16."""
    from pixeltriage.weights.demo import PRESETS, backbone_specs, head_specs, hf_config

    config = hf_config("2b")
    specs = backbone_specs(config) + head_specs(config, PRESETS["2b"].head_dim)
    model = ModelConfig.from_dict(config.to_dict())
    assert shape_from_config(model) == shape_from_config(MODEL)    # the roofline's 2b has the demo's shapes
    params = R.weight_parameters(model, PRESETS["2b"].head_dim)
    assert params == grouped({s.name: s.numel for s in specs}, model)
    assert sum(params.values()) == sum(s.numel for s in specs)     # tied embeddings: no separate LM head stored
    report = R.roofline_report("h100", memories=10, questions=1)
    read = sum(params[k] for k in params if k != "embed")
    assert report["parameters"]["read_per_forward"] == read
    weight_mb = sum(s["weight_mb"] for k, s in report["stages"].items() if k != "embed")
    assert weight_mb == pytest.approx(read * 2 / 1e6, rel=1e-12)


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("memories", [0, 1, 10])
def test_flops_are_the_flop_models_per_stage(cached, memories):
    state = R.default_state(MODEL, memories)
    expected = system_one_flops(MODEL, state, 256, cached_vision=cached)
    for questions in (1, 3):
        stages = R.forward_stages(MODEL, state, SPEC, 256, questions, cached_vision=cached)
        assert set(stages) == set(expected) | {"embed", "host_to_device"}
        for name, f in expected.items():
            assert stages[name]["gflop"] * 1e9 == pytest.approx(questions * f.total, rel=1e-12), name
            assert stages[name]["compute_ms"] == pytest.approx(questions * f.total / 989e12 * 1e3, rel=1e-12)
        assert stages["embed"]["gflop"] == stages["host_to_device"]["gflop"] == 0
        for s in stages.values():
            assert s["roofline_ms"] == max(s["compute_ms"], s["memory_ms"])


def test_a_graph_replay_counts_the_padded_bucket():
    state = R.default_state(MODEL, 10)
    eager = R.forward_stages(MODEL, state, SPEC)
    padded = R.forward_stages(MODEL, state, SPEC, padded_tokens=3072)
    for name in ("linear_attention", "full_attention", "ffn"):
        assert padded[name]["gflop"] > eager[name]["gflop"]
    assert padded["vision"] == eager["vision"]
    graphs = R.predict(MODEL, state, SPEC, cuda_graphs=True)
    assert graphs["bucket"] == 3072 and graphs["cuda_graphs"]
    assert not R.predict(MODEL, state, SPEC, questions=2, cuda_graphs=True)["cuda_graphs"]   # batches stay eager


def test_packed_questions_amortise_the_weights():
    state = R.default_state(MODEL, 10)
    one_forward = 10 ** 9                                          # no split: every batch is one forward
    results = [R.predict(MODEL, state, SPEC, questions=b, max_batch_tokens=one_forward) for b in (1, 2, 4, 8, 16)]
    for fewer, more in zip(results, results[1:]):
        assert more["ms"] > fewer["ms"]
        assert more["ms_per_question"] < fewer["ms_per_question"]
        assert more["questions_per_s"] > fewer["questions_per_s"]
        for name in ("linear_attention", "full_attention", "ffn", "head"):   # weights once per forward
            a, b = (r["forwards"][0]["stages"][name] for r in (fewer, more))
            assert a["weight_mb"] == b["weight_mb"] and b["activation_mb"] > a["activation_mb"]
        vision = [r["forwards"][0]["stages"]["vision"]["weight_mb"] / r["questions"] for r in (fewer, more)]
        assert vision[0] == vision[1]                              # the tower runs once per question
    split = R.predict(MODEL, state, SPEC, questions=16)            # 16 x 2280 tokens > 32768: two forwards
    assert [f["questions"] for f in split["forwards"]] == [14, 2]


def test_more_memories_cost_more():
    ms = [R.predict(MODEL, R.default_state(MODEL, n), SPEC)["ms"] for n in (0, 1, 5, 10, 20)]
    assert ms == sorted(ms) and len(set(ms)) == len(ms)
    faster = [R.predict(MODEL, R.default_state(MODEL, 10), R.device_spec(k))["roofline_ms"]
              for k in ("a100", "h100", "h200")]
    assert faster[0] > faster[1] > faster[2]                       # same compute peak: H200's bandwidth still helps


def run(argv, capsys):
    code = main(["bench", "roofline", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_round_trips(capsys):
    code, out, _ = run(["--device-spec", "h200", "--memories", "4", "--questions", "8", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report == json.loads(json.dumps(R.roofline_report("h200", "2b", 4, 8)))
    assert list(report) == ["device", "preset", "dtype", "memories", "state", "parameters", "stages", "kernels",
                            "p50_ms", "packed", "assumptions"]
    assert report["device"]["bf16_dense_tflops"] == 989.0 and report["device"]["hbm_tb_s"] == 4.8
    assert set(report["p50_ms"]) == {"eager", "cuda_graphs", "no_launch_cost"}
    assert report["packed"]["questions"] == 8 and report["packed"]["vision"]["questions_per_s"] > 0
    assert report["state"]["head_rows"] == 4 + EXTRA_HEAD_ROWS


def test_table_is_the_default_output(capsys):
    code, out, _ = run(["--device-spec", "a100"], capsys)
    assert code == 0
    for text in ("A100-SXM4-80GB", "linear_attention", "predicted p50", "questions/s", "assumptions:", "NOT folded"):
        assert text in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


@pytest.mark.parametrize("argv, message", [
    ([], "the following arguments are required: --device-spec"),
    (["--device-spec", "v100"], "argument --device-spec: invalid choice: 'v100'"),
    (["--device-spec", "h100", "--memories", "-1"], "--memories: must be at least 0"),
    (["--device-spec", "h100", "--questions", "0"], "--questions: must be at least 1"),
    (["--device-spec", "h100", "--preset", "tiny"], "argument --preset: invalid choice: 'tiny'"),
    (["--device-spec", "h100", "--zz"], "unrecognized arguments: --zz"),
])
def test_bad_flags_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "roofline", *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("pixeltriage bench roofline: error:") and message in err, err


def test_cli_choices_are_the_librarys():
    from pixeltriage.cli import bench

    assert list(bench.DEVICE_SPECS) == list(R.DEVICE_SPECS)


@pytest.mark.parametrize("gpu, key", [
    ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA A100-SXM4-40GB", None), ("NVIDIA A100 80GB PCIe", None),
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", None), ("NVIDIA L4", None),
])
def test_gpu_names_map_to_their_specs(gpu, key):
    assert R.spec_key_for_gpu(gpu) == key
