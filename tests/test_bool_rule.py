"""The one boolean rule (``thdpack.common.align.check_bool``) at every public boolean argument, integer ids and
ignore labels, and the bool check of lists of ids (issue 43)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thdpack import ThdCollator, build_thd_batch
from thdpack.common.samples import SampleError

HOLDS_BOOLS = r"^sample {}: field '{}' holds bools; token ids and labels are integers"


# --- a bool among the ids of a list, a tuple or an object array ------------------------------------------------

@pytest.mark.parametrize("container", [tuple, lambda v: np.array(v, dtype=object), list])
@pytest.mark.parametrize("flag", [True, False, np.True_, np.False_])
@pytest.mark.parametrize("field", ["input_ids", "labels"])
def test_a_bool_in_any_sequence_of_ids_is_refused(container, flag, field):
    """numpy reads a bool among Python ints as 0 or 1 (a tuple, an object array, a numpy bool in a list)."""
    values = [4, flag, 6]
    sample = {"input_ids": [4, 5, 6], field: container(values)}
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(0, field)):
        build_thd_batch([sample])


def test_ids_0_and_1_in_a_tuple_still_read():
    assert build_thd_batch([{"input_ids": (0, 1, 2), "labels": (-100, 1, 0)}]).input_ids.tolist() == [0, 1, 2]


# --- the bool check of a batch's lists runs once per batch: the same errors as a check per list -----------------

@pytest.mark.filterwarnings("ignore:thdpack. a batch of")  # one-token samples have no target
@pytest.mark.parametrize("layout", [{}, {"cp_size": 2, "cp_rank": 1}, {"pad_multiple": 8}, {"max_length": 3}])
@given(n=st.integers(1, 5), data=st.data())
@settings(max_examples=30, deadline=None)
def test_a_bool_in_any_sample_of_a_batch_is_named(layout, n, data):
    """Sample ``k``'s field holds a bool (in a slot past ``max_length`` too): that sample and field are named,
    by the builder and by the collator; without the bool the batch builds."""
    rows = [data.draw(st.lists(st.sampled_from([0, 1, 2, 7, 128_000]), min_size=1, max_size=12)) for _ in range(n)]
    samples = [{"input_ids": r, "labels": [-100] + r[1:]} for r in rows]
    build_thd_batch(samples, **layout)
    k = data.draw(st.integers(0, n - 1))
    field = data.draw(st.sampled_from(["input_ids", "labels"]))
    slot = data.draw(st.integers(0, len(rows[k]) - 1))
    samples[k] = {**samples[k], field: list(samples[k][field])}
    samples[k][field][slot] = data.draw(st.booleans())
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(k, field)):
        build_thd_batch(samples, **layout)
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(k, field)):
        ThdCollator(**layout)(samples)


@pytest.mark.parametrize("later", [{"input_ids": [3, 1.5]}, {"input_ids": [3, -4]}, {"input_ids": [3, 4], "labels": [3]},
                                   {"input_ids": [3, 4], "labels": [-7, 1]}, {"input_ids": []}, {"labels": [1]}])
def test_a_bool_is_named_before_a_fault_of_a_later_sample(later):
    """As when each list was checked as it was read: the first sample's bool is the error."""
    with pytest.raises(SampleError, match=HOLDS_BOOLS.format(0, "input_ids")):
        build_thd_batch([{"input_ids": [5, True, 6]}, later])
