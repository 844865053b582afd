"""serve.schema: a model's request schema and table layout, validated, serialized, compared
(the rollout's check) and read from a version's build report. Pure Python, no torch."""
from __future__ import annotations

from typing import Any

import pytest

from serve.errors import ConfigError
from serve.profiles import NUM_DENSE, get_profile, schema_from_report
from serve.schema import FeatureSpec, ModelSchema, TableSpec, criteo_schema

ITEM = TableSpec("t_item", rows=1000, dim=16)
USER = TableSpec("t_user", rows=50, dim=8, pooling="mean", dtype="fp16")


def schema(dense: int = 2, *features: FeatureSpec,
           tables: tuple[TableSpec, ...] = (ITEM, USER)) -> ModelSchema:
    """Two dense, ``item_id`` (one-hot) and ``history`` (20 ids) reading t_item, ``user_id``
    reading t_user; or the ``features`` given."""
    return ModelSchema(dense, tables, features or (
        FeatureSpec("item_id", "t_item", 1), FeatureSpec("history", "t_item", 20),
        FeatureSpec("user_id", "t_user", 1)))


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("build, match", [
    (lambda: schema(2, FeatureSpec("a", "t_item"), FeatureSpec("a", "t_user")),
     r"^feature names must be unique; repeated: \['a'\]$"),
    (lambda: schema(2, FeatureSpec("a", "t_item"), tables=(ITEM, ITEM)),
     r"^table names must be unique; repeated: \['t_item'\]$"),
    (lambda: schema(2, FeatureSpec("a", "t_item"), FeatureSpec("b", "t_nope")),
     (r"^feature b reads table 't_nope', which is not one of the tables "
      r"\['t_item', 't_user'\]$")),
    (lambda: schema(2, FeatureSpec("a", "t_item")),
     r"^tables \['t_user'\] are read by no feature; every table needs one$"),
    (lambda: ModelSchema(2, (), ()), (r"^a model needs at least one embedding table and one "
                                      r"sparse feature; got 0 tables and 0 features$")),
    (lambda: schema(-1), r"^dense=-1 must be an integer >= 0$"),
    (lambda: schema(True), r"^dense=True must be an integer >= 0$"),
    (lambda: TableSpec("t", 10, 4, pooling="max"),
     r"^table t: pooling 'max' is not one of \('sum', 'mean'\)$"),
    (lambda: TableSpec("t", 10, 4, dtype="int2"),
     r"^table t: dtype 'int2' is not one of \('int8', 'int4', 'fp16', 'fp32'\)$"),
    (lambda: TableSpec("t", 10, 7, dtype="int4"),
     r"^table t: int4 needs an even dim, got 7; store it as int8$"),
    (lambda: TableSpec("t", 0, 4), r"^table t: rows=0 must be an integer >= 1$"),
    (lambda: TableSpec("t", 10, 2.5), r"^table t: dim=2.5 must be an integer >= 1$"),
    (lambda: TableSpec("1t", 10, 4), r"^table name='1t' is not a valid name; names are"),
    (lambda: FeatureSpec("a b", "t"), r"^feature name='a b' is not a valid name"),
    (lambda: FeatureSpec("a", "t", 0), r"^feature a: max_ids=0 must be an integer >= 1$"),
])
def test_invalid_schemas_name_the_value_and_the_rule(build: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()


def test_int4_with_an_even_dim_and_shared_tables_are_fine() -> None:
    s = schema(0, FeatureSpec("a", "t_item"), FeatureSpec("b", "t_item"),
               tables=(TableSpec("t_item", 10, 6, dtype="int4"),))
    assert s.feature_tables == (0, 0) and s.pooled_dim == 12 and s.total_rows == 10


# ------------------------------------------------------------------ views, round trip


def test_to_dict_from_dict_round_trip() -> None:
    s = schema()
    d = s.to_dict()
    assert d == {"dense": 2,
                 "tables": [{"name": "t_item", "rows": 1000, "dim": 16, "pooling": "sum",
                             "dtype": "int8"},
                            {"name": "t_user", "rows": 50, "dim": 8, "pooling": "mean",
                             "dtype": "fp16"}],
                 "features": [{"name": "item_id", "table": "t_item", "max_ids": 1},
                              {"name": "history", "table": "t_item", "max_ids": 20},
                              {"name": "user_id", "table": "t_user", "max_ids": 1}]}
    assert ModelSchema.from_dict(d) == s
    lists = ModelSchema(2, [ITEM, USER], list(s.features))  # type: ignore[arg-type]
    assert lists == s and isinstance(lists.tables, tuple)


@pytest.mark.parametrize("d, match", [
    ([1], r"^a model schema is a mapping, got list$"),
    ({"dense": 1, "tables": []}, (r"^model schema is malformed \(KeyError: 'features'\); it "
                                  r"needs dense, tables")),
    ({"dense": 1, "tables": [{"name": "t", "rows": 1}], "features": []},
     r"^model schema is malformed \(TypeError: "),
    ({"dense": 1, "tables": [{"name": "t", "rows": 1, "dim": 2}],
      "features": [{"name": "f", "table": "u"}]}, r"^feature f reads table 'u'"),
])
def test_malformed_dicts_are_config_errors(d: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        ModelSchema.from_dict(d)


def test_describe_is_the_request_view() -> None:
    assert schema().describe() == {"dense": 2, "sparse": [
        {"name": "item_id", "table": "t_item", "rows": 1000, "dim": 16, "pooling": "sum",
         "max_ids": 1},
        {"name": "history", "table": "t_item", "rows": 1000, "dim": 16, "pooling": "sum",
         "max_ids": 20},
        {"name": "user_id", "table": "t_user", "rows": 50, "dim": 8, "pooling": "mean",
         "max_ids": 1}]}


def test_lookups() -> None:
    s = schema()
    assert s.feature_names == ("item_id", "history", "user_id")
    assert s.table_names == ("t_item", "t_user")
    assert s.feature_tables == (0, 0, 1) and s.max_ids == (1, 20, 1)
    assert s.pooled_dim == 16 + 16 + 8 and s.total_rows == 1050
    assert s.table_index("t_user") == 1
    with pytest.raises(ConfigError, match=r"^table 'x' is not one of \['t_item', 't_user'\]$"):
        s.table_index("x")


# ------------------------------------------------------------------ request differences


def test_request_differences() -> None:
    s = schema()
    resized = ModelSchema(2, (TableSpec("t_item", 9, 32, "mean", "fp32"),
                              TableSpec("t_user", 7, 4, "sum", "int4")), s.features)
    assert s.request_differences(resized) == []  # table layout may differ freely
    assert s.request_differences(s) == []
    assert s.request_differences(ModelSchema(5, s.tables, s.features)) == [
        "dense features: 2 vs 5"]
    fewer = schema(2, FeatureSpec("item_id", "t_item"), FeatureSpec("user_id", "t_user"))
    assert s.request_differences(fewer) == ["sparse features only in the first: ['history']"]
    assert fewer.request_differences(s) == ["sparse features only in the second: ['history']"]
    swapped = schema(2, FeatureSpec("item_id", "t_item"), FeatureSpec("user_id", "t_user"),
                     FeatureSpec("history", "t_item", 20))
    assert s.request_differences(swapped) == [
        ("sparse feature order: ['item_id', 'history', 'user_id'] vs "
         "['item_id', 'user_id', 'history']")]
    longer = schema(2, FeatureSpec("item_id", "t_item"), FeatureSpec("history", "t_item", 50),
                    FeatureSpec("user_id", "t_user"))
    assert s.request_differences(longer) == ["max_ids of history: 20 vs 50"]
    other = ModelSchema(3, s.tables, (FeatureSpec("item_id", "t_item", 2),
                                      FeatureSpec("user_id", "t_user"),
                                      FeatureSpec("extra", "t_item")))
    assert s.request_differences(other) == [
        "dense features: 2 vs 3", "sparse features only in the first: ['history']",
        "sparse features only in the second: ['extra']", "max_ids of item_id: 1 vs 2"]


# ------------------------------------------------------------------ build reports


def test_schema_from_a_report_that_records_it() -> None:
    s = schema()
    assert schema_from_report({"version": "v", "schema": s.to_dict(),
                               "profile": "tiny", "quantized_dtype": "int8"}) == s


def test_schema_from_an_older_report_is_its_profiles_dlrm() -> None:
    got = schema_from_report({"version": "v", "profile": "tiny", "quantized_dtype": "int4"})
    tiny = get_profile("tiny")
    assert got == tiny.schema("int4")
    assert got == criteo_schema(tiny.feature_names, tiny.cardinalities, tiny.embedding_dim,
                                "int4", NUM_DENSE, got.max_ids[0])
    assert got.dense == 13 and len(got.features) == len(got.tables) == 26
    assert got.tables[0] == TableSpec("t_C1", 500, 16, "sum", "int4")
    assert got.features[0].table == "t_C1"


@pytest.mark.parametrize("report, match", [
    ({"version": "v1"}, (r"^build report of version 'v1' has no schema and no 'profile' to "
                         r"derive it from; rebuild or re-import it$")),
    ({"version": "v1", "profile": "tiny"}, r"no 'quantized_dtype' to derive it from"),
    ({"profile": "nope", "quantized_dtype": "int8"}, r"^profile 'nope' does not exist"),
    ({"schema": {"dense": 1}}, r"^model schema is malformed"),
])
def test_a_report_without_a_schema_is_a_config_error(report: dict[str, Any],
                                                     match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        schema_from_report(report)
