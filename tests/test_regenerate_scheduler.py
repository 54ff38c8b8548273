"""Length buckets and token-budget batches of prompts."""

from dflash_ipc.regenerate.scheduler import BatchScheduler, bucket_edges


def test_bucket_edges_grow_by_a_fixed_ratio():
    edges = bucket_edges(4096)
    assert edges[:6] == [16, 19, 23, 27, 32, 38] and edges[-1] >= 4096
    assert max(b / a for a, b in zip(edges[4:], edges[5:])) < 1.25


def test_batches_fill_the_budget_and_pad_little():
    s = BatchScheduler(token_budget=1000, max_batch_size=64)
    lengths = [30, 100, 31, 29, 102, 32, 28, 98]
    for i, n in enumerate(lengths):
        s.add(i, n, 20)
    # bucket of 100: 3 prompts, (102 + 20) x 3 = 366 <= 1000: not full; nothing comes out yet
    assert s.next_batch(flush=False) is None
    for i in range(8, 23):
        s.add(i, 30, 20)  # the (27, 32] bucket: 20 prompts; 19 x (32 + 20) = 988 fit, 20 would not
    batch = s.next_batch(flush=False)
    assert batch == [0, 2, 3, 5, 6] + list(range(8, 22))  # oldest first, none of the ~100 bucket
    assert s.next_batch(flush=False) is None  # neither bucket fills a batch
    assert s.next_batch(flush=True) == [1, 4, 7]  # flushed: the bucket of the oldest prompt first
    assert s.next_batch(flush=True) == [22]
    assert s.next_batch(flush=True) is None and len(s) == 0


def test_max_batch_size_and_an_oversized_prompt():
    s = BatchScheduler(token_budget=10**6, max_batch_size=4)
    for i in range(10):
        s.add(i, 50, 10)
    assert s.next_batch(flush=False) == [0, 1, 2, 3]
    s = BatchScheduler(token_budget=100, max_batch_size=4)
    s.add("big", 500, 10)
    s.add("small", 500, 10)
    assert s.next_batch(flush=False) == ["big"]  # alone, over budget, still served


def test_one_queue_for_every_length_when_not_bucketed():
    """The engine's queue: lengths mixed, oldest first, full at max_batch_size."""
    s = BatchScheduler(token_budget=1 << 62, max_batch_size=3, bucketed=False)
    for key, length in enumerate([10, 900, 40, 3000, 17]):
        s.add(key, length, 64)
    assert s.next_batch(flush=False) == [0, 1, 2]
    assert s.next_batch(flush=False) is None and s.next_batch(flush=True) == [3, 4] and len(s) == 0
