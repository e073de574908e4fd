"""`checkpoint.Weights.load_to`: the file's bytes to the device in a few large copies, each tensor converted."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from laya_aot import checkpoint


@pytest.fixture
def weights(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(7, 5, generator=g).half(), "b.bias": torch.randn(3, generator=g),
               "c.weight": torch.randn(4, 4, generator=g).bfloat16(), "d.idx": torch.arange(6).view(2, 3),
               "e.flag": torch.tensor([True, False, True]), "f.odd": torch.randn(1, generator=g).half()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return checkpoint.Weights(tmp_path), tensors


@pytest.mark.parametrize("chunk", [1, 24, 1 << 20])   # a tensor per copy, a few per copy, the whole file at once
def test_load_to_gives_what_a_read_and_convert_per_tensor_gives(weights, chunk, monkeypatch):
    monkeypatch.setattr(checkpoint, "LOAD_CHUNK_BYTES", chunk)
    w, tensors = weights
    targets = {"a.weight": torch.bfloat16, "b.bias": torch.float32, "c.weight": torch.float32,
               "d.idx": torch.int64, "e.flag": torch.bool, "f.odd": torch.float16}
    got = w.load_to(targets, "cpu")
    assert got.keys() == targets.keys()
    for key, dtype in targets.items():
        want = tensors[key].to(dtype)
        assert got[key].dtype == dtype and got[key].shape == want.shape and torch.equal(got[key], want), key
        assert got[key].is_contiguous()
    # each owns its storage: writing one changes nothing else, and the file is unchanged
    got["b.bias"].add_(1.0)
    assert torch.equal(w["b.bias"], tensors["b.bias"]) and torch.equal(w.load_to({"b.bias": torch.float32},
                                                                                 "cpu")["b.bias"], tensors["b.bias"])


def test_load_to_names_a_tensor_the_checkpoint_lacks(weights):
    with pytest.raises(KeyError, match="missing.weight"):
        weights[0].load_to({"missing.weight": torch.float32}, "cpu")


@pytest.mark.parametrize("chunk", [1, 1 << 20])
def test_load_into_allocated_tensors_writes_them_in_place(weights, chunk, monkeypatch):
    """`allocate` then `load_to(into=)`: the bytes land in the tensors handed out before (what a package given
    them in place reads), converted as `load_to` alone converts them."""
    monkeypatch.setattr(checkpoint, "LOAD_CHUNK_BYTES", chunk)
    w, tensors = weights
    targets = {"a.weight": torch.bfloat16, "b.bias": torch.float32, "d.idx": torch.int64, "f.odd": torch.float32}
    shells = w.allocate(targets, "cpu")
    assert {k: (t.shape, t.dtype) for k, t in shells.items()} == {k: (tensors[k].shape, d) for k, d in targets.items()}
    ptrs = {k: t.data_ptr() for k, t in shells.items()}
    for t in shells.values():
        t.fill_(0)
    got = w.load_to(targets, "cpu", into=shells)
    for key, dtype in targets.items():
        assert got[key] is shells[key] and shells[key].data_ptr() == ptrs[key], key
        assert torch.equal(shells[key], tensors[key].to(dtype)), key
    with pytest.raises(KeyError, match="missing.weight"):
        w.allocate({"missing.weight": torch.float32}, "cpu")


@pytest.mark.parametrize("fails_at", ["copy", "device"])
def test_a_failed_load_raises_its_own_error_not_the_mappings(weights, fails_at, monkeypatch):
    """A copy that fails (another shape in `into`; the device out of memory, as on an H200 filled to a few MB)
    raised BufferError "cannot close exported pointers exist" in its place: the traceback kept a
    view of the file's mapping alive while the mapping was closed."""
    w, tensors = weights
    if fails_at == "copy":
        with pytest.raises(RuntimeError, match="must match the size") as got:
            w.load_to({"a.weight": torch.float32}, "cpu", into={"a.weight": torch.empty(3, 2)})
    else:
        real_to = torch.Tensor.to

        def out_of_memory(self, *args, **kwargs):
            if kwargs.get("device") == "cuda-short":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 44.00 MiB")
            return real_to(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError) as got:
            w.load_to({"a.weight": torch.float32}, "cuda-short")
    assert not isinstance(got.value.__context__, BufferError)
    assert torch.equal(w.load_to({"a.weight": torch.float32}, "cpu")["a.weight"], tensors["a.weight"].float())
