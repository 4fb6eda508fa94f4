"""`weights.pages.drop_file_pages`: a file-mapped tensor's pages leave the process's resident memory and read back
the same; memory that is not a file's is never touched; the loads drop what they copied."""
import gc
import shutil
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pixeltriage import Scorer
from pixeltriage.weights import layout, pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps: Linux")


def resident_of(path) -> int:
    """Bytes of this process's mappings of `path` that are resident (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:       # a mapping's header line
                inside = len(fields) == 6 and fields[5] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


@pytest.fixture
def mapped_file(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(300, 1000), "b": torch.randn(257, 333)}, str(path))
    return path


def test_a_file_mapped_tensor_leaves_resident_memory_and_reads_back_the_same(mapped_file):
    handle = safe_open(str(mapped_file), framework="pt", device="cpu")
    a, b = handle.get_tensor("a"), handle.get_tensor("b")
    want_a, want_b = a.clone(), b.clone()                 # reading them made every page resident
    before = resident_of(mapped_file)
    dropped = pages.drop_file_pages([a])
    assert dropped >= a.numel() * 4 - 2 * 4096 and dropped % 4096 == 0
    assert resident_of(mapped_file) <= before - dropped
    assert torch.equal(b, want_b)                          # its neighbour, sharing a page, untouched
    assert torch.equal(a, want_a)                          # read from the file again


def test_memory_that_is_not_a_files_is_left_alone(mapped_file):
    heap = torch.randn(1000, 1000)
    want = heap.clone()
    handle = safe_open(str(mapped_file), framework="pt", device="cpu")
    column = handle.get_tensor("a")[:, 5]                   # a strided view: its bytes interleave with the others'
    assert pages.drop_file_pages([heap, column, torch.empty(0)]) == 0
    assert torch.equal(heap, want)
    assert pages.drop_file_pages([]) == 0


def test_a_directory_load_drops_the_pages_it_copied(tiny_checkpoint, tmp_path, monkeypatch):
    """A bf16 load fuses and casts the checkpoint's tensors into copies: without the drop every page read stays
    resident; with it, the file's resident pages are those the weights still view."""
    checkpoint = shutil.copytree(tiny_checkpoint, tmp_path / "checkpoint")   # files no other test's Scorer maps
    files = sorted(checkpoint.glob("*.safetensors"))

    def resident_after_load() -> int:
        assert sum(resident_of(f) for f in files) == 0          # no earlier load's mapping left to count
        scorer = Scorer.load(checkpoint, dtype=torch.bfloat16, reorder_weights=False)
        resident = sum(resident_of(f) for f in files)
        del scorer
        gc.collect()
        return resident

    dropping = resident_after_load()
    monkeypatch.setattr(layout, "drop_file_pages", lambda tensors: 0)
    keeping = resident_after_load()
    assert keeping > 0 and dropping < keeping
