"""The elsa-sparse layout of one weight: round trips bit for bit, the code picked by bytes, and corrupt codes refused."""
from __future__ import annotations

import pytest
import torch

from elsa_ds.errors import ElsaError
from elsa_ds.sparse import format as fmt


def _pruned(shape, sparsity, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen).to(dtype)
    w[torch.rand(shape, generator=gen) < sparsity] = 0
    return w


CASES = [((7, 1000), 0.995), ((33, 17), 0.5), ((5, 9), 1.0), ((1, 1), 0.0), ((64, 513), 0.9), ((3, 300), 0.0)]


@pytest.mark.parametrize("encoding", [fmt.BITMASK, fmt.DELTA8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,sparsity", CASES)
def test_round_trip_is_bit_exact(shape, sparsity, dtype, encoding):
    w = _pruned(shape, sparsity, dtype)
    if shape[0] > 2:
        w[1] = 0  # an empty row
    enc = fmt.encode(w, encoding)
    fmt.check("w", enc.encoding, enc.shape, enc.parts)
    back = fmt.decode(enc.encoding, enc.shape, enc.parts)
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[dtype]
    assert back.dtype == dtype and torch.equal(back.view(bits), w.view(bits))
    assert enc.nbytes == fmt.encoded_bytes(w)[encoding]


def test_long_gaps_get_fillers_and_stay_exact():
    w = torch.zeros(2, 2000)
    w[0, 0], w[0, 1999], w[1, 700] = 1.0, 2.0, 3.0  # gaps of 1999 and 701 columns
    enc = fmt.encode(w, fmt.DELTA8)
    assert enc.parts["values"].numel() == 3 + 1998 // 256 + 700 // 256  # fillers: 7 in row 0, 2 in row 1
    assert enc.nonzeros == 3
    row, col = fmt.delta8_positions(enc.parts["deltas"], enc.parts["row_offsets"])
    assert col.max() < 2000 and torch.equal(fmt.decode(fmt.DELTA8, enc.shape, enc.parts), w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,sparsity", CASES)
def test_the_gpu_layout_round_trips_through_delta8(shape, sparsity, dtype):
    """cols16 from delta8 and back: the same parts bit for bit, the fillers dropped and put back, the same weight."""
    w = _pruned(shape, sparsity, dtype)
    d8 = fmt.encode_delta8(w)
    c16 = fmt.delta8_to_cols16(d8, shape)
    assert c16["cols"].dtype == torch.int16 and c16["row_offsets"].dtype == torch.int32
    assert c16["values"].numel() == int(torch.count_nonzero(w)) and bool((c16["values"] != 0).all())
    assert torch.equal(fmt.decode(fmt.COLS16, shape, c16), w)
    back = fmt.cols16_to_delta8(c16, shape)
    assert all(torch.equal(back[k], d8[k]) for k in d8)


def test_the_gpu_layout_reads_columns_past_32767_and_refuses_past_65536():
    """A column's 16 bits in an int16: 40000 is stored negative and read back whole; 65537 columns are refused."""
    w = torch.zeros(2, 65536)
    w[0, 0], w[0, 40000], w[1, 65535], w[1, 300] = 1.0, 2.0, 3.0, 4.0
    c16 = fmt.delta8_to_cols16(fmt.encode_delta8(w), (2, 65536))
    assert int(c16["cols"].min()) < 0 and torch.equal(fmt.decode(fmt.COLS16, (2, 65536), c16), w)
    row, col = fmt.cols16_positions(c16["cols"], c16["row_offsets"])
    assert row.tolist() == [0, 0, 1, 1] and col.tolist() == [0, 40000, 300, 65535]
    with pytest.raises(ValueError, match="does not fit cols16 .*keep it in delta8"):
        fmt.delta8_to_cols16(fmt.encode_delta8(torch.ones(1, 65537)), (1, 65537))


def test_negative_zero_is_a_zero():
    w = torch.tensor([[0.0, -0.0, 1.5, -2.0]])
    for encoding in (fmt.BITMASK, fmt.DELTA8):
        enc = fmt.encode(w, encoding)
        assert enc.nonzeros == 2
        back = fmt.decode(encoding, enc.shape, enc.parts)
        assert torch.equal(back, w) and not torch.signbit(back[0, 1])


def test_the_smaller_code_is_picked():
    half, most = _pruned((64, 4096), 0.5), _pruned((64, 4096), 0.95)
    assert fmt.encode(half).encoding == fmt.BITMASK  # 1/8 byte per weight beats a byte per nonzero
    assert fmt.encode(most).encoding == fmt.DELTA8
    for w in (half, most):
        sizes = fmt.encoded_bytes(w)
        assert fmt.encode(w).nbytes == min(sizes.values())
    # at 90 % in bf16 the stored weight is at most 0.2x its dense bytes
    assert fmt.encode(_pruned((256, 4096), 0.9)).nbytes <= 0.2 * 256 * 4096 * 2


def test_compressible_needs_enough_zeros():
    assert fmt.compressible(_pruned((8, 8), 0.5, seed=1), 0.3)
    assert not fmt.compressible(torch.ones(8, 8), 0.3)
    assert not fmt.compressible(torch.zeros(8), 0.3)  # not 2-D
    assert not fmt.compressible(torch.zeros(8, 8, dtype=torch.int64), 0.3)


def _delta8(w):
    return fmt.encode(w, fmt.DELTA8).parts


@pytest.mark.parametrize("corrupt,needle", [
    (lambda p: p.update(values=p["values"][:-1]), "deltas"),
    (lambda p: p.update(deltas=p["deltas"][:-1], values=p["values"][:-1]), "row_offsets do not rise"),
    (lambda p: p["row_offsets"].__setitem__(1, p["row_offsets"][2] + 1), "row_offsets do not rise"),
    (lambda p: p["deltas"].fill_(200), "reaches column"),
    (lambda p: p.pop("deltas"), "lacks"),
])
def test_corrupt_delta8_is_refused(corrupt, needle):
    parts = _delta8(_pruned((6, 300), 0.8))
    corrupt(parts)
    with pytest.raises(ElsaError, match=needle):
        fmt.check("w", fmt.DELTA8, (6, 300), parts)


@pytest.mark.parametrize("corrupt,needle", [
    (lambda p: p.update(values=p["values"][:-1]), "positions but there are"),
    (lambda p: p["bitmask"][:, -1].__ior__(0x80), "padding bits"),
    (lambda p: p.update(bitmask=p["bitmask"][:-1]), "expected"),
])
def test_corrupt_bitmask_is_refused(corrupt, needle):
    w = _pruned((6, 13), 0.5)
    parts = fmt.encode(w, fmt.BITMASK).parts
    corrupt(parts)
    with pytest.raises(ElsaError, match=needle):
        fmt.check("w", fmt.BITMASK, (6, 13), parts)


def test_unknown_code_is_refused():
    with pytest.raises(ElsaError, match="unknown position code"):
        fmt.check("w", "rle", (2, 2), {})
