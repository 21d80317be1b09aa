"""config.pbtxt (Triton's ModelConfig in protobuf text format) <-> BatchingConfig, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from sixfold.server.scheduling.batcher import BatchingConfig, QueuePolicy
from sixfold.server.loading.model_config import load_model_config, parse_model_config, to_model_config

FULL = """
name: "rm2"
max_batch_size: 512
dynamic_batching {
  max_queue_delay_microseconds: 3000
  preferred_batch_size: [ 256, 128 ]
  priority_levels: 3
  default_priority_level: 2
  default_queue_policy {
    max_queue_size: 64
    default_timeout_microseconds: 50000
    timeout_action: DELAY
    allow_timeout_override: true
  }
  priority_queue_policy {
    key: 1
    value { max_queue_size: 8 timeout_action: REJECT default_timeout_microseconds: 2000 }
  }
}
input [ { name: "dense_features" data_type: TYPE_FP32 dims: [ -1, 13 ] } ]
parameters { key: "sixfold.cards" value { string_value: "6" } }
parameters { key: "sixfold.backend" value { string_value: "simcard" } }
parameters { key: "sixfold.host_dense_max_rows" value { string_value: "-1" } }
parameters { key: "sixfold.min_split_rows" value { string_value: "32" } }
parameters { key: "sixfold.card_scheduling" value { string_value: "fifo" } }
parameters { key: "sixfold.allow_nonfinite" value { string_value: "True" } }
parameters { key: "team" value { string_value: "ranking" } }
"""


def _write(tmp_path: Path, text: str) -> Path:
    model_dir = tmp_path / "rm2"
    model_dir.mkdir()
    (model_dir / "config.pbtxt").write_text(text)
    return model_dir


def test_a_full_triton_config_reads_into_batching_and_typed_extras(tmp_path: Path) -> None:
    settings = load_model_config(_write(tmp_path, FULL))
    b = settings.batching
    assert settings.name == "rm2"
    assert (b.max_batch_rows, b.max_queue_delay_microseconds, b.preferred_batch_rows) == (512, 3000, (128, 256))
    assert (b.priority_levels, b.default_priority_level) == (3, 2)
    assert b.default_policy == QueuePolicy(64, 50000, "DELAY", True)
    assert b.policy(1) == QueuePolicy(8, 2000, "REJECT", False)  # written policy: proto3 defaults elsewhere
    assert b.policy(3) == b.default_policy
    assert settings.extras == {"cards": 6, "backend": "simcard", "host_dense_max_rows": -1, "min_split_rows": 32,
                               "card_scheduling": "fifo", "allow_nonfinite": True}
    assert settings.parameters["team"] == "ranking"
    assert [t.name for t in settings.proto.input] == ["dense_features"]


def test_no_dynamic_batching_block_keeps_sixfold_defaults() -> None:
    settings = parse_model_config('name: "tiny"')
    assert settings.batching == BatchingConfig()


def test_the_reverse_round_trips_through_the_real_message() -> None:
    batching = parse_model_config(FULL).batching
    config = to_model_config("rm2", batching, parameters={"sixfold.cards": "6"})
    text = text_format.MessageToString(config)
    again = model_config_pb2.ModelConfig()
    text_format.Parse(text, again)
    assert again.dynamic_batching.priority_levels == 3
    assert again.dynamic_batching.default_queue_policy.timeout_action == model_config_pb2.ModelQueuePolicy.DELAY
    assert again.dynamic_batching.priority_queue_policy[1].max_queue_size == 8
    assert again.parameters["sixfold.max_batch_rows"].string_value == "512"
    assert again.max_batch_size == 0  # ragged inputs: clients send whole tensors (see to_model_config)
    # What the RPC returns reads back into the same batching, both ways of reporting the rows.
    for reported in (0, None):
        config = to_model_config("rm2", batching, max_batch_size=reported)
        assert parse_model_config(text_format.MessageToString(config)).batching == batching


@pytest.mark.parametrize("text, named", [
    ('instance_group [ { count: 2 kind: KIND_GPU } ]', "instance_group"),
    ('sequence_batching { }', "sequence_batching"),
    ('dynamic_batching { preserve_ordering: true }', "preserve_ordering"),
    ('backend: "onnxruntime"', "backend 'onnxruntime'"),
    ('dynamic_batching { max_queue_delay_us: 5 }', "max_queue_delay_us"),  # a typo: protobuf's parse error
    ('dynamic_batching { priority_levels: 2 default_priority_level: 3 }', "dynamic_batching.default_priority_level"),
    ('dynamic_batching { priority_levels: 2 default_priority_level: 1 '
     'priority_queue_policy { key: 5 value { } } }', "dynamic_batching.priority_queue_policy"),
    ('max_batch_size: 64 dynamic_batching { preferred_batch_size: [ 128 ] }', "dynamic_batching.preferred_batch_size"),
    ('dynamic_batching { default_queue_policy { timeout_action: DROP } }', "DROP"),
    ('parameters { key: "sixfold.cardz" value { string_value: "2" } }', "sixfold.cardz"),
    ('parameters { key: "sixfold.cards" value { string_value: "zero" } }', "sixfold.cards"),
    ('parameters { key: "sixfold.host_dense_max_rows" value { string_value: "-2" } }', "sixfold.host_dense_max_rows"),
    ('parameters { key: "sixfold.min_split_rows" value { string_value: "-1" } }', "sixfold.min_split_rows"),
    ('parameters { key: "sixfold.allow_nonfinite" value { string_value: "yes" } }', "sixfold.allow_nonfinite"),
    ('parameters { key: "sixfold.card_scheduling" value { string_value: "random" } }', "sixfold.card_scheduling"),
])
def test_a_bad_or_unsupported_field_is_refused_naming_it_and_the_file(tmp_path: Path, text: str, named: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as caught:
        load_model_config(path)
    message = str(caught.value)
    assert named in message and str(path / "config.pbtxt") in message, message
