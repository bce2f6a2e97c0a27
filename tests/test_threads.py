"""Thread count, seeds and the GIL."""
import threading

import numpy as np

import attnpp
import attnpp.functional as AF


def test_set_get_num_threads():
    before = attnpp.get_num_threads()
    try:
        attnpp.set_num_threads(1)
        assert attnpp.get_num_threads() == 1
        attnpp.set_num_threads(2)
        assert attnpp.get_num_threads() == 2
    finally:
        attnpp.set_num_threads(before)


def test_same_result_and_dropout_mask_on_any_thread_count(rng):
    """Each output element is computed by one thread in a fixed order, so results are bitwise identical."""
    q, k, v = (rng.standard_normal((2, 3, 150, 16)) for _ in range(3))
    before = attnpp.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3):
            attnpp.set_num_threads(n)
            out, lse = AF.scaled_dot_product_attention_forward(q, k, v, dropout_p=0.2, is_causal=True, seed=5)
            grads = AF.scaled_dot_product_attention_backward(out, q, k, v, out, lse, dropout_p=0.2,
                                                             is_causal=True, seed=5)
            results.append((out, lse) + grads + (AF.dropout_mask((2, 3, 150, 150), 0.2, 5),))
    finally:
        attnpp.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_gil_released_during_compute(rng):
    """While one Python thread is inside the kernel, another Python thread keeps running."""
    q = rng.standard_normal((4, 8, 1024, 64)).astype(np.float32)
    started, done, count = threading.Event(), threading.Event(), [0]

    def work():
        started.set()
        for _ in range(3):
            AF.scaled_dot_product_attention(q, q, q)
        done.set()

    t = threading.Thread(target=work)
    t.start()
    started.wait()
    while not done.is_set():
        count[0] += 1
    t.join()
    # with the GIL held for the whole call this loop could only run between calls (a handful of times)
    assert count[0] > 10000
