import pytest
import torch

from stitchflow.ir.errors import FormatError
from stitchflow.ir.types import Level, format_of_tensor, parse_format


def test_named_formats():
    assert str(parse_format("csr", 2)) == "csr"
    assert parse_format("dcsr", 2).levels == (Level.COMPRESSED, Level.COMPRESSED)
    assert parse_format("csc", 2).mode_order == (1, 0)
    assert str(parse_format("cc@10", 2)) == "dcsc"
    assert parse_format("dense", 3).is_dense
    assert parse_format("bsr", 2, (16, 16)).block == (16, 16)


def test_torch_layouts_map_to_formats():
    a = torch.eye(4)
    assert str(format_of_tensor(a.to_sparse_csr())) == "csr"
    assert str(format_of_tensor(a.to_sparse_csc())) == "csc"
    assert str(format_of_tensor(a.to_sparse())) == "dcsr"
    assert format_of_tensor(a.to_sparse_bsr((2, 2))).block == (2, 2)


@pytest.mark.parametrize("bad", ["cscx", "xyz", "dd@2"])
def test_bad_format_names_are_named_in_the_error(bad):
    with pytest.raises(FormatError, match="format|mode order"):
        parse_format(bad, 2)


def test_rank_mismatch():
    with pytest.raises(FormatError, match="3 modes"):
        parse_format("csr", 3)
