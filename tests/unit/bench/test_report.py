"""kvtier.report.median_rows: rounds of the same rows folded into one row each."""
from kvtier.report import Row, median_rows


def test_each_value_and_baseline_is_the_median_of_its_rounds_in_the_first_order():
    rounds = [[Row("get", "GB/s", 1.0, "raw", 2.0), Row("get p99", "us", 30.0, "memcpy", 9.0)],
              [Row("get", "GB/s", 3.0, "raw", 1.0), Row("get p99", "us", 10.0, "memcpy", 7.0)],
              [Row("get p99", "us", 20.0, "memcpy", 8.0), Row("get", "GB/s", 2.0, "raw", 4.0)]]
    assert median_rows(rounds) == [Row("get", "GB/s", 2.0, "raw", 2.0),
                                   Row("get p99", "us", 20.0, "memcpy", 8.0)]


def test_a_row_missing_from_a_round_and_rows_without_a_baseline_are_kept():
    rounds = [[Row("put", "GB/s", 1.0, "mooncake", 1.0), Row("hash", "ops/s", 5.0)],
              [Row("hash", "ops/s", 7.0)]]
    assert median_rows(rounds) == [Row("put", "GB/s", 1.0, "mooncake", 1.0),
                                   Row("hash", "ops/s", 6.0, None, None)]
