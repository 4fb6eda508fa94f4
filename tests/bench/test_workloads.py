"""The benchmarks' one source of questions: seeded, varied where asked, the same draws whatever the encoding."""
import io
from dataclasses import replace

from PIL import Image

from pixeltriage.bench import workloads
from pixeltriage.bench.transformers_baseline import state_packer


def _shape(episodes):
    return [(q, [(m.note, m.dialogue, m.date) for m in ms]) for q, ms in episodes]


def _sizes(episodes):
    return [(q, [m.image.size for m in ms]) for q, ms in episodes]


def test_episodes_are_seeded_and_varied():
    a, b = workloads.episodes(12, 20, seed=3, up_to=True), workloads.episodes(12, 20, seed=3, up_to=True)
    assert _sizes(a) == _sizes(b) and _shape(a) == _shape(b)
    counts = [len(m) for _, m in a]
    assert min(counts) >= 0 and max(counts) <= 20 and len(set(counts)) > 3
    assert _shape(workloads.episodes(12, 20, seed=4, up_to=True)) != _shape(a)
    fixed = workloads.episodes(5, 3, seed=3)
    assert [len(m) for _, m in fixed] == [3] * 5
    assert {x.image.size for _, m in fixed for x in m} <= set(workloads.PHOTO_SIZES)


def test_jpeg_episodes_are_the_same_draws_encoded():
    """A request body's episodes (JPEG bytes) hold the photos, text and dates of the in-memory ones."""
    plain, encoded = workloads.episodes(4, 3, seed=7), workloads.episodes(4, 3, seed=7, jpeg=True)
    assert _shape(plain) == _shape(encoded)
    for (_, ms), (_, js) in zip(plain, encoded):
        for m, j in zip(ms, js):
            decoded = Image.open(io.BytesIO(j.image))
            assert decoded.format == "JPEG" and decoded.size == m.image.size


def test_packed_episode_fills_the_target_and_no_more(tiny_checkpoint):
    """The most dialogue words per memory whose state stays within the target: one word more each passes it."""
    packer = state_packer(tiny_checkpoint)
    episode = workloads.packed_episode(packer, num_memories=2, target_tokens=600)
    assert episode.state.num_memories == 2 and len(episode.memories) == 2 and len(episode.images) == 2
    assert episode.state.num_tokens <= 600
    words = len(episode.memories[0].dialogue.split())
    longer = [replace(m, dialogue=f"{m.dialogue} {workloads.WORDS[(i + words) % len(workloads.WORDS)]}")
              for i, m in enumerate(episode.memories)]
    assert packer.pack(episode.question, longer, images=episode.images).num_tokens > 600


def test_retrieval_workload_is_seeded():
    assert workloads.camera_jpegs(2, (64, 48), seed=1) == workloads.camera_jpegs(2, (64, 48), seed=1)
    assert Image.open(io.BytesIO(workloads.camera_jpegs(1, (64, 48))[0])).size == (64, 48)
    questions = workloads.retrieval_questions(10)
    assert len(questions) == 10 and questions[:2] == questions[8:]
