"""Memory refusals quote both numbers, in units a person reads."""

from __future__ import annotations

import pytest

from sixfold.backends.api import DoesNotFit, PartitionArtifact
from sixfold.backends.memory import check_fits, format_bytes
from sixfold.backends.spec_catalog import load_spec

GiB = 2**30


@pytest.mark.parametrize("nbytes, text", [
    (0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (3 * 2**20, "3.0 MiB"),
    (16 * GiB, "16.0 GiB"), (int(21.3 * GiB), "21.3 GiB"),
])
def test_format_bytes(nbytes, text):
    assert format_bytes(nbytes) == text


def _artifact(param_bytes: int) -> PartitionArtifact:
    return PartitionArtifact(name="dense", format="onnx", payload=b"", input_names=("x",),
                             output_names=("y",), param_bytes=param_bytes)


def test_refusal_quotes_both_numbers():
    with pytest.raises(DoesNotFit) as err:
        check_fits(_artifact(int(21.3 * GiB)), load_spec("m2-card"))
    assert str(err.value) == "partition dense needs 21.3 GiB; device m2-card has 16.0 GiB free"


def test_numbers_that_round_alike_are_given_in_bytes():
    with pytest.raises(DoesNotFit, match=r"needs 16.0 GiB \(17184063488 B\); .* has 16.0 GiB \(17179869184 B\) free"):
        check_fits(_artifact(16 * GiB + 4 * 2**20), load_spec("m2-card"))


def test_fits_exactly_and_free_bytes_override():
    check_fits(_artifact(16 * GiB), load_spec("m2-card"))
    with pytest.raises(DoesNotFit, match="has 1.0 GiB free; 15.0 GiB held"):
        check_fits(_artifact(2 * GiB), load_spec("m2-card"), free_bytes=GiB, detail="; 15.0 GiB held")
