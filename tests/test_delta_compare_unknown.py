"""bench.delta_compare's count of lookups without a row of their own under modulo."""
import numpy as np

from bench.delta_compare import shared_row_lookups


def test_modulo_lookups_sharing_a_row_for_collision():
    # rows 10: 3 and 13 share row 3 (3 lookups of them), 5 is alone, 25 and 5 share row 5
    ids = np.array([3, 13, 3, 7, 5, 25, 9], dtype=np.int64)
    assert shared_row_lookups(ids, 10) == 5          # 3, 13, 3, 5, 25
    assert shared_row_lookups(np.array([1, 2, 3, 1], dtype=np.int64), 10) == 0
    assert shared_row_lookups(np.array([2**63 - 1, 7], dtype=np.int64), 2**62) == 0
    assert shared_row_lookups(np.zeros(0, dtype=np.int64), 10) == 0
