"""errors.one_line: how a recorded reason or a log line names a failure."""
from __future__ import annotations

from laya_aot.errors import one_line


def test_one_line_keeps_the_type_and_the_first_line_only():
    assert one_line(RuntimeError("\n  lowering failed\ntraceback follows")) == "RuntimeError: lowering failed"
    assert one_line(KeyError("torch.uint64"), 8) == "KeyError: 'torch.u"
    assert one_line(ValueError()) == "ValueError"
    assert one_line(ValueError("   \n ")) == "ValueError"
