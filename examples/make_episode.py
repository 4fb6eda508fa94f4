"""Writes examples/episode.json and its images (a few kilobytes each) from the project's synthetic sample pictures.

The committed files were made by `python examples/make_episode.py`; run it again to rebuild them.
"""
import json
from pathlib import Path

from pixeltriage.episode import SAMPLE_ITEMS, sample_image

HERE = Path(__file__).resolve().parent
CHOSEN = [0, 2, 3, 8]          # orchid, receipt, mug, chart
DATES = ["2026-03-02", "2026-03-05", "2026-03-09", "2026-04-01"]


def main() -> None:
    (HERE / "images").mkdir(exist_ok=True)
    memories = []
    for item, date in zip(CHOSEN, DATES):
        name, note, dialogue, color = SAMPLE_ITEMS[item]
        image = sample_image(item, color)
        image.thumbnail((480, 480))
        path = HERE / "images" / f"{name}.jpg"
        image.save(path, quality=80, optimize=True)
        memories.append({"image": f"images/{name}.jpg", "note": note, "dialogue": dialogue, "date": date})
    episode = {"question": "What colour was the stem of the orchid I bought at the market?", "memories": memories}
    (HERE / "episode.json").write_text(json.dumps(episode, indent=2) + "\n")


if __name__ == "__main__":
    main()
