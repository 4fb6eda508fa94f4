"""The decoder's bucketed static path (what CUDA graphs capture), run eagerly on the CPU against the plain forward.

Tolerance (float32): rows of a state padded to its bucket within 1e-5 relative of the unpadded forward (the same
causal arithmetic; only reduction orders may differ), scores within 1e-5.
"""
import pytest
import torch

from pixeltriage import Scorer
from pixeltriage.engine.graphs import DecoderGraphs
from pixeltriage.engine.model import decoder_forward
from pixeltriage.episode import sample_episode
from reference import rel
from sync_guard import HostSyncs, tensors_of


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    return Scorer.load(tiny_checkpoint)


def test_padded_bucket_rows_equal_the_plain_forward(scorer):
    question, memories = sample_episode()
    state = scorer.pack(question, memories)
    embeds, positions = scorer._embeds(state), state.position_ids
    want = decoder_forward(embeds, positions, scorer.weights.text, scorer.model_config.text)
    t = state.num_tokens
    graphs = DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", buckets=(t // 2, t + 37, 4 * t),
                           capture=False)
    assert graphs.bucket(t) == t + 37
    got = graphs.run(embeds, positions)
    assert got.shape == want.shape and rel(got, want) <= 1e-5
    # a shorter state next: whatever the buffers hold beyond it (here NaN) must be cleared, not computed with
    graphs.embeds.fill_(float("nan"))
    graphs.out.fill_(float("nan"))
    short = scorer.pack(question, memories[:1])
    e2, p2 = scorer._embeds(short), short.position_ids
    assert rel(graphs.run(e2, p2), decoder_forward(e2, p2, scorer.weights.text, scorer.model_config.text)) <= 1e-5
    assert graphs.replays == {"graph": 2, "eager": 0}


def test_states_above_the_largest_bucket_run_eagerly(scorer):
    state = scorer.pack(*sample_episode())
    embeds, positions = scorer._embeds(state), state.position_ids
    graphs = DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", buckets=(16,), capture=False)
    got = graphs.run(embeds, positions)
    assert torch.equal(got, decoder_forward(embeds, positions, scorer.weights.text, scorer.model_config.text))
    assert graphs.replays == {"graph": 0, "eager": 1}


def test_rows_from_a_replay_and_from_the_eager_fallback(scorer):
    """run(..., rows): a replay returns those rows of its full output; a state above the largest bucket runs
    eagerly with the last layer at the rows only. Both equal the full forward's rows (float32, <= 1e-5)."""
    state = scorer.pack(*sample_episode())
    embeds, positions = scorer._embeds(state), state.position_ids
    full = decoder_forward(embeds, positions, scorer.weights.text, scorer.model_config.text)
    rows = torch.tensor([3, state.num_tokens - 1, 0, 3])
    for buckets, path in (((4096,), "graph"), ((16,), "eager")):
        graphs = DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", buckets=buckets, capture=False)
        got = graphs.run(embeds, positions, rows)
        assert graphs.replays[path] == 1 and got.shape == (4, full.shape[1])
        assert rel(got, full[rows]) <= 1e-5


def test_scorer_with_the_static_path_scores_the_same(tiny_checkpoint):
    question, memories = sample_episode()
    from pixeltriage.bench.gpu_check import max_diff

    plain = Scorer.load(tiny_checkpoint)
    static = plain.with_cache(None)                                 # the same weights, its own graphs
    static.enable_cuda_graphs(buckets=(256, 1024, 4096), capture=False)
    assert plain.graphs is None
    for mems in (memories, memories[:1], []):
        assert max_diff(plain.score(question, mems), static.score(question, mems)) <= 1e-5
    assert static.graphs.replays["graph"] == 3
    static.disable_cuda_graphs()
    assert static.graphs is None
    assert max_diff(plain.score(question, memories), static.score(question, memories)) <= 1e-5


def test_graphs_need_cuda_and_sane_buckets(tiny_checkpoint, scorer):
    with pytest.raises(ValueError, match="CUDA device"):
        Scorer.load(tiny_checkpoint, cuda_graphs=True)
    with pytest.raises(ValueError, match="CUDA device"):
        DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", capture=True)
    with pytest.raises(ValueError, match="positive"):
        DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", buckets=(0, 64), capture=False)
    with pytest.raises(ValueError, match="positive"):
        DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", buckets=(), capture=False)


def test_profiling_pauses_inside_a_block():
    from pixeltriage.engine import profiling

    with profiling.record() as stages:
        with profiling.stage("a"):
            pass
        with profiling.paused():
            with profiling.stage("b"):
                pass
        with profiling.stage("c"):
            pass
    assert set(stages) == {"a", "c"}


def traced_static_forwards(graphs: DecoderGraphs, states, scorer) -> list[HostSyncs]:
    """Run each state through the static path, recording the bucket's forward (what a capture records)."""
    recorders, forward = [], graphs._forward
    allowed = [graphs.embeds, graphs.positions, graphs.out, *tensors_of(graphs.weights)]

    def recorded(t_b):
        rec = HostSyncs(trace=True, allowed=allowed)
        recorders.append(rec)
        with rec:
            forward(t_b)

    graphs._forward = recorded
    for state in states:
        graphs.run(scorer._embeds(state), state.position_ids)
    return recorders


def test_the_static_path_is_what_a_capture_needs(scorer):
    """What a CUDA graph capture needs, as far as the CPU shows it: two states of different lengths in one bucket
    run the same ops on the same shapes (nothing depends on the data: no shape read back, no branch on values),
    read only the static buffers, the weights and what the forward made itself (a replay reads every input at its
    captured address), make no host sync or upload, and leave the static buffers where they were (no new
    allocation of them across runs). Run after one warm-up of the bucket, as the capture is; what only a GPU
    shows (Triton's autotuning outside the capture, the memory pool, replay timing) is listed in
    docs/performance.md."""
    question, memories = sample_episode()
    long, short = scorer.pack(question, memories), scorer.pack(question, memories[:1])
    assert long.num_tokens != short.num_tokens
    graphs = DecoderGraphs(scorer.weights.text, scorer.model_config.text, "cpu", buckets=(long.num_tokens + 5,),
                           capture=False)
    buffers = [t.data_ptr() for t in (graphs.embeds, graphs.positions, graphs.out)]
    graphs.run(scorer._embeds(short), short.position_ids)                  # the warm-up run
    first, second = traced_static_forwards(graphs, [long, short], scorer)
    for rec in (first, second):
        assert not rec.foreign, "\n".join(rec.foreign[:10])
        assert not [e for e in rec.events if "kernels/gated_delta/chunk.py" not in e.where], rec.events
    assert len(first.trace) == len(second.trace) > 0
    for i, (a, b) in enumerate(zip(first.trace, second.trace)):
        assert a == b, f"op {i} differs between two states of one bucket: {a} vs {b}"
    assert [t.data_ptr() for t in (graphs.embeds, graphs.positions, graphs.out)] == buffers


def test_a_profiler_trace_names_the_registry_kernel(scorer):
    """Under torch.profiler the gated delta call is a range named after the kernel the registry chose."""
    from pixeltriage.kernels import registry

    state = scorer.pack(*sample_episode())
    embeds, positions = scorer._embeds(state), state.position_ids
    name = f"gated_delta: {registry.choose('gated_delta', 'cpu', torch.float32).name}"
    with torch.profiler.profile() as prof:
        decoder_forward(embeds, positions, scorer.weights.text, scorer.model_config.text)
    layers = scorer.model_config.text.layer_types.count("linear_attention")
    assert [e.name for e in prof.events()].count(name) == layers
