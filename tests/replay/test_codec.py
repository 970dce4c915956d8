"""Bit-packing codec (C++) against the numpy reference, and CRC32C."""
import numpy as np
import pytest

from moe_rl import _C
from moe_rl.replay import bits_for, pack, pack_numpy, packed_bytes, unpack, unpack_numpy


def bitwise_reference(ids, bits):
    """The format by definition: id i at bits [i*bits, (i+1)*bits), LSB first."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    planes = ((ids[:, None] >> np.arange(bits)) & 1).astype(np.uint8).reshape(-1)
    return np.packbits(planes, bitorder="little")


@pytest.mark.parametrize("E", [1, 2, 3, 7, 8, 9, 64, 128, 129, 160, 256, 257, 1000, 4096, 65536])
def test_roundtrip_all_widths(E):
    rng = np.random.default_rng(E)
    b = bits_for(E)
    assert b == max(1, int(np.ceil(np.log2(E))))
    for n in [0, 1, 5, 8, 9, 31, 64, 384, 1003]:
        ids = rng.integers(0, E, n)
        p = pack(ids, E)
        assert p.dtype == np.uint8 and p.size == packed_bytes(n, E) == (n * b + 7) // 8
        assert np.array_equal(p, bitwise_reference(ids, b))
        assert np.array_equal(p, pack_numpy(ids, E))
        assert np.array_equal(unpack(p, n, E), ids)
        assert np.array_equal(unpack_numpy(p, n, E), ids)
        assert unpack(p, n, E, dtype=np.int32).dtype == np.int32


def test_unpack_any_subrange():
    rng = np.random.default_rng(0)
    for E in [5, 128, 300]:
        ids = rng.integers(0, E, 77)
        p = pack(ids, E)
        for first in range(0, 20):
            for n in [0, 1, 3, 8, 17, 77 - first]:
                assert np.array_equal(unpack(p, n, E, first=first), ids[first:first + n])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32,
                                   np.int64, np.uint64])
def test_input_dtypes(dtype):
    ids = (np.arange(100) % 100).astype(dtype)
    assert np.array_equal(unpack(pack(ids, 100), 100, 100), ids.astype(np.int64))


def test_out_of_range_rejected():
    with pytest.raises(ValueError, match="flat index 3"):
        pack(np.array([0, 1, 2, 128, 5], dtype=np.int32), 128)
    with pytest.raises(ValueError, match="flat index 1"):
        pack(np.array([0, -1], dtype=np.int64), 128)
    with pytest.raises(ValueError, match="integer dtype"):
        pack(np.zeros(3, dtype=np.float32), 128)
    with pytest.raises(ValueError):
        bits_for(0)
    with pytest.raises(ValueError, match="too short"):
        unpack(np.zeros(3, dtype=np.uint8), 10, 128)


def test_crc32c_known_values():
    assert _C.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert _C.crc32c(b"") == 0
    assert _C.crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4 test vector
    assert _C.crc32c(bytes(range(32))) == 0x46DD794E
    data = np.random.default_rng(1).integers(0, 256, 1001, dtype=np.uint8).tobytes()
    assert _C.crc32c(data[500:], _C.crc32c(data[:500])) == _C.crc32c(data)


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6, 8, 10, 12, 16])
def test_first_duplicate_row_every_pair(k):
    rows = np.tile(np.arange(k, dtype=np.int32), 40)
    assert _C.first_duplicate_row(rows, k) == -1
    for a in range(k):
        for b in range(k):
            if a != b:
                z = rows.copy()
                z[k * 23 + a] = z[k * 23 + b]
                assert _C.first_duplicate_row(z, k) == 23
