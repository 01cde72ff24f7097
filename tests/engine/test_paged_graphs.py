"""CUDA-graph bucketing and padding (pure functions), and the static-buffer replay path run
on CPU with a stand-in for the captured graph."""

import gc
import weakref

import pytest
from scene_helpers import fresh_scene, run_all
from test_paged_helpers import prompt_for, reference_tokens

from fovea.demo import scenes
from fovea.engine import PagedEngine, PagedEngineConfig
from fovea.engine.runner.cuda_graphs import (
    LADDER,
    DecodeBatch,
    GraphedDecode,
    bucket_for,
    capture_sizes,
    pad_decode_batch,
)
from fovea.engine.sampling.params import SamplingParams


def test_capture_sizes_follow_the_ladder_up_to_max_num_seqs():
    assert capture_sizes(256) == list(LADDER)
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(48) == [1, 2, 4, 8, 16, 32, 48]  # the cap itself gets a graph
    assert capture_sizes(1) == [1]
    assert capture_sizes(1000) == list(LADDER)
    assert capture_sizes(1000, max_graph_batch=64) == [1, 2, 4, 8, 16, 32, 64]


def test_a_batch_pads_to_the_next_captured_size():
    sizes = capture_sizes(48)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 17, 33, 48)] == [1, 2, 4, 8, 8, 16, 32, 48, 48]
    assert bucket_for(49, sizes) is None and bucket_for(0, sizes) is None


def test_padding_rows_are_dummy_decodes_in_the_scratch_block():
    batch = DecodeBatch([11, 12, 13], [5, 40, 7], [85, 1640, 23], [[5, 0, 0], [9, 3, 102], [1, 1, 1]], [6, 41, 8])
    padded = pad_decode_batch(batch, 4, pad_slot=999, pad_block=62)
    assert padded.token_ids == [11, 12, 13, 0] and padded.positions == [5, 40, 7, 0]
    assert padded.slots == [85, 1640, 23, 999] and padded.context_lens == [6, 41, 8, 1]
    assert padded.block_tables[:3] == batch.block_tables and padded.block_tables[3] == [62, 62, 62]
    assert pad_decode_batch(batch, 3, 999, 62) == batch
    with pytest.raises(ValueError):
        pad_decode_batch(batch, 2, 999, 62)


class _Replay:
    """Stands in for a captured graph: replays the forward on the static buffers."""

    def __init__(self, forward, inputs, replays, size):
        self.forward, self.inputs, self.replays, self.size = forward, inputs, replays, size
        self.out = forward(*inputs).clone()

    def replay(self):
        self.replays.append(self.size)
        self.out.copy_(self.forward(*self.inputs))


class CPUGraphs(GraphedDecode):
    def capture(self):
        self.replays = []
        for size in self.sizes:
            graph = _Replay(self.forward, self._inputs(size), self.replays, size)
            self.graphs[size] = (graph, graph.out)


def test_decode_through_static_padded_buffers_is_token_identical(demo_model):
    chosen = [prompt_for(demo_model, scenes.render(fresh_scene(s))) for s in range(900, 903)]
    engine = PagedEngine(demo_model, PagedEngineConfig(num_blocks=128))
    runner = engine.runner
    runner.graphs = runner.build_graphs(CPUGraphs)
    runner.graphs.capture()
    assert runner.graphs.sizes == [1, 2, 4, 8, 16]
    results = run_all(engine, [(p, SamplingParams(max_tokens=40, temperature=0)) for p in chosen])
    assert [t for t, _ in results] == [reference_tokens(demo_model, p) for p in chosen]
    assert runner.graphs.replays and 4 in runner.graphs.replays  # three decodes padded to four
    # Padded rows wrote only to the scratch block, which no sequence owns.
    assert engine.block_manager.num_free == 128
    # Dropping the engine frees the KV cache at once: no reference cycle through the graphs.
    cache = weakref.ref(runner.cache.k[0])
    gc.disable()
    try:
        del engine, runner
        assert cache() is None
    finally:
        gc.enable()
