"""The CUDA branch of the forward, run on CPU tensors in Triton's interpreter (tests/triton_interpreter.py), against
the CPU forward: every kernel the registry picks for CUDA (fla's gated delta rule with varlen boundaries as a device
tensor and grouped value heads, the fused Triton head, the torch ops between) runs, in float32 and in bf16 (its dots as
tensor cores compute them, pixeltriage.bench.emulation); in bf16 and in float32 as a GPU runs it (the torch chunked
rule), against a float64 reference and transformers' own forward in that dtype.

The checkpoint has one Gated DeltaNet layer with 4 value heads over 1 key head (key dim 16, value dim 32) and one
attention layer, a short template and 64-px thumbnails: the interpreter takes ~0.8 s per fla program (chunk x
head), so the configs and states are the smallest that still cover each path (a state of one chunk each). A single question runs through the bucketed static path (what a CUDA graph
captures), several through one varlen forward at the head's rows.

Tolerance (float32, scores: p_vis, gains, relevance): within 1e-5 absolute of the CPU forward, both its torch path
(C kernels off) and its default path (C kernels on); measured 9.5e-7 and 1.2e-6 at most (the CPU's two paths
differ by 5.4e-7 themselves). The CPU path's float32 is
the reference on every device, so the CUDA branch is held to it, not to a looser bound of its own.
"""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from pixeltriage import Memory, Scorer
from pixeltriage.config import TriageConfig
from pixeltriage.bench.gpu_check import max_diff
from pixeltriage.engine import scorer as scorer_module
from pixeltriage.engine.model import decoder_forward
from kernel_claims import claims
from pixeltriage.kernels import head, native, registry
from pixeltriage.kernels.gated_delta import fla
from pixeltriage.bench.emulation import EMULATE_CUDA
from pixeltriage.bench.transformers_baseline import force_transformers_torch_path, transformers_hidden
from reference import float64_head, tiny_config, write_reference_checkpoint
from sync_guard import HostSyncs, tensors_of
from triton_interpreter import fla_interpreter  # noqa: F401  (the fixture)

pytestmark = pytest.mark.long            # tens of seconds of processes: scheduled first (tests/conftest.py)

TOLERANCE = 1e-5
GROUPED = tiny_config(
    text=dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], linear_num_key_heads=1,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32),
    vision=dict(depth=1))
KEY_HEADS, VALUE_HEADS, KEY_DIM, VALUE_DIM = 1, 4, 16, 32
# A short template and 64-px thumbnails keep every state within one of fla's 64-token chunks (49-55 tokens)
SHORT_TEMPLATE = {"prefix": "<|im_start|>user\n", "question": "{question}\n", "memory": "\n{date} {dialogue} {note}",
                  "marker": " [{index}]", "q1": "\nQ1:", "q1_true": " yes", "q1_false": " no", "q2": "\nQ2:",
                  "q2_none": " none", "q3": "\nQ3:", "q3_none": " none", "suffix": "<|im_end|>\n",
                  "decision_1": "Q1:", "decision_2": "Q2:", "decision_3": "Q3:"}


def questions():
    """One question with an image memory (the ViT's rows, a marker for the head), one without."""
    memory = Memory(image=Image.new("RGB", (90, 60), (200, 30, 30)), note="red")
    return [("hi", [memory]), ("Which one was first?", [])]


@pytest.fixture(scope="module")
def grouped_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("grouped")
    write_reference_checkpoint(path, GROUPED, seed=3, residual_scale=0.5)
    triage = TriageConfig(head_dim=16, thumbnail_size=64, template=tuple(SHORT_TEMPLATE.items()))
    (path / "pixeltriage.json").write_text(json.dumps(triage.to_dict()))
    return path


@pytest.fixture(scope="module")
def cpu_scores(grouped_checkpoint):
    """The CPU forward's scores, outside the emulation: {"torch": C kernels off, "native": the default path}, each
    (each question alone, the questions packed)."""
    def scores():
        scorer = Scorer.load(grouped_checkpoint)
        return [scorer.score(q, m) for q, m in questions()], scorer.score_batch(questions())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: None)
        assert registry.choose("gated_delta", "cpu", torch.float32).name == "chunked (conv1d, then delta_rule)"
        torch_path = scores()
    return {"torch": torch_path, "native": scores()}


def counted(monkeypatch, module, name) -> list:
    """Count the calls of module.name (still made)."""
    calls, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@claims(fla.FLA, fla.FLA_CONV, head.TRITON)
def test_cuda_branch_forward_equals_the_cpu_forward(grouped_checkpoint, cpu_scores, fla_interpreter, monkeypatch):
    """Each question alone through the static path a CUDA graph captures (one 64-token bucket), then both packed
    (varlen, the head's rows), through fla and the Triton head: the CPU forward's scores within TOLERANCE, and no
    host sync or upload inside any forward (tests/sync_guard.py); the static path reads only its buffers, the
    weights and what it made, and runs the same ops on the same shapes for both questions."""
    import fla.ops.gated_delta_rule as fla_ops

    from pixeltriage.kernels.head import triton as head_triton

    scorer = Scorer.load(grouped_checkpoint)
    kernels = scorer.kernels()
    assert kernels["gated_delta"] == "fla chunk_gated_delta_rule" and kernels["head"] == "triton fused head"
    fla_calls = counted(monkeypatch, fla_ops, "chunk_gated_delta_rule")
    head_calls = counted(monkeypatch, head_triton, "decision_head_triton")

    states = [scorer.pack(q, m) for q, m in questions()]
    assert states[0].num_tokens != states[1].num_tokens
    scorer.enable_cuda_graphs(buckets=(64,), capture=False)
    graphs, static_forward, recorders = scorer.graphs, scorer.graphs._forward, []
    allowed = [graphs.embeds, graphs.positions, graphs.out, *tensors_of(graphs.weights)]

    def recorded_static(t_b):
        recorders.append(HostSyncs(trace=True, allowed=allowed))
        with recorders[-1]:
            static_forward(t_b)

    graphs._forward = recorded_static
    singles = [scorer.score_states([state])[0] for state in states]
    assert graphs.replays == {"graph": 2, "eager": 0} and len(fla_calls) == 2 and len(head_calls) == 2
    assert recorders[0].trace == recorders[1].trace                # what a capture records, for either question
    scorer.disable_cuda_graphs()

    def recorded_forward(*args, **kwargs):
        recorders.append(HostSyncs())
        with recorders[-1]:
            return decoder_forward(*args, **kwargs)

    monkeypatch.setattr(scorer_module, "decoder_forward", recorded_forward)
    packed = scorer.score_batch(questions())
    assert len(fla_calls) == 3 and len(head_calls) == 3 and len(recorders) == 3

    for path, (want_singles, want_packed) in cpu_scores.items():
        for got, want in zip(singles + packed, want_singles + want_packed, strict=True):
            assert max_diff(got, want) <= TOLERANCE, path
    for rec in recorders:
        rec.check()


@claims(fla.FLA, fla.FLA_CONV)
def test_a_bf16_model_hands_fla_bf16_and_grouped_heads(grouped_checkpoint, fla_interpreter, monkeypatch):
    """What reaches fla in a bf16 model (two questions packed): q, k and v in bf16 (not float32: fla's float32
    kernels would move twice the bytes and skip the tensor cores), q and k with their one key head as it is (not
    repeated for the 4 value heads: fla reads each key head for its group), g in float32, the varlen boundaries
    as an int tensor on the device."""
    import fla.ops.gated_delta_rule as fla_ops

    seen, real = [], fla_ops.chunk_gated_delta_rule

    def recording(q, k, v, g, beta, *args, **kwargs):
        seen.append((q, k, v, g, beta, kwargs.get("cu_seqlens")))
        return real(q, k, v, g, beta, *args, **kwargs)

    monkeypatch.setattr(fla_ops, "chunk_gated_delta_rule", recording)
    scorer = Scorer.load(grouped_checkpoint, dtype=torch.bfloat16)
    assert scorer.kernels()["gated_delta"] == "fla chunk_gated_delta_rule"
    states = [scorer.pack(q, m) for q, m in questions()]
    bounds = [0, states[0].num_tokens, states[0].num_tokens + states[1].num_tokens]
    rows = torch.tensor([bounds[1] - 1, bounds[2] - 1])
    hidden = scorer.last_hidden_packed(states, rows)
    assert hidden.shape == (2, GROUPED["text_config"]["hidden_size"]) and torch.isfinite(hidden).all()

    assert len(seen) == 1                                       # one Gated DeltaNet layer
    q, k, v, g, beta, cu_seqlens = seen[0]
    tokens = bounds[-1]
    assert (q.dtype, k.dtype, v.dtype) == (torch.bfloat16,) * 3
    assert q.shape == k.shape == (1, tokens, KEY_HEADS, KEY_DIM)
    assert v.shape == (1, tokens, VALUE_HEADS, VALUE_DIM)
    assert g.dtype == torch.float32 and g.shape == beta.shape == (1, tokens, VALUE_HEADS)
    assert isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device == hidden.device
    assert not cu_seqlens.is_floating_point() and cu_seqlens.tolist() == bounds


def test_the_load_refuses_slow_cuda_fallbacks_unless_allowed(tiny_checkpoint, fla_interpreter, monkeypatch):
    """Without flash-linear-attention a bf16 model's gated delta rule would be the slow torch chunked rule on CUDA:
    the load refuses it naming the package, unless allow_slow, and then the scorer names the fallback it runs. A
    float32 model takes the torch chunked rule anyway (the exact path, not a fallback)."""
    from pixeltriage.errors import BackendUnavailableError
    from pixeltriage.kernels.gated_delta import fla

    assert Scorer.load(tiny_checkpoint, dtype=torch.bfloat16).kernels()["gated_delta"] == "fla chunk_gated_delta_rule"
    monkeypatch.setattr(fla, "available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="flash-linear-attention.*allow_slow=True"):
        Scorer.load(tiny_checkpoint, dtype=torch.bfloat16)
    slow = Scorer.load(tiny_checkpoint, dtype=torch.bfloat16, allow_slow=True)
    assert slow.kernels()["gated_delta"] == "chunked (conv1d, then delta_rule; slow)"
    assert Scorer.load(tiny_checkpoint).kernels()["gated_delta"] == "chunked (conv1d, then delta_rule)"


# The CUDA branch against a float64 reference: transformers' forward in float64 (its torch path), the scores from its
# hidden rows through the head in float64 (tests/reference.py). Per question, the largest difference over p_vis,
# gains, relevance and relevance_none ("gap"):
# - bf16: the CUDA branch's gap (fla's kernels and the fused head in bf16, dots as tensor cores compute them) is no
#   larger than transformers' own bf16 forward's on the same state (its hidden rows through the float64 head), and
#   at most BF16_GAP (the CPU bf16 path's bar against float32, tests/engine/test_parity.py); measured 7.2e-3 and
#   6.6e-3 (the static path and the packed forward alike) against transformers' 8.2e-3 and 9.3e-3;
# - float32 (the torch chunked rule, as a CUDA float32 forward runs it, and the fused head): at most FLOAT32_GAP,
#   the CUDA branch's float32 bar against the CPU forward above; measured <= 1.3e-6 (transformers' float32:
#   1.8e-6 and 2e-8).
BF16_GAP = 2e-2
FLOAT32_GAP = TOLERANCE


def gap(scores, exact: dict) -> float:
    got = scores if isinstance(scores, dict) else {"p_vis": scores.p_vis, "gains": scores.gains,
                                                   "relevance": scores.relevance,
                                                   "relevance_none": scores.relevance_none}
    assert len(got["gains"]) == len(exact["gains"]) and len(got["relevance"]) == len(exact["relevance"])
    return max([abs(got["p_vis"] - exact["p_vis"]), abs(got["relevance_none"] - exact["relevance_none"])]
               + [abs(x - y) for key in ("gains", "relevance") for x, y in zip(got[key], exact[key])])


@pytest.fixture(scope="module")
def references(grouped_checkpoint):
    """Per question: the float64 scores, and transformers' bf16 and float32 forwards' gaps to them."""
    from transformers import Qwen3_5ForConditionalGeneration

    force_transformers_torch_path()
    s32 = Scorer.load(grouped_checkpoint)
    states = [s32.pack(q, m) for q, m in questions()]

    def scores(dtype):
        hf = Qwen3_5ForConditionalGeneration.from_pretrained(grouped_checkpoint, dtype=dtype).eval()
        return [float64_head(transformers_hidden(hf, state)[state.head_positions()], state, s32) for state in states]

    exact = scores(torch.float64)
    return exact, {dtype: [gap(s, e) for s, e in zip(scores(dtype), exact)]
                   for dtype in (torch.bfloat16, torch.float32)}


def cuda_branch_scores(scorer):
    """Each question alone through the static path a CUDA graph captures (one 64-token bucket), then both packed
    (varlen): [(single, packed)] per question."""
    states = [scorer.pack(q, m) for q, m in questions()]
    scorer.enable_cuda_graphs(buckets=(64,), capture=False)
    singles = [scorer.score_states([state])[0] for state in states]
    assert scorer.graphs.replays == {"graph": 2, "eager": 0}
    scorer.disable_cuda_graphs()
    return list(zip(singles, scorer.score_states(states), strict=True))


@claims(fla.FLA, fla.FLA_CONV, head.TRITON)
def test_bf16_cuda_branch_no_further_from_float64_than_transformers_bf16(grouped_checkpoint, references,
                                                                         fla_interpreter, monkeypatch):
    """The bf16 CUDA branch, every kernel the registry picks for bf16 on CUDA (fla's conv and chunked rule, the fused
    Triton head), run in bf16: per question, no further from the float64 scores than transformers' bf16 forward."""
    import fla.ops.gated_delta_rule as fla_ops

    from pixeltriage.kernels.head import triton as head_triton

    exact, theirs = references
    scorer = Scorer.load(grouped_checkpoint, dtype=torch.bfloat16)
    cuda = registry.choices("cuda", torch.bfloat16)
    assert {op: scorer.kernels()[op] for op in ("gated_delta", "conv1d")} == {
        op: cuda[op] for op in ("gated_delta", "conv1d")}
    assert scorer.kernels()["head"] == "triton fused head"
    fla_dtypes, head_dtypes = [], []
    real_fla, real_head = fla_ops.chunk_gated_delta_rule, head_triton.decision_head_triton
    monkeypatch.setattr(fla_ops, "chunk_gated_delta_rule",
                        lambda q, *a, **k: fla_dtypes.append(q.dtype) or real_fla(q, *a, **k))
    monkeypatch.setattr(head_triton, "decision_head_triton",
                        lambda h, *a, **k: head_dtypes.append(h.dtype) or real_head(h, *a, **k))

    results = cuda_branch_scores(scorer)
    assert fla_dtypes == [torch.bfloat16] * 3 and len(head_dtypes) == 3
    for (single, packed), want, bar in zip(results, exact, theirs[torch.bfloat16], strict=True):
        for got in (single, packed):
            assert gap(got, want) <= min(bar, BF16_GAP), (gap(got, want), bar)


@claims(head.TRITON)
def test_float32_cuda_branch_against_float64(grouped_checkpoint, references, fla_interpreter, monkeypatch):
    """The float32 CUDA branch as a GPU runs it: the registry's float32 CUDA kernels (the torch chunked rule: fla's
    kernels take bf16/fp16 only, so they are made unavailable here, where the interpreter would stand float32 in for
    them), the fused Triton head; per question within FLOAT32_GAP of the float64 scores."""
    import fla.ops.gated_delta_rule as fla_ops

    from pixeltriage.kernels.head import triton as head_triton

    exact, theirs = references
    monkeypatch.setattr(fla, "available", lambda: False)
    monkeypatch.setattr(fla, "conv_available", lambda: False)
    scorer = Scorer.load(grouped_checkpoint, dtype=torch.float32)
    monkeypatch.delenv(EMULATE_CUDA)
    cuda = registry.choices("cuda", torch.float32)
    monkeypatch.setenv(EMULATE_CUDA, "1")
    assert {op: scorer.kernels()[op] for op in ("gated_delta", "conv1d", "head")} == {
        op: cuda[op] for op in ("gated_delta", "conv1d", "head")}
    fla_calls = counted(monkeypatch, fla_ops, "chunk_gated_delta_rule")
    head_calls = counted(monkeypatch, head_triton, "decision_head_triton")

    results = cuda_branch_scores(scorer)
    assert fla_calls == [] and len(head_calls) == 3
    for (single, packed), want, bar in zip(results, exact, theirs[torch.float32], strict=True):
        for got in (single, packed):
            assert gap(got, want) <= FLOAT32_GAP, (gap(got, want), bar)
