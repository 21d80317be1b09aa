"""Learning a model's request shape from ModelMetadata, ModelConfig parameters and flags."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from sixfold.loadgen import LoadgenError, ShapeOverrides, shape_from

T = service_pb2.ModelMetadataResponse.TensorMetadata


def metadata(dense: int = 13, tables: int = 4) -> service_pb2.ModelMetadataResponse:
    return service_pb2.ModelMetadataResponse(name="m", inputs=[
        T(name="dense_features", datatype="FP32", shape=[-1, dense]),
        T(name="sparse_lengths", datatype="INT32", shape=[-1, tables]),
        T(name="sparse_indices", datatype="INT64", shape=[-1])])


def config(**params: str) -> model_config_pb2.ModelConfig:
    c = model_config_pb2.ModelConfig(name="m")
    for key, value in params.items():
        c.parameters[f"sixfold.{key}"].string_value = value
    return c


def test_sixfold_parameters():
    shape = shape_from(metadata(), config(table_rows="10,20,30,40", pooling="1,2,3,4", zipf="1.2"))
    assert (shape.dense_dim, shape.table_rows, shape.pooling, shape.zipf) == (13, (10, 20, 30, 40), (1, 2, 3, 4), 1.2)
    assert shape.sources == {"dense_dim": "metadata", "table_rows": "server", "pooling": "server", "zipf": "server"}


def test_flags_override_and_broadcast():
    shape = shape_from(metadata(), config(table_rows="10,20,30,40"),
                       ShapeOverrides(table_rows=(500,), pooling=(7,), dense_dim=5, zipf=1.0))
    assert (shape.dense_dim, shape.table_rows, shape.pooling, shape.zipf) == (5, (500,) * 4, (7,) * 4, 1.0)


def test_non_sixfold_server_needs_table_rows():
    with pytest.raises(LoadgenError, match="--table-rows"):
        shape_from(metadata(), None)
    shape = shape_from(metadata(), None, ShapeOverrides(table_rows=(1000,)))
    assert shape.pooling == (1,) * 4 and shape.sources["pooling"] == "default"


def test_wrong_table_count():
    with pytest.raises(LoadgenError, match="3 values but the model has 4 tables"):
        shape_from(metadata(), None, ShapeOverrides(table_rows=(1, 2, 3)))


def test_not_a_recommendation_model():
    other = service_pb2.ModelMetadataResponse(name="resnet", inputs=[T(name="image", datatype="FP32", shape=[3])])
    with pytest.raises(LoadgenError, match="no input 'dense_features'.*image FP32"):
        shape_from(other, None)


def test_a_model_traced_at_one_pooling_gets_exactly_that_many_ids():
    import numpy as np

    from sixfold.loadgen import LoadConfig, plan_run
    from sixfold.loadgen.runner import generator_for
    from sixfold.loadgen.schedule import PoolRecipe, pool_tensors

    shape = shape_from(metadata(), config(table_rows="10,20,30,40", pooling="1,2,3,4", fixed_pooling="true"))
    assert shape.fixed_pooling and shape.to_dict()["fixed_pooling"] is True
    load = LoadConfig(url="127.0.0.1:1", model="m", qps=50.0, duration_s=1.0, query_size="uniform:1-9")
    schedule = plan_run(load, shape, lambda request: b"")
    recipe = schedule.pool.recipe
    assert recipe.fixed_pooling
    for query in pool_tensors(PoolRecipe.from_dict(recipe.to_dict())):  # also as a recording rebuilds it
        lengths = query["sparse_lengths"]
        assert (lengths == np.array([1, 2, 3, 4], dtype=np.int32)).all() and query["sparse_indices"].size == lengths.sum()
    assert (generator_for(load, shape).lengths(5) == [1, 2, 3, 4]).all()
    # Without the parameter the pooling varies around the factors (uniform in [p/2, 3p/2]).
    free = generator_for(load, shape_from(metadata(), config(table_rows="10,20,30,40", pooling="1,2,3,4")))
    assert not (free.lengths(200) == [1, 2, 3, 4]).all()
    with pytest.raises(LoadgenError, match="drop --pooling"):
        shape_from(metadata(), config(table_rows="10,20,30,40", pooling="1,2,3,4", fixed_pooling="true"),
                   ShapeOverrides(pooling=(2,)))
