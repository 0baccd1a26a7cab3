"""The inseq export's safetensors reader refuses malformed text instead of reading the header
as data or raising raw KeyError / struct.error (issue 41, item 6)."""
import base64
import json
import struct

import pytest
import torch

from captum_transformers.errors import InputError
from captum_transformers.integrations.inseq.export import safetensor_b64, tensor_from_safetensor_b64


def _encode(entry, data=b"", header_size=None):
    header = json.dumps({"attribution": entry}).encode()
    header += b" " * (-len(header) % 8)
    size = len(header) if header_size is None else header_size
    return base64.b64encode(struct.pack("<Q", size) + header + data).decode("ascii")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_keeps_values_and_dtype(dtype):
    tensor = torch.randn(3, 5, dtype=torch.float64).to(dtype)
    back = tensor_from_safetensor_b64(safetensor_b64(tensor))
    assert back.dtype == dtype and torch.equal(back, tensor)
    assert tensor_from_safetensor_b64(safetensor_b64(torch.empty(0, 4))).shape == (0, 4)


@pytest.mark.parametrize("text, found", [
    (_encode({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, b"\0" * 8), "data_offsets"),
    (_encode({"dtype": "F32", "shape": [2], "data_offsets": [-16, -8]}, b"\0" * 8), "data_offsets"),
    (_encode({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, b"\0" * 8), "data_offsets"),
    (_encode({"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}, b"\0" * 8), "data_offsets"),
    (_encode({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, b"\0" * 8), "bytes for shape"),
    (_encode({"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}, b"\0" * 8), "dtype"),
    (_encode({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, b"\0" * 8), "shape"),
    (_encode({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, b"\0" * 8, header_size=10 ** 6), "header length"),
    (base64.b64encode(struct.pack("<Q", 4) + b"nope").decode(), "not JSON"),
    (base64.b64encode(struct.pack("<Q", 2) + b"{}").decode(), "no 'attribution' entry"),
    (base64.b64encode(b"abc").decode(), "fewer than the 8-byte"),
    ("not base64 at all!", "not base64"),
])
def test_malformed_text_is_refused(text, found):
    with pytest.raises(InputError, match=found):
        tensor_from_safetensor_b64(text)
