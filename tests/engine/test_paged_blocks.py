"""Block manager and scheduler, on fake sequences (no model)."""

from test_paged_helpers import IMAGE, fake_seq

from fovea.engine.core.block_manager import BlockManager, block_hash
from fovea.engine.core.scheduler import Scheduler
from fovea.engine.core.sequence import SeqStatus, image_index_per_position

BS = 4


def test_allocate_free_and_refcounts():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = fake_seq(1, list(range(10, 19)))  # 9 tokens -> 3 blocks
    assert bm.ensure(a, 9) and len(a.block_table) == 3 and bm.num_free == 3
    assert bm.ensure(a, 12) and len(a.block_table) == 3  # still fits the third block
    b = fake_seq(2, list(range(10, 30)))
    assert not bm.ensure(b, 20) and b.block_table == [] and bm.num_free == 3  # all or nothing
    assert all(bm.ref_counts[x] == 1 for x in a.block_table)
    bm.release(a)
    assert bm.num_free == 6 and a.block_table == [] and a.num_computed == 0


def test_prefix_blocks_are_shared_and_counted():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(20, 31))  # 11 tokens: 2 full blocks + 3
    a = fake_seq(1, tokens)
    assert bm.lookup(a) == []
    bm.admit(a, [])
    bm.ensure(a, 11)
    a.num_computed = 11
    bm.register(a)
    b = fake_seq(2, tokens + [99])
    hits = bm.lookup(b)
    assert hits == a.block_table[:2]
    assert bm.admit_cost(hits) == 0  # a still holds them: taking them uses no free block
    bm.admit(b, hits)
    assert b.num_computed == 2 * BS and bm.hit_tokens == 2 * BS
    assert [bm.ref_counts[x] for x in hits] == [2, 2]
    bm.release(a)
    assert [bm.ref_counts[x] for x in hits] == [1, 1]


def test_lookup_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = fake_seq(1, list(range(8)))  # exactly 2 full blocks
    bm.admit(a, [])
    bm.ensure(a, 8)
    a.num_computed = 8
    bm.register(a)
    same = fake_seq(2, list(range(8)))
    assert len(bm.lookup(same)) == 1  # the second block is recomputed for the last logits


def test_freed_blocks_stay_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    seqs = []
    for i in range(2):
        s = fake_seq(i, [i * 100 + t for t in range(2 * BS + 1)])  # 2 full blocks each (+1 token)
        bm.admit(s, [])
        bm.ensure(s, 2 * BS)
        s.num_computed = 2 * BS
        bm.register(s)
        seqs.append(s)
    bm.release(seqs[0])  # freed first: evicted first
    bm.release(seqs[1])
    assert bm.num_free == 4 and len(bm.cached) == 4
    again0 = fake_seq(5, list(seqs[0].token_ids))
    again1 = fake_seq(6, list(seqs[1].token_ids))
    assert len(bm.lookup(again0)) == 2 and len(bm.lookup(again1)) == 2
    fresh = fake_seq(7, list(range(500, 505)))
    assert bm.ensure(fresh, 5)  # takes 2 blocks: seq 0's, its tail block first
    assert bm.evictions == 2
    assert bm.lookup(fake_seq(8, list(seqs[0].token_ids))) == []
    assert len(bm.lookup(fake_seq(9, list(seqs[1].token_ids)))) == 2


def test_unnamed_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = fake_seq(1, list(range(BS + 1)))
    bm.admit(a, [])
    bm.ensure(a, BS + 1)
    a.num_computed = BS + 1
    bm.register(a)  # block 0 named, block 1 (partial) not
    bm.release(a)
    b = fake_seq(2, [77])
    bm.ensure(b, 1)
    assert bm.evictions == 0 and len(bm.cached) == 1


def test_image_blocks_are_named_by_the_image_not_the_token_ids():
    ids = [1, 2] + [IMAGE] * 6 + [3, 5]
    red, blue = fake_seq(1, ids, ["red"], 6), fake_seq(2, ids, ["blue"], 6)
    assert image_index_per_position(ids, IMAGE, [6]) == [-1, -1, 0, 0, 0, 0, 0, 0, -1, -1]
    # Images of different sizes (dynamic resolution): each owns its own count of positions.
    assert image_index_per_position(ids, IMAGE, [2, 4]) == [-1, -1, 0, 0, 1, 1, 1, 1, -1, -1]
    assert red.block_extra(0, BS) == ("red",) and red.block_extra(2, BS) == ()
    h_red = block_hash(None, ids[:BS], red.block_extra(0, BS))
    h_blue = block_hash(None, ids[:BS], blue.block_extra(0, BS))
    assert h_red != h_blue
    bm = BlockManager(num_blocks=8, block_size=BS)
    bm.admit(red, [])
    bm.ensure(red, len(ids))
    red.num_computed = len(ids)
    bm.register(red)
    assert bm.lookup(blue) == []
    assert len(bm.lookup(fake_seq(3, ids, ["red"], 6))) == 2
    two = [IMAGE] * 4 + [IMAGE] * 4  # two images of 4 tokens back to back
    s = fake_seq(4, two, ["a", "b"], 4)
    assert s.block_extra(0, BS) == ("a",) and s.block_extra(1, BS) == ("b",)


def running(sched, seq):
    return seq.status is SeqStatus.RUNNING and seq in sched.running


def test_scheduler_token_budget_chunks_a_long_prompt():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_batched_tokens=10, max_num_seqs=4)
    long = fake_seq(1, list(range(100, 125)))  # 25 tokens
    sched.add(long)
    starts = []
    while True:
        plan = sched.schedule()
        assert plan.num_tokens <= 10
        (chunk,) = plan.chunks
        starts.append((chunk.start, chunk.length, chunk.sample))
        sched.on_computed(plan)
        if chunk.sample:
            break
    assert starts == [(0, 10, False), (10, 10, False), (20, 5, True)]
    assert long.num_computed == 25 and long.prompt_embeds is None


def test_scheduler_decodes_come_first_and_new_requests_join_the_running_batch():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=8)
    a, b = fake_seq(1, [1, 2, 3]), fake_seq(2, [4, 5, 6])
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    assert [(c.seq.seq_id, c.length) for c in plan.chunks] == [(1, 3), (2, 3)]
    sched.on_computed(plan)
    a.token_ids.append(9)
    b.token_ids.append(9)
    late = fake_seq(3, list(range(30, 50)))  # 20 tokens, arrives while a and b decode
    sched.add(late)
    plan = sched.schedule()
    assert plan.num_decodes == 2
    assert [(c.seq.seq_id, c.start, c.length) for c in plan.chunks] == [(1, 3, 1), (2, 3, 1), (3, 0, 6)]
    assert running(sched, late) and plan.num_tokens == 8


def test_scheduler_respects_max_num_seqs():
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_batched_tokens=100, max_num_seqs=2)
    seqs = [fake_seq(i, [i, i + 1]) for i in range(5)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert [c.seq for c in plan.chunks] == seqs[:2] and len(sched.waiting) == 3


def test_preemption_takes_the_most_recent_and_keeps_generated_tokens():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    old, new = fake_seq(1, [1, 2, 3, 4]), fake_seq(2, [5, 6, 7, 8, 9, 10, 11, 12])
    sched.add(old)
    sched.add(new)
    plan = sched.schedule()
    sched.on_computed(plan)
    assert bm.num_free == 1
    old.token_ids.append(50)
    new.token_ids.append(60)
    # old needs a second block (takes the last one), then new needs a third: none left.
    plan = sched.schedule()
    assert plan.preempted == [new] and [c.seq for c in plan.chunks] == [old]
    assert new.status is SeqStatus.WAITING and sched.waiting[0] is new and sched.num_preemptions == 1
    assert new.token_ids[-1] == 60 and new.num_computed == 0 and new.block_table == []
    sched.on_computed(plan)
    sched.remove(old)  # old finishes: new comes back and recomputes prompt + generated token
    plan = sched.schedule()
    (chunk,) = plan.chunks
    assert chunk.seq is new and (chunk.start, chunk.length, chunk.sample) == (0, 9, True)


def test_stuck_prefills_preempt_to_make_progress():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_batched_tokens=8, max_num_seqs=4)
    a, b = fake_seq(1, list(range(12))), fake_seq(2, list(range(50, 62)))
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()  # 8 tokens: a's first 8 (2 blocks)
    sched.on_computed(plan)
    plan = sched.schedule()  # a's last 4 (1 block), b's first 4 (the last block)
    sched.on_computed(plan)
    assert bm.num_free == 0 and a.remaining == 0
    a.token_ids.append(7)  # a decodes into a full last block: needs a block, b is preempted
    plan = sched.schedule()
    assert plan.preempted == [b] and plan.chunks[0].seq is a


def test_a_sequence_larger_than_the_cache_is_rejected():
    bm = BlockManager(num_blocks=2, block_size=BS)
    sched = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=4)
    big = fake_seq(1, list(range(9)))
    sched.add(big)
    plan = sched.schedule()
    assert plan.rejected == [big] and not plan.chunks
