"""pandas builds from a CachedArray what it builds from the ndarray, or refuses loudly."""

import numpy as np
import pytest

import cachedarrays as ca

pd = pytest.importorskip("pandas")

RECORDS = np.array([(1, 2.0, b"x"), (3, 4.0, b"y"), (5, 6.0, b"z")],
                   dtype=[("a", "i4"), ("b", "f8"), ("c", "S1")])


def conversions(m):
    return m.stats()["events"]["asarray"]["count"]


@pytest.mark.parametrize("data", [np.arange(5.0), np.arange(12, dtype=np.int32).reshape(3, 4),
                                  np.arange(6.0).reshape(2, 3).T, np.array([True, False])],
                         ids=["1-d", "2-d", "2-d transposed", "bool"])
def test_dataframe_of_a_plain_array_equals_the_ndarrays(m, data):
    x = ca.asarray(data, manager=m)
    before = conversions(m)
    pd.testing.assert_frame_equal(pd.DataFrame(x), pd.DataFrame(data))
    assert conversions(m) == before + 1          # one counted copy, no pointer kept


def test_dataframe_with_labels_and_dtype_equals_the_ndarrays(m):
    data = np.arange(6.0).reshape(3, 2)
    x = ca.asarray(data, manager=m)
    kw = dict(index=["p", "q", "r"], columns=["u", "v"], dtype="float32")
    pd.testing.assert_frame_equal(pd.DataFrame(x, **kw), pd.DataFrame(data, **kw))


def test_series_of_a_1d_array_equals_the_ndarrays(m):
    data = np.arange(4, dtype=np.int16)
    x = ca.asarray(data, manager=m)
    before = conversions(m)
    pd.testing.assert_series_equal(pd.Series(x), pd.Series(data))
    pd.testing.assert_series_equal(pd.Series(x, name="s", index=list("abcd")),
                                   pd.Series(data, name="s", index=list("abcd")))
    assert conversions(m) == before + 2


def test_series_of_a_2d_array_is_refused_as_for_the_ndarray(m):
    data = np.zeros((2, 3))
    with pytest.raises(ValueError, match="1-dimensional"):
        pd.Series(data)
    with pytest.raises(ValueError, match="1-dimensional"):
        pd.Series(ca.asarray(data, manager=m))


def test_the_data_frame_does_not_follow_later_writes(m):
    x = ca.asarray(np.arange(3.0), manager=m)
    df = pd.DataFrame(x)
    x[0] = 99.0
    ca.evict(x)
    assert df[0].tolist() == [0.0, 1.0, 2.0]


def test_structured_array_through_asarray_gives_numpys_columns(m):
    x = ca.asarray(RECORDS, manager=m)
    expected = pd.DataFrame(RECORDS)
    assert list(expected.columns) == ["a", "b", "c"]
    pd.testing.assert_frame_equal(pd.DataFrame(np.asarray(x)), expected)
    pd.testing.assert_series_equal(pd.Series(x["b"]), pd.Series(RECORDS["b"], name=None))


@pytest.mark.parametrize("build", [pd.DataFrame, pd.Series], ids=["DataFrame", "Series"])
def test_structured_array_given_straight_to_pandas_is_refused_not_flattened(m, build):
    # pandas reads fields only from a real ndarray; anything else would become one column of
    # records (shape (3, 1)), so the conversion refuses and says what to pass instead.
    x = ca.asarray(RECORDS, manager=m)
    with pytest.raises(TypeError, match=r"np\.asarray\(x\)"):
        build(x)
    assert conversions(m) == 0


def test_structured_array_converts_outside_pandas(m):
    x = ca.asarray(RECORDS, manager=m)
    assert np.asarray(x).tolist() == RECORDS.tolist()
    assert np.array(x).dtype == RECORDS.dtype
