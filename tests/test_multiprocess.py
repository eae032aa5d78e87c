"""Multi-controller JAX: 2 processes x 4 CPU devices (gloo) against 1 process x 8 devices."""

import numpy as np
import pytest

import mp_programs
import multiprocess


@pytest.fixture(scope="module")
def helpers_2x4():
    return multiprocess.run("mp_programs:helpers", n=2, devices=4, timeout=180)


def test_helpers_match_one_process(helpers_2x4):
    one = mp_programs.helpers()
    assert one["count"] == 1 and [r["count"] for r in helpers_2x4] == [2, 2]
    for name, held in [("fsdp", [(0, 8), (8, 16)]), ("fsdp2", [(0, 8), (8, 16)]),
                       ("tensor", [(0, 16), (0, 16)])]:
        assert one[name]["rows"] == (0, 16)
        for i, r in enumerate(helpers_2x4):
            assert r[name]["rows"] == held[i], name
            np.testing.assert_array_equal(r[name]["whole"], one[name]["whole"], err_msg=name)
            lo, hi = held[i]
            np.testing.assert_array_equal(r[name]["local"], one[name]["whole"][lo:hi])
            assert r[name]["sum"] == one[name]["sum"]
            assert r[name]["inferred_shape"] == (16, 3)
        np.testing.assert_array_equal(one[name]["local"], one[name]["whole"])


def test_agree(helpers_2x4):
    one = mp_programs.helpers()
    assert (one["max"], one["min"], one["sum"], one["any"], one["all"]) == (3, 3, 3, False, False)
    assert one["equal_error"] is None
    for r in helpers_2x4:
        assert (r["max"], r["min"], r["sum"], r["any"], r["all"]) == (7, 3, 10, True, False)
        np.testing.assert_array_equal(r["vec"], [7, -3])
        assert r["equal"] == 7
        assert "disagree" in r["equal_error"] and "[3, 7]" in r["equal_error"]


def test_worker_failure_is_reported(tmp_path):
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        multiprocess.run("mp_programs:fails_on_one", n=2, devices=1, timeout=60)
