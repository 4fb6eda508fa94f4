"""No host synchronisation and no host data upload inside the decoder forward (tests/sync_guard.py records them).

The region is `decoder_forward` as the scorer calls it (one state, and several packed: varlen with the head's
rows), and the forward a CUDA graph captures (`DecoderGraphs._forward`). What the forward needs from the host
(varlen boundaries, each token's state, the head's rows, the positions) is prepared before it (`Varlen.prepare`,
`Scorer.score_states`); inside, the layers only launch kernels.

Here the CPU forward; the CUDA branch (fla, the Triton head) is recorded the same way in
tests/engine/test_cuda_branch.py, inside its interpreter run, and the static path's ops and shapes in
tests/engine/test_graphs.py.
"""
from __future__ import annotations

import pytest
import torch

from pixeltriage import Scorer
from pixeltriage.engine import scorer as scorer_module
from pixeltriage.engine.model import Varlen, decoder_forward
from pixeltriage.episode import sample_episode
from sync_guard import HostSyncs

# Host work of the CPU kernels, never on the CUDA branch: the chunked rule's plan ([N] chunk starts, lengths and
# restarts: CPU tensors the C kernel reads through pointers), made once per packed layout and cached.
CPU_KERNEL_HOST_WORK = ("pixeltriage/kernels/gated_delta/chunk.py",)


@pytest.fixture(scope="module")
def scorer(tiny_checkpoint):
    return Scorer.load(tiny_checkpoint)


def episodes():
    question, memories = sample_episode()
    return [(question, memories), ("Which one was taken first?", memories[:1]), ("Anything blue?", [])]


def recorded_forwards(monkeypatch, score, **recorder):
    """Run `score()` with every decoder forward the scorer makes inside its own HostSyncs; -> the recorders."""
    recorders = []

    def forward(*args, **kwargs):
        rec = HostSyncs(**recorder)
        recorders.append(rec)
        with rec:
            return decoder_forward(*args, **kwargs)

    monkeypatch.setattr(scorer_module, "decoder_forward", forward)
    score()
    return recorders


def engine_events(recorders, allowed_files=()):
    return [str(e) for rec in recorders for e in rec.events if not any(f in e.where for f in allowed_files)]


def test_the_recorder_sees_each_kind_of_sync():
    """The recorder itself: each kind of call it must catch, caught (a recorder that sees nothing passes all)."""
    x = torch.arange(6.0)
    mask = x > 2
    calls = {
        "item": lambda: x[0].item(), "bool": lambda: bool(x[1] > 0), "tolist": lambda: x.tolist(),
        "cpu": lambda: x.cpu(), "nonzero": lambda: x.nonzero(), "where": lambda: torch.where(mask),
        "mask index": lambda: x[mask], "mask assign": lambda: x.clone().__setitem__(mask, 0.0),
        "masked_select": lambda: x.masked_select(mask), "unique": lambda: torch.unique(x),
        "repeat_interleave": lambda: x.repeat_interleave(torch.ones(6, dtype=torch.long)),
        "tensor(list)": lambda: torch.tensor([1, 2], device=x.device), "list index": lambda: x[[0, 1]],
        "equal": lambda: torch.equal(x, x),
    }
    for name, call in calls.items():
        with HostSyncs() as rec:
            call()
        assert rec.events, f"{name}: not recorded"
    with HostSyncs() as rec:      # what the forward does instead: nothing recorded
        x.repeat_interleave(torch.ones(6, dtype=torch.long), output_size=6)
        torch.where(mask, x, 0.0)
        torch.arange(4, device=x.device)
        x.index_select(0, torch.zeros(2, dtype=torch.long))
        x.to(torch.float64) * 2
    assert not rec.events, rec.events
    with pytest.raises(AssertionError, match="tolist"):
        with HostSyncs() as rec:
            x.tolist()
        rec.check()
    outside = torch.ones(6)
    with HostSyncs(trace=True, allowed=[x]) as rec:       # reads of tensors made neither inside nor allowed
        y = x * 2
        y.add_(x[1:].sum()).mul_(outside)
    assert len(rec.foreign) == 1 and "(6,)" in rec.foreign[0] and not rec.events
    assert [op for op, *_ in rec.trace] == ["aten.mul.Tensor", "aten.slice.Tensor", "aten.sum.default",
                                            "aten.add_.Tensor", "aten.mul_.Tensor"]


def test_varlen_is_prepared_before_the_forward():
    varlen = Varlen.prepare([0, 3, 3, 7], "cpu")
    assert varlen.bounds == [0, 3, 3, 7] and varlen.device_bounds is None
    assert varlen.segments.tolist() == [0, 0, 0, 2, 2, 2, 2]
    for bad in ([], [0], [1, 4], [0, 5, 3]):
        with pytest.raises(ValueError, match="rise from 0"):
            Varlen.prepare(bad, "cpu")


def test_cpu_forward_has_no_host_syncs(scorer, monkeypatch):
    """The CPU forward, one question and three packed (varlen, the head's rows only): no event outside the CPU
    kernels' own host work (CPU_KERNEL_HOST_WORK)."""
    for score in (lambda: scorer.score(*episodes()[0]), lambda: scorer.score_batch(episodes())):
        recorders = recorded_forwards(monkeypatch, score)
        assert len(recorders) == 1
        assert not engine_events(recorders, CPU_KERNEL_HOST_WORK), "\n".join(engine_events(recorders))


def test_a_list_of_boundaries_is_an_upload_inside_the_forward(scorer, monkeypatch):
    """The recorder sees the upload the scorer avoids by preparing its Varlen: boundaries given as a list are
    turned into tensors inside decoder_forward."""
    state_a, state_b = (scorer.pack(q, m) for q, m in episodes()[:2])
    embeds = torch.cat([scorer._embeds(state_a), scorer._embeds(state_b)])
    positions = torch.cat([state_a.position_ids, state_b.position_ids], dim=1)
    bounds = [0, state_a.num_tokens, state_a.num_tokens + state_b.num_tokens]
    rows = torch.tensor([0, bounds[1], bounds[2] - 1])
    args = (embeds, positions, scorer.weights.text, scorer.model_config.text)
    with HostSyncs() as listed:
        want = decoder_forward(*args, cu_seqlens=bounds, rows=rows)
    assert any("model.py" in e.where for e in listed.events)
    varlen = Varlen.prepare(bounds, "cpu")
    with HostSyncs() as prepared:
        got = decoder_forward(*args, cu_seqlens=varlen, rows=rows)
    assert not engine_events([prepared], CPU_KERNEL_HOST_WORK)
    assert torch.equal(got, want)


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(x, y, n, BLOCK: tl.constexpr):
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + o, tl.load(x + o, mask=o < n), mask=o < n)
    return copy


def _autotuned_copy_kernel(prune):
    import triton

    return triton.autotune([triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["n"],
                           prune_configs_by={"early_config_prune": prune})(_copy_kernel())


def test_a_sync_in_a_launch_is_caught_the_interpreters_own_copies_are_not():
    """A kernel launch in Triton's interpreter: its argument copies to the host and back are not recorded (a GPU
    launch makes none), but a grid callable or an autotuner's pruning that reads a tensor on the host is (on a GPU
    they run on the host too: a sync per launch, and a capture-breaking one)."""
    from triton.runtime.interpreter import GridExecutor
    from triton_interpreter import fla_interpreter_mode, interpreting

    import sync_guard

    if not interpreting():
        pytest.skip("Triton is not interpreting here (a GPU machine)")
    assert all(callable(getattr(GridExecutor, name, None)) for name in sync_guard.INTERPRETER_COPIES)
    x, n = torch.arange(40, dtype=torch.float32), torch.tensor(40)
    kernel = _copy_kernel()
    with fla_interpreter_mode():
        y = torch.zeros(40)
        with HostSyncs() as quiet:
            kernel[(3,)](x, y, 40, BLOCK=16)
        assert torch.equal(y, x) and quiet.events == []

        with HostSyncs() as in_grid:
            kernel[lambda meta: (int(n.item()) // meta["BLOCK"] + 1,)](x, torch.zeros(40), 40, BLOCK=16)
        assert any(".item()" in e.what or "_local_scalar_dense" in e.what for e in in_grid.events), in_grid.events
        assert all("test_host_syncs.py" in e.where for e in in_grid.events)

        def prune(configs, named_args, **kwargs):
            return configs[:1] if bool(named_args["x"][0] >= 0) else configs
        tuned = _autotuned_copy_kernel(prune)
        with HostSyncs() as in_prune:
            tuned[lambda meta: (triton_cdiv(40, meta["BLOCK"]),)](x, torch.zeros(40), 40)
        assert any("is_nonzero" in e.what or "scalar read" in e.what for e in in_prune.events), in_prune.events


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
